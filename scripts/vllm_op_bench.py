#!/usr/bin/env python3
"""Per-call cost of the plugin's ops against vLLM's own CPU ops, at the shapes where that cost
shows: short contexts, one new token per sequence.

  mjolnir: attend_step (what the plugin calls) with a plan made once per step (plan_step, timed
           apart),
           torch.ops.mjolnir.write_kv
  vLLM:    torch.ops._C.cpu_attention_with_kv_cache (with its scheduler metadata, made once),
           cpu_attn_reshape_and_cache

Each op is called back to back, as the layers of a model call it, after a torch op (a matmul of
the layer's size) so that torch's OpenMP threads are as a real step leaves them; medians over
interleaved rounds. Needs the venv of scripts/vllm-check.sh (torch, vLLM, mjolnir installed).

  build-python/venv/bin/python scripts/vllm_op_bench.py [--json FILE]
  build-python/venv/bin/python scripts/vllm_op_bench.py --prefill [--json FILE]   # a prompt
  build-python/venv/bin/python scripts/vllm_op_bench.py --formats bf16,fp6_e2m3 [--json FILE]
      # a decode step at long contexts (4k, 16k) over each mjolnir format, against vLLM's op
      # over its bf16 cache: what one layer's attention costs the end-to-end decode
  build-python/venv/bin/python scripts/vllm_op_bench.py --cold [--json FILE]
      # a short decode call warm, after its caches were evicted (a 16 MiB copy), and after the
      # eviction and a call over another cache (the code and the state every call shares warm
      # again, this call's data cold): what a cold call waits for
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vllm_bench import machine_name  # the CPU as `mjolnir info` names it


def timed(fn, calls: int, between: bool) -> float:
    """Median microseconds per call over `calls` calls, back to back or each after a matmul
    of a layer's size (which leaves torch's threads and the caches as a model's step does)."""
    a = torch.randn(8, 4096)  # float32: MKL's, fast on every CPU (bf16 is not on AVX2)
    w = torch.randn(4096, 1024)
    samples = []
    for _ in range(calls):
        if between:
            torch.mm(a, w)  # the layer's projection, as in a decode step
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def vllm_isa() -> str:
    """The ISA vLLM's CPU backend picks for a bf16 model: its AMX kernels where the CPU has AMX
    tiles (after asking Linux for them, as vLLM's worker does), else the vector ones."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    isa = _get_attn_isa(torch.bfloat16, 32, 128)  # vLLM's own choice for the bench's shape
    if isa == "amx":
        torch._C._cpu._init_amx()  # the tiles' permission from Linux, as vLLM's worker asks
    return isa


def decode_step(batch: int, context: int, block: int):
    """A decode step's shape as vLLM's metadata gives it: `batch` sequences of `context` tokens
    (the last one new), their blocks numbered in order in a pool with two to spare. Returns the
    pool's block count, the block table, seq_lens and query_start_loc."""
    blocks_per_seq = (context + block - 1) // block
    table = torch.arange(batch * blocks_per_seq, dtype=torch.int32).reshape(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    return batch * blocks_per_seq + 2, table, seq_lens, starts


def vllm_cache(num_blocks: int, hk: int, block: int, d: int):
    """vLLM's CPU cache of random bf16 values, as its backend allocates it ([num_blocks, Hk,
    block, 2 D]): (the pool, its K half, its V half)."""
    pool = torch.randn(num_blocks, hk, block, 2 * d).to(torch.bfloat16)
    kc, vc = pool.view(num_blocks, hk, 2 * block, d).chunk(2, dim=2)
    return pool, kc, vc


def mjolnir_cache(fmt: str, num_blocks: int, block: int, kv: torch.Tensor):
    """The same allocation as the plugin lays it out for a cache of `fmt` (BHN2D, rows of the
    format's bytes), every slot written from kv [num_blocks * block, Hk, D] as both K and V with
    per-tensor scales 1: (the pool, its BHN2D view)."""
    from mjolnir import _ext
    hk, d = kv.shape[1], kv.shape[2]
    if fmt in ("bf16", "fp16"):
        pool = torch.empty(num_blocks, hk, block, 2 * d,
                           dtype=torch.bfloat16 if fmt == "bf16" else torch.float16)
    else:
        pool = torch.empty(num_blocks, hk, block, 2 * _ext.row_bytes(fmt, d), dtype=torch.uint8)
    view = pool.view(num_blocks, hk, 2, block, pool.shape[-1] // 2).permute(0, 1, 3, 2, 4)
    one = torch.ones(1)
    torch.ops.mjolnir.write_kv(kv, kv, view, torch.arange(num_blocks * block, dtype=torch.int64),
                               one, one, fmt, "BHN2D")
    return pool, view


def vllm_attention(q, kc, vc, out, starts, seq_lens, table, isa: str):
    """vLLM's CPU attention op over its bf16 cache (kc, vc), as its backend calls it per layer
    (causal, no window, scales 1), with the step's scheduler metadata made once: a callable."""
    from vllm import _custom_ops as vllm_ops
    hq, d = q.shape[-2], q.shape[-1]
    sched = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=int(seq_lens.numel()), num_heads=hq, num_kv_heads=kc.shape[1], head_dim=d,
        seq_lens=seq_lens, dtype=torch.bfloat16, query_start_loc=starts, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=False, kv_cache_dtype="auto")
    return lambda: vllm_ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=starts,
        seq_lens=seq_lens, scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=table, softcap=0.0, scheduler_metadata=sched, s_aux=None,
        dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


def attend_of(step):
    """A layer's call of a planned step as the plugin makes it: the operator that takes the
    step's id (taken once, as the plugin does), with the rest of attend's arguments."""
    op, step_id = torch.ops.mjolnir.attend_step, step.id()
    return lambda *args: op(step_id, *args)


def load_kernels() -> None:
    """mjolnir's ops (torch.ops.mjolnir) and vLLM's CPU kernels (torch.ops._C)."""
    import mjolnir  # noqa: F401
    from vllm.platforms import current_platform
    current_platform.import_kernels()


def prefill(lengths, rounds: int) -> list:
    """One prompt's attention, all its tokens query tokens (one layer: Hq 32, Hk 8, D 128, bf16
    cache, block 32), through vLLM's op and mjolnir's plan_step / attend (P fp32, and the modes
    "auto" picks), and the prompt's cache write through both (mjolnir's also into fp8);
    interleaved rounds, median milliseconds."""
    from vllm import _custom_ops as vllm_ops
    hq, hk, d, block = 32, 8, 128, 32
    isa = vllm_isa()
    rows = []
    for n in lengths:
        blocks = (n + block - 1) // block
        table = torch.arange(blocks, dtype=torch.int32).reshape(1, -1)
        seq_lens = torch.tensor([n], dtype=torch.int32)
        starts = torch.tensor([0, n], dtype=torch.int32)
        q = torch.randn(n, hq, d, dtype=torch.bfloat16)
        out = torch.empty(n, hq, d, dtype=torch.bfloat16)
        _, kc, vc = vllm_cache(blocks + 1, hk, block, d)
        ours = torch.randn(blocks + 1, hk, block, 2 * d).to(torch.bfloat16)
        view = ours.view(blocks + 1, hk, 2, block, d).permute(0, 1, 3, 2, 4)
        one = torch.ones(1)
        steps = {mode: torch.ops.mjolnir.plan_step(seq_lens, table, starts, 0, hq, hk,
                                                   q_mode=mode, p_mode=mode)
                 for mode in ("fp32", "auto")}
        attends = {mode: attend_of(step) for mode, step in steps.items()}
        # The prompt's cache write: vLLM's into its layout, mjolnir's into BHN2D (bf16, and fp8
        # where vLLM's own op takes it), every token a slot of its own.
        key = torch.randn(n, hk, d, dtype=torch.bfloat16)
        slots = torch.arange(n, dtype=torch.int64)
        theirs_kc, theirs_vc = kc, vc
        fp8_pool = torch.zeros(blocks + 1, hk, block, 2 * d, dtype=torch.uint8)
        fp8_view = fp8_pool.view(blocks + 1, hk, 2, block, d).permute(0, 1, 3, 2, 4)
        fns = {
            f"vllm_{isa}_write_ms": lambda: vllm_ops.cpu_attn_reshape_and_cache(
                key, key, theirs_kc, theirs_vc, slots, isa, k_scale=1.0, v_scale=1.0,
                kv_cache_dtype="auto"),
            "mjolnir_write_bf16_ms": lambda: torch.ops.mjolnir.write_kv(
                key, key, view, slots, one, one, "bf16", "BHN2D"),
            "mjolnir_write_fp8_ms": lambda: torch.ops.mjolnir.write_kv(
                key, key, fp8_view, slots, one, one, "fp8_e4m3", "BHN2D"),
            f"vllm_{isa}_ms": vllm_attention(q, kc, vc, out, starts, seq_lens, table, isa),
            "mjolnir_fp32_ms": lambda: attends["fp32"](out, q, view, one, one, "bf16",
                                                            "BHN2D", d ** -0.5),
            "mjolnir_auto_ms": lambda: attends["auto"](out, q, view, one, one, "bf16",
                                                            "BHN2D", d ** -0.5),
        }
        samples = {name: [] for name in fns}
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
        row = {"kind": "prefill", "tokens": n, "auto_modes": steps["auto"].modes_for("bf16", d, True),
               **{name: statistics.median(v) for name, v in samples.items()}}
        rows.append(row)
        print(f"prefill {n} tokens: " + ", ".join(
            f"{name} {row[name]:.1f}" for name in fns) + f" (auto: {row['auto_modes']})",
            flush=True)
    return rows


def decode_formats(formats, cases, rounds: int, also_p_mode: str = "") -> list:
    """One layer's decode step (one new token per sequence) at long contexts: vLLM's op over
    its bf16 cache against mjolnir's attend_step over a cache of each format (written by
    write_kv from the same Gaussian K / V, per-tensor scales 1), in the plugin's "auto" modes
    (and, with also_p_mode, in that P mode too: rows "mjolnir_<format>_p<mode>").
    Each call follows a matmul of a layer's size, as in a model's step; interleaved rounds of 20
    calls, the median call of each round, then the median over rounds (microseconds)."""
    hq, hk, d, block = 32, 8, 128, 32
    isa = vllm_isa()
    one = torch.ones(1)
    rows = []
    for batch, context in cases:
        num_blocks, table, seq_lens, starts = decode_step(batch, context, block)
        q = torch.randn(batch, hq, d, dtype=torch.bfloat16)
        out = torch.empty(batch, hq, d, dtype=torch.bfloat16)
        _, kc, vc = vllm_cache(num_blocks, hk, block, d)
        fns = {f"vllm_{isa}_bf16": vllm_attention(q, kc, vc, out, starts, seq_lens, table, isa)}
        step = torch.ops.mjolnir.plan_step(seq_lens, table, starts, 0, hq, hk, q_mode="auto",
                                           p_mode="auto")  # the plugin's defaults
        step_attend = attend_of(step)
        caches = []  # keeps each format's pool alive
        kv = torch.randn(num_blocks * block, hk, d, dtype=torch.bfloat16)
        other_attend = None
        if also_p_mode:
            other = torch.ops.mjolnir.plan_step(seq_lens, table, starts, 0, hq, hk, q_mode="auto",
                                                p_mode=also_p_mode)
            caches.append(other)
            other_attend = attend_of(other)
        for fmt in formats:
            pool, view = mjolnir_cache(fmt, num_blocks, block, kv)
            caches.append(pool)
            fns[f"mjolnir_{fmt}"] = (lambda view=view, fmt=fmt: step_attend(
                out, q, view, one, one, fmt, "BHN2D", d ** -0.5))
            if other_attend is not None:
                fns[f"mjolnir_{fmt}_p{also_p_mode}"] = (lambda view=view, fmt=fmt: other_attend(
                    out, q, view, one, one, fmt, "BHN2D", d ** -0.5))
        for fn in fns.values():  # warm-up
            for _ in range(3):
                fn()
        per_round = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                per_round[name].append(timed(fn, 20, True))
        row = {"kind": "decode", "batch": batch, "context": context,
               **{name + "_us": statistics.median(v) for name, v in per_round.items()}}
        rows.append(row)
        base = row[f"vllm_{isa}_bf16_us"]
        print(f"batch {batch} context {context}: " + ", ".join(
            f"{name} {row[name + '_us']:.0f} us ({base / row[name + '_us']:.2f}x)"
            for name in fns), flush=True)
    return rows


def cold_calls(contexts, rounds: int) -> list:
    """One layer's decode call at batch 1 (vLLM's op over bf16; mjolnir's attend_step over bf16
    and nvfp4, "auto" modes, and over nvfp4 through the Step's own method, step.attend, the
    plugin's call before attend_step): warm (back to back), "cold" (each after a 16 MiB copy
    on this thread, which evicts its L1 and L2), and "code_warm" (the copy, then the same call over
    another cache of the same shape: the code, the backend's state and Python's paths warm, this
    call's cache, query and output cold). Interleaved rounds of 30 calls, the median call of each
    round, then the median over rounds (microseconds)."""
    import os
    hq, hk, d, block = 32, 8, 128, 32
    isa = vllm_isa()
    one = torch.ones(1)
    src, dst = bytearray(os.urandom(1 << 24)), bytearray(1 << 24)

    def evict():
        dst[:] = src

    rows = []
    for context in contexts:
        num_blocks, table, seq_lens, starts = decode_step(1, context, block)
        step = torch.ops.mjolnir.plan_step(seq_lens, table, starts, 0, hq, hk, q_mode="auto",
                                           p_mode="auto")
        step_attend = attend_of(step)
        keep = []

        def call(name):  # a callable over a cache of its own for `name`
            q = torch.randn(1, hq, d, dtype=torch.bfloat16)
            out = torch.empty(1, hq, d, dtype=torch.bfloat16)
            if name == "vllm":
                theirs, kc, vc = vllm_cache(num_blocks, hk, block, d)
                keep.append((q, out, theirs))
                return vllm_attention(q, kc, vc, out, starts, seq_lens, table, isa)
            fmt = name.removesuffix("_method")
            kv = torch.randn(num_blocks * block, hk, d, dtype=torch.bfloat16)
            pool, view = mjolnir_cache(fmt, num_blocks, block, kv)
            keep.append((q, out, pool))
            attend = step.attend if name.endswith("_method") else step_attend
            return lambda: attend(out, q, view, one, one, fmt, "BHN2D", d ** -0.5)

        names = ("vllm", "bf16", "nvfp4", "nvfp4_method")
        mine = {name: call(name) for name in names}
        other = {name: call(name) for name in names}
        before = {"warm": lambda name: None, "cold": lambda name: evict(),
                  "code_warm": lambda name: (evict(), other[name]())}
        samples = {(n, b): [] for n in names for b in before}
        for fn in list(mine.values()) + list(other.values()):
            fn()
        for _ in range(rounds):
            for (name, kind), per_round in samples.items():
                times = []
                for _ in range(30):
                    before[kind](name)
                    t0 = time.perf_counter()
                    mine[name]()
                    times.append((time.perf_counter() - t0) * 1e6)
                per_round.append(statistics.median(times))
        label = {"vllm": f"vllm_{isa}_bf16", "bf16": "mjolnir_bf16", "nvfp4": "mjolnir_nvfp4",
                 "nvfp4_method": "mjolnir_nvfp4_step_method"}
        row = {"kind": "decode", "batch": 1, "context": context,
               **{f"{label[n]}_{b}_us": statistics.median(v) for (n, b), v in samples.items()}}
        rows.append(row)
        print(f"context {context}: " + ", ".join(
            f"{label[n]} " + " / ".join(f"{statistics.median(samples[(n, b)]):.0f}"
                                        for b in before)
            for n in names) + " us (warm / cold / code warm)", flush=True)
    return rows


def write_decode_rows(path, rows: list) -> None:
    """The decode rows of --formats or --cold as a results file at `path` (nothing if None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine_name(), "date": time.strftime("%Y-%m-%d"),
                       "torch_threads": torch.get_num_threads(),
                       "shape": {"hq": 32, "hk": 8, "d": 128, "block": 32},
                       "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold", action="store_true",
                        help="time short decode calls warm, with their caches evicted, and "
                             "with only the call's own data cold (contexts 16 and 256)")
    parser.add_argument("--prefill", action="store_true",
                        help="time a prompt's attention (1024 and 4096 tokens) instead")
    parser.add_argument("--formats",
                        help="comma-separated mjolnir formats: time a decode step at long "
                             "contexts over each (--cases) instead")
    parser.add_argument("--also-p-mode", default="",
                        help="with --formats: also time each format in this P mode (e.g. fp32 "
                             "against the auto modes' choice)")
    parser.add_argument("--cases", default="4096x1,16384x1,4096x8",
                        help="with --formats: contexts x batches (default %(default)s)")
    args = parser.parse_args()
    if args.formats:
        load_kernels()
        cases = [tuple(int(x) for x in case.split("x"))[::-1] for case in args.cases.split(",")]
        write_decode_rows(args.json, decode_formats(args.formats.split(","), cases, args.rounds,
                                                    args.also_p_mode))
        return
    if args.cold:
        load_kernels()
        write_decode_rows(args.json, cold_calls((16, 256), args.rounds))
        return
    if args.prefill:
        load_kernels()
        rows = prefill((1024, 4096), args.rounds)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine_name(),
                           "torch_threads": torch.get_num_threads(),
                           "shape": {"hq": 32, "hk": 8, "d": 128, "block": 32, "dtype": "bf16"},
                           "rows": rows}, f, indent=1)
        return

    load_kernels()
    from vllm import _custom_ops as vllm_ops

    hq, hk, d, block = 32, 8, 128, 32
    rows = []
    for batch, context in ((1, 16), (8, 16), (1, 512), (8, 512)):
        num_blocks, table, seq_lens, starts = decode_step(batch, context, block)
        q = torch.randn(batch, hq, d, dtype=torch.bfloat16)
        out = torch.empty(batch, hq * d, dtype=torch.bfloat16)
        key = torch.randn(batch, hk, d, dtype=torch.bfloat16)
        slots = (table[:, -1].long() * block + (context - 1) % block).contiguous()
        one = torch.ones(1)

        # vLLM's: its cache layout, its scheduler metadata made once.
        _, kc, vc = vllm_cache(num_blocks, hk, block, d)
        isa = vllm_isa()  # what vLLM picks here (AMX on CPUs with AMX tiles)
        vllm_attention_op = vllm_attention(q, kc, vc, out.view(batch, hq, d), starts, seq_lens,
                                           table, isa)

        def vllm_write():
            vllm_ops.cpu_attn_reshape_and_cache(key, key, kc, vc, slots, isa, k_scale=1.0,
                                                v_scale=1.0, kv_cache_dtype="auto")

        # mjolnir's: the plugin's layout (BHN2D over the same allocation), one plan per step.
        ours = torch.randn(num_blocks, hk, block, 2 * d).to(torch.bfloat16)
        view = ours.view(num_blocks, hk, 2, block, d).permute(0, 1, 3, 2, 4)
        step = torch.ops.mjolnir.plan_step(seq_lens, table, starts, 0, hq, hk, q_mode="auto",
                                           p_mode="auto")  # the plugin's defaults
        step_attend = attend_of(step)

        def mjolnir_attention():  # what the plugin calls: attend_step with the step's id
            step_attend(out.view(batch, hq, d), q, view, one, one, "bf16", "BHN2D", d ** -0.5)

        def mjolnir_plan():
            torch.ops.mjolnir.plan_step(seq_lens, table, starts, 0, hq, hk, q_mode="auto",
                                        p_mode="auto")

        def mjolnir_write():
            torch.ops.mjolnir.write_kv(key, key, view, slots, one, one, "bf16", "BHN2D")

        fns = {"vllm_attention": vllm_attention_op, "mjolnir_attention": mjolnir_attention,
               "mjolnir_plan_step": mjolnir_plan, "vllm_write": vllm_write,
               "mjolnir_write": mjolnir_write}
        for fn in fns.values():  # warm-up
            for _ in range(20):
                fn()
        for between in (False, True):
            per_round = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    per_round[name].append(timed(fn, args.calls, between))
            row = {"batch": batch, "context": context,
                   "after": "matmul" if between else "back to back",
                   **{name + "_us": statistics.median(v) for name, v in per_round.items()}}
            rows.append(row)
            print(f"batch {batch} context {context} {row['after']}: " + ", ".join(
                f"{name} {row[name + '_us']:.1f} us" for name in fns), flush=True)

    result = {"machine": machine_name(),
              "torch_threads": torch.get_num_threads(),
              "shape": {"hq": hq, "hk": hk, "d": d, "block": block, "dtype": "bf16"},
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

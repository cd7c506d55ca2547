#!/usr/bin/env python3
"""vLLM serving, stock and with the mjolnir plugin, per KV format: a random-weight Llama with
realistic attention shapes (Hq 32, Hk 8, D 128; few layers, a hidden size of 512 and a small
MLP, so that attention is what the numbers show; bf16 matmuls are slow on CPUs without
AVX512_BF16) through vLLM's CPU engine.

For each configuration and (context, batch): prefill time (first token of the batch), time in
attention during prefill steps, decode tokens/s (generated tokens after the first over the time
they took), the process's peak RSS, and the KV capacity in tokens vLLM reports. One engine per
process, warmed up with a short batch before the cases; --rounds engines per config, the configs
interleaved, medians reported (each round's values are kept in the JSON). Raw JSON to
bench/results/vllm-<date>-<machine>.json (-2, -3, ... where that exists: a run never overwrites
a kept result unless --json names it); --doc docs/vllm.md re-renders the doc's tables from their
files (--check: only compare, as the test suite does).

  build-python/venv/bin/python scripts/vllm_bench.py                 # the default set
  build-python/venv/bin/python scripts/vllm_bench.py --configs stock,bf16,fp4_e2m1 \\
      --cases 4096x1,4096x8,16384x1 --decode-tokens 32
  build-python/venv/bin/python scripts/vllm_bench.py --render FILE.json

Configs: "stock" (vLLM's own attention, bf16 cache), a mjolnir format (bf16, fp8_e4m3 through
vLLM's kv_cache_dtype fp8, the others through MJOLNIR_ATTN_KV_FORMAT), or "stock-fp8" (vLLM's
fp8 cache, which needs AVX-512 or AMX). Needs the venv of scripts/vllm-check.sh.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from result_files import file_slug, rerender_doc, unused_path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def machine_name() -> str:
    """The CPU as `mjolnir info` names it ("AMD EPYC (Zen 3)")."""
    model = platform.machine()
    # Either build folder's CLI (scripts/sweep.sh's or the README's): /proc's "AMD EPYC" alone
    # would name a Zen 4's results as a Zen 3's.
    for build in ("build", "build-cpu"):
        cli = os.path.join(ROOT, build, "tools", "mjolnir")
        try:
            info = subprocess.run([cli, "info"], capture_output=True, text=True).stdout
            return next(line.split(":", 1)[1].split(",")[0].strip()
                        for line in info.splitlines() if line.startswith("CPU:"))
        except (OSError, StopIteration):
            continue
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return model


def write_model(path: str, layers: int, max_len: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=max_len,
                         torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


# --- one engine (the child process) ---------------------------------------------------------------


class AttentionTimer:
    """Seconds spent in the attention impl's forward and cache writes, split by whether the
    step had prompt tokens (max_query_len > 1) or was all decodes."""

    def __init__(self):
        self.prefill = self.decode = 0.0
        self.depth = 0

    def wrap(self, cls, name):
        original = getattr(cls, name)
        timer = self

        def timed(impl, layer, *args, **kwargs):
            if timer.depth:
                return original(impl, layer, *args, **kwargs)
            timer.depth += 1
            t0 = time.perf_counter()
            try:
                return original(impl, layer, *args, **kwargs)
            finally:
                timer.depth -= 1
                elapsed = time.perf_counter() - t0
                if timer.phase_prefill:
                    timer.prefill += elapsed
                else:
                    timer.decode += elapsed

        setattr(cls, name, timed)

    phase_prefill = True


def child(spec: dict) -> dict:
    import resource

    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackendImpl,
                                                     CPUAttentionMetadataBuilder)

    timer = AttentionTimer()
    classes = [CPUAttentionBackendImpl]
    builders = [CPUAttentionMetadataBuilder]
    if spec["plugin"]:
        from mjolnir.vllm_backend import (MjolnirCPUAttentionImpl,
                                          MjolnirCPUAttentionMetadataBuilder)
        classes.append(MjolnirCPUAttentionImpl)
        builders.append(MjolnirCPUAttentionMetadataBuilder)
    for cls in classes:
        timer.wrap(cls, "forward")
        timer.wrap(cls, "do_kv_cache_update")
    # Which kind of step is running, known when the step's metadata is built: before any layer,
    # so before its first layer's cache write too (which comes before that layer's forward:
    # taking the phase from forward counted a prompt's first cache write as decode time, 23 ms
    # of a 4096-token nvfp4 prompt, 0.7 ms a step over 31 decode steps).
    for cls in builders:
        def phased(builder, common_prefix_len, common, *rest, _inner=cls.build, **kwargs):
            timer.phase_prefill = int(common.max_query_len) > 1
            return _inner(builder, common_prefix_len, common, *rest, **kwargs)

        cls.build = phased

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", max_model_len=spec["max_len"], block_size=32,
              max_num_seqs=spec["max_batch"], seed=0, enable_prefix_caching=False,
              kv_cache_dtype=spec["kv_cache_dtype"], disable_log_stats=False)
    cache = llm.llm_engine.vllm_config.cache_config
    capacity = (cache.num_gpu_blocks or 0) * cache.block_size
    # Warm-up: the first steps of an engine pay one-time costs (thread pools, first
    # allocations), which would otherwise land on the first case.
    llm.generate([{"prompt_token_ids": list(range(1, 257))}] * spec["max_batch"],
                 SamplingParams(max_tokens=4, temperature=0.0, detokenize=False,
                                ignore_eos=True), use_tqdm=False)
    results = []
    for context, batch in spec["cases"]:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 1 for j in range(context)]}
                   for i in range(batch)]
        params = SamplingParams(max_tokens=spec["decode_tokens"], temperature=0.0,
                                detokenize=False, ignore_eos=True)
        timer.prefill = timer.decode = 0.0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        firsts = [o.metrics.first_token_ts for o in outs]
        lasts = [o.metrics.last_token_ts for o in outs]
        scheduled = [o.metrics.scheduled_ts for o in outs]
        generated = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        decode_s = max(lasts) - max(firsts)
        results.append(dict(
            context=context, batch=batch, wall_s=wall,
            prefill_s=max(firsts) - min(scheduled),
            prefill_attention_s=timer.prefill,
            decode_tokens_per_s=generated / decode_s if decode_s > 0 else None,
            decode_attention_s=timer.decode,
            peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    from mjolnir.vllm_backend import MjolnirCPUAttentionImpl as impl_cls
    return dict(kv_capacity_tokens=capacity, cases=results,
                mjolnir_steps=impl_cls.mjolnir_steps, fallback_steps=impl_cls.fallback_steps)


# --- the parent ----------------------------------------------------------------------------------


def config_env(name: str) -> tuple[dict, str, bool]:
    """Environment, vLLM kv_cache_dtype and whether the plugin runs, for a config name. The
    plugin's configs run on mjolnir on every CPU (MJOLNIR_ATTN_ON_AMX=mjolnir: by default a CPU
    with AMX leaves bf16 and vLLM's fp8 caches to vLLM's AMX kernel, which "stock" and
    "stock-fp8" measure)."""
    if name == "stock":
        return {"MJOLNIR_ATTN_DISABLE": "1"}, "auto", False
    if name == "stock-fp8":
        return {"MJOLNIR_ATTN_DISABLE": "1"}, "fp8", False
    ours = {"MJOLNIR_ATTN_ON_AMX": "mjolnir"}
    if name == "bf16":
        return ours, "auto", True
    if name == "fp8_e4m3":
        return ours, "fp8", True
    if name == "fp8_e5m2":
        return ours, "fp8_e5m2", True
    return {**ours, "MJOLNIR_ATTN_KV_FORMAT": name}, "auto", True


def run(args) -> dict:
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    max_len = max(c for c, _ in cases) + args.decode_tokens + 32
    out = dict(date=datetime.date.today().isoformat(), machine=machine_name(),
               threads=os.cpu_count(), model=dict(layers=args.layers, hq=32, hk=8, d=128,
                                                  hidden=512, intermediate=1024,
                                                  block_size=32),
               decode_tokens=args.decode_tokens, kv_cache_space_gib=args.kv_space,
               rounds=args.rounds, configs={})
    names = args.configs.split(",")
    runs = {name: [] for name in names}  # each round's result per config
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "llama")
        write_model(model, args.layers, max_len)
        # Rounds interleave the configs (stock, plugin, stock, plugin, ...), so that the
        # machine's drift over the run (shared memory bandwidth, neighbours) falls on all alike.
        for round_index in range(args.rounds):
            for name in names:
                env_extra, kv_dtype, plugin = config_env(name)
                spec = dict(model=model, max_len=max_len, cases=cases,
                            max_batch=max(b for _, b in cases), decode_tokens=args.decode_tokens,
                            kv_cache_dtype=kv_dtype, plugin=plugin)
                env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                           VLLM_CPU_KVCACHE_SPACE=str(args.kv_space), **env_extra)
                print(f"vllm_bench: round {round_index + 1}/{args.rounds}: {name} ...", flush=True)
                proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                                      env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stdout[-2000:] + proc.stderr[-6000:], file=sys.stderr)
                    runs[name].append(dict(error=proc.stderr.strip().splitlines()[-1:]))
                    continue
                runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(json.dumps(runs[name][-1]), flush=True)
    for name in names:
        out["configs"][name] = medians(runs[name])
    return out


def medians(rounds: list) -> dict:
    """One config's result over its rounds: each case's timings as the median over the rounds
    (peak RSS: the largest), with every round's values kept under "rounds"."""
    good = [r for r in rounds if "error" not in r]
    if not good:
        return rounds[-1]
    result = dict(good[0])
    result["cases"] = []
    for i, case in enumerate(good[0]["cases"]):
        merged = dict(case)
        for key in ("wall_s", "prefill_s", "prefill_attention_s", "decode_tokens_per_s",
                    "decode_attention_s"):
            values = [r["cases"][i][key] for r in good if r["cases"][i].get(key) is not None]
            merged[key] = statistics.median(values) if values else None
            merged[f"{key}_rounds"] = values
        merged["peak_rss_gib"] = max(r["cases"][i]["peak_rss_gib"] for r in good)
        result["cases"].append(merged)
    result["failed_rounds"] = len(rounds) - len(good)
    return result


def render(data: dict) -> str:
    lines = [f"vLLM CPU engine on {data['machine']} ({data['threads']} threads), "
             f"{data['date']}: random Llama, {data['model']['layers']} layers, Hq 32, Hk 8, "
             f"D 128, block 32, {data['decode_tokens']} generated tokens per request, "
             f"VLLM_CPU_KVCACHE_SPACE={data['kv_cache_space_gib']} GiB. "
             + (f"Medians of {data['rounds']} rounds, the configs interleaved in each. "
                if data.get("rounds", 1) > 1 else "")
             + "Ratios are against stock vLLM on the same case in the same run.", "",
             "| config | context x batch | prefill s | prefill attention s (vs stock) | "
             "decode tok/s (vs stock) | peak RSS GiB | KV capacity tokens (vs stock) |",
             "|---|---|---|---|---|---|---|"]
    stock = data["configs"].get("stock", {})
    stock_cases = {(c["context"], c["batch"]): c for c in stock.get("cases", [])}

    def ratio(value, base):
        return f" ({value / base:.2f}x)" if value and base else ""

    for name, result in data["configs"].items():
        if "error" in result:
            lines.append(f"| {name} | error: {' '.join(result['error'])} | | | | | |")
            continue
        capacity = result["kv_capacity_tokens"]
        for case in result["cases"]:
            base = {} if name == "stock" else stock_cases.get((case["context"], case["batch"]), {})
            tps = case["decode_tokens_per_s"]
            attn = case["prefill_attention_s"]
            tps_text = f"{tps:.1f}{ratio(tps, base.get('decode_tokens_per_s'))}" if tps else "-"
            lines.append(
                f"| {name} | {case['context']} x {case['batch']} | {case['prefill_s']:.2f} | "
                f"{attn:.2f}{ratio(attn, base.get('prefill_attention_s'))} | {tps_text} | "
                f"{case['peak_rss_gib']:.2f} | "
                f"{capacity}{ratio(capacity, base and stock.get('kv_capacity_tokens'))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--configs", default="stock,bf16,fp8_e4m3,fp6_e2m3,fp4_e2m1,nvfp4")
    parser.add_argument("--cases", default="4096x1,4096x8,16384x1",
                        help="context x batch, comma-separated")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--kv-space", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    parser.add_argument("--rounds", type=int, default=3,
                        help="engines per config, interleaved across configs; medians reported")
    parser.add_argument("--json", help="output file (default bench/results/vllm-DATE-MACHINE.json, "
                        "or -2, -3, ... where that exists)")
    parser.add_argument("--render", help="print the table of a results file")
    parser.add_argument("--doc", help="re-render the tables of this doc from their files")
    parser.add_argument("--check", action="store_true",
                        help="with --doc: fail if a table differs from its file's")
    args = parser.parse_args()
    if args.doc:
        rerender_doc(args.doc, "vllm-bench", render, args.check, "scripts/vllm_bench.py")
        return
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)), end="")
        return
    data = run(args)
    path = args.json or unused_path(os.path.join(
        ROOT, "bench", "results", f"vllm-{data['date']}-{file_slug(data['machine'])}"))
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(render(data), end="")
    print(f"vllm_bench: wrote {path}")


if __name__ == "__main__":
    main()

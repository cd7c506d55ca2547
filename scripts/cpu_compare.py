#!/usr/bin/env python3
"""Side by side on this CPU: mjolnir's decode step against what users run instead.

  mjolnir  `mjolnir bench` (its default modes: what the CLI and the vLLM plugin run), every
           format asked for, page 16;
  vLLM     its CPU attention op (torch.ops._C.cpu_attention_with_kv_cache) as its CPU backend
           calls it: its default block size (128), its own ISA choice (AMX tiles where the CPU
           has them), split KV on; bf16, and fp8 where vLLM allows it on this CPU;
  ggml     its CPU flash attention (ggml_flash_attn_ext, what llama.cpp runs with flash
           attention on) over f16, q8_0 and q4_0 caches, built from source with native flags
           (bench/compare/ggml_attention.cc against the llama.cpp that PyPI's llama-cpp-python
           sdist vendors, fetched into build-compare/; nothing of it is kept in the repository).

Every backend gets the same decode step (Hq 32, Hk 8, D 128, one query token per sequence,
batch x context), the same thread count, caches rotated through a working set of at least 4x
the last-level cache (1.2 GiB at least), and a median over its timed calls; the backends take
turns within each round, and the medians over rounds are reported. Rows have `mjolnir bench
--json`'s shape (backend, format, batch, context, median_us, kv_bytes, gbps, bandwidth_fraction
against the read bandwidth mjolnir bench measured in the same run).

  build-python/venv/bin/python scripts/cpu_compare.py            # 8k-128k x batch 1, 8; 3 rounds
  build-python/venv/bin/python scripts/cpu_compare.py --contexts 8192 --batches 1 --rounds 1
  scripts/cpu_compare.py --doc docs/cpu-performance.md [--check]  # re-render the docs' tables

Needs vLLM's CPU wheel and torch for the vLLM rows (the venv of scripts/vllm-check.sh); without
them those rows are skipped, saying so. Raw JSON to bench/results/cpu-compare-DATE-MACHINE.json
(-2, -3, ... where that exists).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time

from result_files import file_slug, rerender_doc, unused_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HQ, HK, D = 32, 8, 128
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp provides ggml
MIN_WORKING_SET = 1200 * 2**20


def log(message: str) -> None:
    print(f"cpu_compare: {message}", file=sys.stderr, flush=True)


# --- ggml ---------------------------------------------------------------------------------------

def build_ggml(work: str) -> str:
    """The ggml_attention driver, built once into `work`: llama.cpp's source from PyPI's
    llama-cpp-python sdist, ggml's CPU backend built with -march=native (GGML_NATIVE)."""
    driver = os.path.join(work, "ggml_attention")
    source = os.path.join(ROOT, "bench", "compare", "ggml_attention.cc")
    if os.path.exists(driver) and os.path.getmtime(driver) >= os.path.getmtime(source):
        return driver
    os.makedirs(work, exist_ok=True)
    llama = os.path.join(work, f"llama_cpp_python-{LLAMA_CPP_PYTHON}", "vendor", "llama.cpp")
    if not os.path.isdir(llama):
        log(f"fetching llama-cpp-python {LLAMA_CPP_PYTHON}'s source (for ggml) from PyPI")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", "--dest", work,
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
        sdist = os.path.join(work, f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    build = os.path.join(work, "ggml-build")
    lib = os.path.join(build, "ggml", "src")
    if not os.path.exists(os.path.join(lib, "libggml-cpu.a")):
        log("building ggml's CPU backend with native flags (about a minute)")
        subprocess.run(["cmake", "-S", llama, "-B", build, "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
                        "-DGGML_OPENMP=ON"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target",
                        "ggml", "ggml-cpu", "ggml-base"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["g++", "-O2", "-std=c++17", "-I", os.path.join(llama, "ggml", "include"),
                    source, os.path.join(lib, "libggml.a"), os.path.join(lib, "libggml-cpu.a"),
                    os.path.join(lib, "libggml-base.a"), "-fopenmp", "-lpthread", "-o", driver],
                   check=True)
    return driver


def ggml_row(driver: str, fmt: str, batch: int, context: int, threads: int, min_time: float,
             working_set: int) -> dict:
    out = subprocess.run([driver, fmt, str(batch), str(context), str(threads), str(min_time),
                          str(working_set)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


# --- vLLM ---------------------------------------------------------------------------------------

class VllmOp:
    """vLLM's CPU attention op as its CPU backend calls it (cpu_attn.py): K and V in its cache
    layout [blocks, Hk, 2 x block, D], its scheduler metadata, split KV as VLLM_CPU_ATTN_SPLIT_KV
    leaves it by default."""

    BLOCK = 128  # vLLM's CPU default block size (its platform sets it when none is asked)

    def __init__(self, threads: int):
        import torch
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends import cpu_attn
        current_platform.import_kernels()
        torch.set_num_threads(threads)
        self.torch, self.ops, self.cpu_attn = torch, ops, cpu_attn

    def dtypes(self) -> list:
        """vLLM's cache dtypes this CPU runs: bf16, and fp8 where vLLM allows it."""
        names = ["bf16"]
        try:
            self.cpu_attn._get_attn_isa(self.torch.bfloat16, self.BLOCK, D, "fp8")
            names.append("fp8")
        except NotImplementedError as e:
            log(f"no vLLM fp8 rows: {e}")
        return names

    def row(self, dtype: str, batch: int, context: int, min_time: float,
            working_set: int) -> dict:
        torch = self.torch
        kv_cache_dtype = "auto" if dtype == "bf16" else "fp8"
        isa = self.cpu_attn._get_attn_isa(torch.bfloat16, self.BLOCK, D, kv_cache_dtype)
        if isa == "amx":
            torch._C._cpu._init_amx()  # the tiles' permission from Linux, as vLLM's worker asks
        element = 2 if dtype == "bf16" else 1
        blocks_per_seq = -(-context // self.BLOCK)
        kv_bytes = 2 * batch * blocks_per_seq * self.BLOCK * HK * D * element
        copies = max(1, -(-working_set // kv_bytes))
        blocks = copies * batch * blocks_per_seq
        # Random rows, repeated: the op's time does not depend on the values, and filling GiBs
        # with torch.randn would take longer than the timing.
        shape = (HK, self.BLOCK, 2 * D)
        pool = (torch.randn(shape).to(torch.bfloat16) if dtype == "bf16" else
                torch.randint(0, 120, shape, dtype=torch.uint8))  # finite e4m3 codes
        cache = torch.empty(blocks, *shape, dtype=pool.dtype)
        cache.copy_(pool.expand_as(cache))
        kc, vc = cache.view(blocks, HK, 2 * self.BLOCK, D).chunk(2, dim=2)
        tables = [torch.arange(c * batch * blocks_per_seq, (c + 1) * batch * blocks_per_seq,
                               dtype=torch.int32).reshape(batch, -1) for c in range(copies)]
        seq_lens = torch.full((batch,), context, dtype=torch.int32)
        starts = torch.arange(batch + 1, dtype=torch.int32)
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16)
        out = torch.empty(batch, HQ, D, dtype=torch.bfloat16)
        sched = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=batch, num_heads=HQ, num_kv_heads=HK, head_dim=D, seq_lens=seq_lens,
            dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1,
            isa=isa, enable_kv_split=True, kv_cache_dtype=kv_cache_dtype)

        def call(i):
            self.ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=starts,
                seq_lens=seq_lens, scale=D ** -0.5, causal=True, alibi_slopes=None,
                sliding_window=-1, block_table=tables[i % copies], softcap=0.0,
                scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=1.0,
                v_scale=1.0, kv_cache_dtype=kv_cache_dtype)

        for i in range(copies):  # warm-up: every copy once
            call(i)
        samples, start, i = [], time.perf_counter(), 0
        while len(samples) < 3 or time.perf_counter() - start < min_time:
            t0 = time.perf_counter()
            call(i)
            samples.append((time.perf_counter() - t0) * 1e6)
            i += 1
        return {"backend": "vllm-cpu", "format": dtype, "batch": batch, "context": context,
                "q_len": 1, "hq": HQ, "hk": HK, "d": D, "page": self.BLOCK, "isa": isa,
                "median_us": statistics.median(samples), "runs": len(samples),
                "kv_bytes": kv_bytes, "working_set_bytes": kv_bytes * copies, "copies": copies}


# --- mjolnir ------------------------------------------------------------------------------------

def mjolnir_cli(path: str | None) -> str:
    """The CLI: --mjolnir, else build/tools/mjolnir (built as scripts/bench.sh builds it)."""
    if path:
        return path
    cli = os.path.join(ROOT, "build", "tools", "mjolnir")
    if not os.path.exists(cli):
        log("building the mjolnir CLI in build/ (as scripts/bench.sh does)")
        subprocess.run(["cmake", "-S", ROOT, "-B", os.path.join(ROOT, "build"), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", os.path.join(ROOT, "build"), "--target",
                        "mjolnir_cli"], check=True, stdout=subprocess.DEVNULL)
    return cli


def mjolnir_rows(cli: str, formats: list, batches: list, contexts: list, threads: int,
                 min_time: float, tmp: str) -> tuple:
    subprocess.run([cli, "bench", "--format", ",".join(formats), "--batch",
                    ",".join(map(str, batches)), "--context", ",".join(map(str, contexts)),
                    "--threads", str(threads), "--min-time", str(min_time), "--json", tmp],
                   check=True, stdout=subprocess.DEVNULL)
    with open(tmp) as f:
        data = json.load(f)
    rows = [{**r, "backend": "mjolnir-cpu"} for r in data["results"]]
    return data["machine"], rows


# --- the run ------------------------------------------------------------------------------------

def run(args) -> dict:
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    formats = args.formats.split(",")
    ggml_types = [t for t in args.ggml_types.split(",") if t]
    cli = mjolnir_cli(args.mjolnir)
    driver = build_ggml(os.path.join(ROOT, "build-compare")) if ggml_types else None
    vllm = None
    try:
        vllm = VllmOp(args.threads)
        vllm_dtypes = vllm.dtypes()
    except ImportError as e:
        log(f"no vLLM rows: vLLM's CPU wheel is not importable here ({e})")
        vllm_dtypes = []
    machine, samples = None, {}
    tmp = os.path.join(ROOT, "build-compare", "mjolnir-bench.json")
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}: mjolnir bench ({', '.join(formats)})")
        machine, rows = mjolnir_rows(cli, formats, batches, contexts, args.threads,
                                     args.min_time, tmp)
        working_set = max(MIN_WORKING_SET, 4 * int(machine.get("llc_bytes", 0)))
        for batch in batches:
            for context in contexts:
                for dtype in vllm_dtypes:
                    log(f"round {r + 1}: vLLM {dtype}, batch {batch}, context {context}")
                    rows.append(vllm.row(dtype, batch, context, args.min_time, working_set))
                for fmt in ggml_types:
                    log(f"round {r + 1}: ggml {fmt}, batch {batch}, context {context}")
                    rows.append(ggml_row(driver, fmt, batch, context, args.threads,
                                         args.min_time, working_set))
        for row in rows:
            key = (row["backend"], row["format"], row["batch"], row["context"])
            samples.setdefault(key, []).append(row)
    bandwidth = machine["read_bandwidth_gbps"]
    results = []
    for rows in samples.values():
        row = dict(rows[0])
        row["median_us"] = statistics.median(r["median_us"] for r in rows)
        row["median_us_rounds"] = [r["median_us"] for r in rows]
        row["gbps"] = row["kv_bytes"] / row["median_us"] / 1e3
        row["bandwidth_fraction"] = row["gbps"] / bandwidth
        results.append(row)
    return {"machine": machine, "date": datetime.date.today().isoformat(),
            "threads": args.threads, "rounds": args.rounds,
            "shape": {"hq": HQ, "hk": HK, "d": D, "q_len": 1},
            "ggml_source": f"llama-cpp-python {LLAMA_CPP_PYTHON} (PyPI sdist)",
            "vllm_version": vllm_version(), "results": results}


def vllm_version() -> str | None:
    try:
        import vllm
        return vllm.__version__
    except ImportError:
        return None


# --- rendering ----------------------------------------------------------------------------------

def render(data: dict) -> str:
    """One table: a row per (batch, context), milliseconds per decode step per backend and
    format, and vLLM's and ggml's best time over mjolnir's."""
    machine = data["machine"]
    results = data["results"]
    columns = []
    for backend in ("mjolnir-cpu", "vllm-cpu", "ggml-cpu"):
        for r in results:
            if r["backend"] == backend and (backend, r["format"]) not in columns:
                columns.append((backend, r["format"]))
    shapes = sorted({(r["batch"], r["context"]) for r in results})
    by_key = {(r["backend"], r["format"], r["batch"], r["context"]): r for r in results}
    label = {"mjolnir-cpu": "mjolnir", "vllm-cpu": "vLLM", "ggml-cpu": "ggml"}
    isa = sorted({r.get("isa", "") for r in results if r["backend"] == "vllm-cpu"} - {""})
    lines = [f"{machine['cpu']}, {data['threads']} threads, {data['date']} (read bandwidth "
             f"{machine['read_bandwidth_gbps']:.1f} GB/s, measured by `mjolnir bench` in the same "
             f"run): one decode step, Hq {data['shape']['hq']}, Hk {data['shape']['hk']}, "
             f"D {data['shape']['d']}, ms, median of {data['rounds']} interleaved rounds. "
             f"mjolnir in its default modes, page 16; vLLM {data.get('vllm_version') or ''}, "
             f"block 128, its {'/'.join(isa) or 'own'} kernel; ggml from "
             f"{data.get('ggml_source', 'source')}, native flags. The last columns divide "
             f"their time by mjolnir's: vLLM's bf16 by mjolnir's bf16, then each one's fastest "
             f"row by mjolnir's fastest.", ""]
    header = ["batch", "context"] + [f"{label[b]} {f}" for b, f in columns] + [
        "vLLM / mjolnir, bf16", "vLLM / mjolnir, fastest", "ggml / mjolnir, fastest"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))

    def best(backend, batch, context):
        times = [r["median_us"] for (b, _, bb, c), r in by_key.items()
                 if b == backend and bb == batch and c == context]
        return min(times) if times else None

    for batch, context in shapes:
        cells = [str(batch), str(context)]
        for backend, fmt in columns:
            r = by_key.get((backend, fmt, batch, context))
            cells.append(f"{r['median_us'] / 1e3:.2f}" if r else "")
        ours = best("mjolnir-cpu", batch, context)
        ours_bf16 = by_key.get(("mjolnir-cpu", "bf16", batch, context))
        theirs_bf16 = by_key.get(("vllm-cpu", "bf16", batch, context))
        cells.append(f"{theirs_bf16['median_us'] / ours_bf16['median_us']:.1f}x"
                     if ours_bf16 and theirs_bf16 else "")
        for other in ("vllm-cpu", "ggml-cpu"):
            theirs = best(other, batch, context)
            cells.append(f"{theirs / ours:.1f}x" if ours and theirs else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--formats", default="bf16,fp8_e4m3,fp6_e2m3,fp4_e2m1,nvfp4",
                        help="mjolnir's cache formats")
    parser.add_argument("--ggml-types", default="f16,q8_0,q4_0",
                        help="ggml's cache types (empty: no ggml rows)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.5,
                        help="seconds each backend times each shape for, per round")
    parser.add_argument("--mjolnir", help="the mjolnir CLI (default build/tools/mjolnir)")
    parser.add_argument("--json", help="output file (default bench/results/"
                        "cpu-compare-DATE-MACHINE.json, or -2, -3, ... where that exists)")
    parser.add_argument("--render", help="print the table of a results file")
    parser.add_argument("--doc", help="re-render the comparison tables of this doc")
    parser.add_argument("--check", action="store_true", help="with --doc: only compare")
    args = parser.parse_args()
    if args.doc:
        rerender_doc(args.doc, "cpu-compare", render, args.check, "scripts/cpu_compare.py")
        return
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)), end="")
        return
    if args.threads < 1 or args.rounds < 1 or args.min_time <= 0:
        parser.error("--threads and --rounds must be at least 1, --min-time positive")
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        parser.error("cmake and g++ are needed (scripts/setup-debian.sh installs them)")
    data = run(args)
    path = args.json or unused_path(os.path.join(
        ROOT, "bench", "results", f"cpu-compare-{data['date']}-{file_slug(data['machine']['cpu'])}"))
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(render(data), end="")
    print(f"cpu_compare: wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()

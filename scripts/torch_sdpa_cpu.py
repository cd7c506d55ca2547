#!/usr/bin/env python3
"""mjolnir's CPU decode step against the one a PyTorch user would otherwise run on the CPU:
torch.nn.functional.scaled_dot_product_attention over a dense bf16 (or fp32) K/V cache with
enable_gqa, the same shape (Hq 32, Hk 8, D 128, one query token) and threads, in the same run.

    build-python/venv/bin/python scripts/torch_sdpa_cpu.py            # measure, write, render
    python3 scripts/torch_sdpa_cpu.py --check --doc docs/cpu-performance.md

Measuring needs torch (scripts/python-check.sh's venv has it) and build/tools/mjolnir. It writes
bench/results/torch-sdpa-cpu-DATE-MACHINE.json: the torch rows (median of timed steps that rotate
through dense cache copies larger than the last-level cache, as `mjolnir bench` rotates its
paged copies) and `mjolnir bench`'s own JSON for the same shapes (bf16 cache, Q bf16, P fp32).
The table replaces what lies between `<!-- torch-sdpa-cpu:begin -->` and
`<!-- torch-sdpa-cpu:end -->` in the doc; `--check` only compares (the test suite runs it).
torch reads a dense cache only: a paged or low-bit cache would first have to be gathered and
decoded to it, which the torch times leave out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

BEGIN = "<!-- torch-sdpa-cpu:begin -->"
END = "<!-- torch-sdpa-cpu:end -->"
ROOT = pathlib.Path(__file__).resolve().parent.parent
HQ, HK, D = 32, 8, 128
SHAPES = [(1, 8192), (1, 32768), (8, 8192), (8, 32768)]  # (batch, context)
WORKING_SET = 1536 << 20  # bytes of cache copies a torch step rotates through, as the bench's


def machine_name() -> str:
    model = platform.processor() or "cpu"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return model


def time_torch(dtype_name: str, batch: int, context: int, min_time_s: float) -> dict:
    import torch
    import torch.nn.functional as F

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    generator = torch.Generator().manual_seed(batch * 1000003 + context)
    kv_bytes = 2 * batch * HK * context * D * torch.finfo(dtype).bits // 8
    copies = max(1, min(64, WORKING_SET // kv_bytes))
    caches = [
        (
            torch.randn(batch, HK, context, D, generator=generator).to(dtype),
            torch.randn(batch, HK, context, D, generator=generator).to(dtype),
        )
        for _ in range(copies)
    ]
    q = torch.randn(batch, HQ, 1, D, generator=generator).to(dtype)
    for k, v in caches:  # warm-up: one step per copy
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    seconds = []
    start = time.perf_counter()
    while len(seconds) < 3 or time.perf_counter() - start < min_time_s:
        k, v = caches[len(seconds) % copies]
        t = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        seconds.append(time.perf_counter() - t)
    median_us = statistics.median(seconds) * 1e6
    return {
        "backend": "torch-sdpa",
        "dtype": dtype_name,
        "batch": batch,
        "context": context,
        "median_us": median_us,
        "runs": len(seconds),
        "kv_bytes": kv_bytes,
        "copies": copies,
        "gbps": kv_bytes / (median_us * 1e-6) / 1e9,
    }


def measure(args: argparse.Namespace) -> pathlib.Path:
    import torch

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    mjolnir = ROOT / "build" / "tools" / "mjolnir"
    if not mjolnir.exists():
        sys.exit(f"torch_sdpa_cpu.py: {mjolnir} is missing; build it first (bash scripts/bench.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        bench_json = pathlib.Path(tmp) / "bench.json"
        contexts = ",".join(str(c) for c in sorted({c for _, c in SHAPES}))
        batches = ",".join(str(b) for b in sorted({b for b, _ in SHAPES}))
        print(f"torch_sdpa_cpu: mjolnir bench, bf16 cache, Q bf16, batches {batches}, contexts {contexts}",
              flush=True)
        subprocess.run([str(mjolnir), "bench", "--format", "bf16", "--q-mode", "bf16", "--batch", batches,
                        "--context", contexts, "--heads", f"{HQ}:{HK}", "--head-dim", str(D),
                        "--threads", str(threads), "--min-time", str(args.min_time), "--json", str(bench_json)],
                       check=True)
        bench = json.loads(bench_json.read_text())
    rows = []
    for dtype in ("bf16", "fp32"):
        for batch, context in SHAPES:
            row = time_torch(dtype, batch, context, args.min_time)
            print(f"torch-sdpa {dtype:4s} batch {batch} context {context:6d}: {row['median_us'] / 1000:.2f} ms",
                  flush=True)
            rows.append(row)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    slug = re.sub(r"[^a-z0-9]+", "-", f"{machine_name()} {threads}t".lower()).strip("-")
    slug = re.sub(r"-(processor|\d+-core)", "", slug)
    path = ROOT / "bench" / "results" / f"torch-sdpa-cpu-{date}-{slug}.json"
    document = {
        "machine": {"cpu": machine_name(), "threads": threads, "date": date, "torch": torch.__version__},
        "torch": rows,
        "mjolnir": bench,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"torch_sdpa_cpu: {path.relative_to(ROOT)}")
    return path


def render(path: pathlib.Path) -> str:
    document = json.loads(path.read_text())
    machine = document["machine"]
    mine = {(r["batch"], r["context"]): r for r in document["mjolnir"]["results"]}
    torch_rows = {(r["dtype"], r["batch"], r["context"]): r for r in document["torch"]}
    lines = [
        f"Generated by `scripts/torch_sdpa_cpu.py` from `{path.relative_to(ROOT)}` ({machine['date']}; "
        f"{machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}, both measured in the same "
        "run). Do not edit by hand.",
        "",
        f"Decode step, Hq {HQ}, Hk {HK}, D {D}, one query token: mjolnir's CPU kernel over a paged bf16 cache "
        "(Q bf16, P fp32) against `torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)` over a "
        "dense cache of the same size, each rotating through copies larger than the last-level cache; median "
        "step times in ms:",
        "",
        "| batch | context | mjolnir bf16 | torch bf16 | torch fp32 | mjolnir's speed-up over the faster torch |",
        "|---|---|---|---|---|---|",
    ]
    for batch, context in SHAPES:
        m = mine.get((batch, context))
        tb = torch_rows.get(("bf16", batch, context))
        tf = torch_rows.get(("fp32", batch, context))
        if m is None or tb is None or tf is None:
            continue
        lines.append(
            f"| {batch} | {context // 1024}k | {m['median_us'] / 1000:.2f} | {tb['median_us'] / 1000:.1f} | "
            f"{tf['median_us'] / 1000:.1f} | {min(tb['median_us'], tf['median_us']) / m['median_us']:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def splice(doc: str, table: str) -> str:
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    return doc[:start] + "\n" + table + doc[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", help="a result file to render (default: measure one)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "cpu-performance.md"))
    parser.add_argument("--check", action="store_true", help="fail if the doc's table differs from its file's")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds to time each configuration for")
    args = parser.parse_args()
    doc_path = pathlib.Path(args.doc)
    doc = doc_path.read_text()
    if args.check:
        named = re.search(r"Generated by `scripts/torch_sdpa_cpu.py` from `([^`]+)`", doc)
        if named is None:
            print(f"{doc_path}: no torch-sdpa-cpu table", file=sys.stderr)
            return 1
        source = ROOT / named.group(1)
        if splice(doc, render(source)) != doc:
            print(f"{doc_path}: the torch-sdpa-cpu table differs from {source}; re-render it", file=sys.stderr)
            return 1
        print(f"{doc_path}: torch-sdpa-cpu table matches {source}")
        return 0
    path = pathlib.Path(args.results) if args.results else measure(args)
    doc_path.write_text(splice(doc, render(path.resolve())))
    print(f"torch_sdpa_cpu: {path} -> {doc_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

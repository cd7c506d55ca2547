#!/usr/bin/env python3
"""Renders `mjolnir accuracy --json` result files into the tables of docs/accuracy.md.

    scripts/render_accuracy.py --doc docs/accuracy.md           # re-render every table
    scripts/render_accuracy.py --doc docs/accuracy.md --check   # only compare (ctest does)

Each block `<!-- accuracy:begin FILE -->` ... `<!-- accuracy:end -->` of the doc is replaced by
the tables of FILE (a path from the repository root): per distribution of K, the error of every
format at each scale granularity and of llama.cpp's q8_0 / q4_0 on the same data; the formats at
about the bytes of q8_0 and q4_0 set against them; every numerics mode at the recommended
granularity. Errors are means over the file's seeds (draws of the data).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- accuracy:begin (\S+) -->\n)(.*?)(<!-- accuracy:end -->)", re.S)
GRANULARITIES = ["tensor", "head", "channel"]
MODES = [(q, p) for p in ("fp32", "bf16", "fp8", "fp16") for q in ("fp32", "bf16", "fp8", "int8")]
DATA = {"outlier_k": "K with outlier channels (x8 on one channel in 23)",
        "gaussian": "plain N(0, 1) K"}
# Against each of llama.cpp's block formats, mjolnir's formats of about its size.
PEERS = {"q8_0": ["fp8_e4m3", "fp8_e5m2", "fp6_e2m3"], "q4_0": ["nvfp4", "fp4_e2m1"]}


def number(x: float) -> str:
    return f"{x:.3g}" if x >= 0.001 else f"{x:.2e}"


def bits(x: float) -> str:
    return f"{x:g}"


class Results:
    def __init__(self, data: dict):
        self.data = data
        self.errors: dict = {}  # (data, format, granularity, q, p) -> [error per seed]
        for row in data["rows"]:
            key = (row["data"], row["format"], row["granularity"], row["q_mode"], row["p_mode"])
            self.errors.setdefault(key, []).append(row["rel_error"])
        self.blocks: dict = {}  # (data, format) -> [error per seed]
        for row in data["block_formats"]:
            self.blocks.setdefault((row["data"], row["format"]), []).append(row["rel_error"])
        self.bits = {row["format"]: row["bits"] for row in data["rows"] + data["block_formats"]}
        self.formats = list(dict.fromkeys(row["format"] for row in data["rows"]))
        compare = data["compare_mode"]
        self.compare = (compare["q_mode"], compare["p_mode"])

    def recommended(self, fmt: str) -> str:
        return self.data["recommended"].get(fmt, {}).get("library", "tensor")

    def mean(self, *key) -> float | None:
        values = self.errors.get(key)
        return statistics.fmean(values) if values else None

    def spread(self, *key) -> str:
        values = self.errors.get(key)
        if not values:
            return "-"
        return f"{number(statistics.fmean(values))} ({number(min(values))}-{number(max(values))})"


def granularity_table(r: Results, data: str) -> list[str]:
    q, p = r.compare
    lines = [f"**{DATA[data]}**, V N(0, 1); Q {q}, P {p}; mean over the seeds (smallest-largest):",
             "", "| format | bits per value | tensor | head | channel | recommended |",
             "|---|---|---|---|---|---|"]
    for fmt in r.formats:
        cells = [r.spread(data, fmt, g, q, p) for g in GRANULARITIES]
        lines.append(f"| {fmt} | {bits(r.bits[fmt])} | " + " | ".join(cells) +
                     f" | {r.recommended(fmt)} |")
    for block in PEERS:
        values = r.blocks[(data, block)]
        lines.append(f"| llama.cpp {block} | {bits(r.bits[block])} | "
                     f"{number(statistics.fmean(values))} ({number(min(values))}-"
                     f"{number(max(values))}), its own block scales | | | |")
    return lines + [""]


def peer_table(r: Results) -> list[str]:
    q, p = r.compare
    lines = ["mjolnir's formats at their recommended granularity against llama.cpp's block format "
             f"of about their size (Q {q}, P {p}; below 1: mjolnir more accurate):", "",
             "| llama.cpp | bits | mjolnir | bits | " +
             " | ".join(f"error ratio, {DATA[d].split(' (')[0]}" for d in DATA) + " |",
             "|---|---|---|---|" + "---|" * len(DATA)]
    for block, peers in PEERS.items():
        for fmt in peers:
            if fmt not in r.formats:
                continue
            ratios = []
            for data in DATA:
                ours = r.mean(data, fmt, r.recommended(fmt), q, p)
                theirs = statistics.fmean(r.blocks[(data, block)])
                ratios.append(f"{ours / theirs:.2f}" if ours else "-")
            lines.append(f"| {block} | {bits(r.bits[block])} | {fmt} ({r.recommended(fmt)}) | "
                         f"{bits(r.bits[fmt])} | " + " | ".join(ratios) + " |")
    return lines + [""]


def mode_table(r: Results, data: str) -> list[str]:
    lines = [f"Every numerics mode at the recommended granularity, **{DATA[data]}** (mean over the "
             "seeds; in brackets the ratio to Q fp32, P fp32):", "",
             "| format | " + " | ".join(f"Q {q}, P {p}" for q, p in MODES) + " |",
             "|---|" + "---|" * len(MODES)]
    for fmt in r.formats:
        g = r.recommended(fmt)
        base = r.mean(data, fmt, g, "fp32", "fp32")
        cells = []
        for q, p in MODES:
            value = r.mean(data, fmt, g, q, p)
            cells.append("-" if value is None else
                         f"{number(value)} ({value / base:.2f})" if base else number(value))
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return lines + [""]


def render(data: dict) -> str:
    r = Results(data)
    shape = data["shape"]
    lines = [f"`mjolnir accuracy` on {data['machine']['cpu']} ({data['machine']['simd_target']}, "
             f"backend {data['backend']}), {data['date']}: Hq {shape['hq']}, Hk {shape['hk']}, "
             f"D {shape['d']}, {shape['batch']} sequences x {shape['context']} tokens, one query "
             f"token each ({shape['queries']}), {data['seeds']} seeds. Relative L2 error of the "
             "output against fp64 attention over the unquantized K/V.", ""]
    for d in DATA:
        lines += granularity_table(r, d)
    lines += peer_table(r)
    for d in DATA:
        lines += mode_table(r, d)
    return "\n".join(lines)


def splice(doc: str) -> str:
    def block(m):
        with open(ROOT / m.group(2)) as f:
            return m.group(1) + render(json.load(f)) + m.group(4)
    return BLOCK.sub(block, doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", required=True, help="the doc whose accuracy tables to render")
    parser.add_argument("--check", action="store_true", help="only compare; fail on a difference")
    args = parser.parse_args()
    doc = pathlib.Path(args.doc).read_text()
    new = splice(doc)
    if args.check:
        if new != doc:
            print(f"{args.doc}: an accuracy table differs from its results file; run "
                  f"scripts/render_accuracy.py --doc {args.doc}", file=sys.stderr)
            sys.exit(1)
        return
    pathlib.Path(args.doc).write_text(new)


if __name__ == "__main__":
    main()

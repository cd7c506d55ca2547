#!/usr/bin/env python3
"""`mjolnir accuracy` end to end on a small step: it runs, writes every row the doc's tables
need, and measures what the recommended granularities rest on (per-channel scales rescue
fp4_e2m1 from K's outlier channels; llama.cpp's q8_0 is more accurate than fp8_e4m3 at about
the same bytes); then docs/accuracy.md's renderer takes the file.

    cli_accuracy_test.py BUILD/tools/mjolnir
"""

import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import render_accuracy  # noqa: E402


def mean(rows, **match):
    values = [r["rel_error"] for r in rows if all(r[k] == v for k, v in match.items())]
    assert values, match
    return sum(values) / len(values)


def main() -> None:
    cli = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "accuracy.json"
        subprocess.run([cli, "accuracy", "--format", "fp8_e4m3,fp4_e2m1,nvfp4", "--context",
                        "512", "--batch", "2", "--seeds", "2", "--json", str(path)], check=True,
                       stdout=subprocess.DEVNULL)
        data = json.loads(path.read_text())
    rows = data["rows"]
    for fmt in ("fp8_e4m3", "fp4_e2m1", "nvfp4"):
        granularities = {r["granularity"] for r in rows if r["format"] == fmt}
        assert granularities == {"tensor", "head", "channel"}, (fmt, granularities)
        recommended = data["recommended"][fmt]["library"]
        modes = {(r["q_mode"], r["p_mode"]) for r in rows
                 if r["format"] == fmt and r["granularity"] == recommended}
        # Q fp32, bf16, fp8, int8 x P fp32, bf16, fp8, fp16 (which these formats all take)
        assert len(modes) == 16, (fmt, modes)
    assert all(0 < r["rel_error"] < 2 for r in rows + data["block_formats"])
    fp4 = {g: mean(rows, data="outlier_k", format="fp4_e2m1", granularity=g, q_mode="bf16",
                   p_mode="fp32") for g in ("tensor", "channel")}
    assert fp4["channel"] < 0.75 * fp4["tensor"], fp4
    q8 = mean(data["block_formats"], format="q8_0")
    fp8 = mean(rows, format="fp8_e4m3", granularity="channel", q_mode="bf16", p_mode="fp32")
    assert q8 < fp8, (q8, fp8)
    assert "| llama.cpp q4_0 |" in render_accuracy.render(data)
    print(f"fp4_e2m1 on outlier K: tensor {fp4['tensor']:.3f}, channel {fp4['channel']:.3f}; "
          f"fp8_e4m3 {fp8:.4f} against q8_0 {q8:.4f}")


if __name__ == "__main__":
    main()

"""What the benchmark scripts share about their raw result files (bench/results/) and the doc
tables rendered from them: file names, and re-rendering or checking a doc's generated blocks."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def file_slug(machine: str) -> str:
    """A machine's name in file-name form, as `mjolnir bench` names its files: "AMD EPYC (Zen 3)"
    -> "amd-epyc-zen-3", "Intel(R) Xeon(R) Processor" -> "intel-xeon-processor"."""
    machine = re.sub(r"\((R|r|TM|tm)\)", "", machine)
    return re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")


def unused_path(stem: str) -> str:
    """stem.json, or stem-2.json, stem-3.json, ... where it exists: a run without an explicit
    output file never overwrites a kept result (the same day and machine run more than once)."""
    path, n = stem + ".json", 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}-{n}.json"
    return path


def rerender_doc(doc_path: str, marker: str, render: Callable[[dict], str], check: bool,
                 script: str) -> None:
    """Every block <!-- MARKER:begin FILE --> ... <!-- MARKER:end --> of the doc re-rendered from
    its raw results file (FILE relative to the repository); with check, only compared: exits 1
    naming the script to run when a block differs."""
    block = re.compile(rf"(<!-- {marker}:begin (\S+) -->\n)(.*?)(<!-- {marker}:end -->)", re.S)

    def rendered(m):
        with open(os.path.join(ROOT, m.group(2))) as f:
            return m.group(1) + render(json.load(f)) + m.group(4)

    with open(doc_path) as f:
        doc = f.read()
    new = block.sub(rendered, doc)
    if check:
        if new != doc:
            print(f"{doc_path}: a {marker} table differs from its results file; run "
                  f"{script} --doc {doc_path}", file=sys.stderr)
            sys.exit(1)
        return
    with open(doc_path, "w") as f:
        f.write(new)

#!/usr/bin/env python3
"""The loops of a CUDA kernel that issue MMAs, from `cuobjdump -sass` output: their instruction
counts, the most frequent opcodes, the branches inside them (so the arms of an if/else in the
loop can be told apart), and the count without the loop's first if-arm (in the decode step
loops, the per-row page lookup that steps inside one page skip: what docs/cuda.md counts). For
reading what a change did to a decode step loop without a GPU.

    nvcc -std=c++20 -O3 -DNDEBUG -DMJOLNIR_HAS_CUDA=1 -Iinclude -Isrc -arch=sm_90a -cubin \\
        -o /tmp/decode.cubin src/cuda/decode_launch.cu
    cuobjdump -sass /tmp/decode.cubin > /tmp/decode.sass
    scripts/sass_loops.py /tmp/decode.sass decode_mma_kernelILNS_6FormatE2ELi128E

The second argument selects kernels by a substring of their mangled name (Format 2 is fp8_e4m3,
see include/mjolnir/format.h). cuobjdump is not part of the CUDA toolkit's nvcc packages; PyPI's
`nvidia-cuda-cuobjdump` wheel carries it (bin/cuobjdump).
"""
import collections
import re
import sys

INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def opcode(text: str) -> str:
    return PREDICATE.sub("", text).split()[0]


def kernels(sass: str):
    for block in sass.split("Function : ")[1:]:
        name, body = block.split("\n", 1)
        instructions = [(int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.match, body.split("\n")) if m]
        yield name.strip(), instructions


def mma_loops(instructions):
    """(first, last) indices of every backward branch's range that holds an MMA."""
    index = {address: i for i, (address, _) in enumerate(instructions)}
    for i, (address, text) in enumerate(instructions):
        m = BRANCH_TARGET.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target <= address and target in index:
            first = index[target]
            if any("MMA" in t for _, t in instructions[first:i + 1]):
                yield first, i


def if_arm(body):
    """(start, end) offsets of the loop's first two-way branch (`@P BRA P, ...`) and the
    unconditional BRA after it that skips the other arm: in the decode step loops, the per-row
    lookup arm, which steps inside one page skip. Subtracting it gives a one-page step."""
    start = next((i for i, t in enumerate(body) if re.match(r"@!?P\d+ BRA !?P\d+", t)), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(body)) if re.match(r"BRA ", body[i])), None)
    return (start, end) if end is not None else None


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    path, selector = sys.argv[1], sys.argv[2]
    found = False
    for name, instructions in kernels(open(path).read()):
        if selector not in name:
            continue
        found = True
        print(f"{name}: {len(instructions)} instructions")
        for first, last in mma_loops(instructions):
            body = [text for _, text in instructions[first:last + 1]]
            counts = collections.Counter(opcode(t) for t in body)
            mmas = sum(n for op, n in counts.items() if "MMA" in op)
            print(f"  loop of {len(body)} instructions, {mmas} MMAs")
            print("    " + ", ".join(f"{op} {n}" for op, n in counts.most_common(12)))
            for offset, text in enumerate(body):
                if "BRA" in text or "BSSY" in text or "BSYNC" in text:
                    print(f"    +{offset}: {text}")
            arm = if_arm(body)
            if arm:
                print(f"    without the arm +{arm[0]}..+{arm[1]}: {len(body) - (arm[1] - arm[0])}"
                      " instructions")
    if not found:
        print(f"no kernel name contains '{selector}'", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

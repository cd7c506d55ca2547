"""Soak through the PyTorch ops (docs/testing.md, "Soak"): thousands of serving steps as the vLLM
plugin makes them (write_kv for the new tokens, plan_step once, attend per layer) over a
rotation of formats and layouts, with bad requests refused along the way. Resident memory stays
flat after the first rotation, later rotations are not slower, and every output matches
torch.ops.mjolnir.decode of the same step."""

from __future__ import annotations

import os
import time

import pytest
import torch

import mjolnir  # registers torch.ops.mjolnir
from test_ops import Problem

CONFIGS = [("fp8_e4m3", "B2NHD", "head"), ("fp6_e2m3", "BHN2D", "channel"),
           ("fp4_e2m1", "2BNHD", "channel"), ("nvfp4", "B2NHD", "tensor"),
           ("bf16", "BNH2D", "tensor"), ("fp8_e5m2", "2BHND", "head")]
STEPS_PER_VISIT = 40
SECONDS = float(os.environ.get("MJOLNIR_SOAK_SECONDS", "8"))


def resident_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def serve(gen, fmt: str, layout: str, granularity: str) -> int:
    """One visit: a fresh cache and batch, STEPS_PER_VISIT decode steps of two layers each."""
    p = Problem(gen, fmt, layout, 1, granularity, num_seqs=4, max_len=200)
    hq, hk = p.q.shape[1], p.k.shape[1]
    steps = 0
    for step_index in range(STEPS_PER_VISIT):
        # The next token of every sequence that still has room in its pages.
        room = p.block_table.shape[1] * 16  # Problem's pages hold 16 tokens
        grow = (p.seq_lens < room).to(torch.int32)
        slots = []
        for b in range(p.seq_lens.numel()):
            if grow[b]:
                pos = int(p.seq_lens[b])
                slots.append(int(p.block_table[b, pos // 16]) * 16 + pos % 16)
            else:
                slots.append(-1)  # padding, skipped
        p.seq_lens += grow
        slots = torch.tensor(slots, dtype=torch.int64)
        k = torch.randn(len(slots), hk, p.d, generator=gen)
        v = torch.randn(len(slots), hk, p.d, generator=gen)
        written = (slots >= 0).nonzero().flatten().tolist()
        if step_index % 8 == 0 and written:
            # A bad request: a NaN in K is refused, naming it, and writes nothing.
            k_bad = k.clone()
            k_bad[written[0], 1, 5] = float("nan")
            before = p.kv_cache.clone()
            with pytest.raises(ValueError, match=rf"^k\[{written[0]}\]\[1\]\[5\] is NaN"):
                torch.ops.mjolnir.write_kv(k_bad, v, p.kv_cache, slots, p.k_scale, p.v_scale,
                                           fmt, layout)
            assert torch.equal(before, p.kv_cache)
        torch.ops.mjolnir.write_kv(k, v, p.kv_cache, slots, p.k_scale, p.v_scale, fmt, layout)

        step = torch.ops.mjolnir.plan_step(p.seq_lens, p.block_table, None, 1, hq, hk)
        q = torch.randn(p.seq_lens.numel(), hq, p.d, generator=gen)
        out = torch.empty_like(q)
        for _layer in range(2):
            torch.ops.mjolnir.attend(step, out, q, p.kv_cache, p.k_scale, p.v_scale, fmt, layout)
        if step_index == STEPS_PER_VISIT - 1:
            once = torch.ops.mjolnir.decode(q, p.kv_cache, p.block_table, p.seq_lens, p.k_scale,
                                            p.v_scale, fmt, 1, layout)
            assert torch.equal(out, once)
        steps += 1
    return steps


def test_soak_ops_memory_and_speed_flat(gen):
    rotation_seconds = []
    steps = 0
    rss_after_warmup = None
    start = time.monotonic()
    while time.monotonic() - start < SECONDS or len(rotation_seconds) < 4:
        began = time.monotonic()
        for config in CONFIGS:
            steps += serve(gen, *config)
        rotation_seconds.append(time.monotonic() - began)
        if rss_after_warmup is None:
            rss_after_warmup = resident_kib()
    growth = resident_kib() - rss_after_warmup
    # The fastest rotation of the first and of the last third: a shared machine's noise comes in
    # bursts that can double a third's median, but it does not slow every rotation of a third,
    # while a per-step leak of time slows every later one.
    early = min(rotation_seconds[1:1 + len(rotation_seconds) // 3])
    late = min(rotation_seconds[-(len(rotation_seconds) // 3):])
    print(f"soak: {len(rotation_seconds)} rotations, {steps} steps, resident memory "
          f"+{growth} KiB after the first rotation, rotation {early * 1e3:.0f} ms early, "
          f"{late * 1e3:.0f} ms late")
    # PyTorch's and glibc's allocators keep a little; a leak of a tensor per step would not fit.
    assert growth < 16 * 1024, f"resident memory grew {growth} KiB after the first rotation"
    # 2x: a per-step leak of time grows without bound.
    assert late < 2.0 * early, f"rotations slowed down {late / early:.2f}x"

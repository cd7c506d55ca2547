"""The non-finite policy through the PyTorch ops (docs/numerics.md, "Non-finite inputs"): a NaN or
an infinity in q, K or V makes exactly the query rows that meet it NaN; every other row is what
it is without the value (for q: with that row zeroed)."""

from __future__ import annotations

import pytest
import torch

import mjolnir  # noqa: F401
from _reference import make_cache

HK, HQ, D, P, PAGES = 2, 4, 64, 16, 12
SEQ_LENS = [40, 23]
BLOCKS = [[0, 1, 2], [3, 4, 5]]


def problem(gen, fmt: str):
    cache = make_cache("2BNHD", fmt, PAGES, P, HK, D)
    n = sum(SEQ_LENS)
    k = torch.randn(n, HK, D, generator=gen)
    v = torch.randn(n, HK, D, generator=gen)
    slots = torch.tensor([BLOCKS[s][t // P] * P + t % P
                          for s, length in enumerate(SEQ_LENS) for t in range(length)])
    scale = torch.tensor([0.05 if fmt.startswith("fp8") else 1.0])
    torch.ops.mjolnir.write_kv(k, v, cache, slots, scale, scale, fmt)
    return dict(q=torch.randn(2, HQ, D, generator=gen), kv_cache=cache,
                block_table=torch.tensor(BLOCKS, dtype=torch.int32),
                seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32), k_scale=scale,
                v_scale=scale, kv_format=fmt, q_len=1, layout="2BNHD")


def expect_poisoned(out, baseline, rows):
    """rows: (sequence, query head) pairs that must be NaN; the rest equal the baseline."""
    for s in range(out.shape[0]):
        for h in range(HQ):
            if (s, h) in rows:
                assert torch.isnan(out[s, h]).all(), (s, h)
            else:
                assert torch.equal(out[s, h], baseline[s, h]), (s, h)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_q_poisons_its_row(gen, backend, value):
    args = problem(gen, "fp8_e4m3")
    args["q"][1, 2] = 0.0  # the policy: the others as if this row were zero
    baseline = torch.ops.mjolnir.decode(**args, q_mode="fp8", backend=backend)
    args["q"][1, 2, 17] = value
    out = torch.ops.mjolnir.decode(**args, q_mode="fp8", backend=backend)
    expect_poisoned(out, baseline, {(1, 2)})


# A value planted in the cache bytes of sequence 0, position 21, KV head 1, channel 9: the code of
# NaN or Inf in that format (vLLM's own cache write, or any other writer, can leave one).
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("fmt,kv,code", [
    ("bf16", 0, (0xC0, 0x7F)), ("bf16", 1, (0x80, 0x7F)), ("fp16", 0, (0x00, 0x7C)),
    ("fp8_e4m3", 0, (0x7F,)), ("fp8_e4m3", 1, (0xFF,)), ("fp8_e5m2", 1, (0x7C,)),
])
def test_non_finite_cache_code_poisons_the_rows_that_see_it(gen, backend, fmt, kv, code):
    args = problem(gen, fmt)
    baseline = torch.ops.mjolnir.decode(**args, backend=backend)
    position, head, channel = 21, 1, 9
    row = args["kv_cache"][kv, BLOCKS[0][position // P], position % P, head]
    width = len(code)
    row[channel * width:(channel + 1) * width] = torch.tensor(code, dtype=torch.uint8)
    out = torch.ops.mjolnir.decode(**args, backend=backend)
    expect_poisoned(out, baseline, {(0, 2), (0, 3)})  # query heads 2 and 3 read KV head 1

"""torch.ops.mjolnir.{write_kv, decode, decode_into, plan} against the plain PyTorch reference in
_reference.py, over every format, layout, q_len 1 and 4, and every scale granularity."""

from __future__ import annotations

import gc
import math

import pytest
import torch

import mjolnir  # registers torch.ops.mjolnir
from _reference import (FORMAT_MAX, FORMATS, LAYOUTS, attention, canonical_pages,
                        dequantize_rows, dequantized_cache, make_cache, minifloat_table)

GRANULARITIES = ["tensor", "head", "channel"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.to(torch.float64) - ref).abs().max() / ref.abs().max())


def emulator_bound(q_mode: str, p_mode: str) -> float:
    """How far a backend may sit from the emulator in the same Q / P modes (docs/numerics.md,
    "Three comparisons per case"): fp32 summation order only (1e-5); a code on an fp8 rounding
    boundary (1e-4); or, in P mode bf16, P rounded from the backend's own scores, where a p on
    a bf16 tie moves its row by up to 2^-7 w_i |v_i| (2^-8; the CPU does this, the worst seen
    over 200 seeds of the test below is 1.0e-3)."""
    if p_mode in ("bf16", "fp16"):  # fp16: also the CPU's fp32 sums where it has no fp16 FMAs
        return 2.0**-8
    return 1e-4 if "fp8" in (q_mode, p_mode) else 1e-5


def make_scales(x: torch.Tensor, fmt: str, granularity: str, gen) -> torch.Tensor:
    """Scales for x [tokens, Hk, D] in the granularity: amax / format max with headroom (the
    quantized formats), or random in [0.5, 2] (bf16 / fp16)."""
    hk, d = x.shape[1], x.shape[2]
    count = {"tensor": 1, "head": hk, "channel": hk * d}[granularity]
    if fmt not in FORMAT_MAX:
        return 0.5 + 1.5 * torch.rand(count, generator=gen)
    amax = x.abs().amax(dim=0)  # [hk, d]
    if granularity == "tensor":
        amax = amax.amax().reshape(1)
    elif granularity == "head":
        amax = amax.amax(dim=1)
    else:
        amax = amax.reshape(-1)
    return (amax / FORMAT_MAX[fmt] * 1.25).to(torch.float32)


class Problem:
    """A random step: sequences with pages scattered over a pool filled with random bytes, K/V
    written through torch.ops.mjolnir.write_kv, and Q as a strided view."""

    def __init__(self, gen, fmt, layout, q_len, granularity, *, num_seqs=3, hk=2, group=2,
                 d=64, page_size=16, max_len=150, cache_dtype=None):
        self.fmt, self.layout, self.q_len, self.d = fmt, layout, q_len, d
        self.seq_lens = torch.randint(q_len, max_len + 1, (num_seqs,), generator=gen,
                                      dtype=torch.int32)
        self.seq_lens[0] = max_len  # one long sequence: several tiles and pages
        max_pages = math.ceil(max_len / page_size) + 1  # one unused column
        num_pages = num_seqs * max_pages + 5
        order = torch.randperm(num_pages, generator=gen)[: num_seqs * max_pages]
        self.block_table = order.reshape(num_seqs, max_pages).to(torch.int32).contiguous()
        cache = make_cache(layout, fmt, num_pages, page_size, hk, d)
        cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8))
        if cache_dtype is not None:
            cache = cache.view(cache_dtype)
        self.kv_cache = cache

        # K with a few outlier channels (what channel scales are for), V plain.
        tokens = int(self.seq_lens.sum())
        self.k = torch.randn(tokens, hk, d, generator=gen)
        self.k[:, :, 3] *= 8.0
        self.v = torch.randn(tokens, hk, d, generator=gen) * 2.0
        self.k_scale = make_scales(self.k, fmt, granularity, gen)
        self.v_scale = make_scales(self.v, fmt, granularity, gen)
        slots = []
        for b, length in enumerate(self.seq_lens.tolist()):
            for pos in range(length):
                slots.append(int(self.block_table[b, pos // page_size]) * page_size
                             + pos % page_size)
        self.slots = torch.tensor(slots, dtype=torch.int64)
        torch.ops.mjolnir.write_kv(self.k, self.v, self.kv_cache, self.slots, self.k_scale,
                                   self.v_scale, fmt, layout)
        # Q [num_seqs * q_len, Hq, D] as a strided view (every other head of a wider tensor).
        wide = torch.randn(num_seqs * q_len, 2 * hk * group, d, generator=gen)
        self.q = wide[:, ::2, :]

    def reference(self, causal=True, softmax_scale=None):
        k_pages, v_pages = dequantized_cache(self.kv_cache, self.layout, self.fmt, self.d,
                                             self.k_scale, self.v_scale)
        return attention(self.q, k_pages, v_pages, self.block_table, self.seq_lens,
                         self.q_len, causal, softmax_scale)

    def decode(self, **kwargs):
        return torch.ops.mjolnir.decode(self.q, self.kv_cache, self.block_table, self.seq_lens,
                                        self.k_scale, self.v_scale, self.fmt, self.q_len,
                                        self.layout, **kwargs)


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_matches_reference(gen, fmt, layout, q_len):
    granularity = GRANULARITIES[(FORMATS.index(fmt) + LAYOUTS.index(layout) + q_len) % 3]
    p = Problem(gen, fmt, layout, q_len, granularity)
    assert p.kv_cache.view(torch.uint8).count_nonzero() > 0 and p.q.abs().max() > 0
    out = p.decode()
    assert out.shape == p.q.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    ref = p.reference()
    assert ref.abs().max() > 0
    err = rel_err(out, ref)
    assert err < 1e-5, f"{fmt} {layout} q_len={q_len} {granularity}: relative error {err:.3g}"


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_decode_non_causal_and_softmax_scale(gen, fmt):
    p = Problem(gen, fmt, "2BNHD", 4, "head")
    out = p.decode(causal=False, softmax_scale=0.05)
    err = rel_err(out, p.reference(causal=False, softmax_scale=0.05))
    assert err < 1e-5, f"relative error {err:.3g}"


@pytest.mark.parametrize("q_mode,p_mode", [("bf16", "fp32"), ("fp8", "fp32"), ("fp32", "bf16"),
                                           ("fp32", "fp8"), ("fp8", "fp8")])
def test_numerics_modes_match_emulator(gen, q_mode, p_mode):
    """Low-precision Q / P modes: the CPU backend follows the emulator ("reference" backend)
    tightly, and stays near the exact float64 result."""
    p = Problem(gen, "fp8_e4m3", "B2NHD", 4, "channel", d=128, max_len=300)
    out = p.decode(q_mode=q_mode, p_mode=p_mode)
    emulated = p.decode(q_mode=q_mode, p_mode=p_mode, backend="reference")
    assert rel_err(out, emulated.to(torch.float64)) < emulator_bound(q_mode, p_mode)
    assert rel_err(out, p.reference()) < 0.1


@pytest.mark.parametrize("fmt", ["nvfp4", "fp4_e2m1", "fp6_e2m3", "fp8_e4m3"])
def test_fp16_probabilities_match_emulator(gen, fmt):
    """P mode fp16 (fp16 P, each 32 keys' products summed in fp16): within the own-scores
    tolerance of the emulator, which sums in fp16 as the CPUs with AVX512-FP16 do (the others sum
    the fp16 P in fp32), and near the exact result; a bf16 cache, whose values fp16 cannot hold,
    is refused naming p_mode."""
    p = Problem(gen, fmt, "B2NHD", 4, "head", d=128, max_len=300)
    out = p.decode(q_mode="int8", p_mode="fp16")
    emulated = p.decode(q_mode="int8", p_mode="fp16", backend="reference")
    assert rel_err(out, emulated.to(torch.float64)) < emulator_bound("int8", "fp16")
    single = p.decode(q_mode="int8", p_mode="fp32")
    exact = p.reference()
    assert rel_err(out, exact) < 1.25 * rel_err(single, exact) + 1e-3
    bf16 = Problem(gen, "bf16", "B2NHD", 4, "head", d=128, max_len=40)
    with pytest.raises(ValueError, match="^p_mode: fp16"):
        bf16.decode(p_mode="fp16")


def test_decode_split_kv(gen):
    """Long sequences cut into chunks (max_splits; 0, the default, as many as fill the device)
    merge to the same result."""
    p = Problem(gen, "fp6_e3m2", "BHN2D", 1, "head", max_len=1500, page_size=32)
    ref = p.reference()
    for splits in (0, 1, 4):
        assert rel_err(p.decode(max_splits=splits), ref) < 1e-5


def test_decode_dtypes_and_decode_into(gen):
    """bf16 / fp16 Q (converted), decode_into a strided bf16 output, and caches held in their
    own torch dtypes (bfloat16, float8_e4m3fn) rather than uint8."""
    p = Problem(gen, "bf16", "2BNHD", 1, "tensor", cache_dtype=torch.bfloat16)
    ref = p.reference()
    p.q = p.q.to(torch.bfloat16)
    out = p.decode()
    assert out.dtype == torch.bfloat16
    ref = p.reference()  # with the bf16-rounded Q
    assert rel_err(out, ref) < 1e-2
    wide = torch.full((p.q.shape[0], p.q.shape[1] * 3, p.q.shape[2]), float("nan"),
                      dtype=torch.bfloat16)
    view = wide[:, 1::3, :]
    torch.ops.mjolnir.decode_into(view, p.q, p.kv_cache, p.block_table, p.seq_lens, p.k_scale,
                                  p.v_scale, "bf16", 1, "2BNHD")
    assert torch.equal(view, out)
    assert torch.isnan(wide[:, 0::3]).all()  # the rest untouched

    p8 = Problem(gen, "fp8_e4m3", "B2NHD", 4, "head", cache_dtype=torch.float8_e4m3fn)
    assert rel_err(p8.decode(), p8.reference()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rows_convert_as_torch_does(gen, dtype):
    """16-bit Q and output rows against torch's conversions: Q widened exactly, the output
    rounded to nearest even as Tensor.to rounds it, NaN included (a poisoned row). bf16 rows go
    to the CPU backend as they are (its kernel widens and rounds them), fp16 rows through the
    ops' own conversions (tensor_views.cpp)."""
    p = Problem(gen, "fp8_e4m3", "BHN2D", 2, "head")
    args = (p.kv_cache, p.block_table, p.seq_lens, p.k_scale, p.v_scale, p.fmt, 2, "BHN2D")
    q16 = p.q.to(dtype)
    q16[1, 2, 5] = float("nan")  # poisons that row's outputs: NaN through the conversion
    wide = torch.ops.mjolnir.decode(q16.float(), *args)
    assert torch.isnan(wide[1, 2]).all() and torch.isfinite(wide[0]).all()
    assert torch.equal(torch.ops.mjolnir.decode(q16, *args).float().nan_to_num(7.0),
                       wide.to(dtype).float().nan_to_num(7.0))
    out = torch.empty(q16.shape, dtype=torch.float32)
    torch.ops.mjolnir.decode_into(out, q16, *args)
    assert torch.equal(out.nan_to_num(7.0), wide.nan_to_num(7.0))


def test_decode_strided_cache_and_padding(gen):
    """A cache view with gaps between pages (every other page of a bigger pool) and a padding
    request (seq_len 0) that writes zeros."""
    p = Problem(gen, "fp4_e2m1", "2BHND", 1, "channel")
    big = make_cache("2BHND", "fp4_e2m1", 2 * p.kv_cache.shape[1], p.kv_cache.shape[3],
                     p.kv_cache.shape[2], p.d, fill=0x77)
    big[:, ::2] = p.kv_cache
    p.kv_cache = big[:, ::2]
    assert not p.kv_cache.is_contiguous()
    ref = p.reference()
    assert rel_err(p.decode(), ref) < 1e-5
    p.seq_lens = torch.cat([p.seq_lens, torch.zeros(1, dtype=torch.int32)])
    p.block_table = torch.cat([p.block_table, torch.zeros_like(p.block_table[:1])])
    p.q = torch.cat([p.q, torch.randn(1, *p.q.shape[1:], generator=gen)])
    out = p.decode()
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert rel_err(out[:-1], ref) < 1e-5


# --- ragged steps (prefill, chunked prefill, mixed) and plans made once per step -----------------


def ragged(p, gen, query_lens):
    """Turns problem p into a ragged step: query_lens[b] query tokens for sequence b (at most
    its seq_len; 0: none this step), fresh queries, and the float64 reference."""
    p.query_start = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0).to(
        torch.int32)
    rows = int(p.query_start[-1])
    p.q = torch.randn(rows, p.q.shape[1], p.d, generator=gen)
    k_pages, v_pages = dequantized_cache(p.kv_cache, p.layout, p.fmt, p.d, p.k_scale,
                                         p.v_scale)
    return attention(p.q, k_pages, v_pages, p.block_table, p.seq_lens, 0,
                     query_start=p.query_start)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "nvfp4"])
def test_ragged_step_matches_reference(gen, fmt):
    """A whole prompt, the tail of a chunked prefill, a decode and a sequence without query
    tokens in one step (q_len 0 with query_start), as vLLM batches them."""
    p = Problem(gen, fmt, "B2NHD", 1, "channel", num_seqs=4, max_len=150)
    lens = p.seq_lens.tolist()
    ref = ragged(p, gen, [lens[0], min(lens[1], 21), 1, 0])
    out = torch.ops.mjolnir.decode(p.q, p.kv_cache, p.block_table, p.seq_lens, p.k_scale,
                                   p.v_scale, fmt, 0, "B2NHD", query_start=p.query_start)
    assert out.shape == p.q.shape and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < 1e-5, f"{fmt}: relative error {err:.3g}"


def test_plan_step_runs_every_layer(gen):
    """One plan for the step, run for two layers with their own caches, formats and scales:
    the same outputs as planning each call (decode), written into vLLM-style padded bf16
    outputs whose padding rows stay untouched."""
    first = Problem(gen, "fp8_e4m3", "BHN2D", 1, "head", num_seqs=3, max_len=200)
    lens = first.seq_lens.tolist()
    query_lens = [lens[0], 1, min(lens[2], 9)]
    ref_first = ragged(first, gen, query_lens)
    second = Problem(gen, "fp4_e2m1", "BHN2D", 1, "tensor", num_seqs=3, max_len=200)
    second.seq_lens, second.block_table = first.seq_lens, first.block_table
    second.slots = first.slots
    # Fresh K/V for the first problem's token count (the second drew its own lengths).
    tokens = int(first.seq_lens.sum())
    second.k = torch.randn(tokens, 2, 64, generator=gen)
    second.k[:, :, 3] *= 8.0
    second.v = torch.randn(tokens, 2, 64, generator=gen) * 2.0
    second.k_scale = make_scales(second.k, "fp4_e2m1", "tensor", gen)
    second.v_scale = make_scales(second.v, "fp4_e2m1", "tensor", gen)
    second.kv_cache.zero_()
    torch.ops.mjolnir.write_kv(second.k, second.v, second.kv_cache, first.slots, second.k_scale,
                               second.v_scale, "fp4_e2m1", "BHN2D")
    ref_second = ragged(second, gen, query_lens)

    step = torch.ops.mjolnir.plan_step(first.seq_lens, first.block_table, first.query_start, 0,
                                       first.q.shape[1], 2)
    assert step.query_rows() == sum(query_lens)
    tile = mjolnir.QUERY_TILE_TOKENS
    assert step.num_query_tiles() == sum((n + tile - 1) // tile for n in query_lens)
    rows = sum(query_lens)
    layers = ((first, ref_first), (second, ref_second), (first, ref_first))
    for layer, (p, ref) in enumerate(layers):
        padded = torch.full((rows + 5, p.q.shape[1], p.d), float("nan"), dtype=torch.bfloat16)
        q = torch.cat([p.q, torch.randn(5, p.q.shape[1], p.d, generator=gen)]).to(torch.bfloat16)
        if layer == 1:  # a view of a fused qkv tensor, as vLLM's query is: tokens further apart
            qkv = torch.randn(rows + 5, (p.q.shape[1] + 4) * p.d, generator=gen).to(torch.bfloat16)
            qkv[:, : p.q.shape[1] * p.d] = q.reshape(rows + 5, -1)
            q = qkv[:, : p.q.shape[1] * p.d].view(rows + 5, p.q.shape[1], p.d)
            assert not q.is_contiguous()
        torch.ops.mjolnir.attend(step, padded, q, p.kv_cache, p.k_scale, p.v_scale, p.fmt,
                                 "BHN2D")
        assert torch.isnan(padded[rows:]).all(), "wrote past the step's query rows"
        # The step's own method and the operator that takes its id (what the vLLM plugin
        # calls) run the same plan: the same bits, and the same padding left alone.
        for call in ("method", "by_id"):
            other = torch.full_like(padded, float("nan"))
            if call == "method":
                step.attend(other, q, p.kv_cache, p.k_scale, p.v_scale, p.fmt, "BHN2D", 0.0)
            else:
                torch.ops.mjolnir.attend_step(step.id(), other, q, p.kv_cache, p.k_scale,
                                              p.v_scale, p.fmt, "BHN2D")
            assert torch.equal(other[:rows], padded[:rows]), call
            assert torch.isnan(other[rows:]).all(), call
        once = torch.ops.mjolnir.decode(q[:rows], p.kv_cache, p.block_table, p.seq_lens,
                                        p.k_scale, p.v_scale, p.fmt, 0, "BHN2D",
                                        query_start=p.query_start)
        assert torch.equal(padded[:rows], once)
        # bf16 rows go to the library as they are: exactly the float32 step, rounded by torch.
        wide = torch.ops.mjolnir.decode(q[:rows].float(), p.kv_cache, p.block_table, p.seq_lens,
                                        p.k_scale, p.v_scale, p.fmt, 0, "BHN2D",
                                        query_start=p.query_start)
        assert torch.equal(padded[:rows], wide.to(torch.bfloat16))
        assert rel_err(padded[:rows].float(), ref) < 1e-2  # bf16 queries and output

    with pytest.raises(ValueError, match=r"^q: shape \(3, 4, 64\), the step has"):
        torch.ops.mjolnir.attend(step, torch.empty(3, 4, 64), torch.empty(3, 4, 64),
                                 first.kv_cache, first.k_scale, first.v_scale, "fp8_e4m3",
                                 "BHN2D")
    with pytest.raises(ValueError, match=r"^q_len: 2 with query_start given"):
        torch.ops.mjolnir.plan_step(first.seq_lens, first.block_table, first.query_start, 2, 4, 2)
    with pytest.raises(ValueError, match=r"^query_start: sequence 1 has"):
        bad = first.query_start.clone()
        bad[2:] += int(first.seq_lens[1]) + 1
        torch.ops.mjolnir.plan_step(first.seq_lens, first.block_table, bad, 0, 4, 2)


def test_attend_step_needs_a_live_step(gen):
    """attend_step takes a Step's id(): ids are distinct, a call for a step that is gone is a
    ValueError naming the step, and the meta kernel checks devices as the others do."""
    p = Problem(gen, "fp8_e4m3", "BHN2D", 1, "head", num_seqs=2, max_len=60)
    steps = [torch.ops.mjolnir.plan_step(p.seq_lens, p.block_table, None, 1, p.q.shape[1], 2)
             for _ in range(2)]
    ids = [s.id() for s in steps]
    assert ids[0] != ids[1]
    out = torch.empty_like(p.q)
    torch.ops.mjolnir.attend_step(ids[1], out, p.q, p.kv_cache, p.k_scale, p.v_scale,
                                  "fp8_e4m3", "BHN2D")
    want = torch.ops.mjolnir.decode(p.q, p.kv_cache, p.block_table, p.seq_lens, p.k_scale,
                                    p.v_scale, "fp8_e4m3", 1, "BHN2D")
    assert torch.equal(out, want)
    del steps
    gc.collect()
    for gone in ids + [-1]:
        with pytest.raises(ValueError, match=rf"^step: no live step has id {gone} "):
            torch.ops.mjolnir.attend_step(gone, out, p.q, p.kv_cache, p.k_scale, p.v_scale,
                                          "fp8_e4m3", "BHN2D")
    live = torch.ops.mjolnir.plan_step(p.seq_lens, p.block_table, None, 1, p.q.shape[1], 2)
    meta = [t.to("meta") for t in (out, p.q, p.kv_cache, p.k_scale, p.v_scale)]
    torch.ops.mjolnir.attend_step(live.id(), *meta, "fp8_e4m3", "BHN2D")
    with pytest.raises(ValueError, match=r"^q: on cpu, but other arguments are on meta"):
        torch.ops.mjolnir.attend_step(live.id(), meta[0], p.q, *meta[2:], "fp8_e4m3", "BHN2D")


# --- write_kv against an independent quantizer ---------------------------------------------------


def nearest_code_values(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round float64 values to the nearest value of an OCP MX element format, ties to the even
    code, saturating; returns the rounded values."""
    table = minifloat_table(fmt)
    half = table.numel() // 2
    mags = table[:half]  # codes 0..half-1: ascending magnitudes
    a = x.abs().clamp(max=float(mags[-1]))
    hi = torch.searchsorted(mags, a).clamp(max=half - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - mags[lo], mags[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    return mags[code] * torch.sign(x)


def expected_rows(x32: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """Dequantized values (before the outer scale) that write_kv must store for float32 rows
    x32 [tokens, Hk, D] divided by the scale grid [Hk, D]."""
    hk, d = x32.shape[1], x32.shape[2]
    s = scale.reshape(-1)
    grid = s.expand(hk, d) if s.numel() == 1 else (
        s[:, None].expand(hk, d) if s.numel() == hk else s.reshape(hk, d))
    y = x32 / grid  # float32 division, as the library
    if fmt == "bf16":
        return y.to(torch.bfloat16).to(torch.float64)
    if fmt == "fp16":
        return y.to(torch.float16).to(torch.float64)
    if fmt == "fp8_e4m3":
        return y.to(torch.float8_e4m3fn).to(torch.float32).to(torch.float64)
    if fmt == "fp8_e5m2":
        return y.to(torch.float8_e5m2).to(torch.float32).to(torch.float64)
    if fmt in ("fp6_e2m3", "fp6_e3m2", "fp4_e2m1"):
        return nearest_code_values(y.to(torch.float64), fmt)
    assert fmt == "nvfp4"
    blocks = y.reshape(*y.shape[:-1], d // 16, 16)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    bscale = (amax / 6.0).to(torch.float8_e4m3fn).to(torch.float32)
    tiny = torch.tensor(2.0 ** -9)
    bscale = torch.where((bscale == 0) & (amax > 0), tiny, bscale)
    safe = torch.where(bscale == 0, torch.ones_like(bscale), bscale)
    codes = nearest_code_values((blocks / safe).to(torch.float64), "fp4_e2m1")
    return (codes * bscale.to(torch.float64)).reshape(y.shape)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_matches_independent_quantizer(gen, fmt, granularity):
    layout = LAYOUTS[(FORMATS.index(fmt) + GRANULARITIES.index(granularity)) % len(LAYOUTS)]
    p = Problem(gen, fmt, layout, 1, granularity, d=128)
    pages = canonical_pages(p.kv_cache, layout)  # [2, pages, tokens, heads, row_bytes]
    page_size = pages.shape[2]
    page, offset = p.slots // page_size, p.slots % page_size
    for kv, (x, scale) in enumerate(((p.k, p.k_scale), (p.v, p.v_scale))):
        stored = dequantize_rows(pages[kv][page, offset], fmt, p.d)  # [tokens, heads, D]
        expected = expected_rows(x, fmt, scale)
        mismatch = (stored != expected).nonzero()
        assert mismatch.numel() == 0, (
            f"{'kv'[kv]} {fmt}: {mismatch.shape[0]} values differ, first at {mismatch[0].tolist()}:"
            f" stored {stored[tuple(mismatch[0])]}, expected {expected[tuple(mismatch[0])]}")


def test_write_kv_skips_negative_slots(gen):
    p = Problem(gen, "fp8_e5m2", "2BNHD", 1, "head")
    before = p.kv_cache.clone()
    k = torch.randn(4, 2, 64, generator=gen)
    torch.ops.mjolnir.write_kv(k, k, p.kv_cache, torch.full((4,), -1, dtype=torch.int64),
                               p.k_scale, p.v_scale, "fp8_e5m2", "2BNHD")
    assert torch.equal(before, p.kv_cache)


# --- plan, and torch.library / torch.compile integration ----------------------------------------


def test_plan_covers_every_token(gen):
    seq_lens = torch.tensor([0, 1, 700, 64, 2000], dtype=torch.int32)
    items = torch.ops.mjolnir.plan(seq_lens, 1, 4, workers=8, max_splits=4)
    assert items.dtype == torch.int32 and items.shape[1] == 6
    for seq, length in enumerate(seq_lens.tolist()):
        for head in range(4):
            rows = items[(items[:, 0] == seq) & (items[:, 1] == head)]
            covered = sorted((int(r[2]), int(r[3])) for r in rows)
            assert covered[0][0] == 0 and covered[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_opcheck(gen):
    p = Problem(gen, "fp8_e4m3", "2BNHD", 1, "head", max_len=40)
    args = (p.q.contiguous(), p.kv_cache, p.block_table, p.seq_lens, p.k_scale, p.v_scale,
            "fp8_e4m3", 1, "2BNHD")
    torch.library.opcheck(torch.ops.mjolnir.decode.default, args)
    out = torch.empty_like(p.q.contiguous())
    torch.library.opcheck(torch.ops.mjolnir.decode_into.default, (out,) + args)
    cache = p.kv_cache.clone()
    torch.library.opcheck(torch.ops.mjolnir.write_kv.default,
                          (p.k[:5], p.v[:5], cache, p.slots[:5], p.k_scale, p.v_scale,
                           "fp8_e4m3", "2BNHD"))


def test_torch_compile_traces_ops(gen):
    p = Problem(gen, "fp6_e2m3", "2BNHD", 1, "head", max_len=60)
    k_new = torch.randn(p.seq_lens.numel(), 2, 64, generator=gen)

    def step(q, k, cache, slots):
        torch.ops.mjolnir.write_kv(k, k, cache, slots, p.k_scale, p.v_scale, "fp6_e2m3", "2BNHD")
        out = torch.ops.mjolnir.decode(q * 1.0, cache, p.block_table, p.seq_lens, p.k_scale,
                                       p.v_scale, "fp6_e2m3", 1, "2BNHD")
        return out + 0.0

    # Overwrite each sequence's last token (a slot it reads) and run the step.
    last = torch.tensor([int(p.block_table[b, (n - 1) // 16]) * 16 + (n - 1) % 16
                         for b, n in enumerate(p.seq_lens.tolist())], dtype=torch.int64)
    eager_cache = p.kv_cache.clone()
    eager = step(p.q, k_new, eager_cache, last)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled_cache = p.kv_cache.clone()
    got = compiled(p.q, k_new, compiled_cache, last)
    assert torch.equal(eager_cache, compiled_cache)
    assert torch.allclose(eager, got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_codec_bindings_match_independent_decoder(gen, fmt):
    """mjolnir._ext.encode_row / decode_row (the C++ scalar codecs) against _reference's
    decoder: fp8 / bf16 / fp16 through torch's dtypes, fp6 / fp4 / nvfp4 through the tables."""
    from mjolnir import _ext
    d = 128
    values = (torch.randn(d, generator=gen) * 3.0).tolist()
    row = _ext.encode_row(fmt, values)
    assert len(row) == _ext.row_bytes(fmt, d) and any(row)
    raw = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    independent = dequantize_rows(raw, fmt, d)
    ours = torch.tensor(_ext.decode_row(fmt, row, d), dtype=torch.float64)
    assert torch.equal(ours, independent)
    if fmt in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"):
        expected = expected_rows(torch.tensor(values).reshape(1, 1, d), fmt, torch.ones(1))
        assert torch.equal(ours, expected.reshape(d))


def test_empty_step(gen):
    p = Problem(gen, "fp8_e4m3", "2BNHD", 1, "head", max_len=40)
    empty = torch.zeros(0, dtype=torch.int32)
    out = torch.ops.mjolnir.decode(p.q[:0], p.kv_cache, p.block_table[:0], empty, p.k_scale,
                                   p.v_scale, "fp8_e4m3", 1)
    assert out.shape == (0,) + tuple(p.q.shape[1:])
    before = p.kv_cache.clone()
    torch.ops.mjolnir.write_kv(p.k[:0], p.v[:0], p.kv_cache, p.slots[:0], p.k_scale,
                               p.v_scale, "fp8_e4m3")
    assert torch.equal(before, p.kv_cache)


def test_auto_modes_are_the_backends_choice(gen):
    """plan_step with q_mode / p_mode "auto": each layer runs in the modes Backend::auto_modes
    picks for its format and queries (Q bf16 for bf16 queries; P bf16 only where P . V runs on
    AMX tiles, from 8 query rows), with the same outputs as those modes given explicitly."""
    p = Problem(gen, "fp8_e4m3", "BHN2D", 1, "channel", d=128, num_seqs=2, max_len=120)
    lens = p.seq_lens.tolist()
    query_lens = [lens[0], 1]
    ragged(p, gen, query_lens)
    rows = sum(query_lens)
    q = p.q[:rows].to(torch.bfloat16)
    auto = torch.ops.mjolnir.plan_step(p.seq_lens, p.block_table, p.query_start, 0, q.shape[1], 2,
                                       q_mode="auto", p_mode="auto")
    group = q.shape[1] // 2
    want_q, want_p = mjolnir._ext.auto_modes("cpu", "fp8_e4m3", 128,
                                             group * min(lens[0], mjolnir.QUERY_TILE_TOKENS), True)
    assert auto.modes_for("fp8_e4m3", 128, True) == f"{want_q},{want_p}"
    assert want_q == "bf16"
    explicit = torch.ops.mjolnir.plan_step(p.seq_lens, p.block_table, p.query_start, 0,
                                           q.shape[1], 2, q_mode=want_q, p_mode=want_p)
    outs = []
    for step in (auto, explicit):
        out = torch.empty_like(q)
        step.attend(out, q, p.kv_cache, p.k_scale, p.v_scale, "fp8_e4m3", "BHN2D", 0.0)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="backend"):
        mjolnir._ext.auto_modes("gpu", "bf16", 128, 4, True)

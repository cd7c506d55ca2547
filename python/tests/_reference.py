"""A plain PyTorch reference for the ops, independent of mjolnir's own codecs.

Cache rows are dequantized here: bf16 / fp16 / fp8 through torch's own dtypes (views of the
bytes), fp6 / fp4 (and nvfp4's codes) through value tables built below from the OCP bit layouts,
nvfp4's block scales through torch.float8_e4m3fn. Attention is then computed in float64.
"""

from __future__ import annotations

import math

import torch

FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1", "nvfp4"]
LAYOUTS = ["BHN2D", "BNH2D", "B2NHD", "B2HND", "2BNHD", "2BHND"]
FORMAT_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "fp6_e2m3": 7.5, "fp6_e3m2": 28.0,
              "fp4_e2m1": 6.0, "nvfp4": 6.0 * 448.0}
# (exponent bits, mantissa bits, bias) of the formats without Inf / NaN.
MINIFLOAT = {"fp6_e2m3": (2, 3, 1), "fp6_e3m2": (3, 2, 3), "fp4_e2m1": (2, 1, 1)}


def row_bytes(fmt: str, d: int) -> int:
    return {"bf16": 2 * d, "fp16": 2 * d, "fp8_e4m3": d, "fp8_e5m2": d, "fp6_e2m3": 3 * d // 4,
            "fp6_e3m2": 3 * d // 4, "fp4_e2m1": d // 2, "nvfp4": d // 2 + d // 16}[fmt]


def minifloat_table(fmt: str) -> torch.Tensor:
    """Value of every code of an OCP MX element format (sign, exponent, mantissa; no Inf/NaN)."""
    e, m, bias = MINIFLOAT[fmt]
    values = []
    for code in range(1 << (1 + e + m)):
        sign = -1.0 if code >> (e + m) else 1.0
        exp = (code >> m) & ((1 << e) - 1)
        man = code & ((1 << m) - 1)
        if exp == 0:
            mag = man / (1 << m) * 2.0 ** (1 - bias)
        else:
            mag = (1 + man / (1 << m)) * 2.0 ** (exp - bias)
        values.append(sign * mag)
    return torch.tensor(values, dtype=torch.float64)


def unpack_codes(raw: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Packed little-endian codes of `bits` (6 or 4) -> int64 codes [..., d]."""
    raw = raw.to(torch.int64)
    if bits == 4:
        codes = torch.stack([raw & 15, raw >> 4], dim=-1)
    else:
        groups = raw.reshape(*raw.shape[:-1], d // 4, 3)
        word = groups[..., 0] | (groups[..., 1] << 8) | (groups[..., 2] << 16)
        codes = torch.stack([(word >> (6 * i)) & 63 for i in range(4)], dim=-1)
    return codes.reshape(*raw.shape[:-1], d)


def dequantize_rows(raw: torch.Tensor, fmt: str, d: int) -> torch.Tensor:
    """uint8 rows [..., row_bytes] -> float64 values [..., d] before the outer scale."""
    raw = raw.contiguous()
    if fmt in ("bf16", "fp16"):
        return raw.view(torch.bfloat16 if fmt == "bf16" else torch.float16).to(torch.float64)
    if fmt == "fp8_e4m3":
        return raw.view(torch.float8_e4m3fn).to(torch.float32).to(torch.float64)
    if fmt == "fp8_e5m2":
        return raw.view(torch.float8_e5m2).to(torch.float32).to(torch.float64)
    if fmt in ("fp6_e2m3", "fp6_e3m2"):
        return minifloat_table(fmt)[unpack_codes(raw, 6, d)]
    if fmt == "fp4_e2m1":
        return minifloat_table(fmt)[unpack_codes(raw, 4, d)]
    assert fmt == "nvfp4"
    values = minifloat_table("fp4_e2m1")[unpack_codes(raw[..., : d // 2], 4, d)]
    block = raw[..., d // 2: d // 2 + d // 16].contiguous().view(torch.float8_e4m3fn)
    return values * block.to(torch.float32).to(torch.float64).repeat_interleave(16, dim=-1)


def canonical_pages(kv_cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The cache's bytes as [2, pages, tokens, heads, row_bytes] uint8, whatever the layout."""
    raw = kv_cache.view(torch.uint8)
    return raw.permute(*[layout.index(c) for c in "2BNHD"])


def scale_grid(scale: torch.Tensor, hk: int, d: int) -> torch.Tensor:
    """Outer scale broadcast to [hk, d] float64."""
    s = scale.to(torch.float64).reshape(-1)
    if s.numel() == 1:
        return s.expand(hk, d)
    if s.numel() == hk:
        return s[:, None].expand(hk, d)
    return s.reshape(hk, d)


def dequantized_cache(kv_cache, layout, fmt, d, k_scale, v_scale):
    """K and V as float64 [pages, tokens, heads, d], scales applied."""
    pages = canonical_pages(kv_cache, layout)
    hk = pages.shape[3]
    k = dequantize_rows(pages[0], fmt, d) * scale_grid(k_scale, hk, d)
    v = dequantize_rows(pages[1], fmt, d) * scale_grid(v_scale, hk, d)
    return k, v


def attention(q, k_pages, v_pages, block_table, seq_lens, q_len, causal=True,
              softmax_scale=None, query_start=None):
    """float64 softmax attention of q [B*q_len, Hq, D] over the paged K/V; with query_start
    [B + 1] (q_len 0), sequence b's query tokens are rows query_start[b]..query_start[b + 1]."""
    num_tokens, hq, d = q.shape
    page_size, hk = k_pages.shape[1], k_pages.shape[2]
    g = hq // hk
    scale = 1.0 / math.sqrt(d) if not softmax_scale else softmax_scale
    out = torch.zeros(num_tokens, hq, d, dtype=torch.float64)
    q = q.to(torch.float64)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        pages = block_table[b, : (length + page_size - 1) // page_size].long()
        k = k_pages[pages].reshape(-1, hk, d)[:length]
        v = v_pages[pages].reshape(-1, hk, d)[:length]
        first = b * q_len if query_start is None else int(query_start[b])
        count = q_len if query_start is None else int(query_start[b + 1]) - first
        for t in range(count):
            visible = length - count + t + 1 if causal else length
            row = q[first + t].reshape(hk, g, d)
            s = torch.einsum("hgd,nhd->hgn", row, k[:visible]) * scale
            p = torch.softmax(s, dim=-1)
            out[first + t] = torch.einsum("hgn,nhd->hgd", p, v[:visible]).reshape(hq, d)
    return out


def make_cache(layout: str, fmt: str, num_pages: int, page_size: int, hk: int, d: int,
               fill: int = 0) -> torch.Tensor:
    """A dense uint8 cache tensor with the layout's dimension order (fill: byte value)."""
    size = {"2": 2, "B": num_pages, "N": page_size, "H": hk, "D": row_bytes(fmt, d)}
    return torch.full([size[c] for c in layout], fill, dtype=torch.uint8)

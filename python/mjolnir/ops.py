"""PyTorch custom ops over the mjolnir C++ library: torch.ops.mjolnir.{decode, decode_into,
write_kv, plan}.

Tensors are taken as vLLM lays them out: Q / O [num_tokens, Hq, D] (any strides, channels
contiguous), the paged cache as one 5-D tensor whose dimensions follow a named layout (default
"2BNHD" = [2, num_blocks, block_size, Hk, D], vLLM's older flash-attention layout;
"B2NHD" = [num_blocks, 2, block_size, Hk, D] etc.), whose last dimension holds one packed token row, an
int32 block table [B, max_blocks] and int32 seq_lens [B]. Every argument is checked here (or in the
C++ library) and a bad one raises ValueError whose message starts with the argument's name.

Each op has a fake (meta) implementation, so torch.compile traces through it.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from . import _ext

DEFAULT_LAYOUT = "2BNHD"

# Cache tensor dtypes that imply a format; uint8 / int8 hold any format's packed bytes.
_DTYPE_FORMAT = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}
for _name, _fmt in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")):
    if hasattr(torch, _name):
        _DTYPE_FORMAT[getattr(torch, _name)] = _fmt
_BYTE_DTYPES = (torch.uint8, torch.int8)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# kMaxCpuThreads of mjolnir/decode.h.
_MAX_CPU_THREADS = 4096

def _require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _check_format(kv_format: str) -> str:
    if not isinstance(kv_format, str) or kv_format not in _ext.formats():
        raise ValueError(f"kv_format: '{kv_format}' is not one of {', '.join(_ext.formats())}")
    return kv_format


def _check_head_dim(name: str, head_dim: int) -> None:
    if head_dim <= 0 or head_dim % 32 != 0 or head_dim > 256:
        raise ValueError(f"{name}: head size (last dimension) {head_dim} is not a multiple of 32 "
                         "in [32, 256]")


def _layout_dims(layout: str) -> str:
    if not isinstance(layout, str):
        raise ValueError(f"layout: expected a layout name, got {type(layout).__name__}")
    return _ext.parse_layout(layout)  # raises "layout: 'X' is not one of ..."


def _byte_extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    elements = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return elements * t.element_size()


def cache_description(kv_cache: torch.Tensor, kv_format: str, layout: str,
                      head_dim: int) -> Dict[str, object]:
    """Geometry, byte strides and address of a cache tensor, checked against the layout."""
    _require_tensor("kv_cache", kv_cache)
    _check_format(kv_format)
    dims = _layout_dims(layout)
    if kv_cache.dim() != 5:
        raise ValueError(f"kv_cache: expected 5 dimensions [{', '.join(dims)}] for layout "
                         f"{dims}, got shape {tuple(kv_cache.shape)}")
    implied = _DTYPE_FORMAT.get(kv_cache.dtype)
    if implied is None and kv_cache.dtype not in _BYTE_DTYPES:
        raise ValueError(f"kv_cache: dtype {kv_cache.dtype} cannot hold a {kv_format} cache "
                         "(use uint8, or the format's own torch dtype)")
    if implied is not None and implied != kv_format:
        raise ValueError(f"kv_format: '{kv_format}' does not match the cache dtype "
                         f"{kv_cache.dtype} (which holds {implied})")
    item = kv_cache.element_size()
    row = _ext.row_bytes(kv_format, head_dim)
    if kv_cache.shape[-1] * item != row:
        raise ValueError(f"kv_cache: the last dimension holds {kv_cache.shape[-1] * item} bytes "
                         f"per token row, but {head_dim} channels of {kv_format} take {row} bytes")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache: the last dimension (a token's row) must be contiguous, "
                         f"got stride {kv_cache.stride(-1)}")
    size = dict(zip(dims, kv_cache.shape))
    stride = {d: kv_cache.stride(i) * item for i, d in enumerate(dims)}
    if size["2"] != 2:
        raise ValueError(f"kv_cache: dimension {dims.index('2')} (K/V) of layout {dims} has size "
                         f"{size['2']}, expected 2; shape {tuple(kv_cache.shape)}")
    return dict(
        kv_format=kv_format,
        num_pages=int(size["B"]),
        page_size=int(size["N"]),
        num_kv_heads=int(size["H"]),
        head_dim=int(head_dim),
        strides=(stride["B"], stride["H"], stride["N"], stride["2"]),
        cache_data=kv_cache.data_ptr(),
        cache_bytes=_byte_extent(kv_cache),
    )


def _host_scales(k_scale, v_scale, num_kv_heads: int,
                 head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, str]:
    def host(name, s):
        if isinstance(s, (int, float)):
            s = torch.tensor([float(s)])
        _require_tensor(name, s)
        if not (s.is_floating_point()):
            raise ValueError(f"{name}: expected a float tensor, got {s.dtype}")
        return s.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)

    k = host("k_scale", k_scale)
    v = host("v_scale", v_scale)
    counts = {1: "tensor", num_kv_heads: "head", num_kv_heads * head_dim: "channel"}
    for name, s in (("k_scale", k), ("v_scale", v)):
        if s.numel() not in counts:
            raise ValueError(f"{name}: {s.numel()} values; expected 1 (per tensor), "
                             f"{num_kv_heads} (per KV head) or {num_kv_heads * head_dim} "
                             "(per KV head and channel)")
    if k.numel() != v.numel():
        raise ValueError(f"v_scale: {v.numel()} values, but k_scale has {k.numel()}; both must "
                         "have the same granularity")
    return k, v, counts[k.numel()]


def _host_int(name: str, t, dims: int) -> torch.Tensor:
    _require_tensor(name, t)
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions, got shape {tuple(t.shape)}")
    return t.detach().to("cpu").contiguous()


def _rows(name: str, t, expect_heads: Optional[int] = None) -> torch.Tensor:
    _require_tensor(name, t)
    if t.dim() != 3:
        raise ValueError(f"{name}: expected 3 dimensions [num_tokens, heads, head_size], got "
                         f"shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected float32, bfloat16 or float16, got {t.dtype}")
    if expect_heads is not None and t.shape[1] != expect_heads:
        raise ValueError(f"{name}: {t.shape[1]} heads, but the cache has {expect_heads} KV heads")
    return t


# The C++ library names its own fields ("cache.k_scale[3]: ..."); say them as the ops' arguments.
_RENAMES = (("cache.k_scale", "k_scale"), ("cache.v_scale", "v_scale"), ("cache.", "kv_cache."),
            ("o.", "output."))


def _call(fn, **kwargs):
    try:
        return fn(**kwargs)
    except ValueError as e:
        message = str(e)
        for old, new in _RENAMES:
            if message.startswith(old):
                raise ValueError(new + message[len(old):]) from None
        raise


def _backend_for(device: torch.device, backend: str) -> str:
    if backend:
        return backend
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        if not _ext.has_cuda:
            raise ValueError(f"q: on {device}, but this build of mjolnir has no CUDA backend "
                             "(reinstall with MJOLNIR_PYTHON_CUDA=ON)")
        return "cuda"
    raise ValueError(f"q: device {device} is not supported (cpu, or cuda when built with CUDA)")


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but q is on {device}")


def _decode_impl(output: Optional[torch.Tensor], q, kv_cache, block_table, seq_lens, k_scale,
                 v_scale, kv_format, q_len, layout, causal, softmax_scale, q_mode, p_mode,
                 max_splits, threads, backend) -> torch.Tensor:
    _rows("q", q)
    if not isinstance(q_len, int) or isinstance(q_len, bool):
        raise ValueError(f"q_len: expected an int, got {type(q_len).__name__}")
    num_tokens, num_q_heads, head_dim = q.shape
    _check_head_dim("q", head_dim)
    device = q.device
    _require_tensor("kv_cache", kv_cache)
    _same_device("kv_cache", kv_cache, device)
    cache = cache_description(kv_cache, kv_format, layout, head_dim)
    table = _host_int("block_table", block_table, 2)
    lens = _host_int("seq_lens", seq_lens, 1)
    if lens.numel() != table.shape[0]:
        raise ValueError(f"seq_lens: {lens.numel()} sequences, but block_table has "
                         f"{table.shape[0]} rows")
    if num_tokens != lens.numel() * q_len:
        raise ValueError(f"q: {num_tokens} token rows, but {lens.numel()} sequences x q_len "
                         f"{q_len} = {lens.numel() * q_len}")
    ks, vs, granularity = _host_scales(k_scale, v_scale, cache["num_kv_heads"], head_dim)
    _ext.check_mode(q_mode, p_mode)
    name = _backend_for(device, backend)
    if not isinstance(threads, int) or isinstance(threads, bool) or \
            not 0 <= threads <= _MAX_CPU_THREADS:
        raise ValueError(f"threads: {threads!r} is outside [0, {_MAX_CPU_THREADS}] "
                         f"(0 = every core)")

    if num_tokens == 0:  # an empty step: nothing to read or write
        return output if output is not None else torch.empty(q.shape, dtype=q.dtype,
                                                             device=device)
    q32 = q if (q.dtype == torch.float32 and q.stride(-1) == 1) else \
        q.to(torch.float32).contiguous()
    if output is not None:
        _rows("output", output)
        _same_device("output", output, device)
        if tuple(output.shape) != tuple(q.shape):
            raise ValueError(f"output: shape {tuple(output.shape)}, expected {tuple(q.shape)}")
    direct = output is not None and output.dtype == torch.float32 and output.stride(-1) == 1
    o32 = output if direct else torch.empty(q.shape, dtype=torch.float32, device=device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the backend runs on its own stream
    _call(
        _ext.decode,
        backend=name, threads=int(threads), granularity=granularity,
        k_scale=ks.data_ptr(), v_scale=vs.data_ptr(), scale_count=ks.numel(),
        block_table=table.data_ptr(), num_seqs=lens.numel(),
        max_pages_per_seq=table.shape[1], seq_lens=lens.data_ptr(),
        q=q32.data_ptr(), q_token_stride=q32.stride(0), q_head_stride=q32.stride(1),
        o=o32.data_ptr(), o_token_stride=o32.stride(0), o_head_stride=o32.stride(1), lse=0,
        q_len=q_len, num_q_heads=num_q_heads, causal=bool(causal),
        softmax_scale=float(softmax_scale), q_mode=q_mode, p_mode=p_mode,
        max_splits=int(max_splits), **cache)
    if output is None:
        return o32 if q.dtype == torch.float32 else o32.to(q.dtype)
    if not direct:
        output.copy_(o32)
    return output


@torch.library.custom_op("mjolnir::decode", mutates_args=())
def decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
           kv_format: str, q_len: int = 1, layout: str = DEFAULT_LAYOUT, causal: bool = True,
           softmax_scale: float = 0.0, q_mode: str = "fp32", p_mode: str = "fp32",
           max_splits: int = 0, threads: int = 0, backend: str = "") -> torch.Tensor:
    """One decode step; returns O [num_tokens, Hq, D] in q's dtype."""
    return _decode_impl(None, q, kv_cache, block_table, seq_lens, k_scale, v_scale, kv_format,
                        q_len, layout, causal, softmax_scale, q_mode, p_mode, max_splits,
                        threads, backend)


@decode.register_fake
def _decode_fake(q, kv_cache, block_table, seq_lens, k_scale, v_scale, kv_format, q_len=1,
                 layout=DEFAULT_LAYOUT, causal=True, softmax_scale=0.0, q_mode="fp32",
                 p_mode="fp32", max_splits=0, threads=0, backend=""):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("mjolnir::decode_into", mutates_args=("output",))
def decode_into(output: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor, k_scale: torch.Tensor,
                v_scale: torch.Tensor, kv_format: str, q_len: int = 1,
                layout: str = DEFAULT_LAYOUT, causal: bool = True, softmax_scale: float = 0.0,
                q_mode: str = "fp32", p_mode: str = "fp32", max_splits: int = 0,
                threads: int = 0, backend: str = "") -> None:
    """decode() writing into `output` [num_tokens, Hq, D] (any float dtype and strides)."""
    _decode_impl(output, q, kv_cache, block_table, seq_lens, k_scale, v_scale, kv_format, q_len,
                 layout, causal, softmax_scale, q_mode, p_mode, max_splits, threads, backend)


@decode_into.register_fake
def _decode_into_fake(output, q, kv_cache, block_table, seq_lens, k_scale, v_scale, kv_format,
                      q_len=1, layout=DEFAULT_LAYOUT, causal=True, softmax_scale=0.0,
                      q_mode="fp32", p_mode="fp32", max_splits=0, threads=0, backend=""):
    return None


@torch.library.custom_op("mjolnir::write_kv", mutates_args=("kv_cache",))
def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
             kv_format: str, layout: str = DEFAULT_LAYOUT) -> None:
    """Quantizes key / value [num_tokens, Hk, D] into slots slot_mapping[i] = block * block_size
    + offset (int64; negative = skip) of kv_cache, as vLLM's reshape_and_cache_flash."""
    _rows("key", key)
    _rows("value", value)
    num_tokens, _, head_dim = key.shape
    _check_head_dim("key", head_dim)
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value: shape {tuple(value.shape)}, but key has {tuple(key.shape)}")
    device = key.device
    _same_device("value", value, device)
    _require_tensor("kv_cache", kv_cache)
    if kv_cache.device != device:
        raise ValueError(f"kv_cache: on {kv_cache.device}, but key is on {device}")
    cache = cache_description(kv_cache, kv_format, layout, head_dim)
    _rows("key", key, cache["num_kv_heads"])
    _rows("value", value, cache["num_kv_heads"])
    _require_tensor("slot_mapping", slot_mapping)
    if slot_mapping.dtype not in (torch.int64, torch.int32) or slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping: expected a 1-D int64 tensor, got {slot_mapping.dtype} "
                         f"of shape {tuple(slot_mapping.shape)}")
    if slot_mapping.numel() != num_tokens:
        raise ValueError(f"slot_mapping: {slot_mapping.numel()} slots, but key has "
                         f"{num_tokens} tokens")
    ks, vs, granularity = _host_scales(k_scale, v_scale, cache["num_kv_heads"], head_dim)
    if num_tokens == 0:
        return
    if device.type == "cpu":
        slots = slot_mapping.to(torch.int64).contiguous()
        stream = 0
    elif device.type == "cuda":
        if not _ext.has_cuda:
            raise ValueError(f"kv_cache: on {device}, but this build of mjolnir has no CUDA "
                             "backend (reinstall with MJOLNIR_PYTHON_CUDA=ON)")
        slots = slot_mapping.to(device=device, dtype=torch.int64).contiguous()
        stream = torch.cuda.current_stream(device).cuda_stream
    else:
        raise ValueError(f"key: device {device} is not supported")

    def f32(t):
        return t if (t.dtype == torch.float32 and t.stride(-1) == 1) else \
            t.to(torch.float32).contiguous()

    k32, v32 = f32(key), f32(value)
    _call(
        _ext.write_kv,
        device=device.type, granularity=granularity, k_scale=ks.data_ptr(),
        v_scale=vs.data_ptr(), scale_count=ks.numel(), k=k32.data_ptr(),
        k_token_stride=k32.stride(0), k_head_stride=k32.stride(1), v=v32.data_ptr(),
        v_token_stride=v32.stride(0), v_head_stride=v32.stride(1),
        slot_mapping=slots.data_ptr(), num_tokens=num_tokens, stream=stream, **cache)


@write_kv.register_fake
def _write_kv_fake(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_format,
                   layout=DEFAULT_LAYOUT):
    return None


@torch.library.custom_op("mjolnir::plan", mutates_args=())
def plan(seq_lens: torch.Tensor, q_len: int, num_kv_heads: int, workers: int = 0,
         max_splits: int = 16, tile_tokens: int = 64, min_chunk_tokens: int = 256,
         fixed_splits: int = 0) -> torch.Tensor:
    """The work items of a step: int32 [num_items, 6] rows (seq, kv_head, kv_begin, kv_end,
    split, partial_slot). workers 0 = the CPU backend's thread count."""
    lens = _host_int("seq_lens", seq_lens, 1)
    if workers <= 0:
        workers = _ext.workers("cpu", 0)
    rows = _ext.plan(seq_lens=lens.data_ptr(), num_seqs=lens.numel(), q_len=q_len,
                     num_kv_heads=num_kv_heads, workers=workers, max_splits=max_splits,
                     tile_tokens=tile_tokens, min_chunk_tokens=min_chunk_tokens,
                     fixed_splits=fixed_splits)
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 6)


@plan.register_fake
def _plan_fake(seq_lens, q_len, num_kv_heads, workers=0, max_splits=16, tile_tokens=64,
               min_chunk_tokens=256, fixed_splits=0):
    items = torch.library.get_ctx().new_dynamic_size()
    return seq_lens.new_empty((items, 6), dtype=torch.int32, device="cpu")

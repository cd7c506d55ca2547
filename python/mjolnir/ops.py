"""PyTorch operators over the mjolnir C++ library: torch.ops.mjolnir.{write_kv, decode,
decode_into, plan_step, attend, attend_step, plan}.

All but `plan` are registered from C++ (python/mjolnir/csrc/torch_ops.cpp, loaded with
mjolnir._ext), with Meta kernels for torch.compile, and check their arguments there: a bad one
raises ValueError whose message starts with the argument's name.

Tensors are taken as vLLM lays them out: Q / O [num_tokens, Hq, D] (any strides, channels
contiguous), the paged cache as one 5-D tensor whose dimensions follow a named layout (default
"2BNHD" = [2, num_blocks, block_size, Hk, D], vLLM's older flash-attention layout;
"B2NHD" = [num_blocks, 2, block_size, Hk, D] etc.) whose last dimension holds one packed token
row, an int32 block table [B, max_blocks], int32 seq_lens [B] and, for a step with any number of
query tokens per sequence (prefill, chunked prefill, mixed), int32 query_start [B + 1] with
q_len 0.

A serving loop plans once per step and runs that plan for every layer:

    step = torch.ops.mjolnir.plan_step(seq_lens, block_table, query_start, 0, Hq, Hk)
    for layer in layers:
        torch.ops.mjolnir.attend(step, output, q, kv_cache, k_scale, v_scale, "fp8_e4m3")

`attend` takes the Step object, so PyTorch dispatches it through Python; `step.attend(...)`
(the object's own method) and `torch.ops.mjolnir.attend_step(step.id(), ...)` do the same work
for less per call, the second least: an operator of plain arguments, up to 16 us less than the
method when the core's caches are cold, which is what a layer's call finds after the layer's
matmuls (docs/python.md). The id is valid while the Step object lives; a call with the id of a
step that is gone raises ValueError.

On the CPU both run on torch's intra-op threads (threads=0), so mjolnir shares the cores with
torch instead of competing with its spinning OpenMP threads; threads=N runs on N of its own.
"""

from __future__ import annotations

import torch

from . import _ext  # noqa: F401  (loading it registers the C++ operators)

DEFAULT_LAYOUT = "2BNHD"

decode = torch.ops.mjolnir.decode
decode_into = torch.ops.mjolnir.decode_into
write_kv = torch.ops.mjolnir.write_kv
plan_step = torch.ops.mjolnir.plan_step
attend = torch.ops.mjolnir.attend
attend_step = torch.ops.mjolnir.attend_step


def _host_int32(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected 1 dimensions, got shape {tuple(t.shape)}")
    return t.detach().to("cpu").contiguous()


@torch.library.custom_op("mjolnir::plan", mutates_args=())
def plan(seq_lens: torch.Tensor, q_len: int, num_kv_heads: int, workers: int = 0,
         max_splits: int = 16, tile_tokens: int = 64, min_chunk_tokens: int = 256,
         fixed_splits: int = 0) -> torch.Tensor:
    """The work items of a decode step: int32 [num_items, 6] rows (seq, kv_head, kv_begin,
    kv_end, split, partial_slot). workers 0 = the CPU backend's thread count."""
    lens = _host_int32("seq_lens", seq_lens)
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

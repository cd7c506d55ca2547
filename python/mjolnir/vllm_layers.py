"""Which vLLM attention layers mjolnir can run, as both vLLM backends (vllm_backend.py on CPUs,
vllm_gpu_backend.py on GPUs) decide it: the rules that do not depend on the device."""

from __future__ import annotations

from typing import Optional

from vllm.v1.attention.backend import AttentionType


def feature_reason(impl) -> Optional[str]:
    """Why mjolnir does not run a layer with the features of vLLM's attention impl `impl`
    (not causal decoder attention, ALiBi, a sliding window, a logits soft-cap, sinks), or
    None. A sliding window of -1 (CPU impls) or (-1, -1) (GPU impls) is none."""
    if impl.attn_type != AttentionType.DECODER:
        return f"attention type {impl.attn_type}"
    for what, present in (
            ("ALiBi", getattr(impl, "alibi_slopes", None) is not None),
            ("sliding window", getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1))),
            ("logits soft-cap", bool(getattr(impl, "logits_soft_cap", 0))),
            ("attention sinks", getattr(impl, "sinks", None) is not None)):
        if present:
            return what
    return None


def block_size_reason(block_size: int) -> Optional[str]:
    """Why mjolnir does not take a cache of `block_size` tokens a block (a power of 2 from 8
    to 256 is what its page sizes are), or None."""
    if block_size < 8 or block_size > 256 or block_size & (block_size - 1):
        return f"block size {block_size}"
    return None

"""mjolnir: paged decode attention over low-bit KV caches, as PyTorch ops and a vLLM plugin.

Importing the package registers torch.ops.mjolnir.{write_kv, decode, decode_into, plan_step,
attend, plan}.
See docs/python.md.
"""

from __future__ import annotations

import torch  # noqa: F401  (the ops below register with torch.library)

from . import _ext
from .config import AttnConfig
from .ops import DEFAULT_LAYOUT, attend, decode, decode_into, plan, plan_step, write_kv

__version__ = _ext.__version__
has_cuda = _ext.has_cuda
formats = _ext.formats
layouts = _ext.layouts
row_bytes = _ext.row_bytes
format_max = _ext.format_max
compiled_backends = _ext.compiled_backends
QUERY_TILE_TOKENS = _ext.QUERY_TILE_TOKENS


def register() -> bool:
    """The vLLM general-plugin entry point (`mjolnir = "mjolnir:register"`); True when the
    backend was registered (see mjolnir.vllm_plugin)."""
    from .vllm_plugin import register as _register

    return _register()


__all__ = [
    "AttnConfig", "DEFAULT_LAYOUT", "QUERY_TILE_TOKENS", "attend", "compiled_backends", "decode", "decode_into",
    "format_max", "formats", "has_cuda", "layouts", "plan", "plan_step", "register",
    "row_bytes", "write_kv",
]

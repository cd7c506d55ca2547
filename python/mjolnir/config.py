"""Every MJOLNIR_ATTN_* environment variable, parsed in this one place (documented in docs/python.md).

A bad value raises ValueError naming the variable, when the configuration is read (at plugin
registration), not later inside a forward pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_Q_MODES = ("auto", "fp32", "bf16", "fp8", "int8")
_P_MODES = ("auto", "fp32", "bf16", "fp8", "fp16")
# Where MJOLNIR_ATTN_KV_CALIBRATE=1 records.
DEFAULT_AMAX_FILE = "mjolnir-kv-amax.json"
# The formats MJOLNIR_ATTN_KV_FORMAT takes (every mjolnir format; "" = vLLM's kv_cache_dtype).
FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1", "nvfp4")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}: '{raw}' is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"{name}: '{raw}' is not an integer") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}: {value} is outside [{lo}, {hi}]")
    return value


def _format(env: Mapping[str, str], name: str) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return ""
    value = raw.strip().lower()
    if value not in FORMATS:
        raise ValueError(f"{name}: '{raw}' is not one of {', '.join(FORMATS)}")
    return value


def _path(env: Mapping[str, str], name: str, flag_default: str = "") -> str:
    """A file path; with flag_default, the boolean spellings turn it on (at flag_default) or
    off."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return ""
    value = raw.strip()
    if flag_default and value.lower() in _TRUE:
        return flag_default
    if flag_default and value.lower() in _FALSE:
        return ""
    return value


# Who runs, on a CPU where vLLM's attention runs on AMX tiles, the caches vLLM runs itself (bf16,
# and its fp8 without a scales file): "vllm" or "mjolnir" (MJOLNIR_ATTN_ON_AMX;
# vllm_backend.vllm_amx_reason).
ON_AMX = ("vllm", "mjolnir")

# The vLLM GPU backends the GPU backend can subclass (MJOLNIR_ATTN_GPU_BASE).
GPU_BASES = ("flash_attn", "flashinfer")


def _choice(env: Mapping[str, str], name: str, choices, default: str) -> str:
    """One of `choices` (case-insensitive), `default` when unset or empty."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}: '{raw}' is not one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class AttnConfig:
    """The plugin's settings. Defaults are those of an empty environment."""

    disable: bool = False  # MJOLNIR_ATTN_DISABLE: 1 = do not register the backend at all
    fallback: bool = True  # MJOLNIR_ATTN_FALLBACK: a step mjolnir cannot plan -> PyTorch path
    # MJOLNIR_ATTN_Q_DTYPE / _P_DTYPE: Q and P modes, auto | fp32 | bf16 | fp8, and int8 for Q.
    # auto: the backend's choice per layer (Backend::auto_modes; docs/python.md).
    q_dtype: str = "auto"
    p_dtype: str = "auto"
    max_splits: int = 16  # MJOLNIR_ATTN_MAX_SPLITS: cap on split-KV chunks per sequence
    threads: int = 0  # MJOLNIR_ATTN_THREADS: CPU worker threads of mjolnir's own, 0 = torch's
    kv_format: str = ""  # MJOLNIR_ATTN_KV_FORMAT: the cache's format, "" = vLLM's kv_cache_dtype
    kv_scales: str = ""  # MJOLNIR_ATTN_KV_SCALES: a scales file (python -m mjolnir.calibrate)
    kv_calibrate: str = ""  # MJOLNIR_ATTN_KV_CALIBRATE: record amax to this file (1: the default)
    on_amx: str = "vllm"  # MJOLNIR_ATTN_ON_AMX: vllm | mjolnir, caches vLLM runs on AMX (CPU)
    # GPU backend only (vllm_gpu_backend.py): the vLLM backend it subclasses and falls back to,
    # flash_attn | flashinfer, and the longest uniform query of a decode step it runs (1-8).
    gpu_base: str = "flash_attn"  # MJOLNIR_ATTN_GPU_BASE
    max_qlen: int = 1  # MJOLNIR_ATTN_MAX_QLEN
    # 1: decode steps planned into fixed-capacity buffers, so that vLLM may capture them in its
    # full CUDA graphs (opt-in until it has run on a GPU inside vLLM; docs/vllm.md).
    cuda_graphs: bool = False  # MJOLNIR_ATTN_CUDA_GRAPHS

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "AttnConfig":
        env = os.environ if env is None else env
        return cls(
            disable=_flag(env, "MJOLNIR_ATTN_DISABLE", False),
            fallback=_flag(env, "MJOLNIR_ATTN_FALLBACK", True),
            q_dtype=_choice(env, "MJOLNIR_ATTN_Q_DTYPE", _Q_MODES, "auto"),
            p_dtype=_choice(env, "MJOLNIR_ATTN_P_DTYPE", _P_MODES, "auto"),
            max_splits=_int(env, "MJOLNIR_ATTN_MAX_SPLITS", 16, 1, 256),
            threads=_int(env, "MJOLNIR_ATTN_THREADS", 0, 0, 4096),
            kv_format=_format(env, "MJOLNIR_ATTN_KV_FORMAT"),
            kv_scales=_path(env, "MJOLNIR_ATTN_KV_SCALES"),
            kv_calibrate=_path(env, "MJOLNIR_ATTN_KV_CALIBRATE", DEFAULT_AMAX_FILE),
            on_amx=_choice(env, "MJOLNIR_ATTN_ON_AMX", ON_AMX, "vllm"),
            gpu_base=_choice(env, "MJOLNIR_ATTN_GPU_BASE", GPU_BASES, "flash_attn"),
            max_qlen=_int(env, "MJOLNIR_ATTN_MAX_QLEN", 1, 1, 8),
            cuda_graphs=_flag(env, "MJOLNIR_ATTN_CUDA_GRAPHS", False),
        )


# Names, for documentation and for `python -m mjolnir` style listings.
ENV_VARS = (
    "MJOLNIR_ATTN_DISABLE",
    "MJOLNIR_ATTN_FALLBACK",
    "MJOLNIR_ATTN_Q_DTYPE",
    "MJOLNIR_ATTN_P_DTYPE",
    "MJOLNIR_ATTN_MAX_SPLITS",
    "MJOLNIR_ATTN_THREADS",
    "MJOLNIR_ATTN_KV_FORMAT",
    "MJOLNIR_ATTN_KV_SCALES",
    "MJOLNIR_ATTN_KV_CALIBRATE",
    "MJOLNIR_ATTN_ON_AMX",
    "MJOLNIR_ATTN_GPU_BASE",
    "MJOLNIR_ATTN_MAX_QLEN",
    "MJOLNIR_ATTN_CUDA_GRAPHS",
)

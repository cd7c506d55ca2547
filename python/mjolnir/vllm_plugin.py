"""The vLLM general plugin: `register()` is the `vllm.general_plugins` entry point
(`mjolnir = "mjolnir:register"` in pyproject.toml), called by vLLM in every process it starts.

On vLLM's CPU platform it points vLLM's CPU_ATTN backend at
mjolnir.vllm_backend.MjolnirCPUAttentionBackend, a subclass of vLLM's CPUAttentionBackend. Layers it
can serve (causal decoder attention, bf16 / fp16 / fp8 caches, no ALiBi, sliding window, soft-cap
or sinks) keep their cache in mjolnir's layout and run decode steps (uniform q_len up to
MJOLNIR_ATTN_MAX_Q_LEN) with mjolnir, other steps with a PyTorch path; other layers stay vLLM's.
MJOLNIR_ATTN_DISABLE=1 turns the plugin off.
Settings: mjolnir.config.AttnConfig (docs/python.md lists every MJOLNIR_ATTN_* variable).
"""

from __future__ import annotations

import logging

from .config import AttnConfig

# A child of vLLM's logger, so its handler (and VLLM_LOGGING_LEVEL) applies to these lines.
logger = logging.getLogger("vllm.mjolnir")

BACKEND_PATH = "mjolnir.vllm_backend.MjolnirCPUAttentionBackend"


def register() -> bool:
    """Registers the backend; returns True when it did. Raises ValueError for a bad
    MJOLNIR_ATTN_* value (so a typo is not silently ignored)."""
    config = AttnConfig.from_env()
    if config.disable:
        logger.info("mjolnir: MJOLNIR_ATTN_DISABLE is set; vLLM's own attention is used")
        return False
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:  # a vLLM without the v1 backend registry
        logger.warning("mjolnir: this vLLM has no attention backend registry (%s); not "
                       "registered", e)
        return False
    if not current_platform.is_cpu():
        # The CUDA backend of mjolnir is reachable through torch.ops.mjolnir, but no vLLM GPU
        # attention backend wraps it yet.
        logger.info("mjolnir: vLLM platform is %s, not CPU; not registered",
                    current_platform.device_type)
        return False
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    logger.info("mjolnir: CPU_ATTN -> %s (%s)", BACKEND_PATH, config)
    return True

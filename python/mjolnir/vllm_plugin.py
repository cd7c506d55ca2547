"""The vLLM general plugin: `register()` is the `vllm.general_plugins` entry point
(`mjolnir = "mjolnir:register"` in pyproject.toml), called by vLLM in every process it starts.

On vLLM's CPU platform it points vLLM's CPU_ATTN backend at
mjolnir.vllm_backend.MjolnirCPUAttentionBackend, a subclass of vLLM's CPUAttentionBackend. Layers it
can serve (causal decoder attention, no ALiBi, sliding window, soft-cap or sinks) keep their cache
in mjolnir's layout and format and run every step with mjolnir; other layers stay vLLM's. With
MJOLNIR_ATTN_KV_FORMAT (any mjolnir format, vLLM's kv_cache_dtype "auto"), it also makes vLLM
size and allocate those layers' caches at the format's true size, so the KV capacity vLLM reports
grows with it. MJOLNIR_ATTN_DISABLE=1 turns the plugin off.
Settings: mjolnir.config.AttnConfig (docs/python.md lists every MJOLNIR_ATTN_* variable).
"""

from __future__ import annotations

import logging

from .config import AttnConfig

# A child of vLLM's logger, so its handler (and VLLM_LOGGING_LEVEL) applies to these lines.
logger = logging.getLogger("vllm.mjolnir")

BACKEND_PATH = "mjolnir.vllm_backend.MjolnirCPUAttentionBackend"
GPU_BACKEND_PATH = "mjolnir.vllm_gpu_backend.MjolnirGpuAttentionBackend"


def register() -> bool:
    """Registers the backend; returns True when it did. Raises ValueError for a bad
    MJOLNIR_ATTN_* value (so a typo is not silently ignored)."""
    config = AttnConfig.from_env()
    if config.disable:
        logger.info("mjolnir: MJOLNIR_ATTN_DISABLE is set; vLLM's own attention is used")
        return False
    if config.kv_scales:
        from .calibrate import scales
        scales(config.kv_scales)  # a missing or malformed file fails here, naming the field
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:  # a vLLM without the v1 backend registry
        logger.warning("mjolnir: this vLLM has no attention backend registry (%s); not "
                       "registered", e)
        return False
    if current_platform.is_cuda():
        return _register_gpu(config, AttentionBackendEnum, register_backend)
    if not current_platform.is_cpu():
        logger.info("mjolnir: vLLM platform is %s, neither CPU nor CUDA; not registered",
                    current_platform.device_type)
        return False
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    if config.kv_format:
        _size_caches_by_format()
    # vLLM loads plugins before it sets up logging, so this line may not show; the metadata
    # builder logs again, once the engine's logging is up, which layers run on mjolnir.
    logger.info("mjolnir: CPU_ATTN -> %s (%s)", BACKEND_PATH, config)
    return True


def _register_gpu(config: AttnConfig, backends, register_backend) -> bool:
    """On CUDA platforms: mjolnir's GPU backend (decode steps on mjolnir, the rest vLLM's
    FlashAttention or FlashInfer, MJOLNIR_ATTN_GPU_BASE) as AttentionBackendEnum.CUSTOM and as a
    new MJOLNIR member, which a user selects (attention_backend="MJOLNIR"); vLLM's default
    backend is left alone."""
    from . import has_cuda

    if not has_cuda:
        logger.warning("mjolnir: vLLM runs on CUDA but this build of mjolnir has no CUDA backend "
                       "(reinstall with MJOLNIR_PYTHON_CUDA=ON); not registered")
        return False
    if config.kv_format:
        logger.warning("mjolnir: MJOLNIR_ATTN_KV_FORMAT=%s is for the CPU backend; on GPUs the "
                       "cache keeps vLLM's kv_cache_dtype", config.kv_format)
    register_backend(backends.CUSTOM, GPU_BACKEND_PATH)
    if "MJOLNIR" not in backends.__members__:
        register_backend("MJOLNIR", GPU_BACKEND_PATH)
    logger.info("mjolnir: CUSTOM and MJOLNIR -> %s (decode steps on mjolnir, the rest on "
                "vLLM's %s; %s)", GPU_BACKEND_PATH, config.gpu_base, config)
    return True


def _size_caches_by_format() -> None:
    """Has vLLM size and allocate the cache of each layer mjolnir owns in the format of
    MJOLNIR_ATTN_KV_FORMAT: the layer's KV cache spec (from which vLLM computes its capacity
    and allocates) describes packed rows of bytes, row_bytes(format, head size) for K and again
    for V per token, instead of model-dtype rows. Layers mjolnir does not own keep vLLM's spec."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    original = Attention.get_kv_cache_spec
    if getattr(original, "mjolnir_sized", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        from .vllm_backend import MjolnirCPUAttentionImpl, packed_spec

        impl = getattr(self, "impl", None)
        if type(spec) is FullAttentionSpec and isinstance(impl, MjolnirCPUAttentionImpl):
            return packed_spec(impl, spec) or spec
        return spec

    get_kv_cache_spec.mjolnir_sized = True
    Attention.get_kv_cache_spec = get_kv_cache_spec

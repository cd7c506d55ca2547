"""mjolnir as a vLLM GPU attention backend (imports vLLM; registered by vllm_plugin.register()
under AttentionBackendEnum.CUSTOM and a new MJOLNIR member on CUDA platforms). Written against
vLLM 0.32's vllm.v1.attention.backends.flash_attn (and .flashinfer).

The backend is vLLM's FlashAttention backend (MJOLNIR_ATTN_GPU_BASE=flashinfer: FlashInfer's)
with one thing changed: **decode-only steps** of the layers it qualifies run on mjolnir's CUDA
decode. Everything else is inherited: the cache's allocation and layout, the cache write, prefill
and mixed steps, validation, and every layer that does not qualify (which logs why once).

- The cache stays vLLM's and is read in place. vLLM 0.32 hands a layer a logical
  [num_blocks, Hk, block_size, 2 * head_size] tensor (a token's K row then its V row; the
  physical order of the first three dimensions is its KV cache layout's, visible in the strides);
  split into [blocks, Hk, block_size, 2, head_size] it is mjolnir's "BHN2D" with vLLM's strides.
- A step qualifies when every request has the same number of query tokens, at most
  MJOLNIR_ATTN_MAX_QLEN (1 by default: plain decode; more for a drafter's verification), after
  any trailing padding requests with none. The metadata builder plans such a step once
  (torch.ops.mjolnir.plan_step on the "cuda" backend) and every layer runs that plan.
- fp8 caches take vLLM's per-tensor k/v scales (the layer's floats), bf16 / fp16 caches 1.

- Each layer's call only enqueues work on torch's current stream: the step's plan goes into the
  device step buffer once per step (before its first layer), the kernels read vLLM's scale
  tensors where they are, and nothing waits for the device.

- CUDA graphs (MJOLNIR_ATTN_CUDA_GRAPHS=1; off by default until it has run inside vLLM on a
  GPU): the builder then declares the support of a decode-only backend (uniform single-token
  decode, or uniform batches where MJOLNIR_ATTN_MAX_QLEN > 1), and plans each qualifying step
  into buffers of fixed capacity (torch.classes.mjolnir.GraphBuffers: the scheduler's
  max_num_seqs sequences, the model's max_model_len, MJOLNIR_ATTN_MAX_SPLITS chunks), made by
  the first eager decode step of a layer mjolnir runs from its cache's shape. The plan is
  uploaded there in build(), which vLLM runs before every replay; a layer's attend then only
  enqueues kernels over the capacity's fixed grids, which a full graph captures once. Without
  it, the kernels' grids are sized to each step's plan and vLLM runs attention eagerly between
  its graph pieces (AttentionCGSupport.NEVER).

What this version does not do, and says so: it copies the step's sequence lengths and block
table to the host once per step to plan (one synchronisation a step). It has not run inside
vLLM on a GPU: no GPU machine here has vLLM (docs/vllm.md).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from vllm.v1.attention.backend import AttentionCGSupport

from . import _ext, ops  # noqa: F401  (registers torch.ops.mjolnir)
from .config import AttnConfig
from .vllm_layers import block_size_reason, feature_reason

logger = logging.getLogger("vllm.mjolnir")

LAYOUT = "BHN2D"
_attend_step = torch.ops.mjolnir.attend_step
# vLLM cache dtype names -> mjolnir formats; "auto" holds the model's dtype.
_KV_DTYPE_FORMAT = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_MODEL_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _base_classes(name: str):
    """vLLM's backend, metadata builder and impl classes that MJOLNIR_ATTN_GPU_BASE names."""
    if name == "flashinfer":
        from vllm.v1.attention.backends import flashinfer as module
        return module.FlashInferBackend, module.FlashInferMetadataBuilder, module.FlashInferImpl
    from vllm.v1.attention.backends import flash_attn as module
    return (module.FlashAttentionBackend, module.FlashAttentionMetadataBuilder,
            module.FlashAttentionImpl)


_CONFIG = AttnConfig.from_env()
_Backend, _Builder, _Impl = _base_classes(_CONFIG.gpu_base)


def layer_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> Optional[str]:
    """The mjolnir format of a layer's vLLM cache, or None when mjolnir has no such format."""
    if kv_cache_dtype in ("auto", "bfloat16", "float16"):
        if kv_cache_dtype == "bfloat16":
            return "bf16"
        if kv_cache_dtype == "float16":
            return "fp16"
        return _MODEL_FORMAT.get(model_dtype)
    return _KV_DTYPE_FORMAT.get(kv_cache_dtype)


def cache_view(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """vLLM's [blocks, Hk, block_size, 2 * head_size] cache as mjolnir's 5-D BHN2D view, in
    place, with vLLM's strides."""
    return kv_cache.unflatten(-1, (2, head_size))


def uniform_query_len(query_start_loc_cpu: torch.Tensor, num_reqs: int,
                      max_qlen: int) -> tuple[Optional[int], int, str]:
    """(q_len, requests, why) of a step: the query tokens every request has and how many
    requests have them, trailing requests with none left out; q_len None and the reason when
    the step is not a uniform decode step of at most max_qlen tokens."""
    lens = (query_start_loc_cpu[1:num_reqs + 1] - query_start_loc_cpu[:num_reqs]).tolist()
    while lens and lens[-1] == 0:
        lens.pop()
    if not lens:
        return None, 0, "no query tokens"
    q_len = lens[0]
    if any(n != q_len for n in lens):
        return None, 0, f"query lengths differ ({min(lens)}-{max(lens)}): a prefill or mixed step"
    if q_len > max_qlen:
        return None, 0, f"{q_len} query tokens per request, over MJOLNIR_ATTN_MAX_QLEN {max_qlen}"
    return q_len, len(lens), ""


class MjolnirGpuAttentionBackend(_Backend):
    """vLLM's GPU attention backend (FlashAttention, or FlashInfer) with decode-only steps on
    mjolnir's CUDA decode."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return MjolnirGpuAttentionImpl

    @staticmethod
    def get_builder_cls():
        return MjolnirGpuMetadataBuilder


def cudagraph_support(config: AttnConfig, base: AttentionCGSupport) -> AttentionCGSupport:
    """The CUDA-graph support the builder declares: none unless config.cuda_graphs; else that
    of a backend whose graphs hold decode-only steps (uniform single-token decode, or uniform
    batches where decode steps may have more query tokens), at most the base backend's (whose
    kernels a captured graph holds for the layers mjolnir leaves to it)."""
    if not config.cuda_graphs:
        return AttentionCGSupport.NEVER
    ours = (AttentionCGSupport.UNIFORM_BATCH if config.max_qlen > 1
            else AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    return min(ours, base, key=lambda s: s.value)


class GraphSlot:
    """A builder's graph buffers, one per q_len, shared with its layers through each step's
    metadata: made by a layer's first eager decode step (which knows the cache's shape), used
    by the builder's later plans."""

    def __init__(self, max_seqs: int, max_model_len: int) -> None:
        self.max_seqs = max_seqs  # the scheduler's max_num_seqs
        self.max_model_len = max_model_len
        # q_len -> GraphBuffers, or None where they could not be made
        self.buffers: dict[int, Any] = {}


class MjolnirGpuMetadataBuilder(_Builder):
    """vLLM's metadata builder, plus the step's mjolnir plan when the step qualifies."""

    # Without MJOLNIR_ATTN_CUDA_GRAPHS each step's kernels are launched with grids sized to its
    # own plan (see the module's docstring): a captured graph would replay the wrong ones.
    _cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return cudagraph_support(_CONFIG, _Builder.get_cudagraph_support(vllm_config,
                                                                         kv_cache_spec))

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        slot = self._graph_slot()
        step, why = plan_decode_step(common_attn_metadata, self._mjolnir_heads(),
                                     _CONFIG, common_prefix_len, graphs=slot)
        meta.mjolnir_step = step  # type: ignore[attr-defined]
        meta.mjolnir_skip = why  # type: ignore[attr-defined]
        meta.mjolnir_graph_slot = slot  # type: ignore[attr-defined]
        return meta

    def _graph_slot(self) -> Optional[GraphSlot]:
        if not _CONFIG.cuda_graphs:
            return None
        slot = self.__dict__.get("_mjolnir_graph_slot")
        if slot is None:
            slot = self.__dict__["_mjolnir_graph_slot"] = GraphSlot(
                int(self.vllm_config.scheduler_config.max_num_seqs),
                int(self.vllm_config.model_config.max_model_len))
        return slot

    def _mjolnir_heads(self) -> tuple[int, int]:
        heads = self.__dict__.get("_mjolnir_heads_cache")
        if heads is None:
            config = self.vllm_config.model_config
            parallel = self.vllm_config.parallel_config
            heads = (config.get_num_attention_heads(parallel), config.get_num_kv_heads(parallel))
            self.__dict__["_mjolnir_heads_cache"] = heads
        return heads


def _step_handle(meta, step) -> tuple[int, int, int, int]:
    """The step's query rows, id, the rows of the graph buffers it was planned into (0: none)
    and its query tokens per request, asked once per step and kept on its metadata: each is a
    method call of the torchbind Step, which costs more than the layer's whole host-side call
    of attend_step (docs/python.md)."""
    handle = meta.__dict__.get("mjolnir_handle")
    if handle is None or handle[0] is not step:
        handle = (step, step.query_rows(), step.id(), step.graph_rows(), step.q_len())
        meta.__dict__["mjolnir_handle"] = handle
    return handle[1:]


def plan_decode_step(common, heads: tuple[int, int], config: AttnConfig,
                     common_prefix_len: int = 0, backend: str = "cuda",
                     graphs: Optional[GraphSlot] = None):
    """(the step's plan, "") from vLLM's CommonAttentionMetadata when it is a uniform decode
    step mjolnir runs, else (None, why). Its sequence lengths and block table are copied to the
    host here, once per step. Where `graphs` holds buffers for the step's q_len the plan is
    uploaded into them now (a full CUDA graph replays the layers' kernels without calling
    them); a step that does not fit them is an error, since a replayed graph would read the
    buffers' last plan."""
    if common_prefix_len:
        return None, "cascade attention (a common prefix)"
    causal = common.causal
    if isinstance(causal, torch.Tensor):
        return None, "per-request causality"
    q_len, num_reqs, why = uniform_query_len(common.query_start_loc_cpu, common.num_reqs,
                                             config.max_qlen)
    if q_len is None:
        return None, why
    seq_lens = common.seq_lens[:num_reqs].to("cpu", torch.int32)
    block_table = common.block_table_tensor[:num_reqs].to("cpu", torch.int32)
    num_heads, num_kv_heads = heads
    graph = graphs.buffers.get(q_len) if graphs is not None else None
    try:
        step = torch.ops.mjolnir.plan_step(seq_lens, block_table, None, q_len, num_heads,
                                           num_kv_heads, bool(causal), config.q_dtype,
                                           config.p_dtype, 0, 0, backend, graph)
    except ValueError as e:
        if graph is None:
            raise
        raise RuntimeError(
            f"mjolnir: a decode step of {num_reqs} requests does not fit the CUDA-graph buffers "
            f"({graph.describe()}): {e}. A captured graph would replay their last plan; "
            "run without MJOLNIR_ATTN_CUDA_GRAPHS") from e
    return step, ""


def make_graph_buffers(slot: GraphSlot, q_len: int, impl, kv_cache: torch.Tensor,
                       config: AttnConfig) -> None:
    """Graph buffers for steps of q_len over this layer's cache (its heads and head size, its
    pool of pages), sized for the slot's sequences and model length, into the slot. Called from
    a layer's eager decode step, never while a graph captures (a capture after vLLM's warm-up
    finds them made)."""
    block_size, num_blocks = int(kv_cache.shape[2]), int(kv_cache.shape[0])
    max_pages = -(-slot.max_model_len // block_size)
    try:
        buffers = torch.classes.mjolnir.GraphBuffers(
            slot.max_seqs, max_pages, q_len, impl.num_heads, impl.num_kv_heads, impl.head_size,
            config.max_splits, block_size, num_blocks, kv_cache.device.index or 0)
    except (ValueError, RuntimeError) as e:  # out of range, out of device memory
        slot.buffers[q_len] = None
        logger.warning("mjolnir: no CUDA-graph buffers for decode steps of %d query token(s) "
                       "(%s); vLLM's graphs hold %s's kernels for them", q_len, e,
                       config.gpu_base)
        return
    slot.buffers[q_len] = buffers
    logger.info("mjolnir: decode steps of %d query token(s) planned into CUDA-graph buffers "
                "from the next step on: %s", q_len, buffers.describe())


class MjolnirGpuAttentionImpl(_Impl):
    """vLLM's impl; decode-only steps of a qualifying layer on mjolnir."""

    mjolnir_steps = 0  # layer calls mjolnir ran (for tests and logs)
    fallback_steps = 0  # layer calls of mjolnir's layers left to the base backend
    _logged: set = set()

    def owner_reason(self, kv_cache: torch.Tensor) -> Optional[str]:
        """None when mjolnir may run this layer's decode steps; else why not. Depends only on
        the layer and its cache tensor."""
        why = feature_reason(self)
        if why is not None:
            return why
        if self.head_size not in (64, 128, 256):
            return f"head size {self.head_size} (the CUDA decode takes 64, 128, 256)"
        model_dtype = kv_cache.dtype if kv_cache.dtype in _MODEL_FORMAT else None
        fmt = layer_format(self.kv_cache_dtype, model_dtype)
        if fmt is None:
            return f"KV cache dtype {self.kv_cache_dtype} / {kv_cache.dtype}"
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * self.head_size \
                or kv_cache.stride(-1) != 1:
            return (f"cache shape {tuple(kv_cache.shape)}, strides {kv_cache.stride()}: not "
                    f"[blocks, Hk, block_size, {2 * self.head_size}] with contiguous rows")
        return block_size_reason(kv_cache.shape[2])

    def _layer_state(self, layer, kv_cache: torch.Tensor) -> Optional[dict[str, Any]]:
        """This layer's mjolnir state for this cache tensor (format, view, host scales), or None
        when the layer stays the base backend's; worked out once per cache tensor."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        state = self.__dict__.get("_mjolnir_state")
        if state is not None and state["key"] == key:
            return state if state["owned"] else None
        reason = self.owner_reason(kv_cache)
        state = {"key": key, "owned": reason is None}
        if reason is not None:
            if reason not in self._logged:
                self._logged.add(reason)
                logger.info("mjolnir: a layer stays on vLLM's %s: %s", _CONFIG.gpu_base,
                            reason)
        else:
            model_dtype = kv_cache.dtype if kv_cache.dtype in _MODEL_FORMAT else None
            state["format"] = layer_format(self.kv_cache_dtype, model_dtype)
            state["view"] = cache_view(kv_cache, self.head_size)
        self.__dict__["_mjolnir_state"] = state
        return state if state["owned"] else None

    def _scales(self, layer, fmt: str, device: torch.device):
        """The layer's K and V scales as float32 tensors on the cache's device, which the
        kernels read there (a host value would make each call wait for a copy): vLLM's own
        per-tensor scale tensors for fp8 where the layer has them on that device, else tensors
        made once from its floats; ones for bf16 / fp16."""
        if fmt not in ("bf16", "fp16"):
            k, v = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
            if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) \
                    and k.device == device and v.device == device \
                    and k.dtype == torch.float32 and v.dtype == torch.float32:
                return k, v
            values = (float(getattr(layer, "_k_scale_float", 1.0)),
                      float(getattr(layer, "_v_scale_float", 1.0)))
        else:
            values = (1.0, 1.0)
        cached = self.__dict__.get("_mjolnir_scales")
        if cached is None or cached[0] != (values, device):
            cached = ((values, device), torch.tensor([values[0]], device=device),
                      torch.tensor([values[1]], device=device))
            self.__dict__["_mjolnir_scales"] = cached
        return cached[1], cached[2]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        step = getattr(attn_metadata, "mjolnir_step", None)
        state = None
        if step is not None and output_scale is None and output_block_scale is None:
            state = self._layer_state(layer, kv_cache)
        if state is None:
            if step is not None or getattr(attn_metadata, "mjolnir_skip", ""):
                type(self).fallback_steps += 1
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        # The cache write stays the base backend's (its own step when
        # forward_includes_kv_cache_update is False, vLLM calls do_kv_cache_update first).
        rows, step_id, graph_rows, q_len = _step_handle(attn_metadata, step)
        slot = getattr(attn_metadata, "mjolnir_graph_slot", None)
        if graph_rows:
            # Every row vLLM's (padded) tensors hold, up to the buffers' capacity: a graph
            # captured now replays this call over later steps of up to that many rows.
            rows = min(query.shape[0], graph_rows)
        elif slot is not None and torch.cuda.is_current_stream_capturing():
            # A plan sized to this step cannot be captured; the base backend's kernels can.
            type(self).fallback_steps += 1
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        k_scale, v_scale = self._scales(layer, state["format"], kv_cache.device)
        try:
            _attend_step(step_id, output[:rows].view(rows, self.num_heads, self.head_size),
                         query[:rows], state["view"], k_scale, v_scale, state["format"], LAYOUT,
                         self.scale)
        except ValueError as e:
            # Raised before any kernel runs (the arguments' checks, a shape the CUDA decode does
            # not take): the layer goes back to the base backend for good, this step included,
            # rather than ending the engine and every request in it.
            state["owned"] = False
            logger.warning("mjolnir: a decode step failed on mjolnir (%s); this layer stays on "
                           "vLLM's %s", e, _CONFIG.gpu_base)
            type(self).fallback_steps += 1
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        type(self).mjolnir_steps += 1
        if slot is not None and not graph_rows and q_len not in slot.buffers:
            make_graph_buffers(slot, q_len, self, kv_cache, _CONFIG)
        return output

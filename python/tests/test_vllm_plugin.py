"""The vLLM plugin against a real vLLM (skipped where vLLM is not installed): registration, and
MjolnirCPUAttentionImpl.forward against vLLM's own CPU attention kernel on a cache that vLLM's
cpu_attn_reshape_and_cache wrote."""

from __future__ import annotations

import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cpu():
    pytest.skip("vLLM platform is not CPU", allow_module_level=True)

import mjolnir  # noqa: E402
from _reference import attention  # noqa: E402
from mjolnir.config import AttnConfig  # noqa: E402


@pytest.fixture(scope="module")
def vllm_ops():
    current_platform.import_kernels()  # loads vllm._C (the AVX2 or AVX-512 build)
    from vllm import _custom_ops
    return _custom_ops


def test_register_overrides_cpu_attn(monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    monkeypatch.delenv("MJOLNIR_ATTN_DISABLE", raising=False)
    try:
        assert mjolnir.register() is True
        cls = AttentionBackendEnum.CPU_ATTN.get_class()
        from mjolnir.vllm_backend import MjolnirCPUAttentionBackend, MjolnirCPUAttentionImpl
        assert cls is MjolnirCPUAttentionBackend and issubclass(cls, CPUAttentionBackend)
        assert cls.get_name() == "CPU_ATTN" and cls.get_impl_cls() is MjolnirCPUAttentionImpl
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()
    monkeypatch.setenv("MJOLNIR_ATTN_DISABLE", "1")
    assert mjolnir.register() is False
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()


# The plugin's settings with its bf16 layers on mjolnir on every CPU: by default a CPU with AMX
# leaves them to vLLM's AMX kernel (test_stays_vllms_where_vllm_runs_amx), and these tests are
# of mjolnir's path.
ON_MJOLNIR = AttnConfig(on_amx="mjolnir")


def make_impl(num_heads, num_kv_heads, head_size, config):
    """The impl without vLLM's engine config (its __init__ reads the current VllmConfig): the
    fields forward() uses, as CPUAttentionBackendImpl.__init__ sets them."""
    from vllm.v1.attention.backend import AttentionType
    from mjolnir.vllm_backend import MjolnirCPUAttentionImpl
    impl = MjolnirCPUAttentionImpl.__new__(MjolnirCPUAttentionImpl)
    impl.__dict__.update(
        num_heads=num_heads, head_size=head_size, scale=head_size ** -0.5,
        num_kv_heads=num_kv_heads, alibi_slopes=None, sliding_window=-1, kv_cache_dtype="auto",
        logits_soft_cap=0, attn_type=AttentionType.DECODER, sinks=None, use_zentorch_sdpa=False,
        num_queries_per_kv=num_heads // num_kv_heads, is_fp8_kv_cache=False,
        kv_sharing_target_layer_name=None, mjolnir_config=config)
    return impl


def vllm_layout_probe(vllm_ops):
    """vLLM's "vec" CPU cache: per (block, head), K channel-major [D][block_size], then V
    row-major [block_size][D]. This is why the backend owns its layers' caches."""
    blocks, heads, block, d = 2, 2, 32, 64
    kv = torch.zeros(blocks, heads, block, 2 * d, dtype=torch.float16)
    key_cache, value_cache = kv.view(blocks, heads, 2 * block, d).chunk(2, dim=2)
    key, value = torch.randn(1, heads, d).half(), torch.randn(1, heads, d).half()
    vllm_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                        torch.tensor([block + 5]), "vec", k_scale=1.0,
                                        v_scale=1.0, kv_cache_dtype="auto")
    per_head = kv.view(blocks, heads, 2 * block, d)[1]
    k_transposed = per_head[:, :block].reshape(heads, d, block)
    return (torch.equal(k_transposed[:, :, 5], key[0]),
            torch.equal(per_head[:, block + 5], value[0]))


def test_vllm_cpu_cache_layout_is_as_documented(vllm_ops):
    assert vllm_layout_probe(vllm_ops) == (True, True)


class Step:
    """A batch of sequences written once through the mjolnir impl (its own cache layout) and
    once through vLLM's cpu_attn_reshape_and_cache (vLLM's layout), with metadata as vLLM's
    CPU builder makes it."""

    def __init__(self, vllm_ops, gen, impl, dtype, q_lens, hq=8, hk=2, d=64, block=32,
                 max_len=200):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata
        num_reqs = len(q_lens)
        seq_lens = torch.randint(max(q_lens), max_len, (num_reqs,), generator=gen,
                                 dtype=torch.int32)
        seq_lens[0] = max_len
        max_blocks = (max_len + block - 1) // block
        num_blocks = num_reqs * max_blocks + 4
        table = torch.randperm(num_blocks, generator=gen)[: num_reqs * max_blocks]
        table = table.reshape(num_reqs, max_blocks).to(torch.int32)
        tokens = int(seq_lens.sum())
        key = torch.randn(tokens, hk, d, generator=gen).to(dtype)
        value = torch.randn(tokens, hk, d, generator=gen).to(dtype)
        slots = torch.tensor([int(table[b, p // block]) * block + p % block
                              for b, n in enumerate(seq_lens.tolist()) for p in range(n)])
        self.layer = types.SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
        self.ours = torch.zeros(num_blocks, hk, block, 2 * d, dtype=dtype)
        impl.do_kv_cache_update(self.layer, key, value, self.ours, slots)
        self.theirs = torch.zeros_like(self.ours)
        kc, vc = self.theirs.view(num_blocks, hk, 2 * block, d).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "vec", k_scale=1.0,
                                            v_scale=1.0, kv_cache_dtype="auto")
        assert self.ours.count_nonzero() > 0 and self.theirs.count_nonzero() > 0

        self.query = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
        starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        scheduler_metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=num_reqs, num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=seq_lens,
            dtype=dtype, query_start_loc=starts, causal=True, sliding_window_size=-1,
            isa="vec", enable_kv_split=False, kv_cache_dtype="auto")
        self.meta = CPUAttentionMetadata(
            num_actual_tokens=sum(q_lens), max_query_len=max(q_lens), query_start_loc=starts,
            max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=table,
            slot_mapping=slots, scheduler_metadata=scheduler_metadata, causal=True)

        # float64 attention over K/V as written (bf16 / fp16 caches hold them exactly), for
        # query token j of sequence i at position seq_len - q_len_i + j.
        k64, v64 = key.to(torch.float64), value.to(torch.float64)
        ref = torch.zeros(sum(q_lens), hq, d, dtype=torch.float64)
        offsets = [0] + seq_lens.cumsum(0).tolist()
        for i, (n, ql) in enumerate(zip(seq_lens.tolist(), q_lens)):
            k = k64[offsets[i]: offsets[i] + n].repeat_interleave(hq // hk, dim=1)
            v = v64[offsets[i]: offsets[i] + n].repeat_interleave(hq // hk, dim=1)
            q = self.query[int(starts[i]): int(starts[i + 1])].to(torch.float64)
            s = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
            pos = torch.arange(n - ql, n)[:, None]
            s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
            ref[int(starts[i]): int(starts[i + 1])] = torch.einsum(
                "hqk,khd->qhd", torch.softmax(s, -1), v)
        self.ref = ref

    def error(self, out):
        out = out.view(self.ref.shape).to(torch.float64)
        return float((out - self.ref).abs().max() / self.ref.abs().max())


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [4, 4, 4], [3, 17, 1], [40]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_matches_vllm_kernel(vllm_ops, gen, dtype, q_lens):
    """Every step, decode, speculative, mixed and prefill, runs on mjolnir: against float64
    attention, as vLLM's own kernel on its own cache is."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    hq, d = 8, 64
    impl = make_impl(hq, 2, d, ON_MJOLNIR)
    step = Step(vllm_ops, gen, impl, dtype, q_lens)
    assert impl.owner_reason(step.ours) is None
    ours = torch.full((sum(q_lens), hq * d), float("nan"), dtype=dtype)
    mjolnir_steps, torch_steps = type(impl).mjolnir_steps, type(impl).fallback_steps
    impl.forward(step.layer, step.query, None, None, step.ours, step.meta, ours)
    assert type(impl).mjolnir_steps == mjolnir_steps + 1
    assert type(impl).fallback_steps == torch_steps
    # vLLM's builder made this metadata: the first layer planned the step and left the plan on
    # it for the others.
    assert step.meta.mjolnir_step.query_rows() == sum(q_lens)
    theirs = torch.full_like(ours, float("nan"))
    CPUAttentionBackendImpl.forward(impl, step.layer, step.query, None, None, step.theirs,
                                    step.meta, theirs)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3  # the output's own rounding
    assert step.error(ours) < tolerance
    assert step.error(theirs) < 2 * tolerance


def test_per_request_causality_takes_the_pytorch_path(vllm_ops, gen):
    """vLLM's dynamic_causal (a causal flag per request) is the one step mjolnir does not plan:
    the PyTorch path runs it (the causal request matching mjolnir's own result), or, with
    MJOLNIR_ATTN_FALLBACK=0, it raises."""
    impl = make_impl(8, 2, 64, ON_MJOLNIR)
    step = Step(vllm_ops, gen, impl, torch.bfloat16, [3, 5])
    planned = torch.empty(8, 8 * 64, dtype=torch.bfloat16)
    impl.forward(step.layer, step.query, None, None, step.ours, step.meta, planned)
    step.meta.dynamic_causal = torch.tensor([True, False])
    step.meta.causal = False
    out = torch.full_like(planned, float("nan"))
    torch_steps = type(impl).fallback_steps
    impl.forward(step.layer, step.query, None, None, step.ours, step.meta, out)
    assert type(impl).fallback_steps == torch_steps + 1
    assert (out[:3].float() - planned[:3].float()).abs().max() < 2e-2
    assert torch.isfinite(out[3:].float()).all()
    strict = make_impl(8, 2, 64, AttnConfig(fallback=False, on_amx="mjolnir"))
    with pytest.raises(NotImplementedError, match="per-request causality"):
        strict.forward(step.layer, step.query, None, None, step.ours, step.meta, out)


def test_layers_mjolnir_does_not_take(vllm_ops):
    impl = make_impl(4, 2, 64, ON_MJOLNIR)
    cache = torch.zeros(4, 2, 32, 128, dtype=torch.bfloat16)
    assert impl.owner_reason(cache) is None
    assert "KV cache dtype" in impl.owner_reason(cache.float())
    assert "block size" in impl.owner_reason(torch.zeros(4, 2, 48, 128, dtype=torch.bfloat16))
    impl.sliding_window = 128
    assert impl.owner_reason(cache) == "sliding window"


@pytest.mark.parametrize("amx", [False, True])
def test_stays_vllms_where_vllm_runs_amx(monkeypatch, amx):
    """By default, on a CPU with AMX and blocks of a multiple of 32 tokens (where vLLM runs its
    AMX kernel for a bf16 model), the caches vLLM runs itself stay vLLM's, saying why: bf16,
    and vLLM's fp8 without a scales file. Everywhere else mjolnir takes them, as it does with
    MJOLNIR_ATTN_ON_AMX=mjolnir, while recording amax, with a scales file or with a format of
    its own; fp16 caches and fp8 under an fp16 model (vLLM's vec kernel there) are mjolnir's."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    bf16 = torch.zeros(4, 2, 32, 128, dtype=torch.bfloat16)
    why = make_impl(4, 2, 64, AttnConfig()).owner_reason(bf16)
    if amx:
        assert "bf16 cache on a CPU with AMX" in why and "MJOLNIR_ATTN_ON_AMX=mjolnir" in why
    else:
        assert why is None
    assert make_impl(4, 2, 64, AttnConfig()).owner_reason(
        torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)) is None  # vLLM's vec16 there
    assert make_impl(4, 2, 64, AttnConfig()).owner_reason(bf16.half()) is None
    assert make_impl(4, 2, 64, ON_MJOLNIR).owner_reason(bf16) is None
    assert make_impl(4, 2, 64, AttnConfig(kv_calibrate="amax.json")).owner_reason(bf16) is None

    def fp8(config, model_dtype):
        impl = make_impl(4, 2, 64, config)
        impl.kv_cache_dtype = "fp8"
        impl.mjolnir_model_dtype = model_dtype
        return impl.owner_reason(torch.zeros(4, 2, 32, 128, dtype=torch.uint8))

    why = fp8(AttnConfig(), torch.bfloat16)
    assert ("fp8_e4m3 cache on a CPU with AMX" in why) if amx else why is None
    assert fp8(AttnConfig(), torch.float16) is None
    assert fp8(AttnConfig(kv_scales="kv_scales.json"), torch.bfloat16) is None
    assert fp8(ON_MJOLNIR, torch.bfloat16) is None
    packed = make_impl(4, 2, 64, AttnConfig(kv_format="fp4_e2m1"))
    assert packed.owner_reason(torch.zeros(4, 2, 32, 64, dtype=torch.uint8)) is None


def test_non_finite_kv_does_not_end_the_engine(vllm_ops, gen):
    """A request whose K/V holds NaN or Inf: the write goes through (Inf saturated, NaN as 0),
    is counted, and the other tokens of the batch are stored as they are."""
    impl = make_impl(4, 2, 64, ON_MJOLNIR)
    cache = torch.zeros(4, 2, 32, 128, dtype=torch.bfloat16)
    layer = types.SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0,
                                  layer_name="model.layers.0.self_attn.attn")
    key = torch.randn(3, 2, 64, generator=gen).to(torch.bfloat16)
    value = torch.randn(3, 2, 64, generator=gen).to(torch.bfloat16)
    key[1, 0, 5] = float("nan")
    value[2, 1, 7] = float("inf")
    before = type(impl).nonfinite_writes
    impl.do_kv_cache_update(layer, key, value, cache, torch.tensor([0, 1, 2]))
    assert type(impl).nonfinite_writes == before + 1
    view = impl.cache_view(cache)  # [blocks, Hk, N, 2, D]
    stored_k, stored_v = view[0, :, :3, 0].transpose(0, 1), view[0, :, :3, 1].transpose(0, 1)
    assert torch.isfinite(stored_k.float()).all() and torch.isfinite(stored_v.float()).all()
    assert stored_k[1, 0, 5] == 0
    assert stored_v[2, 1, 7] == torch.finfo(torch.bfloat16).max
    assert torch.equal(stored_k[0], key[0]) and torch.equal(stored_v[1], value[1])

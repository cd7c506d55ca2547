"""mjolnir's vLLM GPU backend against vLLM's real classes, on the CPU (skipped where vLLM is not
installed). No GPU machine here has vLLM, so everything short of a GPU serving run is checked
here: registration on a CUDA platform, the classes it subclasses, which steps and layers
qualify, vLLM's metadata to the plan's arguments, and the in-place view of vLLM's GPU cache
(written as vLLM's cache write lays it out, in a permuted physical layout) decoded by mjolnir
against the float64 reference. The decode itself runs on the CPU backend here; on a GPU it is
the same plan on the "cuda" backend (python/tests/test_cuda_ops.py tests that path)."""

from __future__ import annotations

import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

import mjolnir  # noqa: E402
from _reference import attention  # noqa: E402
from mjolnir import vllm_gpu_backend as gpu  # noqa: E402
from mjolnir.config import AttnConfig  # noqa: E402


def test_classes_subclass_vllms_flash_attention():
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends import flash_attn
    assert issubclass(gpu.MjolnirGpuAttentionBackend, flash_attn.FlashAttentionBackend)
    assert issubclass(gpu.MjolnirGpuMetadataBuilder, flash_attn.FlashAttentionMetadataBuilder)
    assert issubclass(gpu.MjolnirGpuAttentionImpl, flash_attn.FlashAttentionImpl)
    assert gpu.MjolnirGpuAttentionBackend.get_impl_cls() is gpu.MjolnirGpuAttentionImpl
    assert gpu.MjolnirGpuAttentionBackend.get_builder_cls() is gpu.MjolnirGpuMetadataBuilder
    assert gpu.MjolnirGpuAttentionBackend.get_name() == "CUSTOM"
    # Grids sized to each step's plan: no CUDA-graph support is claimed.
    assert gpu.MjolnirGpuMetadataBuilder.get_cudagraph_support(None, None) == \
        AttentionCGSupport.NEVER


def test_registers_on_a_cuda_platform(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    monkeypatch.delenv("MJOLNIR_ATTN_DISABLE", raising=False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(mjolnir, "has_cuda", False)
    assert mjolnir.register() is False  # a build without the CUDA backend says so and stays out
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    monkeypatch.setattr(mjolnir, "has_cuda", True)
    try:
        assert mjolnir.register() is True
        assert AttentionBackendEnum.CUSTOM.get_class() is gpu.MjolnirGpuAttentionBackend
        assert AttentionBackendEnum["MJOLNIR"].get_class() is gpu.MjolnirGpuAttentionBackend
        assert not AttentionBackendEnum.FLASH_ATTN.is_overridden()  # vLLM's default untouched
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()
        AttentionBackendEnum["MJOLNIR"].clear_override()


@pytest.mark.parametrize("starts,max_qlen,expected", [
    ([0, 1, 2, 3], 1, (1, 3, "")),
    ([0, 2, 4, 4, 4], 2, (2, 2, "")),  # trailing padding requests with no query tokens
    ([0, 1, 9, 10], 1, (None, 0, "differ")),  # a prefill beside decodes
    ([0, 3, 6], 2, (None, 0, "MJOLNIR_ATTN_MAX_QLEN")),
    ([0, 0, 0], 1, (None, 0, "no query")),
])
def test_uniform_query_len(starts, max_qlen, expected):
    q_len, reqs, why = gpu.uniform_query_len(torch.tensor(starts, dtype=torch.int32),
                                             len(starts) - 1, max_qlen)
    assert (q_len, reqs) == expected[:2]
    assert expected[2] in why


def common_metadata(seq_lens, q_len, block_table, causal=True, pad=0):
    """The fields of vLLM's CommonAttentionMetadata that plan_decode_step reads."""
    n = len(seq_lens)
    starts = [i * q_len for i in range(n + 1)] + [n * q_len] * pad
    return types.SimpleNamespace(
        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
        num_reqs=n + pad,
        seq_lens=torch.tensor(list(seq_lens) + [0] * pad, dtype=torch.int32),
        block_table_tensor=torch.cat(
            [block_table, torch.zeros(pad, block_table.shape[1], dtype=torch.int32)]),
        causal=causal)


def vllm_gpu_cache(gen, fmt, num_blocks, hk, block, d):
    """A cache as vLLM 0.32 hands a GPU layer: logical [blocks, Hk, block_size, 2 * D] over a
    physical [blocks, block_size, Hk, 2 * D] allocation (an NHD layout), K then V in a row."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.uint8
    physical = torch.zeros(num_blocks, block, hk, 2 * d, dtype=dtype)
    return physical.permute(0, 2, 1, 3)


def write_like_vllm(cache, k, v, slots, fmt, k_scale, v_scale):
    """vLLM's cache write (reshape_and_cache_flash): token t's K at [..., :D] and V at [..., D:]
    of its slot's row, fp8 as e4m3 codes of x / scale."""
    block = cache.shape[2]
    d = k.shape[-1]
    for t, slot in enumerate(slots.tolist()):
        b, n = divmod(slot, block)
        if fmt == "bf16":
            cache[b, :, n, :d] = k[t].to(torch.bfloat16)
            cache[b, :, n, d:] = v[t].to(torch.bfloat16)
        else:
            cache[b, :, n, :d] = (k[t] / k_scale).to(torch.float8_e4m3fn).view(torch.uint8)
            cache[b, :, n, d:] = (v[t] / v_scale).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantized(cache, fmt, k_scale, v_scale):
    """[blocks, N, Hk, D] K and V pages of the cache, in float64, as vLLM stored them."""
    d = cache.shape[-1] // 2
    rows = cache if fmt == "bf16" else cache.view(torch.float8_e4m3fn)
    k = rows[..., :d].double() * (1.0 if fmt == "bf16" else k_scale)
    v = rows[..., d:].double() * (1.0 if fmt == "bf16" else v_scale)
    return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("q_len,pad", [(1, 0), (2, 2)])
def test_decode_step_over_vllms_cache_in_place(gen, fmt, q_len, pad):
    hk, group, d, block = 2, 4, 128, 16
    seq_lens = [37, 5, 80]
    pages = [(n + block - 1) // block for n in seq_lens]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=gen)[:sum(pages)].to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    slots, at = [], 0
    for i, (n, p) in enumerate(zip(seq_lens, pages)):
        block_table[i, :p] = order[at:at + p]
        at += p
        slots += [int(block_table[i, t // block]) * block + t % block for t in range(n)]
    tokens = sum(seq_lens)
    k = torch.randn(tokens, hk, d, generator=gen)
    v = torch.randn(tokens, hk, d, generator=gen)
    k_scale, v_scale = (0.02, 0.015) if fmt != "bf16" else (1.0, 1.0)
    cache = vllm_gpu_cache(gen, fmt, num_blocks, hk, block, d)
    write_like_vllm(cache, k, v, torch.tensor(slots), fmt, k_scale, v_scale)

    config = AttnConfig(max_qlen=2, q_dtype="fp32", p_dtype="fp32")
    meta = common_metadata(seq_lens, q_len, block_table, pad=pad)
    step, why = gpu.plan_decode_step(meta, (hk * group, hk), config, backend="cpu")
    assert why == "" and step.query_rows() == len(seq_lens) * q_len
    q = torch.randn(len(seq_lens) * q_len, hk * group, d, generator=gen)
    out = torch.zeros_like(q)
    step.attend(out, q, gpu.cache_view(cache, d), torch.tensor([k_scale]),
                torch.tensor([v_scale]), gpu.layer_format(
                    "auto" if fmt == "bf16" else "fp8", torch.bfloat16), gpu.LAYOUT, d ** -0.5)
    k_pages, v_pages = dequantized(cache, fmt, k_scale, v_scale)
    ref = attention(q, k_pages, v_pages, block_table, torch.tensor(seq_lens, dtype=torch.int32),
                    q_len, True, None)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, f"{fmt} q_len {q_len}: relative error {err:.3g}"


def test_steps_that_do_not_qualify(gen):
    config = AttnConfig()
    table = torch.zeros(2, 4, dtype=torch.int32)
    mixed = common_metadata([10, 30], 1, table)
    mixed.query_start_loc_cpu = torch.tensor([0, 1, 9], dtype=torch.int32)
    assert gpu.plan_decode_step(mixed, (8, 2), config, backend="cpu")[0] is None
    dynamic = common_metadata([10, 30], 1, table, causal=torch.tensor([True, False]))
    assert "causality" in gpu.plan_decode_step(dynamic, (8, 2), config, backend="cpu")[1]
    cascade = common_metadata([10, 30], 1, table)
    assert "prefix" in gpu.plan_decode_step(cascade, (8, 2), config, 16, backend="cpu")[1]


def make_impl(head_size=128, kv_cache_dtype="auto", **fields):
    """The impl with the fields forward() and owner_reason() read, as vLLM's __init__ sets
    them (its __init__ reads the engine's config and the GPU's FlashAttention version)."""
    from vllm.v1.attention.backend import AttentionType
    impl = gpu.MjolnirGpuAttentionImpl.__new__(gpu.MjolnirGpuAttentionImpl)
    impl.__dict__.update(num_heads=8, num_kv_heads=2, head_size=head_size, scale=head_size ** -0.5,
                         alibi_slopes=None, sliding_window=(-1, -1), logits_soft_cap=0,
                         sinks=None, attn_type=AttentionType.DECODER,
                         kv_cache_dtype=kv_cache_dtype)
    impl.__dict__.update(fields)
    return impl


def test_layers_that_stay_vllms():
    from vllm.v1.attention.backend import AttentionType
    cache = torch.empty(4, 2, 16, 256, dtype=torch.bfloat16, device="meta")
    assert make_impl().owner_reason(cache) is None
    assert "sliding" in make_impl(sliding_window=(127, 0)).owner_reason(cache)
    assert "soft-cap" in make_impl(logits_soft_cap=30.0).owner_reason(cache)
    assert "ENCODER" in str(make_impl(attn_type=AttentionType.ENCODER).owner_reason(cache)).upper()
    assert "head size" in make_impl(head_size=96).owner_reason(
        torch.empty(4, 2, 16, 192, dtype=torch.bfloat16, device="meta"))
    assert "dtype" in make_impl(kv_cache_dtype="fp8_ds_mla").owner_reason(cache)
    assert "block size" in make_impl().owner_reason(
        torch.empty(4, 2, 24, 256, dtype=torch.bfloat16, device="meta"))
    fp8 = torch.empty(4, 2, 16, 256, dtype=torch.uint8, device="meta")
    assert make_impl(kv_cache_dtype="fp8").owner_reason(fp8) is None


def test_forward_runs_the_plan_or_the_base_backend(gen, monkeypatch):
    """forward(): a step with a plan runs mjolnir over the layer's cache; a step without one
    (prefill, mixed) and a layer that does not qualify go to the base backend's forward."""
    calls = []
    monkeypatch.setattr(gpu._Impl, "forward", lambda self, *a, **k: calls.append("base"))
    impl = make_impl()
    hk, d, block = 2, 128, 16
    cache = vllm_gpu_cache(gen, "bf16", 6, hk, block, d)
    cache.normal_(generator=gen)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    meta = common_metadata([20, 9], 1, table)
    step, _ = gpu.plan_decode_step(meta, (8, hk), AttnConfig(q_dtype="fp32", p_dtype="fp32"),
                                   backend="cpu")
    layer = types.SimpleNamespace()
    q = torch.randn(2, 8, d, generator=gen)
    out = torch.zeros(2, 8 * d)
    impl.forward(layer, q, None, None, cache, types.SimpleNamespace(mjolnir_step=step), out)
    k_pages, v_pages = dequantized(cache, "bf16", 1.0, 1.0)
    ref = attention(q, k_pages, v_pages, table, torch.tensor([20, 9], dtype=torch.int32), 1,
                    True, None)
    assert ((out.view(2, 8, d).double() - ref).norm() / ref.norm()).item() < 1e-5
    assert calls == []
    impl.forward(layer, q, None, None, cache,
                 types.SimpleNamespace(mjolnir_step=None, mjolnir_skip="prefill"), out)
    sliding = make_impl(sliding_window=(63, 0))
    sliding.forward(layer, q, None, None, cache, types.SimpleNamespace(mjolnir_step=step), out)
    assert calls == ["base", "base"]

    # A step mjolnir refuses (here: planned for other heads) goes to the base backend and the
    # layer stays there, instead of an exception ending the engine.
    other = make_impl()
    wrong, _ = gpu.plan_decode_step(meta, (8, 1), AttnConfig(q_dtype="fp32", p_dtype="fp32"),
                                    backend="cpu")
    other.forward(layer, q, None, None, cache, types.SimpleNamespace(mjolnir_step=wrong), out)
    other.forward(layer, q, None, None, cache, types.SimpleNamespace(mjolnir_step=step), out)
    assert calls == ["base", "base", "base", "base"]


def test_scales_stay_where_the_cache_is():
    """The scales a layer hands the op are tensors on the cache's device (which the CUDA kernels
    read in place, with no copy a call would wait for): vLLM's own fp8 scale tensors when the
    layer has them there, else tensors of its floats made once; ones for bf16."""
    impl = make_impl(kv_cache_dtype="fp8")
    device = torch.device("cpu")
    k, v = torch.tensor([0.5]), torch.tensor([0.25])
    layer = types.SimpleNamespace(_k_scale=k, _v_scale=v, _k_scale_float=0.5,
                                  _v_scale_float=0.25)
    ks, vs = impl._scales(layer, "fp8_e4m3", device)
    assert ks is k and vs is v
    floats_only = types.SimpleNamespace(_k_scale_float=0.125, _v_scale_float=2.0)
    ks, vs = impl._scales(floats_only, "fp8_e4m3", device)
    assert ks.device == device and ks.dtype == torch.float32
    assert ks.tolist() == [0.125] and vs.tolist() == [2.0]
    assert impl._scales(floats_only, "fp8_e4m3", device)[0] is ks  # made once
    wrong_dtype = types.SimpleNamespace(_k_scale=k.double(), _v_scale=v.double(),
                                        _k_scale_float=0.5, _v_scale_float=0.25)
    assert impl._scales(wrong_dtype, "fp8_e4m3", device)[0].tolist() == [0.5]
    ks, vs = make_impl()._scales(types.SimpleNamespace(), "bf16", device)
    assert ks.tolist() == [1.0] and vs.tolist() == [1.0] and ks.device == device


def test_cuda_graph_support_is_declared_only_when_asked():
    """MJOLNIR_ATTN_CUDA_GRAPHS off: no support (each step's grids are its plan's). On: a
    decode-only backend's, uniform batches where decode steps may have several query tokens,
    never more than the base backend's."""
    from vllm.v1.attention.backend import AttentionCGSupport as CG
    on = AttnConfig(cuda_graphs=True)
    assert gpu.cudagraph_support(AttnConfig(), CG.ALWAYS) == CG.NEVER
    assert gpu.cudagraph_support(on, CG.ALWAYS) == CG.UNIFORM_SINGLE_TOKEN_DECODE
    assert gpu.cudagraph_support(AttnConfig(cuda_graphs=True, max_qlen=3), CG.ALWAYS) == \
        CG.UNIFORM_BATCH
    assert gpu.cudagraph_support(AttnConfig(cuda_graphs=True, max_qlen=3),
                                 CG.UNIFORM_SINGLE_TOKEN_DECODE) == CG.UNIFORM_SINGLE_TOKEN_DECODE
    assert gpu.cudagraph_support(on, CG.NEVER) == CG.NEVER


def test_graph_buffers_need_the_cuda_backend_and_a_device():
    if mjolnir.has_cuda and torch.cuda.is_available():
        pytest.skip("a GPU is visible (test_cuda_ops.py tests the graph buffers on it)")
    missing = "no CUDA device is visible" if mjolnir.has_cuda else \
        "this build of mjolnir has no CUDA backend"
    with pytest.raises(ValueError, match=f"GraphBuffers: {missing}"):
        torch.classes.mjolnir.GraphBuffers(4, 8, 1, 8, 2, 128, 16, 16, 64, 0)


def test_graph_buffers_come_from_the_first_eager_step(gen, monkeypatch, caplog):
    """With MJOLNIR_ATTN_CUDA_GRAPHS the builder's slot gets graph buffers from a layer's first
    eager decode step: sized from the slot (vLLM's max_num_seqs and max_model_len) and that
    layer's cache and heads, made once per q_len. While a graph captures, a step that was not
    planned into them goes to the base backend, whose kernels the graph can hold. Buffers that
    cannot be made are remembered as such, and steps stay eager."""
    calls = []
    monkeypatch.setattr(gpu._Impl, "forward", lambda self, *a, **k: calls.append("base"))
    made = []

    class FakeBuffers:
        def __init__(self, *args):
            made.append(args)
            self.args = args

        def max_rows(self):
            return self.args[0] * self.args[2]

        def describe(self):
            return "fake buffers"

    monkeypatch.setattr(torch.classes.mjolnir, "GraphBuffers", FakeBuffers)
    hk, d, block = 2, 128, 16
    cache = vllm_gpu_cache(gen, "bf16", 6, hk, block, d)
    cache.normal_(generator=gen)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    slot = gpu.GraphSlot(max_seqs=4, max_model_len=100)
    step, _ = gpu.plan_decode_step(common_metadata([20, 9], 1, table), (8, hk),
                                   AttnConfig(q_dtype="fp32", p_dtype="fp32"), backend="cpu",
                                   graphs=slot)
    assert step.graph_rows() == 0  # no buffers yet: planned for itself
    meta = types.SimpleNamespace(mjolnir_step=step, mjolnir_graph_slot=slot)
    impl, layer = make_impl(), types.SimpleNamespace()
    q, out = torch.randn(2, 8, d, generator=gen), torch.zeros(2, 8 * d)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    impl.forward(layer, q, None, None, cache, meta, out)
    assert calls == ["base"] and made == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with caplog.at_level("INFO", logger="vllm.mjolnir"):
        impl.forward(layer, q, None, None, cache, meta, out)
        impl.forward(layer, q, None, None, cache, meta, out)
    assert calls == ["base"]
    # max_seqs, pages of max_model_len, q_len, Hq, Hk, D, max_splits, block size, pool, device
    assert made == [(4, 7, 1, 8, 2, 128, 16, 16, 6, 0)]
    assert set(slot.buffers) == {1} and slot.buffers[1].max_rows() == 4
    assert "CUDA-graph buffers" in caplog.text and "fake buffers" in caplog.text

    # Buffers that cannot be made: a warning, once; later steps plan for themselves.
    def refuse(*args):
        raise ValueError("max_seqs: 0 is outside [1, 65536]")
    monkeypatch.setattr(torch.classes.mjolnir, "GraphBuffers", refuse)
    slot = gpu.GraphSlot(max_seqs=0, max_model_len=100)
    meta = types.SimpleNamespace(mjolnir_step=step, mjolnir_graph_slot=slot)
    with caplog.at_level("WARNING", logger="vllm.mjolnir"):
        impl.forward(layer, q, None, None, cache, meta, out)
        impl.forward(layer, q, None, None, cache, meta, out)
    assert slot.buffers == {1: None}
    assert caplog.text.count("no CUDA-graph buffers") == 1
    again, _ = gpu.plan_decode_step(common_metadata([20, 9], 1, table), (8, hk),
                                    AttnConfig(q_dtype="fp32", p_dtype="fp32"), backend="cpu",
                                    graphs=slot)
    assert again.graph_rows() == 0

"""torch.ops.mjolnir on CUDA tensors: decode against the plain PyTorch reference and the CPU
backend on the same cache, write_kv against the CPU write_kv byte for byte, and the device checks.
They need a GPU and a build with the CUDA backend (MJOLNIR_PYTHON_CUDA=ON); without either they
skip, saying which is missing. scripts/device-check.sh builds that and runs them on the GPU
machine."""

from __future__ import annotations

import pytest
import torch

import mjolnir
from _reference import FORMATS, LAYOUTS, attention, dequantized_cache
from test_ops import GRANULARITIES, Problem, emulator_bound, rel_err


def _missing() -> str:
    if not mjolnir.has_cuda:
        return "this build of mjolnir has no CUDA backend (MJOLNIR_PYTHON_CUDA=ON builds it)"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return ""


pytestmark = pytest.mark.skipif(bool(_missing()), reason=_missing() or "runs")


def on_cuda(p: Problem) -> Problem:
    """The problem's Q and cache moved to the GPU (block table, lengths and scales stay on the
    host, where the plan is made)."""
    p.q = p.q.cuda()
    p.kv_cache = p.kv_cache.cuda()
    return p


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_decode_matches_reference_and_cpu(gen, fmt, q_len):
    layout = LAYOUTS[(FORMATS.index(fmt) + q_len) % len(LAYOUTS)]
    granularity = GRANULARITIES[(FORMATS.index(fmt) + q_len) % 3]
    p = Problem(gen, fmt, layout, q_len, granularity, d=128, max_len=300)
    on_cpu = p.decode()
    ref = p.reference()
    on_cuda(p)
    out = p.decode()
    assert out.device.type == "cuda" and out.shape == p.q.shape
    out = out.cpu()
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < 1e-5, f"{fmt} {layout} q_len={q_len} {granularity}: relative error {err:.3g}"
    assert rel_err(out, on_cpu.to(torch.float64)) < 1e-5


@pytest.mark.parametrize("q_mode,p_mode", [("bf16", "fp32"), ("fp8", "fp32"), ("fp32", "bf16"),
                                           ("fp8", "fp8")])
def test_cuda_numerics_modes_match_emulator(gen, q_mode, p_mode):
    p = Problem(gen, "fp8_e4m3", "B2NHD", 4, "channel", d=128, max_len=300)
    emulated = p.decode(q_mode=q_mode, p_mode=p_mode, backend="reference")
    on_cuda(p)
    out = p.decode(q_mode=q_mode, p_mode=p_mode).cpu()
    assert rel_err(out, emulated.to(torch.float64)) < emulator_bound(q_mode, p_mode)


def test_cuda_split_kv_and_decode_into(gen):
    """Long sequences cut into chunks (0: as many as fill the GPU), and decode_into a strided
    bf16 output on the device."""
    p = Problem(gen, "nvfp4", "BHN2D", 1, "head", d=128, max_len=3000, page_size=32)
    ref = p.reference()
    on_cuda(p)
    for splits in (0, 1, 4):
        assert rel_err(p.decode(max_splits=splits).cpu(), ref) < 1e-5
    wide = torch.full((p.q.shape[0], p.q.shape[1] * 2, p.q.shape[2]), float("nan"),
                      dtype=torch.bfloat16, device="cuda")
    view = wide[:, 1::2, :]
    torch.ops.mjolnir.decode_into(view, p.q, p.kv_cache, p.block_table, p.seq_lens, p.k_scale,
                                  p.v_scale, p.fmt, 1, p.layout)
    assert rel_err(view.float().cpu(), ref) < 1e-2
    assert torch.isnan(wide[:, 0::2]).all()  # the rest untouched


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_write_kv_matches_cpu(gen, fmt):
    """The device write_kv stores the same bytes as the host one, into every slot it is given
    and nowhere else (negative slots skipped)."""
    layout = LAYOUTS[FORMATS.index(fmt) % len(LAYOUTS)]
    granularity = GRANULARITIES[FORMATS.index(fmt) % 3]
    p = Problem(gen, fmt, layout, 1, granularity, d=128)
    pool = torch.randint(0, 256, p.kv_cache.view(torch.uint8).shape, generator=gen,
                         dtype=torch.uint8)
    slots = p.slots.clone()
    slots[::7] = -1
    host = pool.clone()
    torch.ops.mjolnir.write_kv(p.k, p.v, host, slots, p.k_scale, p.v_scale, fmt, layout)
    device = pool.cuda()
    torch.ops.mjolnir.write_kv(p.k.cuda(), p.v.cuda(), device, slots.cuda(), p.k_scale,
                               p.v_scale, fmt, layout)
    torch.cuda.synchronize()
    assert not torch.equal(host, pool)  # something was written
    differ = (device.cpu() != host).nonzero()
    assert differ.numel() == 0, f"{fmt}: {differ.shape[0]} bytes differ, first at {differ[0]}"


def test_cuda_tensors_on_mixed_devices_are_rejected(gen):
    p = Problem(gen, "fp8_e4m3", "2BNHD", 1, "head")
    q = p.q.cuda()
    with pytest.raises(ValueError, match="kv_cache: on cpu, but q is on cuda"):
        torch.ops.mjolnir.decode(q, p.kv_cache, p.block_table, p.seq_lens, p.k_scale,
                                 p.v_scale, p.fmt, 1, p.layout)
    with pytest.raises(ValueError, match="kv_cache: on cpu, but key is on cuda"):
        torch.ops.mjolnir.write_kv(p.k.cuda(), p.v.cuda(), p.kv_cache, p.slots.cuda(),
                                   p.k_scale, p.v_scale, p.fmt, p.layout)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_cuda_plan_once_over_a_vllm_gpu_cache(gen, fmt):
    """What the vLLM GPU backend (mjolnir/vllm_gpu_backend.py) does each decode step, without
    vLLM (no GPU machine has it): vLLM 0.32's logical [blocks, Hk, block_size, 2 * D] cache
    over a permuted physical allocation, read in place as BHN2D, one plan_step for the step
    and one Step.attend per layer on CUDA tensors, against the float64 reference."""
    hk, group, d, block = 2, 4, 128, 16
    seq_lens = [300, 17, 1000]
    pages = [(n + block - 1) // block for n in seq_lens]
    num_blocks = sum(pages) + 5
    order = torch.randperm(num_blocks, generator=gen)[:sum(pages)].to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = order[at:at + p]
        at += p
    k_scale, v_scale = (0.03, 0.02) if fmt != "bf16" else (1.0, 1.0)
    step = torch.ops.mjolnir.plan_step(torch.tensor(seq_lens, dtype=torch.int32), table, None,
                                       1, hk * group, hk, True, "fp32", "fp32", 0, 0, "cuda")
    for layer in range(2):
        values = torch.randn(num_blocks, block, hk, 2 * d, generator=gen)
        if fmt == "bf16":
            physical = values.to(torch.bfloat16)
            k_pages, v_pages = physical[..., :d].double(), physical[..., d:].double()
        else:
            codes = torch.cat([values[..., :d] / k_scale, values[..., d:] / v_scale], -1)
            physical = codes.to(torch.float8_e4m3fn).view(torch.uint8)
            f = physical.view(torch.float8_e4m3fn).double()
            k_pages, v_pages = f[..., :d] * k_scale, f[..., d:] * v_scale
        cache = physical.cuda().permute(0, 2, 1, 3)  # logical [blocks, Hk, block, 2D], NHD
        q = torch.randn(len(seq_lens), hk * group, d, generator=gen)
        out = torch.full((len(seq_lens), hk * group, d), float("nan"), device="cuda",
                         dtype=torch.bfloat16)
        step.attend(out, q.cuda().to(torch.bfloat16), cache.unflatten(-1, (2, d)),
                    torch.tensor([k_scale]), torch.tensor([v_scale]), fmt, "BHN2D", d ** -0.5)
        ref = attention(q.to(torch.bfloat16).float(), k_pages, v_pages, table,
                        torch.tensor(seq_lens, dtype=torch.int32), 1)
        err = rel_err(out.float().cpu(), ref)
        assert err < 1e-2, f"{fmt} layer {layer}: relative error {err:.3g}"


def plan_on_cuda(p: Problem):
    """A Step for the problem's sequences on the "cuda" backend (planned on the host)."""
    hq, hk = p.q.shape[1], p.kv_cache.shape[p.layout.index("H")]
    return torch.ops.mjolnir.plan_step(p.seq_lens, p.block_table, None, p.q_len, hq, hk, True,
                                       "fp32", "fp32", 0, 0, "cuda")


def test_cuda_attend_only_enqueues(gen):
    """A layer's attend on CUDA tensors with device scales launches its kernels on torch's
    current stream and returns without waiting for the device: queued behind a long sleep
    kernel, the stream is still busy when three layers' calls have returned, and once it
    drains every layer's output is right."""
    p = Problem(gen, "fp8_e4m3", "BHN2D", 1, "head", d=128, max_len=2000)
    step = plan_on_cuda(p)
    cache, ks, vs = p.kv_cache.cuda(), p.k_scale.cuda(), p.v_scale.cuda()
    layers = []
    for _ in range(3):  # each layer its own queries
        p.q = torch.randn(p.q.shape, generator=gen)
        layers.append((p.reference(), p.q.cuda(), torch.full(p.q.shape, float("nan"),
                                                             device="cuda")))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of one SM's clock
    for _, q, out in layers:
        step.attend(out, q, cache, ks, vs, p.fmt, p.layout, 0.0)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "attend waited for the device"
    for i, (ref, _, out) in enumerate(layers):
        err = rel_err(out.cpu(), ref)
        assert err < 1e-5, f"layer {i}: relative error {err:.3g}"


def test_cuda_steps_share_the_step_buffer(gen):
    """Steps of different sequences planned one after the other share the device step buffer:
    each layer's attend runs its own step's plan even when another step's was uploaded since
    (A, B, A, B), and a step larger than the buffer grows it."""
    small = Problem(gen, "bf16", "2BNHD", 1, "tensor", d=128, max_len=200, num_seqs=2)
    large = Problem(gen, "bf16", "2BNHD", 1, "tensor", d=128, max_len=3000, num_seqs=6)
    steps = [(plan_on_cuda(p), p, p.reference()) for p in (small, large, small, large)]
    for step, p, ref in steps:
        out = torch.empty(p.q.shape, device="cuda")
        step.attend(out, p.q.cuda(), p.kv_cache.cuda(), p.k_scale.cuda(), p.v_scale.cuda(),
                    p.fmt, p.layout, 0.0)
        err = rel_err(out.cpu(), ref)
        assert err < 1e-5, f"{p.seq_lens.tolist()}: relative error {err:.3g}"


def graph_buffers(p: Problem, max_seqs: int, max_splits: int = 16):
    """Graph buffers for steps of up to max_seqs of the problem's sequences over its cache."""
    hq, layout = p.q.shape[1], p.layout
    hk, page_size = p.kv_cache.shape[layout.index("H")], p.kv_cache.shape[layout.index("N")]
    num_pages = p.kv_cache.shape[layout.index("B")]
    return torch.classes.mjolnir.GraphBuffers(max_seqs, p.block_table.shape[1], p.q_len, hq, hk,
                                              p.d, max_splits, page_size, num_pages,
                                              torch.cuda.current_device())


@pytest.mark.parametrize("fmt,layout,q_len", [("fp8_e4m3", "BHN2D", 1), ("nvfp4", "2BNHD", 1),
                                              ("bf16", "B2NHD", 4)])
def test_cuda_graph_replays_changing_plans(gen, fmt, layout, q_len):
    """What vLLM's full CUDA graphs do with the GPU backend (MJOLNIR_ATTN_CUDA_GRAPHS=1): two
    layers' attend over a step planned into graph buffers, captured once on bf16 tensors of
    the buffers' rows, then replayed over steps of other lengths, another order of the
    sequences' pages, fewer sequences (the rest padding) and a single token, each planned (its
    upload) before its replay; every step's rows against the float64 reference."""
    p = Problem(gen, fmt, layout, q_len, "head", num_seqs=6, hk=2, group=4, d=128,
                max_len=1500)
    k_pages, v_pages = dequantized_cache(p.kv_cache, p.layout, fmt, p.d, p.k_scale, p.v_scale)
    cache, ks, vs = p.kv_cache.cuda(), p.k_scale.cuda().float(), p.v_scale.cuda().float()
    buffers = graph_buffers(p, max_seqs=6)
    assert buffers.max_rows() == 6 * q_len and "6 sequences" in buffers.describe()
    hq, rows = p.q.shape[1], 6 * q_len
    layers = 2
    q_static = torch.zeros(layers, rows, hq, p.d, dtype=torch.bfloat16, device="cuda")
    o_static = torch.zeros(layers, rows, hq, p.d, dtype=torch.bfloat16, device="cuda")

    def plan(lens, table):
        return torch.ops.mjolnir.plan_step(lens, table, None, q_len, hq, 2, True, "fp32",
                                           "fp32", 0, 0, "cuda", buffers)

    def attend_layers(step):
        for layer in range(layers):
            step.attend(o_static[layer], q_static[layer], cache, ks, vs, fmt, layout, 0.0)

    def check(lens, table, what):
        n = lens.numel() * q_len
        for layer in range(layers):
            q = q_static[layer, :n].float().cpu()
            ref = attention(q, k_pages, v_pages, table, lens, q_len)
            err = rel_err(o_static[layer, :n].float().cpu(), ref)
            assert err < 1e-2, f"{fmt} {what}, layer {layer}: relative error {err:.3g}"

    def new_queries():
        q_static.copy_(torch.randn(q_static.shape, generator=gen).to(torch.bfloat16))

    # The first step, run eagerly (vLLM warms up before it captures), then captured.
    new_queries()
    step = plan(p.seq_lens, p.block_table)
    assert step.graph_rows() == rows and step.q_len() == q_len
    attend_layers(step)
    torch.cuda.synchronize()
    check(p.seq_lens, p.block_table, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend_layers(step)

    order = torch.randperm(6, generator=gen)
    shorter = torch.stack([torch.randint(q_len, int(n) + 1, (), generator=gen)
                           for n in p.seq_lens]).to(torch.int32)
    steps = [
        ("shorter, reordered", shorter[order], p.block_table[order]),
        ("3 of 6 sequences", p.seq_lens[[5, 0, 2]], p.block_table[[5, 0, 2]]),
        ("one sequence of q_len tokens", torch.tensor([q_len], dtype=torch.int32),
         p.block_table[[3]]),
        ("the captured step again", p.seq_lens, p.block_table),
    ]
    for what, lens, table in steps:
        new_queries()
        o_static.fill_(float("nan"))
        step = plan(lens.contiguous(), table.contiguous())  # uploads on the current stream
        graph.replay()
        torch.cuda.synchronize()
        check(lens, table, what)


def test_cuda_graph_buffers_refuse_what_a_graph_cannot_replay(gen):
    """A step that does not fit the buffers, host scales (a graph cannot re-read host memory),
    more query rows than the buffers hold, and a plan made while the stream captures: each a
    ValueError naming what is wrong."""
    p = Problem(gen, "fp8_e4m3", "BHN2D", 1, "head", num_seqs=4, hk=2, group=4, d=128,
                max_len=400)
    hq = p.q.shape[1]
    buffers = graph_buffers(p, max_seqs=2)

    def plan(lens, table, q_len=1):
        return torch.ops.mjolnir.plan_step(lens, table, None, q_len, hq, 2, True, "fp32",
                                           "fp32", 0, 0, "cuda", buffers)

    with pytest.raises(ValueError, match="sequences exceed the step capacity of 2"):
        plan(p.seq_lens, p.block_table)
    with pytest.raises(ValueError, match="made for steps of q_len 1"):
        plan(p.seq_lens[:2], p.block_table[:2], q_len=2)
    step = plan(p.seq_lens[:2], p.block_table[:2])
    cache = p.kv_cache.cuda()
    q = p.q[:2].cuda()
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="k_scale: .* graph buffers takes"):
        step.attend(out, q, cache, p.k_scale, p.v_scale.cuda(), p.fmt, p.layout, 0.0)
    too_many = torch.zeros(3, hq, p.d, device="cuda")
    with pytest.raises(ValueError, match="hold at most 2 rows"):
        step.attend(torch.empty_like(too_many), too_many, cache, p.k_scale.cuda(),
                    p.v_scale.cuda(), p.fmt, p.layout, 0.0)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="capturing a CUDA graph"):
        with torch.cuda.graph(graph):
            plan(p.seq_lens[:2], p.block_table[:2])

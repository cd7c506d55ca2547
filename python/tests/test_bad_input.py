"""Bad arguments raise ValueError whose message starts with (or names) the argument."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

import mjolnir  # noqa: F401
from _reference import make_cache

HK, HQ, D, P, PAGES = 2, 4, 64, 16, 12


@pytest.fixture
def step(gen):
    cache = make_cache("2BNHD", "fp8_e4m3", PAGES, P, HK, D)
    k = torch.randn(40, HK, D, generator=gen)
    v = torch.randn(40, HK, D, generator=gen)
    scale = torch.tensor([0.02])
    torch.ops.mjolnir.write_kv(k, v, cache, torch.arange(40), scale, scale, "fp8_e4m3")
    args = dict(
        q=torch.randn(2, HQ, D, generator=gen), kv_cache=cache,
        block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
        seq_lens=torch.tensor([40, 7], dtype=torch.int32), k_scale=scale, v_scale=scale,
        kv_format="fp8_e4m3", q_len=1, layout="2BNHD")
    assert torch.isfinite(torch.ops.mjolnir.decode(**args)).all()  # the good call works
    return args


def decode_with(args, **changes):
    return torch.ops.mjolnir.decode(**{**args, **changes})


@pytest.mark.parametrize("change,pattern", [
    (dict(kv_format="fp7_e3m3"), r"^kv_format: 'fp7_e3m3' is not one of"),
    (dict(layout="BXN2D"), r"^layout: 'BXN2D'"),
    (dict(q_len=2), r"^q: 2 token rows, but 2 sequences x q_len 2 = 4"),
    (dict(q=torch.randn(2, HQ, 96)), r"^kv_cache: the last dimension holds 64 bytes"),
    (dict(q=torch.randn(2, HQ, 40)), r"^q: head size \(last dimension\) 40"),
    (dict(q=torch.randn(2, HQ, D).to(torch.int32)), r"^q: expected float32, bfloat16"),
    (dict(q=torch.randn(2 * HQ * D)), r"^q: expected 3 dimensions"),
    (dict(block_table=torch.tensor([[0, 1, 2], [3, 4, 5]])), r"^block_table: expected dtype "
                                                             r"torch.int32, got torch.int64"),
    (dict(block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32)),
     r"^seq_lens: 2 sequences, but block_table has 1 rows"),
    (dict(seq_lens=torch.tensor([40, 7])), r"^seq_lens: expected dtype torch.int32"),
    (dict(v_scale=torch.tensor([0.1, 0.2])), r"^v_scale: 2 values, but k_scale has 1"),
    (dict(k_scale=torch.tensor([1], dtype=torch.int32)), r"^k_scale: expected a float tensor"),
    (dict(kv_cache=torch.zeros(2, PAGES, P, HK, D)), r"^kv_cache: dtype torch.float32"),
    (dict(kv_cache=torch.zeros(2, PAGES, P, HK, D, dtype=torch.float8_e5m2)),
     r"^kv_format: 'fp8_e4m3' does not match the cache dtype torch.float8_e5m2"),
    (dict(kv_cache=torch.zeros(PAGES, P, HK, D, dtype=torch.uint8)),
     r"^kv_cache: expected 5 dimensions \[2, B, N, H, D\]"),
    (dict(kv_cache=torch.zeros(3, PAGES, P, HK, D, dtype=torch.uint8)),
     r"^kv_cache: dimension 0 \(K/V\) of layout 2BNHD has size 3"),
    (dict(kv_cache=torch.zeros(2, PAGES, 12, HK, D, dtype=torch.uint8)),
     r"^kv_cache.geometry.page_size: 12"),
    (dict(kv_cache=torch.zeros(2, 0, P, HK, D, dtype=torch.uint8)),
     r"^kv_cache: dimension 1 \(pages\) of layout 2BNHD has size 0"),
    (dict(kv_cache=torch.zeros(2, PAGES, P, HK, 2 * D, dtype=torch.uint8)[..., ::2]),
     r"^kv_cache: the last dimension \(a token's row\) must be contiguous"),
    (dict(q_mode="int4"), r"^q_mode: 'int4' is not one of fp32, bf16, fp8, int8"),
    (dict(p_mode="fp4"), r"^p_mode: 'fp4' is not one of fp32, bf16, fp8"),
    (dict(backend="tpu"), r"^backend: 'tpu' is not one of"),
])
def test_decode_rejects(step, change, pattern):
    with pytest.raises(ValueError, match=pattern):
        decode_with(step, **change)


# The bad-input table every binding runs (tests/bad_inputs.json; the C++ and C APIs run it in
# tests/test_decode_validation.cc and tests/test_capi.cc): its step, built as the ops take it, and
# each case's change made where the ops take that argument.
_TABLE = json.loads((pathlib.Path(__file__).parents[2] / "tests" / "bad_inputs.json").read_text())


def _table_number(value):
    return math.nan if value == "nan" else value


@pytest.fixture
def table_step(gen):
    s = _TABLE["step"]
    hk, hq, d, page = s["num_kv_heads"], s["num_q_heads"], s["head_dim"], s["page_size"]
    seqs, per_seq = len(s["seq_lens"]), s["pages_per_seq"]
    assert s["granularity"] == "tensor"  # one K and one V scale
    cache = make_cache("2BNHD", s["format"], seqs * per_seq, page, hk, d)
    block_table = torch.arange(seqs * per_seq, dtype=torch.int32).reshape(seqs, per_seq)
    scale = torch.tensor([0.02])
    for b, n in enumerate(s["seq_lens"]):
        slots = block_table[b].repeat_interleave(page)[:n].long() * page + torch.arange(n) % page
        k, v = (torch.randn(n, hk, d, generator=gen) for _ in range(2))
        torch.ops.mjolnir.write_kv(k, v, cache, slots, scale, scale, s["format"])
    args = dict(q=torch.randn(seqs * s["q_len"], hq, d, generator=gen), kv_cache=cache,
                block_table=block_table, seq_lens=torch.tensor(s["seq_lens"], dtype=torch.int32),
                k_scale=scale, v_scale=scale, kv_format=s["format"], q_len=s["q_len"],
                layout="2BNHD")
    assert torch.isfinite(torch.ops.mjolnir.decode(**args)).all()  # the step itself is good
    return args


@pytest.mark.parametrize("bad", _TABLE["cases"], ids=[c["case"] for c in _TABLE["cases"]])
def test_bad_input_table(table_step, bad):
    args = dict(table_step)
    num_pages = args["kv_cache"].shape[1]
    named = {"num_pages": num_pages,
             "pages_plus_one": args["block_table"].shape[1] * _TABLE["step"]["page_size"] + 1}
    for key, value in bad["change"].items():
        if key == "q_len":  # with the q rows it implies, so that q_len itself is what is wrong
            args["q"] = torch.randn(args["q"].shape[0] // args["q_len"] * value, *args["q"].shape[1:])
            args[key] = value
        elif key == "threads":
            args[key] = value
        elif key == "num_q_heads":
            q = args["q"]
            args["q"] = torch.randn(q.shape[0], value, q.shape[2])
        elif key == "softmax_scale":
            args[key] = _table_number(value)
        elif key in ("block_table", "seq_lens"):
            *index, entry = value
            tensor = args[key].clone()
            tensor[tuple(index)] = named.get(entry, entry)
            args[key] = tensor
        elif key in ("k_scale", "v_scale"):
            args[key] = torch.tensor([_table_number(x) for x in value])
        else:
            pytest.fail(f"bad_inputs.json: no op argument for {key!r}")
    with pytest.raises(ValueError) as error:
        torch.ops.mjolnir.decode(**args)
    for name in bad["names"]:
        assert name in str(error.value)


def test_decode_rejects_overlapping_q_rows(step):
    q = torch.randn(1, HQ, D).expand(2, HQ, D)  # token stride 0
    with pytest.raises(ValueError, match=r"^q.token_stride: 0"):
        decode_with(step, q=q)


def test_decode_into_rejects_bad_output(step):
    with pytest.raises(ValueError, match=r"^output: shape \(2, 4, 32\), expected \(2, 4, 64\)"):
        torch.ops.mjolnir.decode_into(torch.empty(2, HQ, 32), **step)


def test_decode_rejects_device_mismatch(step):
    # A meta tensor among the inputs dispatches to the Meta kernel, which must not return an
    # uninitialized output for the real ones (nor skip a write) but name the odd argument.
    meta_cache = torch.empty(2, PAGES, P, HK, D, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=r"^q: on cpu, but other arguments are on meta"):
        decode_with(step, kv_cache=meta_cache)
    with pytest.raises(ValueError, match=r"^output: on cpu, but other arguments are on meta"):
        torch.ops.mjolnir.decode_into(torch.empty(2, HQ, D), **{**step, "kv_cache": meta_cache})
    k = torch.randn(3, HK, D)
    with pytest.raises(ValueError, match=r"^key: on cpu, but other arguments are on meta"):
        torch.ops.mjolnir.write_kv(k, k, meta_cache, torch.arange(3), step["k_scale"],
                                   step["v_scale"], "fp8_e4m3")
    # All on meta: shapes only, as torch.compile's fake tensors see them.
    meta = {name: t.to("meta") if isinstance(t, torch.Tensor) else t for name, t in step.items()}
    assert torch.ops.mjolnir.decode(**meta).shape == step["q"].shape


@pytest.fixture
def write_args(step, gen):
    return dict(key=torch.randn(3, HK, D, generator=gen), value=torch.randn(3, HK, D, generator=gen),
                kv_cache=step["kv_cache"], slot_mapping=torch.tensor([40, 41, -1]),
                k_scale=step["k_scale"], v_scale=step["v_scale"], kv_format="fp8_e4m3",
                layout="2BNHD")


@pytest.mark.parametrize("change,pattern", [
    (dict(slot_mapping=torch.tensor([40, 192, 0])), r"^slot_mapping\[1\]: slot 192"),
    (dict(slot_mapping=torch.tensor([40, 41])), r"^slot_mapping: 2 slots, but key has 3 tokens"),
    (dict(slot_mapping=torch.tensor([40.0, 41.0, 42.0])), r"^slot_mapping: expected a 1-D int64"),
    (dict(value=torch.randn(3, HK, 32)), r"^value: shape \(3, 2, 32\), but key has"),
    (dict(key=torch.randn(3, 3, D), value=torch.randn(3, 3, D)),
     r"^key: 3 heads, but the cache has 2 KV heads"),
    (dict(kv_format="fp6_e2m3"), r"^kv_cache: the last dimension holds 64 bytes per token row, "
                                 r"but 64 channels of fp6_e2m3 take 48 bytes"),
    (dict(layout="B2NHD"), r"^kv_cache: dimension 1 \(K/V\) of layout B2NHD has size 12"),
    (dict(k_scale=torch.tensor([0.0])), r"^k_scale\[0\]: 0"),
])
def test_write_kv_rejects(write_args, change, pattern):
    before = write_args["kv_cache"].clone()
    with pytest.raises(ValueError, match=pattern):
        torch.ops.mjolnir.write_kv(**{**write_args, **change})
    assert torch.equal(before, write_args["kv_cache"])  # nothing written


@pytest.mark.parametrize("which,bad", [("key", float("nan")), ("value", float("inf"))])
def test_write_kv_rejects_non_finite(write_args, which, bad):
    before = write_args["kv_cache"].clone()
    write_args[which][1, 1, 17] = bad
    name = "k" if which == "key" else "v"
    with pytest.raises(ValueError, match=rf"^{name}\[1\]\[1\]\[17\] is (nan|inf|NaN|Inf)"):
        torch.ops.mjolnir.write_kv(**write_args)
    assert torch.equal(before, write_args["kv_cache"])


def test_plan_rejects(gen):
    with pytest.raises(ValueError, match=r"^seq_lens: expected dtype torch.int32"):
        torch.ops.mjolnir.plan(torch.tensor([3, 4]), 1, 2)
    with pytest.raises(ValueError, match=r"q_len"):
        torch.ops.mjolnir.plan(torch.tensor([3, 4], dtype=torch.int32), 0, 2)


_THREADS_CHILD = r"""
import resource, sys, torch, mjolnir
from _reference import make_cache
cache = make_cache("2BNHD", "bf16", 4, 16, 2, 64)
args = dict(q=torch.randn(1, 4, 64), kv_cache=cache, block_table=torch.tensor([[0, 1]], dtype=torch.int32),
            seq_lens=torch.tensor([20], dtype=torch.int32), k_scale=torch.ones(1),
            v_scale=torch.ones(1), kv_format="bf16", threads=512)
mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (128 << 20), resource.RLIM_INFINITY))
try:
    torch.ops.mjolnir.decode(**args)
except Exception as e:
    print(type(e).__name__, e)
    sys.exit(0)
print("no error")
"""


def test_threads_that_cannot_start_are_an_error_not_a_hang(tmp_path):
    """A CPU backend whose worker threads the system cannot start (no address space for their
    stacks, here: a child process capped 128 MiB above its mappings, asking for 512 threads) fails
    the call with an error that says so, and the process goes on; it used to hang."""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-c", _THREADS_CHILD], cwd=here, timeout=120,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "threads: the CPU backend could start only" in result.stdout, result.stdout

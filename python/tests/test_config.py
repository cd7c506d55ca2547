"""MJOLNIR_ATTN_* parsing (mjolnir.config) and the plugin entry point, without vLLM."""

from __future__ import annotations

import importlib.metadata

import pytest

import mjolnir
from mjolnir.config import ENV_VARS, AttnConfig


def test_defaults():
    assert AttnConfig.from_env({}) == AttnConfig()
    c = AttnConfig()
    assert (c.disable, c.fallback, c.q_dtype, c.p_dtype, c.max_splits, c.threads, c.kv_format,
            c.on_amx, c.cuda_graphs) == (False, True, "auto", "auto", 16, 0, "", "vllm", False)


def test_values():
    env = {"MJOLNIR_ATTN_DISABLE": "yes", "MJOLNIR_ATTN_FALLBACK": "0",
           "MJOLNIR_ATTN_Q_DTYPE": "FP8", "MJOLNIR_ATTN_P_DTYPE": "bf16",
           "MJOLNIR_ATTN_MAX_SPLITS": "32", "MJOLNIR_ATTN_THREADS": "3",
           "MJOLNIR_ATTN_KV_FORMAT": "FP4_E2M1", "MJOLNIR_ATTN_KV_SCALES": "s.json",
           "MJOLNIR_ATTN_KV_CALIBRATE": "yes", "MJOLNIR_ATTN_ON_AMX": "MJOLNIR",
           "MJOLNIR_ATTN_GPU_BASE": "FlashInfer", "MJOLNIR_ATTN_MAX_QLEN": "4",
           "MJOLNIR_ATTN_CUDA_GRAPHS": "on"}
    assert AttnConfig.from_env(env) == AttnConfig(
        disable=True, fallback=False, q_dtype="fp8", p_dtype="bf16", max_splits=32, threads=3,
        kv_format="fp4_e2m1", kv_scales="s.json", kv_calibrate="mjolnir-kv-amax.json",
        on_amx="mjolnir", gpu_base="flashinfer", max_qlen=4, cuda_graphs=True)
    assert AttnConfig.from_env({"MJOLNIR_ATTN_KV_CALIBRATE": "run/a.json"}).kv_calibrate == \
        "run/a.json"
    assert AttnConfig.from_env({"MJOLNIR_ATTN_KV_CALIBRATE": "0"}).kv_calibrate == ""
    assert set(env) == set(ENV_VARS)


@pytest.mark.parametrize("name,value,pattern", [
    ("MJOLNIR_ATTN_DISABLE", "maybe", "is not a boolean"),
    ("MJOLNIR_ATTN_FALLBACK", "2", "is not a boolean"),
    ("MJOLNIR_ATTN_Q_DTYPE", "int4", "is not one of auto, fp32, bf16, fp8, int8"),
    ("MJOLNIR_ATTN_P_DTYPE", "fp4", "is not one of auto, fp32, bf16, fp8"),
    ("MJOLNIR_ATTN_KV_FORMAT", "fp5", "is not one of bf16, fp16, fp8_e4m3"),
    ("MJOLNIR_ATTN_MAX_SPLITS", "many", "is not an integer"),
    ("MJOLNIR_ATTN_THREADS", "-1", r"-1 is outside \[0, 4096\]"),
    ("MJOLNIR_ATTN_ON_AMX", "yes", "is not one of vllm, mjolnir"),
    ("MJOLNIR_ATTN_GPU_BASE", "triton", "is not one of flash_attn, flashinfer"),
    ("MJOLNIR_ATTN_MAX_QLEN", "9", r"9 is outside \[1, 8\]"),
    ("MJOLNIR_ATTN_CUDA_GRAPHS", "full", "is not a boolean"),
])
def test_bad_values_name_the_variable(name, value, pattern):
    with pytest.raises(ValueError, match=rf"^{name}: .*{pattern}"):
        AttnConfig.from_env({name: value})


def test_register_disabled(monkeypatch):
    monkeypatch.setenv("MJOLNIR_ATTN_DISABLE", "1")
    assert mjolnir.register() is False


def test_register_rejects_bad_env(monkeypatch):
    monkeypatch.setenv("MJOLNIR_ATTN_Q_DTYPE", "fp16")
    with pytest.raises(ValueError, match="^MJOLNIR_ATTN_Q_DTYPE"):
        mjolnir.register()


def test_entry_point_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    found = [ep for ep in eps if ep.name == "mjolnir"]
    assert found and found[0].value == "mjolnir:register"
    assert found[0].load() is mjolnir.register


def test_formats_are_the_librarys():
    """config.FORMATS is read at plugin registration, before the extension loads, so it keeps its
    own list: it must be the library's format table (core/format_table.h), in its order, as must
    the tests' independent list."""
    from _reference import FORMATS as reference_formats
    from mjolnir.config import FORMATS

    assert FORMATS == tuple(mjolnir.formats())
    assert tuple(reference_formats) == tuple(mjolnir.formats())

"""The calibration flow without vLLM: amax recorded from K/V writes, the amax file, scales
from it (python -m mjolnir.calibrate), the scales file checked against a model, and the start-up
errors for each bad scales file class."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mjolnir
from mjolnir import calibrate


def test_recorder_to_scales_file(tmp_path, gen):
    amax_path = str(tmp_path / "amax.json")
    rec = calibrate.AmaxRecorder(amax_path)
    k = torch.randn(5, 2, 32, generator=gen)
    v = torch.randn(5, 2, 32, generator=gen) * 3
    slots = torch.tensor([0, 1, -1, 3, 4])  # the third token is not written, so not recorded
    k[2], v[2] = 100.0, -100.0
    # Out of model order on purpose: the file lists layers by the numbers in their names.
    rec.record("model.layers.10.attn", k, v, slots)
    rec.record("model.layers.9.attn", 2 * k, v, slots)
    rec.record("model.layers.9.attn", k, 2 * v, slots)  # a running maximum
    rec.flush()
    with open(amax_path) as f:
        recorded = json.load(f)
    assert [layer["name"] for layer in recorded["layers"]] == ["model.layers.9.attn",
                                                               "model.layers.10.attn"]
    written = torch.tensor([0, 1, 3, 4])
    want_k9 = (2 * k[written]).abs().amax(0).reshape(-1)
    want_v9 = (2 * v[written]).abs().amax(0).reshape(-1)
    assert torch.equal(torch.tensor(recorded["layers"][0]["k_amax"]), want_k9)
    assert torch.equal(torch.tensor(recorded["layers"][0]["v_amax"]), want_v9)

    out = str(tmp_path / "scales.json")
    proc = subprocess.run([sys.executable, "-m", "mjolnir.calibrate", amax_path, "--format",
                           "fp4_e2m1", "--headroom", "1.25", "--out", out],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    scales = calibrate.Scales(out)
    assert (scales.format, scales.granularity, scales.num_kv_heads, scales.head_dim) == \
        ("fp4_e2m1", "channel", 2, 32)
    # scale = amax / 6 * 1.25, rounded once to float32.
    want = (want_k9.double() / 6.0 * 1.25).float()
    assert torch.equal(scales.layers[0][0], want)
    scales.check(["a", "b"], 2, 32, "fp4_e2m1")


@pytest.mark.parametrize("change,message", [
    (dict(names=["a"]), "layers: 2 in the file, but the model has 1 layers on mjolnir"),
    (dict(heads=4), "num_kv_heads: 2 in the file, but the model's layers have 4"),
    (dict(d=64), "head_dim: 32 in the file, but the model's layers have 64"),
    (dict(fmt="nvfp4"), "format: fp4_e2m1 in the file, but the cache is nvfp4"),
])
def test_scales_for_another_model_are_refused(tmp_path, change, message):
    path = str(tmp_path / "amax.json")
    mjolnir._ext.write_amax_file(path, 2, 32, [("l0", [1.0] * 64, [2.0] * 64),
                                               ("l1", [3.0] * 64, [4.0] * 64)])
    out = str(tmp_path / "s.json")
    mjolnir._ext.calibrate(path, "fp4_e2m1", "channel", 1.0, out)
    scales = calibrate.Scales(out)
    args = dict(names=["a", "b"], heads=2, d=32, fmt="fp4_e2m1")
    args.update(change)
    with pytest.raises(ValueError, match=rf"^MJOLNIR_ATTN_KV_SCALES={out}: {message}"):
        scales.check(args["names"], args["heads"], args["d"], args["fmt"])


@pytest.mark.parametrize("content,message", [
    (None, "file not found"),
    ("{", "truncated"),
    ('{"mjolnir_scales_version": 7}', "mjolnir_scales_version: 7 is not supported"),
    ('{"mjolnir_scales_version": 1, "format": "fp5"}', "format: 'fp5' is not one of"),
])
def test_a_bad_scales_file_fails_registration(tmp_path, monkeypatch, content, message):
    """The plugin reads MJOLNIR_ATTN_KV_SCALES when vLLM loads it: a missing or malformed file
    stops the start-up with the file and the field named."""
    path = tmp_path / "kv_scales.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("MJOLNIR_ATTN_KV_SCALES", str(path))
    monkeypatch.delenv("MJOLNIR_ATTN_DISABLE", raising=False)
    calibrate._scales.clear()
    with pytest.raises(ValueError, match=message) as error:
        mjolnir.register()
    assert str(path) in str(error.value)


def test_calibrate_cli_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mjolnir.calibrate", str(tmp_path / "none.json"),
                           "--format", "fp6_e2m3", "--out", str(tmp_path / "o.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "none.json: file not found" in proc.stderr

"""End to end through vLLM's engine on CPU with a tiny random Llama written to a temporary
directory (no download): greedy generation with the plugin, for every KV format, against stock
vLLM with a bf16 cache, with calibrated scales for the low-bit formats; the calibration flow
(record amax while serving, convert, serve with the scales file); KV capacity per format; a
4096-token prompt's peak memory against stock's; a scales file for another model failing at
start-up. Slow (an engine start-up per run, about half
a minute), so it runs only with MJOLNIR_VLLM_E2E=1 and vLLM installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if __name__ != "__main__" and os.environ.get("MJOLNIR_VLLM_E2E") != "1":
    pytest.skip("set MJOLNIR_VLLM_E2E=1 to run vLLM end to end", allow_module_level=True)
if __name__ != "__main__":
    vllm = pytest.importorskip("vllm")

LAYERS = 2


def tiny_llama(path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # Head size 128 and GQA (4 query heads per KV head), as the serving shapes mjolnir targets.
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=128, max_position_embeddings=4608,
                         torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


def generate(model_dir, prompts, kv_cache_dtype, max_model_len=512, max_tokens=24):
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=max_model_len, block_size=32, max_num_seqs=4, seed=0,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                            ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    # Top-5 log-probabilities of each generated position: {token: logprob}.
    logprobs = [[{str(t): float(lp.logprob) for t, lp in step.items()}
                 for step in o.outputs[0].logprobs] for o in outs]
    cache = llm.llm_engine.vllm_config.cache_config
    return tokens, logprobs, (cache.num_gpu_blocks or 0) * cache.block_size


PROMPTS = [[1, 5, 9, 200, 17, 33, 4], [1] + list(range(40, 140)), [7] * 30]
LONG_PROMPT = [[(11 * i) % 500 + 1 for i in range(4096)]]


def run_in_subprocess(model_dir, env_extra, kv_cache_dtype="auto", expect_ok=True, long=False):
    """One engine per process: vLLM loads its plugins once per process."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               **env_extra)
    proc = subprocess.run([sys.executable, __file__, model_dir, kv_cache_dtype,
                           "long" if long else "short"], env=env, capture_output=True, text=True,
                          timeout=900)
    if not expect_ok:
        return proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["log"] = proc.stdout + proc.stderr
    return result


# Logprob agreement on the shared prefix with stock vLLM (bf16 cache, its own attention), per
# format. Both runs compute attention in fp32; every layer rounds its output to bf16 (relative
# step 2^-8), and one rounding flip in a hidden state moves this model's logits by about 1e-2:
# 0.05 nats leaves room for a few such flips over 2 layers. A quantized cache adds its own
# error: the attention output's relative error e (against the exact reference; mjolnir bench's
# err_exact column) perturbs the logits by about e times their spread, which is about 1 nat for
# this model. So the tolerance is 0.05 + e_format, with e_format about the format's output error
# with calibrated per-channel scales (fp8 ~3%, fp6 ~4%, nvfp4 ~10%, fp4 ~20%). Measured on
# 2026-12-03 (AMD EPYC Zen 3): largest differences 0.008 (bf16), 0.008 (fp8), 0.012 (fp6),
# 0.031 (nvfp4), 0.062 (fp4) nats.
FORMAT_ERROR = {"bf16": 0.0, "fp8_e4m3": 0.03, "fp6_e2m3": 0.04, "fp4_e2m1": 0.2, "nvfp4": 0.1}
# At a divergence both choices must be a near tie: each in the other's top 5, at most 1 nat apart.
TIE_NATS = 1.0


def compare(theirs, ours, fmt):
    tolerance = 0.05 + FORMAT_ERROR[fmt]
    worst = 0.0
    for i, (a, b) in enumerate(zip(theirs["tokens"], ours["tokens"])):
        diverged = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        # Shared prefix: the chosen token gets the same logprob from both runs.
        for j in range(diverged):
            delta = abs(theirs["logprobs"][i][j][str(a[j])] - ours["logprobs"][i][j][str(a[j])])
            worst = max(worst, delta)
            assert delta <= tolerance, (fmt, i, j, delta, tolerance)
        if diverged == len(a):
            continue
        mine, other = ours["logprobs"][i][diverged], theirs["logprobs"][i][diverged]
        t_theirs, t_ours = str(a[diverged]), str(b[diverged])
        print(f"{fmt} prompt {i}: diverges at token {diverged}")
        assert t_ours in other and t_theirs in mine, (fmt, i, diverged, other, mine)
        assert other[t_theirs] - other[t_ours] <= TIE_NATS, (fmt, i, diverged, other)
        assert mine[t_ours] - mine[t_theirs] <= TIE_NATS, (fmt, i, diverged, mine)
    print(f"{fmt}: largest logprob difference on the shared prefixes: {worst:.4f} nats "
          f"(tolerance {tolerance})")
    return worst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="module")
def stock(model_dir):
    result = run_in_subprocess(model_dir, {"MJOLNIR_ATTN_DISABLE": "1"})
    assert result["mjolnir_steps"] == 0 and result["fallback_steps"] == 0
    assert "attention layers run on mjolnir" not in result["log"]
    return result


@pytest.fixture(scope="module")
def calibrated(model_dir, tmp_path_factory):
    """The calibration flow: serve (bf16 cache, the plugin) recording amax, then the scales
    file for each low-bit format. Returns (bf16 run, {format: scales path})."""
    tmp = tmp_path_factory.mktemp("calibration")
    amax = str(tmp / "amax.json")
    result = run_in_subprocess(model_dir, {"MJOLNIR_ATTN_KV_CALIBRATE": amax})
    with open(amax) as f:
        recorded = json.load(f)
    assert len(recorded["layers"]) == LAYERS and recorded["num_kv_heads"] == 2
    assert all(max(layer["k_amax"]) > 0 for layer in recorded["layers"])
    scales = {}
    for fmt in ("fp8_e4m3", "fp6_e2m3", "fp4_e2m1", "nvfp4"):
        path = str(tmp / f"{fmt}.json")
        proc = subprocess.run([sys.executable, "-m", "mjolnir.calibrate", amax, "--format", fmt,
                               "--out", path], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert f"{LAYERS} layers x 2 KV heads x 128 channels -> {fmt}" in proc.stdout
        scales[fmt] = path
    return result, scales


def test_bf16_matches_stock_and_records_amax(stock, calibrated):
    ours, _ = calibrated
    # Every step, prefill and decode alike, on mjolnir.
    assert ours["mjolnir_steps"] > 0 and ours["fallback_steps"] == 0
    assert "mjolnir: 2 of 2 attention layers run on mjolnir (format bf16" in ours["log"], \
        ours["log"][-3000:]
    compare(stock, ours, "bf16")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp6_e2m3", "fp4_e2m1", "nvfp4"])
def test_low_bit_formats_with_calibrated_scales(model_dir, stock, calibrated, fmt):
    """fp8 through vLLM's kv_cache_dtype (which vLLM itself refuses on CPUs without AVX-512),
    the others through MJOLNIR_ATTN_KV_FORMAT; each with its scales file; the cache allocated
    at the format's size, so vLLM's capacity in tokens grows with it."""
    _, scales = calibrated
    env = {"MJOLNIR_ATTN_KV_SCALES": scales[fmt]}
    if fmt == "fp8_e4m3":
        ours = run_in_subprocess(model_dir, env, kv_cache_dtype="fp8")
    else:
        ours = run_in_subprocess(model_dir, {**env, "MJOLNIR_ATTN_KV_FORMAT": fmt})
    assert ours["mjolnir_steps"] > 0 and ours["fallback_steps"] == 0
    assert f"attention layers run on mjolnir (format {fmt}" in ours["log"]
    assert f"{fmt} scales of {scales[fmt]} for {LAYERS} layers" in ours["log"]
    compare(stock, ours, fmt)
    # Capacity against the bf16 cache at the same VLLM_CPU_KVCACHE_SPACE: 2x for 8-bit codes,
    # 2.67x for 6, 4x for 4 (3.56x for nvfp4, whose block scales add a byte per 16 channels),
    # less what vLLM's block rounding takes.
    ratio = ours["capacity"] / stock["capacity"]
    minimum = {"fp8_e4m3": 1.9, "fp6_e2m3": 2.5, "fp4_e2m1": 3.5, "nvfp4": 3.2}[fmt]
    print(f"{fmt}: {ours['capacity']} tokens, {ratio:.2f}x the bf16 cache's")
    assert ratio >= minimum, (fmt, ours["capacity"], stock["capacity"])


def test_a_long_prompt_in_bounded_memory(model_dir):
    """A 4096-token prompt: prefill through mjolnir's ragged steps (query tiles, no score matrix)
    peaks within 10% of stock vLLM's resident memory, and gives the same first tokens up to near
    ties."""
    theirs = run_in_subprocess(model_dir, {"MJOLNIR_ATTN_DISABLE": "1"}, long=True)
    # bf16 on mjolnir on every CPU (a CPU with AMX leaves it to vLLM's kernel by default).
    ours = run_in_subprocess(model_dir, {"MJOLNIR_ATTN_ON_AMX": "mjolnir"}, long=True)
    assert ours["mjolnir_steps"] > 0 and ours["fallback_steps"] == 0
    print(f"long prompt: peak RSS {ours['peak_rss_mib']:.0f} MiB with mjolnir, "
          f"{theirs['peak_rss_mib']:.0f} MiB stock")
    assert ours["peak_rss_mib"] <= 1.10 * theirs["peak_rss_mib"]
    compare(theirs, ours, "bf16")


def test_a_scales_file_for_another_model_fails_at_start_up(model_dir, calibrated, tmp_path):
    """A scales file whose layer count does not match: a clean start-up error naming the file
    and the field, not a crash at the first request."""
    _, scales = calibrated
    with open(scales["fp4_e2m1"]) as f:
        document = json.load(f)
    document["layers"] = document["layers"][:1]
    bad = tmp_path / "one-layer.json"
    bad.write_text(json.dumps(document))
    proc = run_in_subprocess(model_dir, {"MJOLNIR_ATTN_KV_FORMAT": "fp4_e2m1",
                                         "MJOLNIR_ATTN_KV_SCALES": str(bad)}, expect_ok=False)
    assert proc.returncode != 0
    assert f"MJOLNIR_ATTN_KV_SCALES={bad}: layers: 1 in the file, but the model has 2" in \
        proc.stderr, proc.stderr[-3000:]


if __name__ == "__main__":
    import resource
    if sys.argv[3] == "long":
        tokens, logprobs, capacity = generate(sys.argv[1], LONG_PROMPT, sys.argv[2],
                                              max_model_len=4200, max_tokens=4)
    else:
        tokens, logprobs, capacity = generate(sys.argv[1], PROMPTS, sys.argv[2])
    from mjolnir.vllm_backend import MjolnirCPUAttentionImpl as impl
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": tokens, "logprobs": logprobs, "capacity": capacity,
                      "peak_rss_mib": rss,
                      "mjolnir_steps": impl.mjolnir_steps,
                      "fallback_steps": impl.fallback_steps}))

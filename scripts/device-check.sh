#!/usr/bin/env bash
# One command for a GPU machine (the H200 of the device tool): build the CUDA backend for that
# GPU, run the GPU tests, the benchmark table against the card's measured copy bandwidth and the
# PyTorch SDPA baseline, compute-sanitizer on a subset, and the Python ops on CUDA tensors (the
# package built with its CUDA backend), within about 8 minutes. Raw results go
# under $OUT (8 files at most, as the device tool returns them); a short table is printed last.
#
#   scripts/device-check.sh              on the GPU machine, from the repository root
#   scripts/device-check.sh --fetch-deps here (with a package registry): download the Debian
#                                        packages of the C++ dependencies (Highway, GoogleTest,
#                                        nlohmann-json, CLI11) into build-deps/, which the GPU
#                                        machine cannot fetch. build-deps/ is ignored by git
#                                        (/build*/); name it in the device tool's `carry`.
#
# Environment: OUT (default ./device-check-out), MJOLNIR_CUDA_ARCH (default 90a-real),
# MJOLNIR_BUILD_DIR (default build-device),
# MJOLNIR_JOBS (default nproc), MJOLNIR_CHECK_BUDGET_S (default 470), MJOLNIR_CUDA_CASE_EVERY
# (1 in N cases of the full matrix; default 1 = all), MJOLNIR_CUDA_BENCH_SET (full | short),
# MJOLNIR_CHECK_STAGES: "all" (default: tests bench baselines sanitizer cli python) or a comma list
# of those and "splits" (mjolnir bench --backend cuda over caps on chunks per sequence), so that
# a rerun in the same lease repeats only what failed.
# See docs/cuda.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
root=$PWD
deps_dir=$root/build-deps

if [[ "${1:-}" == "--fetch-deps" ]]; then
  mkdir -p "$deps_dir/debs"
  (cd "$deps_dir/debs" &&
    apt-get download libhwy-dev libhwy1 libgtest-dev nlohmann-json3-dev libcli11-dev)
  ls -l "$deps_dir/debs"
  exit $?
fi

out=${OUT:-$root/device-check-out}
mkdir -p "$out"
arch=${MJOLNIR_CUDA_ARCH:-90a-real}
jobs=${MJOLNIR_JOBS:-$(nproc)}
budget=${MJOLNIR_CHECK_BUDGET_S:-470}
build=$root/${MJOLNIR_BUILD_DIR:-build-device}
start=$(date +%s)
export PATH="/usr/local/cuda/bin:$PATH"
export PYTHONUNBUFFERED=1
export MJOLNIR_TEST_SEED=${MJOLNIR_TEST_SEED:-20251130}

stages=${MJOLNIR_CHECK_STAGES:-all}
# Whether stage $1 runs: named in MJOLNIR_CHECK_STAGES, or "all" and not an opt-in stage.
wants() { [[ ",$stages," == *",$1,"* ]] || { [[ $stages == all && $1 != splits ]]; }; }

summary=$out/summary.txt
: >"$summary"
elapsed() { echo $(($(date +%s) - start)); }
left() { echo $((budget - $(elapsed))); }
note() { echo "[device-check +$(elapsed)s] $*" | tee -a "$summary"; }
# Runs "$@" with a timeout of min($1, time left - reserve) seconds; skips it when under 20 s.
staged() {
  local want=$1 reserve=$2
  shift 2
  local limit=$(($(left) - reserve))
  ((limit > want)) && limit=$want
  if ((limit < 20)); then
    note "skipped (only $(left) s left): $*"
    return 124
  fi
  timeout --kill-after=10 "$limit" "$@"
}

{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem \
    --format=csv 2>&1
  nvcc --version 2>&1 | tail -1
  cmake --version 2>&1 | head -1
  echo "python3: $(python3 -c 'import torch; print("torch", torch.__version__)' 2>&1)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null) (+ working tree changes: $(git status --porcelain 2>/dev/null | wc -l))"
} >>"$summary" 2>&1

# --- 1. build ----------------------------------------------------------------------------------
prefix_args=()
if compgen -G "$deps_dir/debs/*.deb" >/dev/null; then
  mkdir -p "$deps_dir/root"
  for deb in "$deps_dir"/debs/*.deb; do dpkg -x "$deb" "$deps_dir/root"; done
  prefix_args=(-DCMAKE_PREFIX_PATH="$deps_dir/root/usr")
  note "using the carried dependencies in build-deps/"
fi
build_status=0
if wants tests || wants bench || wants sanitizer || wants cli || wants splits; then
note "configure + build for $arch with -j$jobs"
{
  staged 120 300 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DMJOLNIR_CUDA=ON -DMJOLNIR_CUDA_ARCHITECTURES="$arch" -DCMAKE_CUDA_FLAGS="-Xptxas=-v" \
    "${prefix_args[@]}" &&
    staged 300 180 cmake --build "$build" -j "$jobs" --target test_cuda_backend \
      test_cuda_write_kv test_cuda_bench &&
    { staged 120 170 cmake --build "$build" -j "$jobs" --target mjolnir_cli ||
      echo "(the CLI did not build; the GPU checks go on without it)"; }
} >"$out/build.log" 2>&1 || build_status=$?
if ((build_status != 0)); then
  note "BUILD FAILED (status $build_status; 124 = out of time); errors in build.log:"
  grep -E "error|FAILED|Error|CMake Warning" "$out/build.log" | head -25 | tee -a "$summary"
  grep -vE "^ptxas info|bytes stack frame" "$out/build.log" | tail -5 | tee -a "$summary"
  exit 1
fi
note "built"
fi
# The resource use of the decode kernels (registers, stack, spills), from ptxas -v, for the record.
grep -A3 "entry function.*decode_kernel" "$out/build.log" | grep -E "registers|stack frame" |
  sort | uniq -c | head -6 >>"$summary"

test_status=0
tests_line="not run"
# --- 2. GPU tests ------------------------------------------------------------------------------
if wants tests; then
note "GPU tests (ctest -L gpu -j $jobs)"
staged 180 150 ctest --test-dir "$build" -L gpu -j "$jobs" --timeout 180 --output-on-failure \
  >"$out/ctest.log" 2>&1
test_status=$?
tests_line=$(grep -E "tests passed|tests failed" "$out/ctest.log" | tail -1)
tests_line="${tests_line:-no summary}; $(grep -c "(Skipped)" "$out/ctest.log") of them skipped"
note "tests: $tests_line (status $test_status)"
grep -h "\[ cuda     \]" "$out/ctest.log" | sort | uniq | head -12 >>"$summary"

fi

# --- 3. benchmark: the CUDA decode against the copy bandwidth ---------------------------------
if wants bench; then
note "benchmark table (cuda)"
MJOLNIR_CUDA_BENCH_JSON=$out/bench-cuda.json \
  staged 150 90 "$build/tests/test_cuda_bench" --gtest_filter=CudaBench.Table \
  >"$out/bench.log" 2>&1
note "bench status $?"
# The same first rows on the plain tensor-core layout, against the stacked / tokens-on-M ones the
# table above ran (MmaLayout, docs/cuda.md): the A/B of the layouts in one run.
note "benchmark rows on the plain layout (MJOLNIR_CUDA_MMA_LAYOUT=plain)"
MJOLNIR_CUDA_MMA_LAYOUT=plain MJOLNIR_CUDA_BENCH_SET=short \
  MJOLNIR_CUDA_BENCH_JSON=$out/bench-cuda-plain.json \
  staged 45 80 "$build/tests/test_cuda_bench" --gtest_filter=CudaBench.Table \
  >>"$out/bench.log" 2>&1
note "plain-layout bench status $?"

fi

# --- 4. PyTorch SDPA over the same shapes, K/V dequantized to bf16 (and FlashInfer if present) --
if wants baselines; then
note "baselines (torch SDPA bf16; FlashInfer if importable)"
staged 70 50 python3 - "$out/bench-torch.json" "$out/bench-cuda.json" >>"$out/bench.log" 2>&1 <<'PY'
import json, math, os, sys, time
import torch
import torch.nn.functional as F
out_path, cuda_path = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
copy_gbps = read_gbps = None
if os.path.exists(cuda_path):
    machine = json.load(open(cuda_path))["machine"]
    copy_gbps, read_gbps = machine["copy_bandwidth_gbps"], machine.get("read_bandwidth_gbps")
reference_gbps = read_gbps or copy_gbps  # fractions of the read-only bandwidth where measured
def timed(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]
results = []
def record(backend, fmt, batch, ctx, q_len, hq, hk, d, us, kv_bytes):
    gbps = kv_bytes / (us * 1e-6) / 1e9
    results.append(dict(backend=backend, format=fmt, batch=batch, context=ctx, q_len=q_len, hq=hq,
                        hk=hk, d=d, page=16, layout="dense" if "sdpa" in backend else "NHD",
                        granularity="tensor", q_mode="bf16", p_mode="fp32", median_us=us, runs=20,
                        kv_bytes=kv_bytes, working_set_bytes=kv_bytes, copies=1, gbps=gbps,
                        bandwidth_fraction=(gbps / reference_gbps) if reference_gbps else None,
                        rel_error_vs_exact=None))
    print(f"{backend:22s} {fmt:9s} b{batch:<3d} ctx {ctx:6d} q {q_len} hq {hq} d {d}: "
          f"{us:10.1f} us {gbps:8.1f} GB/s", flush=True)
shapes = [(16, 32768, 1, 32, 128), (1, 32768, 1, 32, 128), (16, 32768, 4, 32, 128),
          (16, 8192, 1, 32, 128), (64, 32768, 1, 32, 128), (16, 131072, 1, 32, 128)]
hk = 8
for batch, ctx, q_len, hq, d in shapes:
    try:
        k = torch.randn(batch, hk, ctx, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(batch, hk, ctx, d, device=dev, dtype=torch.bfloat16)
        q = torch.randn(batch, hq, q_len, d, device=dev, dtype=torch.bfloat16)
        us = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        record("torch_sdpa_bf16", "bf16", batch, ctx, q_len, hq, hk, d, us, 2 * k.numel() * 2)
        del k, v, q
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - a baseline failing must not stop the others
        print(f"torch sdpa b{batch} ctx {ctx}: failed: {e}", flush=True)
try:
    import flashinfer
    page = 16
    for batch, ctx, q_len, hq, d in shapes[:2] + shapes[4:5]:
        if q_len != 1:
            continue
        for kv_dtype, name in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8_e4m3")):
            try:
                pages = batch * ctx // page
                ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
                indptr = torch.arange(batch + 1, device=dev, dtype=torch.int32) * (ctx // page)
                indices = torch.randperm(pages, device=dev).to(torch.int32)
                last = torch.full((batch,), page, device=dev, dtype=torch.int32)
                wrapper.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16,
                             kv_data_type=kv_dtype)
                cache = torch.randn(pages, 2, page, hk, d, device=dev,
                                    dtype=torch.bfloat16).to(kv_dtype)
                q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
                us = timed(lambda: wrapper.run(q, cache))
                record("flashinfer", name, batch, ctx, 1, hq, hk, d, us,
                       cache.numel() * cache.element_size())
                del cache
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                print(f"flashinfer {name} b{batch} ctx {ctx}: failed: {e}", flush=True)
except ImportError as e:
    print(f"flashinfer: not importable here ({e}); carry the flashinfer-python wheel to run it")
json.dump({"machine": {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_gbps": copy_gbps,
                       "read_bandwidth_gbps": read_gbps},
           "results": results}, open(out_path, "w"), indent=2)
PY
note "baselines status $?"

fi

# --- 5. compute-sanitizer on a subset ---------------------------------------------------------
if wants sanitizer; then
note "compute-sanitizer memcheck + racecheck on a subset"
{
  echo "== memcheck: quick matrix 1 in 12, the graph test, write_kv"
  MJOLNIR_CUDA_CASE_EVERY=12 staged 70 35 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$build/tests/test_cuda_backend" --gtest_filter='CudaMatrix.Quick:CudaGraph.*'
  echo "memcheck backend status $?"
  staged 40 30 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$build/tests/test_cuda_write_kv" --gtest_filter='CudaWriteKv.Bad*'
  echo "memcheck write_kv status $?"
  echo "== racecheck: quick matrix 1 in 48"
  MJOLNIR_CUDA_CASE_EVERY=48 staged 60 15 compute-sanitizer --tool racecheck --error-exitcode 9 \
    "$build/tests/test_cuda_backend" --gtest_filter='CudaMatrix.Quick'
  echo "racecheck status $?"
} >"$out/sanitizer.log" 2>&1
grep -E "status|ERROR SUMMARY|RACECHECK SUMMARY|skipped" "$out/sanitizer.log" >>"$summary"

fi

# --- 6. the CLI (its --backend cuda needs device buffers: see docs/cuda.md) ---------------------
if wants cli && [[ -x "$build/tools/mjolnir" ]]; then
  {
    echo "== mjolnir info"
    staged 20 10 "$build/tools/mjolnir" info
    echo "== mjolnir bench --backend cuda (small)"
    staged 30 5 "$build/tools/mjolnir" bench --backend cuda --batch 4 --context 4096 \
      --iterations 5
    echo "bench status $?"
  } >>"$out/bench.log" 2>&1
  grep -E "^bench status|GPU 0" "$out/bench.log" | tail -2 >>"$summary"
fi

# --- 6b. the cap on chunks per sequence (max_splits), swept where the plan's default may miss ---
# batches 1-4 (where splitting is most of the parallelism, and where Backend::wave_workers()
# caps the chunks at one wave), fp8 and fp4, D 128 and 256. Opt-in: MJOLNIR_CHECK_STAGES=...,splits.
if wants splits && [[ -x "$build/tools/mjolnir" ]]; then
  note "chunks per sequence swept (mjolnir bench --backend cuda --max-splits N)"
  {
    for shape in "1 32768 fp8_e4m3" "2 32768 fp8_e4m3" "4 32768 fp8_e4m3" "1 131072 fp8_e4m3" \
      "1 32768 fp4_e2m1" "1 32768 fp8_e4m3 --head-dim 256"; do
      read -r batch context format extra <<<"$shape"
      for splits in 0 8 16 24 32 48 64 96; do
        ((batch > 4 && splits > 32)) && continue
        echo "== splits $splits batch $batch context $context $format $extra"
        # shellcheck disable=SC2086 # $extra: further bench flags, split on purpose
        staged 20 60 "$build/tools/mjolnir" bench --backend cuda --format "$format" \
          --batch "$batch" --context "$context" --max-splits "$splits" --iterations 50 $extra |
          grep -E "^$format"
      done
    done
  } >"$out/splits.log" 2>&1
  note "splits: $(grep -c "^fp" "$out/splits.log") rows in splits.log"
fi

# --- 7. the Python ops on the GPU ---------------------------------------------------------------
# The package built with its CUDA backend for this GPU (the image has scikit-build-core, nanobind
# and pytest; no build isolation, so nothing is fetched), installed into the build folder, then
# python/tests/test_cuda_ops.py: decode and write_kv on CUDA tensors against the reference and
# the CPU backend. Its log goes into ctest.log ($OUT takes 8 files).
if wants python; then
note "python: the package with its CUDA backend, then test_cuda_ops.py"
py_site=$build/python-site
# The extension links the carried Highway (libhwy.so.1), which the loader must find there.
deps_lib=$deps_dir/root/usr/lib/x86_64-linux-gnu
[[ -d $deps_lib ]] && export LD_LIBRARY_PATH="$deps_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  echo
  echo "== python: pip install with MJOLNIR_PYTHON_CUDA=ON for $arch"
  MJOLNIR_PYTHON_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
    CMAKE_ARGS="-DMJOLNIR_CUDA_ARCHITECTURES=$arch ${prefix_args[*]}" \
    staged 200 25 python3 -m pip install -q --no-build-isolation --no-deps --no-compile \
    --upgrade --target "$py_site" --config-settings=build-dir="$build/python-build" . &&
    (cd python/tests && PYTHONPATH=$py_site staged 90 5 python3 -m pytest -q \
      -p no:cacheprovider -rs test_cuda_ops.py)
  echo "python status $?"
} >>"$out/ctest.log" 2>&1
python_line=$(sed -n '/^== python:/,$p' "$out/ctest.log" | grep -E " passed| failed| skipped|rror" |
  tail -1)
note "python: ${python_line:-no summary} ($(grep "^python status" "$out/ctest.log" | tail -1))"
fi

# --- the short table ---------------------------------------------------------------------------
{
  echo
  echo "== device-check summary ($(elapsed) s; raw results in $out)"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -1
  echo "tests: $tests_line"
  echo "python (CUDA tensors): ${python_line:-no summary}"
  echo "cuda decode (graph replay) vs the measured read-only and copy bandwidths:"
  grep -E "^(device:|format |bf16 |fp16 |fp8_|fp6_|fp4_|nvfp4 )" "$out/bench.log" | head -40
  echo "baselines:"
  grep -E "^(torch_sdpa|flashinfer)" "$out/bench.log" | head -12
  echo "sanitizers:"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|status" "$out/sanitizer.log" | sort | uniq -c
} | tee -a "$summary"
exit $((test_status != 0))

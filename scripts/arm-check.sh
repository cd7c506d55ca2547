#!/usr/bin/env bash
# The Arm check: cross-compiles the library and its tests for aarch64 in build-arm64/ and runs
# them under qemu's user-mode emulator (NEON, SVE and SVE2 Highway targets), on a Debian 12
# x86-64 host. Run as root (or with sudo available). Idempotent: installs only what is missing
# (the arm64 architecture, the cross compiler, qemu, libhwy-dev:arm64 and libgtest-dev:arm64
# from Debian's multiarch archive) and rebuilds incrementally. MJOLNIR_JOBS sets build and test
# parallelism (scripts/env.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

as_root=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "arm-check.sh: run as root (or install sudo)" >&2; exit 1; }
  as_root=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

# The host set-up first (cmake, ninja, the header-only nlohmann-json the library needs).
bash scripts/setup-debian.sh

packages=(
  g++-aarch64-linux-gnu  # the cross compiler, its libc and libstdc++ in /usr/aarch64-linux-gnu
  libhwy-dev:arm64       # Highway for aarch64 (Multi-Arch: same, beside the amd64 copy)
  libgtest-dev:arm64     # GoogleTest for aarch64
)
missing=()
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  echo "arm-check.sh: adding the arm64 architecture"
  "${as_root[@]}" dpkg --add-architecture arm64
  missing+=("${packages[@]}")  # and refresh the package lists below
else
  for package in "${packages[@]}"; do
    installed "$package" || missing+=("$package")
  done
fi
# Either emulator will do; qemu-user-static has no dependencies.
if ! command -v qemu-aarch64-static >/dev/null && ! command -v qemu-aarch64 >/dev/null; then
  missing+=(qemu-user-static)
fi
if ((${#missing[@]} > 0)); then
  echo "arm-check.sh: installing ${missing[*]}"
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The library, the tests and the examples; no CUDA, no CLI, no microbenchmarks (their
# dependencies are not cross-installed, and nothing Arm-specific is in them).
cmake -S . -B build-arm64 -G Ninja -DCMAKE_BUILD_TYPE=Release --no-warn-unused-cli \
  -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake \
  -DMJOLNIR_CUDA=OFF -DMJOLNIR_BUILD_TOOLS=OFF -DMJOLNIR_BUILD_BENCHMARKS=OFF >/dev/null
# Highway and GoogleTest must be the arm64 copies, not the host's.
for package in hwy GTest; do
  dir=$(sed -n "s/^${package}_DIR:PATH=//p" build-arm64/CMakeCache.txt)
  if [[ "$dir" != /usr/lib/aarch64-linux-gnu/* ]]; then
    echo "arm-check.sh: ${package} found in '${dir}', not /usr/lib/aarch64-linux-gnu" >&2
    exit 1
  fi
done
# The emulated CPU (see the tests below): set before the build, whose test discovery runs the
# test binaries under qemu and lists the Highway targets that CPU supports.
export QEMU_CPU=${QEMU_CPU:-max,sve-default-vector-length=16}
cmake --build build-arm64 -j "$jobs"
if ! file -b build-arm64/tests/test_cpu_kernels | grep -q "ARM aarch64"; then
  echo "arm-check.sh: build-arm64/tests/test_cpu_kernels is not an aarch64 executable" >&2
  exit 1
fi

# Every test runs under qemu (CMAKE_CROSSCOMPILING_EMULATOR), with the covering subset of the
# case matrix (MJOLNIR_TEST_QUICK=1), on an emulated CPU with 128-bit SVE vectors (QEMU_CPU
# below), the width of the Neoverse V2 and N2 cores (NVIDIA Grace, AWS Graviton4): Highway then
# also dispatches its SVE2_128 target, the one those CPUs run, which qemu's default 512-bit
# vectors never reach. qemu runs 128-bit SVE about 10x faster than 512-bit (the SVE2 quick
# matrix: 7.7 s against 87 s, 2026-12-06). Not run here: SVE_256 (Graviton3's 256-bit target;
# QEMU_CPU=max,sve-default-vector-length=32 instantiates it, but qemu took over ten minutes for
# one third of its quick matrix); 512-bit vectors (A64FX, qemu's default) run one test, at the end.
# qemu runs NEON code ~10-30x slower than the host, so a few tests are left to the native runs
# (scripts/test.sh, both builds):
#   CpuKernelTest.TestRounding/*: the exhaustive rounding sweep (~70 million floats x 7
#     formats, each against the scalar codec) takes 7 to over 15 minutes per target under qemu
#     here. The same SIMD rounding is still checked bit for bit on NEON, SVE and SVE2 through
#     every Q and P mode of CpuKernelMatrix (a P or Q code that differs from the emulator's fails
#     its 1e-5 tolerance) and through the encoders of TestRowEncoder; the sweep runs natively.
#   CudaEmulated.*: the CUDA kernels' code run on CPU threads, portable C++ (5-6 minutes under
#     qemu); the native runs cover it. What differs on Arm, the emulator's fused Q . K that the
#     exact-order body must follow (core/fused_dot.h), CudaEmulatedContract.* checks here.
#   Reference/CaseMatrix.Shard/("reference", 1-3): the emulator against the exact reference,
#     portable scalar C++ with nothing Arm-specific: the four shards took 1000 s of the run's
#     3060 test-seconds under qemu (2026-12-05), one of them 459 s, the run's long pole.
#     Shard 0 (a quarter of the covering cases) still runs here; natively, every shard runs.
#   CpuKernelMatrix.*/{NEON,SVE,SVE2,SVE2_128}: the quick case matrix is shared between the
#     targets (MJOLNIR_TEST_CASE_EVERY=3: each runs every third case, by its target bit, so every
#     case runs at least once; NEON and SVE2_128 take the same third). A whole matrix took about
#     a minute on NEON but over ten on SVE and SVE2 under qemu's 512-bit vectors (2026-12-04);
#     the full matrix of every x86 target runs natively.
# (The docs_* tests, host-side Python checks of docs/, are not defined in a cross build.)
# --timeout: a hung test fails after 10 minutes instead of ctest's 25.
excluded='CpuKernelTest\.TestRounding/|^CudaEmulated\.|^Reference/CaseMatrix\.Shard/.*"reference", [1-3]\)'
log=build-arm64/arm-ctest.log
status=0
MJOLNIR_TEST_QUICK=1 MJOLNIR_TEST_CASE_EVERY=3 ctest --test-dir build-arm64 --output-on-failure -j "$jobs" --timeout 600 \
  -E "$excluded" 2>&1 | tee "$log" || status=$?
# One kernel test again at qemu's default 512-bit vectors, on the SVE target (a third of the
# quick matrix, about a minute): code that holds at 128 bits but not on a wider vector fails here.
QEMU_CPU=max MJOLNIR_TEST_QUICK=1 MJOLNIR_TEST_CASE_EVERY=3 ctest --test-dir build-arm64 \
  --output-on-failure --timeout 600 -R 'QuickMatrixMatchesEmulator/SVE ' 2>&1 |
  tee -a "$log" || status=$?

# The Highway targets whose kernel tests ran (test_cpu_kernels instantiates every compiled
# target that qemu's CPU supports: NEON, SVE, SVE2 and, at 128-bit vectors, SVE2_128).
targets=$(grep -E 'CpuKernel[A-Za-z]*\.[A-Za-z0-9]+/[A-Z0-9_]+ .*Passed' "$log" | sed -E 's|.*CpuKernel[A-Za-z]*\.[A-Za-z0-9]+/([A-Z0-9_]+) .*|\1|' |
  awk '!seen[$0]++' | tr '\n' ' ')
echo "arm-check.sh: Highway targets exercised by test_cpu_kernels under qemu: ${targets:-none}"
exit "$status"

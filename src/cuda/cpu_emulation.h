// Runs the CUDA kernels of this directory on the CPU, for tests on machines without a GPU
// (tests/test_cuda_emulated.cc). Included by the kernel headers instead of <cuda_runtime.h> when
// MJOLNIR_CUDA_EMULATION is defined; never part of the library.
//
// One CPU thread per CUDA thread of a CTA (a persistent pool), CTAs one after another:
// __syncthreads is a barrier of the CTA's threads, __syncwarp a barrier of the warp's 32, and
// __shfl_sync and __shfl_xor_sync trade values through a per-warp array between two warp
// barriers. The arithmetic intrinsics are the plain IEEE operations (the test builds without FMA
// contraction), cp.async falls back to plain copies (kernels guard the PTX with __CUDA_ARCH__).
// What this cannot show: real concurrency between warps beyond the barriers, cp.async itself, the
// device's libm, and resource limits.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

// The kernels carry nvcc pragmas (#pragma unroll) that GCC does not know.
#pragma GCC diagnostic ignored "-Wunknown-pragmas"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__

namespace mjolnir::cuda::emulation {

struct Dim3 {
  unsigned x = 0, y = 1, z = 1;
};

// The barriers of one CTA.
struct CtaState {
  explicit CtaState(int threads)
      : block(threads), shuffle(std::size_t(threads)), fragments(std::size_t(threads)) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> shuffle;
  std::vector<std::array<std::uint32_t, 8>> fragments;  // what warp_gather exchanges
};

inline thread_local CtaState* cta = nullptr;
inline thread_local Dim3 thread_idx, block_idx, block_dim;

// A pool of CPU threads that run one CTA at a time: run(threads, block, body) executes body()
// on `threads` of them with threadIdx.x = 0..threads-1 and blockIdx.x = block, and returns when
// all have finished.
class CtaRunner {
 public:
  explicit CtaRunner(int max_threads) : start_(max_threads + 1), done_(max_threads + 1) {
    for (int t = 0; t < max_threads; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  ~CtaRunner() {
    stop_ = true;
    start_.arrive_and_wait();
    for (std::thread& worker : workers_) worker.join();
  }
  CtaRunner(const CtaRunner&) = delete;
  CtaRunner& operator=(const CtaRunner&) = delete;

  void run(int threads, unsigned block, const std::function<void()>& body) {
    CtaState state(threads);
    state_ = &state;
    threads_ = threads;
    block_ = block;
    body_ = &body;
    start_.arrive_and_wait();
    done_.arrive_and_wait();
  }

 private:
  void work(int t) {
    for (;;) {
      start_.arrive_and_wait();
      if (stop_) return;
      if (t < threads_) {
        cta = state_;
        thread_idx = {unsigned(t)};
        block_idx = {block_};
        block_dim = {unsigned(threads_)};
        (*body_)();
      }
      done_.arrive_and_wait();
    }
  }

  std::barrier<> start_, done_;
  std::vector<std::thread> workers_;
  CtaState* state_ = nullptr;
  int threads_ = 0;
  unsigned block_ = 0;
  const std::function<void()>* body_ = nullptr;
  bool stop_ = false;
};

}  // namespace mjolnir::cuda::emulation

namespace mjolnir::cuda {
// The dynamic shared memory of the CTA being run (`extern __shared__ smem[]` in the kernels);
// one buffer serves every CTA since they run one at a time.
inline constexpr std::size_t kEmulatedSharedMemoryBytes = 256 * 1024;
alignas(16) inline std::uint8_t smem[kEmulatedSharedMemoryBytes];
}  // namespace mjolnir::cuda

#define threadIdx (::mjolnir::cuda::emulation::thread_idx)
#define blockIdx (::mjolnir::cuda::emulation::block_idx)
#define blockDim (::mjolnir::cuda::emulation::block_dim)

inline void __syncthreads() { ::mjolnir::cuda::emulation::cta->block.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
  ::mjolnir::cuda::emulation::cta->warps[threadIdx.x / 32]->arrive_and_wait();
}
// Lane `source_lane` of the warp's x (width 32, the only one the kernels use).
inline float __shfl_sync(unsigned, float x, int source_lane, int = 32) {
  auto& state = *::mjolnir::cuda::emulation::cta;
  const unsigned t = threadIdx.x, warp = t / 32;
  state.shuffle[t] = x;
  state.warps[warp]->arrive_and_wait();
  const float y = state.shuffle[warp * 32 + unsigned(source_lane) % 32];
  state.warps[warp]->arrive_and_wait();
  return y;
}
inline float __shfl_xor_sync(unsigned mask, float x, int lane_mask, int width = 32) {
  return __shfl_sync(mask, x, int((threadIdx.x % 32) ^ unsigned(lane_mask)), width);
}
namespace mjolnir::cuda::emulation {
// Every lane of the warp publishes `mine` and receives all 32 lanes' values, between two warp
// barriers (one exchange where shuffles would take one per value).
inline std::array<std::array<std::uint32_t, 8>, 32> warp_gather(
    const std::array<std::uint32_t, 8>& mine) {
  auto& state = *cta;
  const unsigned t = thread_idx.x, warp = t / 32;
  state.fragments[t] = mine;
  state.warps[warp]->arrive_and_wait();
  std::array<std::array<std::uint32_t, 8>, 32> all;
  for (unsigned i = 0; i < 32; ++i) all[i] = state.fragments[warp * 32 + i];
  state.warps[warp]->arrive_and_wait();
  return all;
}
}  // namespace mjolnir::cuda::emulation

// Whether any lane of the warp has `predicate` set.
inline bool __any_sync(unsigned, bool predicate) {
  const auto all = ::mjolnir::cuda::emulation::warp_gather({predicate ? 1u : 0u});
  return std::any_of(all.begin(), all.end(), [](const auto& lane) { return lane[0] != 0; });
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a < b ? b : a; }
inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  std::atomic_ref<unsigned long long> word(*address);
  unsigned long long old = word.load();
  while (value < old && !word.compare_exchange_weak(old, value)) {
  }
  return old;
}
using std::isfinite;
using std::isnan;

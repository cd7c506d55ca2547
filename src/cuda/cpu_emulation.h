// Runs the CUDA kernels of this directory on the CPU, for tests on machines without a GPU
// (tests/test_cuda_emulated.cc). Included by the kernel headers instead of <cuda_runtime.h> when
// MJOLNIR_CUDA_EMULATION is defined; never part of the library.
//
// One fiber per CUDA thread of a CTA, all on the calling thread, CTAs one after another: a fiber
// runs until it waits at a barrier, then the next runnable one runs. __syncthreads is a barrier
// of the CTA's fibers, __syncwarp a barrier of the warp's 32, and __shfl_sync and
// __shfl_xor_sync trade values through a per-warp array between two warp barriers. The
// arithmetic intrinsics are the plain IEEE operations (the test builds with -ffp-contract=off),
// cp.async falls back to plain copies (kernels guard the PTX with __CUDA_ARCH__). What this
// cannot show: real concurrency between warps beyond the barriers, cp.async itself, the device's
// libm, and resource limits. Fibers, not a thread per CUDA thread: with threads, 95% of the
// tests' time went to waking 128-256 threads at every barrier on two cores (perf, 2026-12-06).
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define MJOLNIR_EMULATION_ASAN 1
#else
#define MJOLNIR_EMULATION_ASAN 0
#endif

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

class CtaRunner;

// A barrier of `count` fibers of the running CTA: the last to arrive makes the others runnable
// and goes on; the others wait, switching to the next runnable fiber.
class FiberBarrier {
 public:
  explicit FiberBarrier(int count) : count_(count) {}
  void arrive_and_wait();

 private:
  int count_;
  int arrived_ = 0;
  std::vector<int> waiting_;
};

// The barriers of one CTA.
struct CtaState {
  explicit CtaState(int threads)
      : block(threads), shuffle(std::size_t(threads)), fragments(std::size_t(threads)) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<FiberBarrier>(32));
  }
  FiberBarrier block;
  std::vector<std::unique_ptr<FiberBarrier>> warps;
  std::vector<float> shuffle;
  std::vector<std::array<std::uint32_t, 8>> fragments;  // what warp_gather exchanges
};

// The CTA and thread the calling thread is running now (set before every switch to a fiber).
inline thread_local CtaState* cta = nullptr;
inline thread_local Dim3 thread_idx, block_idx, block_dim;
inline thread_local CtaRunner* running = nullptr;

// Runs one CTA at a time on the calling thread: run(threads, block, body) executes body() as
// `threads` fibers with threadIdx.x = 0..threads-1 and blockIdx.x = block, and returns when all
// have finished. Fibers start in index order and take turns at the barriers, so a run is
// deterministic. A barrier some fibers never reach (a kernel bug) is an error, not a hang.
class CtaRunner {
 public:
  explicit CtaRunner(int max_threads) : fibers_(std::size_t(max_threads)) {
    for (Fiber& fiber : fibers_) {
      // A guard page below each stack: an overflow faults instead of writing the next one.
      void* region = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
      if (region == MAP_FAILED) throw std::bad_alloc();
      mprotect(region, kGuardBytes, PROT_NONE);
      fiber.region = region;
      fiber.stack = static_cast<std::byte*>(region) + kGuardBytes;
    }
  }
  ~CtaRunner() {
    for (Fiber& fiber : fibers_) munmap(fiber.region, kStackBytes + kGuardBytes);
  }
  CtaRunner(const CtaRunner&) = delete;
  CtaRunner& operator=(const CtaRunner&) = delete;

  void run(int threads, unsigned block, const std::function<void()>& body) {
    if (threads < 1 || threads > int(fibers_.size())) {
      throw std::invalid_argument("emulated CTA: " + std::to_string(threads) +
                                  " threads, the runner has " + std::to_string(fibers_.size()));
    }
    CtaState state(threads);
    body_ = &body;
    finished_ = 0;
    ready_.clear();
    for (int t = 0; t < threads; ++t) {
      Fiber& fiber = fibers_[std::size_t(t)];
      getcontext(&fiber.context);
      fiber.context.uc_stack.ss_sp = fiber.stack;
      fiber.context.uc_stack.ss_size = kStackBytes;
      fiber.context.uc_link = &scheduler_;
      makecontext(&fiber.context, &CtaRunner::entry, 0);
      ready_.push_back(t);
    }
    running = this;
    while (!ready_.empty()) {
      current_ = ready_.front();
      ready_.pop_front();
      cta = &state;
      thread_idx = {unsigned(current_)};
      block_idx = {block};
      block_dim = {unsigned(threads)};
      switch_to_fiber(fibers_[std::size_t(current_)]);
    }
    running = nullptr;
    cta = nullptr;
    if (finished_ != threads) {
      throw std::logic_error("emulated CTA " + std::to_string(block) + ": " +
                             std::to_string(threads - finished_) +
                             " threads wait at a barrier the others never reach");
    }
  }

  // The running fiber waits: the scheduler runs the next runnable one.
  void wait() {
    Fiber& fiber = fibers_[std::size_t(current_)];
#if MJOLNIR_EMULATION_ASAN
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(&fake_stack, scheduler_bottom_, scheduler_size_);
    swapcontext(&fiber.context, &scheduler_);
    __sanitizer_finish_switch_fiber(fake_stack, &scheduler_bottom_, &scheduler_size_);
#else
    swapcontext(&fiber.context, &scheduler_);
#endif
  }
  void make_runnable(int fiber) { ready_.push_back(fiber); }
  int current() const { return current_; }

 private:
  // Ample for the kernels' frames, ASan's included; and small enough that AddressSanitizer,
  // which clears a stack's shadow at every swapcontext, does so with a memset (a 2 MiB stack's
  // shadow took an madvise a switch: 4.5 minutes of system time for these tests).
  static constexpr std::size_t kStackBytes = std::size_t(256) << 10;
  static constexpr std::size_t kGuardBytes = 4096;

  struct Fiber {
    void* region = nullptr;
    std::byte* stack = nullptr;
    ucontext_t context{};
  };

  static void entry() {
    CtaRunner& self = *running;
#if MJOLNIR_EMULATION_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &self.scheduler_bottom_, &self.scheduler_size_);
#endif
    (*self.body_)();
    ++self.finished_;
#if MJOLNIR_EMULATION_ASAN
    // The fiber ends: uc_link returns to the scheduler, and its fake stack goes with it.
    __sanitizer_start_switch_fiber(nullptr, self.scheduler_bottom_, self.scheduler_size_);
#endif
  }

  void switch_to_fiber(Fiber& fiber) {
#if MJOLNIR_EMULATION_ASAN
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(&fake_stack, fiber.stack, kStackBytes);
    swapcontext(&scheduler_, &fiber.context);
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
    swapcontext(&scheduler_, &fiber.context);
#endif
  }

  std::vector<Fiber> fibers_;
  ucontext_t scheduler_{};
  const void* scheduler_bottom_ = nullptr;
  std::size_t scheduler_size_ = 0;
  std::deque<int> ready_;
  const std::function<void()>* body_ = nullptr;
  int current_ = 0;
  int finished_ = 0;
};

inline void FiberBarrier::arrive_and_wait() {
  CtaRunner& runner = *running;
  if (++arrived_ == count_) {
    arrived_ = 0;
    for (int fiber : waiting_) runner.make_runnable(fiber);
    waiting_.clear();
    return;
  }
  waiting_.push_back(runner.current());
  runner.wait();
}

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
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
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

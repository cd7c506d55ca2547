// FMA peak of this machine (compute_peak.h), per Highway target like every src/cpu kernel.
#include "cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/compute_peak.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Independent FMA chains: enough to cover latency x ports on current cores (Zen 3 and Golden
// Cove: 4 cycles x 2 pipes = 8; Neoverse V2: 4 x 4 = 16), and few enough to stay in registers
// with the two operands (x86 has 16 vector registers; Arm has 32).
#if HWY_ARCH_X86
constexpr int kChains = 12;
#else
constexpr int kChains = 16;
#endif

// `rounds` x kChains vector FMAs. Returns the flops done and a sum the caller keeps, so no chain
// is optimized away.
float FmaChains(std::int64_t rounds, double* flops) {
  const hn::ScalableTag<float> d;
  const auto m = hn::Set(d, 0.999999f);
  const auto a = hn::Set(d, 1e-7f);
  // Distinct starting values: from equal ones the compiler proves the chains equal and keeps one.
  const auto start = [&](int i) { return hn::Set(d, 1.0f + 0x1p-10f * static_cast<float>(i)); };
  auto c0 = start(0), c1 = start(1), c2 = start(2), c3 = start(3), c4 = start(4), c5 = start(5);
  auto c6 = start(6), c7 = start(7), c8 = start(8), c9 = start(9), c10 = start(10);
  auto c11 = start(11), c12 = start(12), c13 = start(13), c14 = start(14), c15 = start(15);
  for (std::int64_t i = 0; i < rounds; ++i) {
    c0 = hn::MulAdd(c0, m, a), c1 = hn::MulAdd(c1, m, a), c2 = hn::MulAdd(c2, m, a);
    c3 = hn::MulAdd(c3, m, a), c4 = hn::MulAdd(c4, m, a), c5 = hn::MulAdd(c5, m, a);
    c6 = hn::MulAdd(c6, m, a), c7 = hn::MulAdd(c7, m, a), c8 = hn::MulAdd(c8, m, a);
    c9 = hn::MulAdd(c9, m, a), c10 = hn::MulAdd(c10, m, a), c11 = hn::MulAdd(c11, m, a);
    if constexpr (kChains == 16) {
      c12 = hn::MulAdd(c12, m, a), c13 = hn::MulAdd(c13, m, a), c14 = hn::MulAdd(c14, m, a);
      c15 = hn::MulAdd(c15, m, a);
    }
  }
  *flops = 2.0 * kChains * static_cast<double>(hn::Lanes(d)) * static_cast<double>(rounds);
  const auto s0 =
      hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)), hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)));
  const auto s1 = hn::Add(hn::Add(hn::Add(c8, c9), hn::Add(c10, c11)),
                          hn::Add(hn::Add(c12, c13), hn::Add(c14, c15)));
  return hn::GetLane(hn::Add(s0, s1));
}

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "bench/compute_peak.h"

namespace mjolnir::cpu {

HWY_EXPORT(FmaChains);

namespace {
constexpr int kPasses = 5;
}  // namespace

double measure_fma_peak_gflops(int threads, double seconds) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  using Clock = std::chrono::steady_clock;
  // Rounds per thread sized from a short single-thread probe, so every thread runs about
  // `seconds` and they overlap fully.
  double probe_flops = 0;
  const auto probe_begin = Clock::now();
  volatile float keep = HWY_DYNAMIC_DISPATCH(FmaChains)(1 << 20, &probe_flops);
  const double probe_s = std::chrono::duration<double>(Clock::now() - probe_begin).count();
  const auto rounds = static_cast<std::int64_t>(
      std::max(1.0, (1 << 20) * (seconds / kPasses) / std::max(probe_s, 1e-6)));

  // A peak: the best of several passes, since any other process sharing a core only lowers it.
  double best = 0;
  for (int pass = 0; pass < kPasses; ++pass) {
    std::vector<double> flops(threads, 0.0);
    std::vector<std::thread> workers;
    const auto begin = Clock::now();
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] { keep = HWY_DYNAMIC_DISPATCH(FmaChains)(rounds, &flops[t]); });
    }
    for (std::thread& worker : workers) worker.join();
    const double elapsed = std::chrono::duration<double>(Clock::now() - begin).count();
    double total = 0;
    for (const double f : flops) total += f;
    best = std::max(best, total / elapsed / 1e9);
  }
  (void)keep;
  return best;
}

}  // namespace mjolnir::cpu

#endif  // HWY_ONCE

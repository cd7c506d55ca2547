// FMA peak of this machine (compute_peak.h), per Highway target like every src/cpu kernel.
#include "cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/compute_peak.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// `rounds` x 16 vector FMAs on 16 independent chains: enough chains to cover latency x ports
// on every current core (Zen 3: 4 x 2, Golden Cove: 4 x 2, Neoverse V2: 4 x 4). Returns the
// flops done and a sum the caller keeps, so no chain is optimized away.
float FmaChains(std::int64_t rounds, double* flops) {
  const hn::ScalableTag<float> d;
  const auto m = hn::Set(d, 0.999999f);
  const auto a = hn::Set(d, 1e-7f);
  auto c0 = hn::Set(d, 1.0f), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  auto c8 = c0, c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
  for (std::int64_t i = 0; i < rounds; ++i) {
    c0 = hn::MulAdd(c0, m, a), c1 = hn::MulAdd(c1, m, a), c2 = hn::MulAdd(c2, m, a);
    c3 = hn::MulAdd(c3, m, a), c4 = hn::MulAdd(c4, m, a), c5 = hn::MulAdd(c5, m, a);
    c6 = hn::MulAdd(c6, m, a), c7 = hn::MulAdd(c7, m, a), c8 = hn::MulAdd(c8, m, a);
    c9 = hn::MulAdd(c9, m, a), c10 = hn::MulAdd(c10, m, a), c11 = hn::MulAdd(c11, m, a);
    c12 = hn::MulAdd(c12, m, a), c13 = hn::MulAdd(c13, m, a), c14 = hn::MulAdd(c14, m, a);
    c15 = hn::MulAdd(c15, m, a);
  }
  *flops = 2.0 * 16 * static_cast<double>(hn::Lanes(d)) * static_cast<double>(rounds);
  const auto s0 = hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)),
                          hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)));
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

#include "cpu/compute_peak.h"

namespace mjolnir::cpu {

HWY_EXPORT(FmaChains);

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
      std::max(1.0, (1 << 20) * seconds / std::max(probe_s, 1e-6)));

  std::vector<double> flops(threads, 0.0);
  std::vector<std::thread> workers;
  const auto begin = Clock::now();
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] { keep = HWY_DYNAMIC_DISPATCH(FmaChains)(rounds, &flops[t]); });
  }
  for (std::thread& worker : workers) worker.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - begin).count();
  (void)keep;
  double total = 0;
  for (const double f : flops) total += f;
  return total / elapsed / 1e9;
}

}  // namespace mjolnir::cpu

#endif  // HWY_ONCE

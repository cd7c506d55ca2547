#include "bench_workload.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "machine_info.h"
#include "mjolnir/error.h"
#include "reference/exact.h"

namespace mjolnir::tools {

namespace {

using Clock = std::chrono::steady_clock;

// Bounds for the automatic run count: enough runs for a stable median, and a stop for slow
// backends (the emulator) that would otherwise take minutes.
constexpr int kMinAutoRuns = 3;
constexpr int kMaxRuns = 100000;
constexpr double kSlowBackendTimeFactor = 10;
// The accuracy check keeps every float of K and V: 32k tokens of 8 heads x 128 channels is
// 256 MiB and a few seconds of fp64 work, which is plenty to measure a format's error.
constexpr int kMaxErrorCheckTokens = 32768;
// Each copy of the cache starts on a page of its own, as a separate allocation would.
constexpr std::size_t kCopyAlignment = 4096;

double seconds_since(Clock::time_point begin) {
  return std::chrono::duration<double>(Clock::now() - begin).count();
}

}  // namespace

RotatingCaches::RotatingCaches(verify::ProblemSpec spec, std::size_t target_working_set_bytes,
                               std::size_t memory_limit_bytes) {
  spec.keep_original_kv = false;
  const auto begin = Clock::now();
  // Generating and quantizing a serving-sized cache takes seconds: say so before, not after.
  std::fprintf(stderr, "bench: building the %s cache of %zu x %d tokens...",
               std::string(to_string(spec.format)).c_str(), spec.seq_lens.size(),
               spec.seq_lens.empty() ? 0 : spec.seq_lens[0]);
  std::fflush(stderr);
  problem_ = std::make_unique<verify::Problem>(spec);
  DecodeArgs base = problem_->args();
  validate(base);
  const std::size_t pool = base.cache.bytes;
  std::fprintf(stderr, " %s in %.1f s\n", format_bytes(pool).c_str(), seconds_since(begin));

  // The copies lie back to back in one allocation, each starting on a page of its own: one
  // allocation per copy would round each up to a huge page, and a cache of a few hundred KiB
  // (short contexts) would then take thousands of 2 MiB pages, many times the working set.
  const std::size_t stride = (pool + kCopyAlignment - 1) / kCopyAlignment * kCopyAlignment;
  std::size_t copies = std::max<std::size_t>(1, (target_working_set_bytes + pool - 1) / pool);
  copies = std::max<std::size_t>(1, std::min(copies, memory_limit_bytes / stride));
  if (copies * pool < target_working_set_bytes) {
    std::fprintf(stderr,
                 "bench: warning: memory allows only %zu copies (%s), less than the %s working "
                 "set that keeps the last-level cache out of the measurement\n",
                 copies, format_bytes(copies * pool).c_str(),
                 format_bytes(target_working_set_bytes).c_str());
  }
  // In memory that huge pages may back, as a serving engine's one large cache allocation would
  // be (bench/huge_pages.h).
  storage_ = cpu::allocate_huge_page_buffer(copies * stride, "bench cache copies");
  for (std::size_t i = 0; i < copies; ++i) {
    std::byte* data = storage_.get() + i * stride;
    std::memcpy(data, base.cache.data, pool);
    DecodeArgs copy = base;
    copy.cache.data = data;
    args_.push_back(copy);
  }
  if (copies > 1) {
    std::fprintf(stderr, "bench: %zu copies of the cache rotate through a %s working set\n", copies,
                 format_bytes(working_set_bytes()).c_str());
  }
}

Timing time_decode(const Backend& backend, const RotatingCaches& caches,
                   const PlanOptions& plan_options, const TimingOptions& timing) {
  const DecodeArgs& first = caches.args(0);
  const int num_seqs = first.batch.num_seqs();
  const int num_kv_heads = first.cache.geometry.num_kv_heads;
  BackendPlan plan(PlanCapacity{num_seqs, num_kv_heads, plan_options.max_splits});
  backend.plan(plan, first.step_shape(), plan_options);
  std::vector<std::byte> workspace(
      backend.workspace_bytes(plan.plan(), first.cache.geometry, first.params));

  // Warm-up: one run per copy touches every page (and the backend's threads and workspace),
  // cut short for backends so slow that a pass over the copies would dominate the run.
  const auto warmup_begin = Clock::now();
  for (int i = 0; i < caches.copies(); ++i) {
    backend.run(caches.args(i), plan, workspace);
    if (seconds_since(warmup_begin) > timing.min_time_s) break;
  }

  std::vector<double> run_us;
  const auto begin = Clock::now();
  for (int copy = 0;; copy = (copy + 1) % caches.copies()) {
    const int runs = static_cast<int>(run_us.size());
    if (timing.iterations > 0) {
      if (runs >= timing.iterations) break;
    } else {
      const double elapsed = seconds_since(begin);
      if (runs >= kMinAutoRuns && elapsed >= timing.min_time_s) break;
      if (runs >= 1 && elapsed >= kSlowBackendTimeFactor * timing.min_time_s) break;
      if (runs >= kMaxRuns) break;
    }
    const auto run_begin = Clock::now();
    backend.run(caches.args(copy), plan, workspace);
    run_us.push_back(seconds_since(run_begin) * 1e6);
  }

  Timing result;
  result.runs = static_cast<int>(run_us.size());
  std::sort(run_us.begin(), run_us.end());
  const std::size_t n = run_us.size();
  result.median_us = n % 2 == 1 ? run_us[n / 2] : 0.5 * (run_us[n / 2 - 1] + run_us[n / 2]);
  return result;
}

Measurement measure_host_backend(const Backend& backend, const verify::ProblemSpec& spec,
                                 const PlanOptions& plan_options, const TimingOptions& timing,
                                 std::size_t working_set_bytes, std::size_t memory_limit_bytes) {
  const RotatingCaches caches(spec, working_set_bytes, memory_limit_bytes);
  Measurement measurement;
  measurement.timing = time_decode(backend, caches, plan_options, timing);
  measurement.kv_bytes = caches.problem().kv_bytes_read();
  measurement.working_set_bytes = caches.working_set_bytes();
  measurement.copies = caches.copies();
  return measurement;
}

double error_vs_exact(const Backend& backend, verify::ProblemSpec spec,
                      const PlanOptions& plan_options) {
  const std::int32_t seq_len = spec.seq_lens.empty() ? 0 : spec.seq_lens[0];
  spec.seq_lens = {std::min(seq_len, kMaxErrorCheckTokens)};
  spec.keep_original_kv = true;
  verify::Problem problem(spec);
  const DecodeArgs args = problem.args();
  const int num_kv_heads = spec.num_kv_heads;

  BackendPlan plan(PlanCapacity{1, num_kv_heads, plan_options.max_splits});
  backend.plan(plan, args.step_shape(), plan_options);
  std::vector<std::byte> workspace(
      backend.workspace_bytes(plan.plan(), args.cache.geometry, args.params));
  backend.run(args, plan, workspace);

  const int head_dim = spec.head_dim;
  const reference::ExactResult exact = reference::exact_attention(
      args, [&](int seq, int head, int position, int kv, std::span<double> out) {
        const float* original = problem.original_kv(seq, head, position, kv);
        std::copy(original, original + head_dim, out.begin());
      });

  // Relative L2 over the whole output: sqrt(sum (o - exact)^2 / sum exact^2).
  double diff = 0, norm = 0;
  const auto o = problem.output();  // [q_len, Hq, D] of the one sequence
  for (std::size_t i = 0; i < o.size(); ++i) {
    diff += (o[i] - exact.o[i]) * (o[i] - exact.o[i]);
    norm += exact.o[i] * exact.o[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

}  // namespace mjolnir::tools

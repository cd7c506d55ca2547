// The bench's workload: a decode problem whose KV cache is copied until the copies together
// outgrow the last-level cache, and the timing of backend.run() rotating over those copies, so
// every timed step streams its KV from memory as it does in serving.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>

#include "bench/huge_pages.h"
#include "mjolnir/decode.h"
#include "verify/problem.h"

namespace mjolnir::tools {

// One Problem plus byte copies of its pool, back to back in one buffer that huge pages may back.
// Copy i is the same cache at another address, read through the same block table, strides and
// scales.
class RotatingCaches {
 public:
  // Builds the problem (keep_original_kv is turned off: the bench never needs the floats), then
  // makes copies until they total at least `target_working_set_bytes`, but no more than
  // `memory_limit_bytes` (at least one).
  RotatingCaches(verify::ProblemSpec spec, std::size_t target_working_set_bytes,
                 std::size_t memory_limit_bytes);

  int copies() const { return static_cast<int>(args_.size()); }
  // Arguments of one decode step reading copy `i`; every copy writes the same output buffers.
  const DecodeArgs& args(int i) const { return args_[i]; }
  const verify::Problem& problem() const { return *problem_; }
  std::size_t pool_bytes() const { return args_[0].cache.bytes; }
  std::size_t working_set_bytes() const { return pool_bytes() * args_.size(); }

 private:
  std::unique_ptr<verify::Problem> problem_;
  cpu::HugePageBuffer storage_;   // the copies, back to back
  std::vector<DecodeArgs> args_;  // [copies]
};

struct TimingOptions {
  int iterations = 0;     // > 0: exactly this many timed runs; 0: run for min_time_s
  double min_time_s = 1;  // with iterations == 0: time at least this long (and >= 3 runs)
};

struct Timing {
  double median_us = 0;
  int runs = 0;
};

// Plans once (outside the timed region: every copy has the same sequences, so one plan and one
// workspace serve them all), warms up on every copy, then times each run() separately, rotating
// over the copies, and returns the median.
Timing time_decode(const Backend& backend, const RotatingCaches& caches,
                   const PlanOptions& plan_options, const TimingOptions& timing);

// What one configuration measured, whichever way it was timed.
struct Measurement {
  Timing timing;
  std::size_t kv_bytes = 0;           // K/V bytes one step reads
  std::size_t working_set_bytes = 0;  // every cache copy the steps rotate over
  int copies = 0;
};

// A host-memory backend (cpu, reference): builds RotatingCaches of at least
// `working_set_bytes` (within `memory_limit_bytes`) and times them with time_decode().
Measurement measure_host_backend(const Backend& backend, const verify::ProblemSpec& spec,
                                 const PlanOptions& plan_options, const TimingOptions& timing,
                                 std::size_t working_set_bytes, std::size_t memory_limit_bytes);

// Relative L2 error of the backend's output against the fp64 exact reference on the original
// float K/V (docs/design.md section 4: the accuracy of the format and mode together), for one
// sequence of `spec` (the first seq_len, capped at 32k tokens so the check stays quick). The
// backend must support the configuration and take host arguments.
double error_vs_exact(const Backend& backend, verify::ProblemSpec spec,
                      const PlanOptions& plan_options);

}  // namespace mjolnir::tools

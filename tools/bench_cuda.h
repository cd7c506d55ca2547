// The GPU side of `mjolnir bench --backend cuda`: caches built and timed on the device by
// cuda::bench_decode (device-resident copies, one captured graph per copy, event timing), set
// against the card's measured copy bandwidth. Without the CUDA backend compiled in, every
// function throws Error saying so.
#pragma once

#include <string>

#include "bench_workload.h"
#include "verify/problem.h"

namespace mjolnir::tools {

struct GpuLimit {
  std::string device;              // "NVIDIA H200"
  double copy_bandwidth_gbps = 0;  // device-to-device copy, bytes read plus bytes written
};
GpuLimit measure_gpu_limit();

// Times `spec` (format, layout, heads, modes; batch = seq_lens.size(), context = seq_lens[0]).
// timing.iterations > 0 sets the graph replays per timed batch; the CUDA timer picks its own
// otherwise (timing.min_time_s does not apply: replays take microseconds).
Measurement measure_cuda(const verify::ProblemSpec& spec, const PlanOptions& plan_options,
                         const TimingOptions& timing);

}  // namespace mjolnir::tools

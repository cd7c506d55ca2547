#include "bench_cuda.h"

#include "mjolnir/error.h"

#if MJOLNIR_HAS_CUDA
#include "bench/cuda_bench.h"
#endif

namespace mjolnir::tools {

#if MJOLNIR_HAS_CUDA

GpuLimit measure_gpu_limit() {
  GpuLimit limit;
  limit.device = cuda::device_name();
  limit.copy_bandwidth_gbps = cuda::copy_bandwidth_gbps();
  return limit;
}

Measurement measure_cuda(const verify::ProblemSpec& spec, const PlanOptions& plan_options,
                         const TimingOptions& timing) {
  cuda::BenchSpec bench;
  bench.format = spec.format;
  bench.layout = spec.layout;
  bench.granularity = spec.granularity;
  bench.batch = static_cast<int>(spec.seq_lens.size());
  bench.context = spec.seq_lens.empty() ? 0 : spec.seq_lens[0];
  bench.q_len = spec.params.q_len;
  bench.num_q_heads = spec.num_kv_heads * spec.group;
  bench.num_kv_heads = spec.num_kv_heads;
  bench.head_dim = spec.head_dim;
  bench.page_size = spec.page_size;
  bench.q_mode = spec.params.q_mode;
  bench.p_mode = spec.params.p_mode;
  bench.tile_tokens = plan_options.tile_tokens;
  bench.max_splits = plan_options.max_splits;
  bench.steps_per_repeat = timing.iterations;
  bench.seed = spec.seed;
  const cuda::BenchResult result = cuda::bench_decode(bench);

  Measurement measurement;
  measurement.timing.median_us = result.median_us;
  measurement.timing.runs = result.runs;
  measurement.kv_bytes = result.kv_bytes;
  measurement.working_set_bytes = result.working_set_bytes;
  measurement.copies = result.copies;
  return measurement;
}

#else

namespace {
[[noreturn]] void cuda_not_compiled() {
  detail::throw_error(
      "--backend: cuda is not in this build (configure with nvcc found and "
      "MJOLNIR_CUDA=ON)");
}
}  // namespace

GpuLimit measure_gpu_limit() { cuda_not_compiled(); }

Measurement measure_cuda(const verify::ProblemSpec&, const PlanOptions&, const TimingOptions&) {
  cuda_not_compiled();
}

#endif

}  // namespace mjolnir::tools

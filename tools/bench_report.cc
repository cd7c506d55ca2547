// `mjolnir bench`'s table and results entries (bench_report.h).
#include "bench_report.h"

#include <cstdio>

namespace mjolnir::tools {

namespace {
constexpr double kMiB = double(std::size_t{1} << 20);
}  // namespace

void print_table_header() {
  std::printf("%-9s %6s %8s %6s %12s %10s %8s %8s %7s %10s\n", "format", "batch", "context",
              "q_len", "median_us", "KV_MiB", "GB/s", "limit", "of_bw", "err_exact");
  std::fflush(stdout);
}

void print_row(const Row& row) {
  std::printf("%-9s %6d %8d %6d %12.1f %10.1f %8.2f %8.2f %6.0f%% %10.2e\n",
              std::string(to_string(row.spec.format)).c_str(), row.batch(), row.context(),
              row.spec.params.q_len, row.measurement.timing.median_us,
              static_cast<double>(row.measurement.kv_bytes) / kMiB, row.gbps, row.limit_gbps,
              100 * row.bandwidth_fraction, row.rel_error_vs_exact);
  std::fflush(stdout);
}

nlohmann::ordered_json to_json(const Row& row) {
  const verify::ProblemSpec& spec = row.spec;
  return {
      {"backend", row.backend},
      {"series", row.series},
      {"format", std::string(to_string(spec.format))},
      {"batch", row.batch()},
      {"context", row.context()},
      {"q_len", spec.params.q_len},
      {"hq", spec.num_kv_heads * spec.group},
      {"hk", spec.num_kv_heads},
      {"d", spec.head_dim},
      {"page", spec.page_size},
      {"layout", std::string(to_string(spec.layout))},
      {"granularity", std::string(to_string(spec.granularity))},
      {"q_mode", std::string(to_string(spec.params.q_mode))},
      {"p_mode", std::string(to_string(spec.params.p_mode))},
      {"qk_bf16_dot", row.qk_bf16_dot},
      {"median_us", row.measurement.timing.median_us},
      {"runs", row.measurement.timing.runs},
      {"kv_bytes", row.measurement.kv_bytes},
      {"working_set_bytes", row.measurement.working_set_bytes},
      {"copies", row.measurement.copies},
      {"floor_us", row.floor_us},
      {"gbps", row.gbps},
      {"limit_gbps", row.limit_gbps},
      {"bandwidth_fraction", row.bandwidth_fraction},
      {"rel_error_vs_exact", row.rel_error_vs_exact},
  };
}

}  // namespace mjolnir::tools

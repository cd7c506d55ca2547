// `mjolnir bench`'s table and results entries (bench_report.h).
#include "bench_report.h"

#include <algorithm>
#include <cstdio>
#include <utility>

namespace mjolnir::tools {

namespace {
constexpr double kMiB = double(std::size_t{1} << 20);
}  // namespace

template <class Mode>
std::string describe_modes(const std::string& option, const std::vector<verify::ProblemSpec>& specs,
                           Mode DecodeParams::*mode) {
  if (option != "auto") return option;
  if (specs.empty()) return "auto";
  // The modes in the order they first appear, each with its formats.
  std::vector<std::pair<Mode, std::vector<std::string>>> groups;
  for (const verify::ProblemSpec& spec : specs) {
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& g) { return g.first == spec.params.*mode; });
    if (group == groups.end()) group = groups.insert(groups.end(), {spec.params.*mode, {}});
    group->second.emplace_back(to_string(spec.format));
  }
  if (groups.size() == 1) return "auto: " + std::string(to_string(groups.front().first));
  std::stable_sort(groups.begin(), groups.end(),
                   [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
  std::string text = "auto (";
  for (std::size_t i = 0; i + 1 < groups.size(); ++i) {
    text += std::string(to_string(groups[i].first)) + " for ";
    for (std::size_t j = 0; j < groups[i].second.size(); ++j) {
      text += (j == 0 ? "" : ", ") + groups[i].second[j];
    }
    text += "; ";
  }
  return text + std::string(to_string(groups.back().first)) + " for the rest)";
}
template std::string describe_modes(const std::string&, const std::vector<verify::ProblemSpec>&,
                                    QMode DecodeParams::*);
template std::string describe_modes(const std::string&, const std::vector<verify::ProblemSpec>&,
                                    PMode DecodeParams::*);

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

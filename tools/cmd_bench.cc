#include "cmd_bench.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/compute_peak.h"
#include "bench/huge_pages.h"
#include "bench/read_bandwidth.h"
#include "bench_cuda.h"
#include "bench_report.h"
#include "bench_series.h"
#include "bench_workload.h"
#include "cpu/attention_kernel.h"
#include "cpu/cpu_backend.h"
#include "host_backend.h"
#include "machine_info.h"
#include "mjolnir/calibrate.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "mjolnir/plan.h"
#include "verify/problem.h"

namespace mjolnir::tools {

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
// Working sets below this (or 4x the last-level cache) would time the cache, not memory.
constexpr std::size_t kMinWorkingSetBytes = 512 * kMiB;
// The copies may take at most this share of the memory available when the bench starts, and
// never more than this many bytes: the bench must not push a serving machine into swap.
constexpr double kMemoryShare = 0.5;
constexpr std::size_t kMaxCopiesBytes = 16 * kGiB;
// Positions per sequence with their own drawn K/V (verify::ProblemSpec::distinct_positions).
constexpr int kDistinctPositions = 4096;

std::size_t copies_memory_limit() {
  const std::size_t available = available_memory_bytes();
  if (available == 0) return 4 * kGiB;  // /proc/meminfo unreadable: stay modest
  return std::min(kMaxCopiesBytes, static_cast<std::size_t>(kMemoryShare * available));
}

verify::ProblemSpec base_spec(const BenchOptions& options, const Series& series) {
  const Heads& heads = series.heads;
  verify::ProblemSpec spec;
  spec.layout = parse_layout(options.layout, "--layout");
  // Empty: each format's recommended granularity, set per row (with_format).
  if (!options.granularity.empty()) {
    spec.granularity = parse_granularity(options.granularity, "--granularity");
  }
  spec.page_size = options.page_size;
  spec.head_dim = series.head_dim;
  spec.num_kv_heads = heads.num_kv_heads;
  spec.group = heads.num_q_heads / heads.num_kv_heads;
  spec.params.q_len = series.q_len;
  spec.params.num_q_heads = heads.num_q_heads;
  // "auto": the backend's choice per format (with_format), for a bf16 model's queries.
  if (options.q_mode != "auto") spec.params.q_mode = parse_q_mode(options.q_mode);
  if (options.p_mode != "auto") spec.params.p_mode = parse_p_mode(options.p_mode);
  spec.bf16_queries = options.q_mode == "auto" || options.p_mode == "auto";
  spec.seed = options.seed;
  // Long caches repeat the K/V of their first positions on every later page: a batch of 8 x 128k
  // tokens would otherwise draw 2G normal values. The bytes read are the same.
  spec.distinct_positions = kDistinctPositions;
  return spec;
}

// The base spec for one format: the --granularity given, or the format's recommended one; the
// Q and P modes given, or those the backend picks for the format ("auto": Backend::auto_modes).
verify::ProblemSpec with_format(verify::ProblemSpec spec, const BenchOptions& options,
                                const Backend& backend, Format format) {
  spec.format = format;
  if (options.granularity.empty()) spec.granularity = recommended_granularity(format);
  CacheGeometry geometry;
  geometry.format = format;
  geometry.head_dim = spec.head_dim;
  geometry.num_kv_heads = spec.num_kv_heads;
  geometry.page_size = spec.page_size;
  const NumericsModes modes =
      backend.auto_modes(geometry, spec.params.q_len * spec.group, spec.bf16_queries);
  if (options.q_mode == "auto") spec.params.q_mode = modes.q_mode;
  if (options.p_mode == "auto") spec.params.p_mode = modes.p_mode;
  return spec;
}

// "channel scales", or "channel scales (recommended)" when the flag is not given and the
// formats share their recommended granularity, else "each format's recommended scales".
std::string scales_description(const BenchOptions& options, const std::vector<Format>& formats) {
  if (!options.granularity.empty()) return options.granularity + " scales";
  if (formats.empty()) return "recommended scales";
  const ScaleGranularity first = recommended_granularity(formats.front());
  for (const Format format : formats) {
    if (recommended_granularity(format) != first) return "each format's recommended scales";
  }
  return std::string(to_string(first)) + " scales (recommended)";
}

// Builds a one-sequence problem of every format, so a bad flag (a page size, a head size) fails
// now with the library's own message, not after the bandwidth measurement.
void check_configurations(const verify::ProblemSpec& base, const BenchOptions& options,
                          const Backend& backend, const std::vector<Format>& formats) {
  for (const Format format : formats) {
    verify::ProblemSpec spec = with_format(base, options, backend, format);
    spec.seq_lens = {spec.params.q_len};
    spec.keep_original_kv = false;
    verify::Problem problem(spec);
    validate(problem.args());
  }
}

// The physical limit the results are set against, measured at the start of the run: the CPU's
// read bandwidth for host backends (measured again after every row, see Row::limit_gbps), the
// card's copy bandwidth for cuda.
struct Limit {
  double gbps = 0;
  std::string what;                // for the header line
  nlohmann::ordered_json machine;  // the JSON "machine" object
  int threads = 0;                 // CPU: the read-bandwidth probe's threads and buffer
  std::size_t probe_bytes = 0;

  bool per_row() const { return probe_bytes != 0; }
};

Limit measure_limit(bool on_gpu, int threads) {
  Limit limit;
  if (on_gpu) {
    std::fprintf(stderr, "bench: measuring the GPU's copy bandwidth\n");
    const GpuLimit gpu = measure_gpu_limit();
    limit.gbps = gpu.copy_bandwidth_gbps;
    limit.what = gpu.device + ", copy bandwidth (read + write)";
    limit.machine = {{"gpu", gpu.device},
                     {"copy_bandwidth_gbps", gpu.copy_bandwidth_gbps},
                     {"cpu", cpu_model_name()},
                     {"threads", threads}};
    return limit;
  }
  const std::size_t llc = cpu::last_level_cache_bytes();
  const std::size_t bytes = cpu::default_read_bandwidth_bytes();
  std::fprintf(stderr, "bench: measuring read bandwidth (%d threads, %s buffer)\n", threads,
               format_bytes(bytes).c_str());
  limit.gbps = cpu::measure_read_bandwidth_gbps(threads, bytes);
  limit.threads = threads;
  limit.probe_bytes = bytes;
  // Not the limit the rows are divided by, but the one that binds when decoding is compute
  // bound (few bytes per element, many query rows): docs/cpu-performance.md shows both.
  const double fma_gflops = cpu::measure_fma_peak_gflops(threads);
  std::fprintf(stderr, "bench: fp32 FMA peak %.1f GFLOP/s (%d threads)\n", fma_gflops, threads);
  const std::string huge_pages = cpu::transparent_huge_pages_mode();
  limit.what = cpu_model_name() + ", " + std::to_string(threads) + " threads, last-level cache " +
               format_bytes(llc) + ", huge pages " + huge_pages + ", read bandwidth";
  limit.machine = {{"read_bandwidth_gbps", limit.gbps},
                   {"fma_peak_gflops", fma_gflops},
                   {"cpu", cpu_model_name()},
                   {"simd_target", cpu::dispatched_simd_target()},
                   {"bf16_dot_products",
                    cpu::resolve_kernel_config(cpu_kernel_options_from_environment()).bf16_dot},
                   {"threads", threads},
                   {"llc_bytes", llc},
                   {"transparent_huge_pages", huge_pages}};
  return limit;
}

// Times the step and checks its accuracy. nullopt (after saying why) when the backend does not
// support the configuration. `host_backend` takes host arguments (for cuda: the staging
// adapter); it answers the support question and runs the accuracy check.
std::optional<Row> measure(const Backend& host_backend, bool on_gpu,
                           const verify::ProblemSpec& spec, const PlanOptions& plan_options,
                           const TimingOptions& timing, const Limit& limit) {
  CacheGeometry geometry;
  geometry.format = spec.format;
  geometry.page_size = spec.page_size;
  geometry.num_kv_heads = spec.num_kv_heads;
  geometry.head_dim = spec.head_dim;
  const std::string unsupported = host_backend.unsupported_reason(geometry, spec.params);
  if (!unsupported.empty()) {
    std::printf("%-9s %6zu %8d unsupported: %s\n", std::string(to_string(spec.format)).c_str(),
                spec.seq_lens.size(), spec.seq_lens[0], unsupported.c_str());
    return std::nullopt;
  }

  Row row;
  row.backend = host_backend.name();
  row.spec = spec;
  row.qk_bf16_dot = !on_gpu && row.backend == "cpu" && spec.params.p_mode != PMode::fp8 &&
                    cpu::bf16_dot_applies(cpu::kernel_config(host_backend), spec.format,
                                          spec.params.q_mode, spec.head_dim);
  // Working sets below this (or 4x the last-level cache) would time the cache, not memory.
  const std::size_t working_set = std::max(kMinWorkingSetBytes, 4 * cpu::last_level_cache_bytes());
  row.measurement = on_gpu ? measure_cuda(spec, plan_options, timing)
                           : measure_host_backend(host_backend, spec, plan_options, timing,
                                                  working_set, copies_memory_limit());
  row.gbps = static_cast<double>(row.measurement.kv_bytes) /
             (row.measurement.timing.median_us * 1e-6) / 1e9;
  row.limit_gbps = limit.per_row()
                       ? cpu::measure_read_bandwidth_gbps(limit.threads, limit.probe_bytes)
                       : limit.gbps;
  row.bandwidth_fraction = row.gbps / row.limit_gbps;
  row.floor_us = static_cast<double>(row.measurement.kv_bytes) / (row.limit_gbps * 1e9) * 1e6;
  row.rel_error_vs_exact = error_vs_exact(host_backend, spec, plan_options);
  return row;
}

// CLI11's PositiveNumber and NonNegativeNumber print the whole range of a double ("0.000000 to
// 1797693134862315...") when a value is out of it; these say what the argument must be.
CLI::Validator NumberAtLeast(double least, bool inclusive, const char* description) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(text, value)) return "'" + text + "' is not a number";
        if (inclusive ? value >= least : value > least) return {};
        return std::string("must be ") + description + ", got " + text;
      },
      description);
}
const CLI::Validator kPositive = NumberAtLeast(0, false, "positive");
const CLI::Validator kNonNegative = NumberAtLeast(0, true, "at least 0");

}  // namespace

CLI::App* add_bench_command(CLI::App& app, BenchOptions& options) {
  CLI::App* cmd = app.add_subcommand(
      "bench", "Time decode steps against this machine's measured read bandwidth");
  cmd->add_option("--backend", options.backend, "Backend to time: cpu, reference or cuda")
      ->capture_default_str();
  cmd->add_option("--format", options.formats,
                  "KV cache format (repeatable or comma list; 'all' for every format)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--context", options.contexts, "KV tokens per sequence (repeatable or list)")
      ->delimiter(',')
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--batch", options.batches, "Sequences in the step (repeatable or list)")
      ->delimiter(',')
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--q-len", options.q_len, "Query tokens per sequence (1 + speculative)")
      ->check(CLI::Range(1, kMaxQLen))
      ->capture_default_str();
  cmd->add_option("--heads", options.heads, "Query and KV heads, HQ:HK")->capture_default_str();
  cmd->add_option("--head-dim", options.head_dim, "Channels per head (D)")->capture_default_str();
  cmd->add_option("--page-size", options.page_size, "Tokens per page")->capture_default_str();
  cmd->add_option("--layout", options.layout, "Cache layout: BHN2D BNH2D B2NHD B2HND 2BNHD 2BHND")
      ->capture_default_str();
  cmd->add_option("--granularity", options.granularity,
                  "Scale granularity: tensor, head, channel (default: each format's recommended "
                  "one, docs/accuracy.md)");
  cmd->add_option("--q-mode", options.q_mode,
                  "Q numerics: auto (the backend's choice for a bf16 model's queries), fp32, "
                  "bf16, fp8, int8")
      ->capture_default_str();
  cmd->add_option("--p-mode", options.p_mode,
                  "P numerics: auto (the backend's choice), fp32, bf16, fp8, fp16")
      ->capture_default_str();
  cmd->add_option("--threads", options.threads, "CPU threads (0: every hardware thread)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--max-splits", options.max_splits,
                  "Cap on split-KV chunks per sequence (0: as many as fill the device at the "
                  "batch, at least 16)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--iterations", options.iterations,
                  "Timed runs per configuration (0: as many as fit in --min-time)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--min-time", options.min_time_s, "Seconds to time each configuration for")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--seed", options.seed, "Seed of the generated cache")->capture_default_str();
  cmd->add_option("--json", options.json_path, "Also write the results to this JSON file");
  CLI::Option* sweep =
      cmd->add_flag("--sweep", options.sweep,
                    "Run the fixed sweep (every format; 8k-128k; q_len 4; short contexts; Hq 64 "
                    "and D 256) and write its JSON to --results-dir unless --json is given");
  cmd->add_option("--results-dir", options.results_dir, "Folder of the sweep's dated JSON file")
      ->capture_default_str();
  for (const char* grid_flag :
       {"--format", "--context", "--batch", "--q-len", "--heads", "--head-dim"}) {
    sweep->excludes(cmd->get_option(grid_flag));
  }
  return cmd;
}

int run_bench(const BenchOptions& options) {
  const bool on_gpu = options.backend == "cuda";
  const std::vector<Series> runs =
      options.sweep ? sweep_series(on_gpu) : std::vector<Series>{series_from_flags(options)};
  const int threads = options.threads > 0 ? options.threads : hardware_threads();

  BackendOptions backend_options;
  backend_options.threads = threads;
  const auto backend = make_host_backend(options.backend, backend_options);
  const std::string unavailable = backend->unavailable_reason();
  MJOLNIR_REQUIRE(unavailable.empty(), "--backend: ", options.backend,
                  " cannot run here: ", unavailable);

  for (const Series& series : runs) {
    check_configurations(base_spec(options, series), options, *backend, series.formats);
    for (const int context : series.contexts) {
      // The context counts the q_len new tokens, which are in the cache when attention runs.
      MJOLNIR_REQUIRE(context >= series.q_len, "--context: ", context,
                      " tokens cannot hold the --q-len ", series.q_len, " new ones");
    }
  }
  const Limit limit = measure_limit(on_gpu, threads);

  // Opened before measuring, so an unwritable path fails now, not after minutes of work.
  std::string json_path = options.json_path;
  if (json_path.empty() && options.sweep) {
    const std::string machine = limit.machine.contains("gpu")
                                    ? limit.machine["gpu"].get<std::string>()
                                    : cpu_model_name() + " " + std::to_string(threads) + "t";
    json_path = unused_results_path(sweep_results_path(options.results_dir,
                                                       std::string(backend->name()), utc_date(),
                                                       machine, options.q_mode, options.p_mode));
  }
  std::ofstream json_file;
  if (!json_path.empty()) {
    json_file.open(json_path);
    MJOLNIR_REQUIRE(json_file.good(), options.json_path.empty() ? "--results-dir" : "--json",
                    ": cannot open '", json_path, "' for writing");
  }

  const PlanOptions plan_options = backend->plan_options();
  TimingOptions timing;
  timing.iterations = options.iterations;
  timing.min_time_s = options.min_time_s;

  std::printf("machine: %s %.2f GB/s\n", limit.what.c_str(), limit.gbps);
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const Series& series : runs) {
    const verify::ProblemSpec base = base_spec(options, series);
    std::vector<verify::ProblemSpec> per_format;
    for (const Format format : series.formats) {
      per_format.push_back(with_format(base, options, *backend, format));
    }
    std::printf("%sworkload: backend %s, Hq %d, Hk %d, D %d, page %d, %s, %s, q %s, p %s\n",
                series.name.empty() ? "" : ("\n[" + series.name + "] ").c_str(),
                std::string(backend->name()).c_str(), series.heads.num_q_heads,
                series.heads.num_kv_heads, series.head_dim, options.page_size,
                std::string(to_string(base.layout)).c_str(),
                scales_description(options, series.formats).c_str(),
                describe_modes(options.q_mode, per_format, &DecodeParams::q_mode).c_str(),
                describe_modes(options.p_mode, per_format, &DecodeParams::p_mode).c_str());
    print_table_header();
    for (const int batch : series.batches) {
      for (const Format format : series.formats) {
        for (const int context : series.contexts) {
          verify::ProblemSpec spec = with_format(base, options, *backend, format);
          spec.seq_lens.assign(batch, context);
          PlanOptions row_plan = plan_options;
          row_plan.max_splits = options.max_splits;
          row_plan.max_splits = effective_max_splits(row_plan, batch, series.heads.num_kv_heads);
          std::optional<Row> row = measure(*backend, on_gpu, spec, row_plan, timing, limit);
          if (!row) continue;
          row->series = series.name;
          print_row(*row);
          results.push_back(to_json(*row));
        }
      }
    }
  }

  if (json_file.is_open()) {
    nlohmann::ordered_json machine = limit.machine;
    machine["date"] = utc_date();
    const nlohmann::ordered_json document = {{"machine", machine}, {"results", results}};
    json_file << document.dump(2) << '\n';
    MJOLNIR_REQUIRE(json_file.good(), "--json: writing '", json_path, "' failed");
    std::printf("results: %s\n", json_path.c_str());
  }
  return 0;
}

}  // namespace mjolnir::tools

#include "cmd_accuracy.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/read_bandwidth.h"
#include "host_backend.h"
#include "machine_info.h"
#include "mjolnir/calibrate.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "reference/exact.h"
#include "verify/block_formats.h"
#include "verify/problem.h"

namespace mjolnir::tools {

namespace {

constexpr verify::BlockFormat kBlockFormats[] = {verify::BlockFormat::q8_0,
                                                 verify::BlockFormat::q4_0};
constexpr QMode kQModes[] = {QMode::fp32, QMode::bf16, QMode::fp8, QMode::int8};
constexpr PMode kPModes[] = {PMode::fp32, PMode::bf16, PMode::fp8, PMode::fp16};
constexpr ScaleGranularity kGranularities[] = {ScaleGranularity::tensor, ScaleGranularity::head,
                                               ScaleGranularity::channel};
// The mode the granularities are compared in: a bf16 model's queries on the CPU (Q bf16, P fp32).
constexpr QMode kCompareQ = QMode::bf16;
constexpr PMode kCompareP = PMode::fp32;

// One distribution of K (V is plain N(0, 1) in both).
struct Data {
  const char* name;
  const char* description;
  bool k_outlier_channels;
};
constexpr Data kData[] = {
    {"outlier_k", "K with outlier channels (x8 on one channel in 23, as real models' K has)", true},
    {"gaussian", "plain N(0, 1) K", false},
};

// The step every case runs: a Llama-3-8B layer (Hq 32, Hk 8, D 128), vLLM's layout, page 16,
// one query token per sequence whose values are bf16 values (a bf16 model's).
verify::ProblemSpec base_spec(const AccuracyOptions& options, const Data& data) {
  verify::ProblemSpec spec;
  spec.layout = Layout::B2NHD;
  spec.page_size = 16;
  spec.head_dim = 128;
  spec.num_kv_heads = 8;
  spec.group = 4;
  spec.params.q_len = 1;
  spec.seq_lens.assign(std::size_t(options.batch), options.context);
  spec.keep_original_kv = true;
  spec.bf16_queries = true;
  spec.k_outlier_channels = data.k_outlier_channels;
  spec.seed = options.seed;
  spec.scale_headroom = options.headroom;
  return spec;
}

// Relative L2 error over every output of the step: sqrt(sum (o - exact)^2 / sum exact^2).
double relative_error(std::span<const float> o, const std::vector<double>& exact) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < o.size(); ++i) {
    diff += (o[i] - exact[i]) * (o[i] - exact[i]);
    norm += exact[i] * exact[i];
  }
  return std::sqrt(diff / norm);
}

// The error of llama.cpp's block format on the problem's data: K and V rounded through it, and Q
// through q8_0 as ggml's CPU flash attention does before its q8_0 / q4_0 dot products; the rest
// exact (ggml's own softmax and accumulation rounding are not counted, so this is a lower bound
// on what its kernel gives).
double block_format_error(verify::BlockFormat format, verify::Problem& problem,
                          const std::vector<double>& exact) {
  DecodeArgs args = problem.args();
  const int d = problem.spec().head_dim;
  std::vector<float> q = problem.query();
  for (std::size_t row = 0; row < q.size(); row += std::size_t(d)) {
    const std::span<float> values(&q[row], std::size_t(d));
    verify::round_trip(verify::BlockFormat::q8_0, values, values);
  }
  args.q.data = q.data();
  std::vector<float> rounded(static_cast<std::size_t>(d));
  const reference::ExactResult result = reference::exact_attention(
      args, [&](int seq, int head, int position, int kv, std::span<double> out) {
        const float* original = problem.original_kv(seq, head, position, kv);
        verify::round_trip(format, std::span<const float>(original, std::size_t(d)), rounded);
        std::copy(rounded.begin(), rounded.end(), out.begin());
      });
  std::vector<float> o(result.o.begin(), result.o.end());
  return relative_error(o, exact);
}

struct Case {
  std::string data;
  std::uint64_t seed;
  Format format;
  ScaleGranularity granularity;
  QMode q_mode;
  PMode p_mode;
  double error;
};

double bits_per_value(Format format, int head_dim) {
  return 8.0 * static_cast<double>(row_bytes(format, head_dim)) / head_dim;
}

// A configuration's errors over the seeds: their mean and spread.
struct Summary {
  int seeds = 0;
  double mean = 0, min = INFINITY, max = 0;
};

Summary summarize(const std::vector<Case>& cases, const std::string& data, Format format,
                  ScaleGranularity granularity, QMode q, PMode p) {
  Summary s;
  for (const Case& c : cases) {
    if (c.data == data && c.format == format && c.granularity == granularity && c.q_mode == q &&
        c.p_mode == p) {
      ++s.seeds;
      s.mean += c.error;
      s.min = std::min(s.min, c.error);
      s.max = std::max(s.max, c.error);
    }
  }
  if (s.seeds > 0) s.mean /= s.seeds;
  return s;
}

// Whether the library's recommended granularity measured worse than another one on K with
// outlier channels by more than the seed-to-seed spread of both (then it names that one).
std::optional<ScaleGranularity> measured_better(const std::vector<Case>& cases, Format format) {
  const ScaleGranularity library = recommended_granularity(format);
  const Summary ours = summarize(cases, kData[0].name, format, library, kCompareQ, kCompareP);
  for (const ScaleGranularity g : kGranularities) {
    const Summary other = summarize(cases, kData[0].name, format, g, kCompareQ, kCompareP);
    if (g != library && other.seeds > 0 && ours.seeds > 0 && other.max < ours.min) return g;
  }
  return std::nullopt;
}

std::vector<Format> parse_formats(const std::vector<std::string>& names) {
  std::vector<Format> formats;
  for (const std::string& name : names) {
    if (name == "all") {
      formats.assign(std::begin(kAllFormats), std::end(kAllFormats));
    } else {
      formats.push_back(parse_format(name, "--format"));
    }
  }
  return formats;
}

}  // namespace

CLI::App* add_accuracy_command(CLI::App& app, AccuracyOptions& options) {
  CLI::App* cmd = app.add_subcommand(
      "accuracy",
      "Error of every format x scale granularity x numerics mode against the exact reference, "
      "beside llama.cpp's q8_0 and q4_0 on the same data");
  cmd->add_option("--backend", options.backend, "Backend to run: cpu or reference")
      ->capture_default_str();
  cmd->add_option("--format", options.formats, "KV cache formats (comma list, or 'all')")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--context", options.context, "KV tokens per sequence")
      ->check(CLI::Range(16, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--batch", options.batch, "Sequences (the error is over all their outputs)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--seed", options.seed, "Seed of the first draw of the data")
      ->capture_default_str();
  cmd->add_option("--seeds", options.seeds,
                  "Draws of the data (seed, seed + 1, ...): the tables give the mean, and a "
                  "granularity is only called better beyond the spread between draws")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--headroom", options.headroom,
                  "Factor on the amax the scales are calibrated from (below 1 clips the largest "
                  "values), as mjolnir calibrate --headroom")
      ->check(CLI::Range(0.05, 16.0))
      ->capture_default_str();
  cmd->add_option("--json", options.json_path, "Also write the results to this JSON file");
  return cmd;
}

int run_accuracy(const AccuracyOptions& options) {
  const std::vector<Format> formats = parse_formats(options.formats);
  const auto backend = make_host_backend(options.backend);
  const std::string unavailable = backend->unavailable_reason();
  MJOLNIR_REQUIRE(unavailable.empty(), "--backend: ", options.backend,
                  " cannot run here: ", unavailable);
  std::ofstream json_file;
  if (!options.json_path.empty()) {
    json_file.open(options.json_path);
    MJOLNIR_REQUIRE(json_file.good(), "--json: cannot open '", options.json_path, "' for writing");
  }

  std::vector<Case> cases;
  nlohmann::ordered_json block_rows = nlohmann::ordered_json::array();
  // data -> block format -> its error per seed
  std::map<std::string, std::map<std::string, std::vector<double>>> block_errors;
  for (const Data& data : kData) {
    for (int i = 0; i < options.seeds; ++i) {
      const std::uint64_t seed = options.seed + std::uint64_t(i);
      std::fprintf(stderr, "accuracy: %s, seed %llu: the exact reference, q8_0, q4_0...\n",
                   data.name, static_cast<unsigned long long>(seed));
      verify::ProblemSpec spec = base_spec(options, data);
      spec.seed = seed;
      spec.format = Format::bf16;
      verify::Problem originals(spec);
      const reference::ExactResult exact = reference::exact_attention(
          originals.args(), [&](int seq, int head, int position, int kv, std::span<double> out) {
            const float* original = originals.original_kv(seq, head, position, kv);
            std::copy(original, original + spec.head_dim, out.begin());
          });

      for (const verify::BlockFormat block : kBlockFormats) {
        const double error = block_format_error(block, originals, exact.o);
        const std::string name(verify::to_string(block));
        block_errors[data.name][name].push_back(error);
        block_rows.push_back({{"data", data.name},
                              {"seed", seed},
                              {"format", name},
                              {"bits", verify::block_format_bits(block)},
                              {"rel_error", error}});
      }

      for (const Format format : formats) {
        std::fprintf(stderr, "accuracy: %s, seed %llu: %s\n", data.name,
                     static_cast<unsigned long long>(seed), std::string(to_string(format)).c_str());
        for (const ScaleGranularity granularity : kGranularities) {
          // 16-bit caches have no scale to choose: scale 1, reported once as "tensor".
          if (!is_quantized(format) && granularity != ScaleGranularity::tensor) continue;
          const bool recommended =
              !is_quantized(format) || granularity == recommended_granularity(format);
          spec.format = format;
          spec.granularity = granularity;
          verify::Problem problem(spec);
          MJOLNIR_REQUIRE(problem.query() == originals.query(),
                          "accuracy: the generated queries differ between formats");
          // Every granularity in the comparison mode; every mode at the recommended one.
          for (const QMode q_mode : kQModes) {
            for (const PMode p_mode : kPModes) {
              const bool compare = q_mode == kCompareQ && p_mode == kCompareP;
              if (!compare && !recommended) continue;
              if (p_mode == PMode::fp16 && !half_sums_take(format)) continue;
              DecodeArgs args = problem.args();
              args.params.q_mode = q_mode;
              args.params.p_mode = p_mode;
              if (!backend->unsupported_reason(args.cache.geometry, args.params).empty()) continue;
              decode(*backend, args);
              cases.push_back({data.name, seed, format, granularity, q_mode, p_mode,
                               relative_error(problem.output(), exact.o)});
            }
          }
        }
      }
    }
  }

  // The tables: per distribution, the granularities in the comparison mode (mean over the
  // seeds); what the library recommends, and where the measurement says otherwise.
  for (const Data& data : kData) {
    std::printf("\n%s; V N(0, 1). Hq 32, Hk 8, D 128, %d x %d tokens, Q bf16 values, %d seeds\n",
                data.description, options.batch, options.context, options.seeds);
    std::printf(
        "relative L2 error of the output against fp64 attention over the unquantized K/V "
        "(Q %s, P %s), mean over the seeds:\n",
        std::string(to_string(kCompareQ)).c_str(), std::string(to_string(kCompareP)).c_str());
    std::printf("%-10s %5s %9s %9s %9s   %s\n", "format", "bits", "tensor", "head", "channel",
                "recommended");
    for (const Format format : formats) {
      std::printf("%-10s %5.2g", std::string(to_string(format)).c_str(),
                  bits_per_value(format, 128));
      for (const ScaleGranularity g : kGranularities) {
        const Summary summary = summarize(cases, data.name, format, g, kCompareQ, kCompareP);
        if (summary.seeds > 0) {
          std::printf(" %9.2e", summary.mean);
        } else {
          std::printf(" %9s", "-");
        }
      }
      std::printf("   %s\n", std::string(to_string(recommended_granularity(format))).c_str());
    }
    for (const verify::BlockFormat block : kBlockFormats) {
      const std::string name(verify::to_string(block));
      const std::vector<double>& errors = block_errors[data.name][name];
      double mean = 0;
      for (const double e : errors) mean += e;
      mean /= static_cast<double>(errors.size());
      std::printf("%-10s %5.2g %29.2e   (llama.cpp: blocks of 32, an fp16 scale each; Q in q8_0)\n",
                  name.c_str(), verify::block_format_bits(block), mean);
    }
  }

  nlohmann::ordered_json recommended = nlohmann::ordered_json::object();
  bool agree = true;
  for (const Format format : formats) {
    if (!is_quantized(format)) continue;
    const std::optional<ScaleGranularity> better = measured_better(cases, format);
    recommended[std::string(to_string(format))] = {
        {"library", std::string(to_string(recommended_granularity(format)))},
        {"measured_better", better ? std::string(to_string(*better)) : ""}};
    if (better) {
      agree = false;
      std::printf("note: %s: %s scales measured better than the recommended %s on every seed\n",
                  std::string(to_string(format)).c_str(), std::string(to_string(*better)).c_str(),
                  std::string(to_string(recommended_granularity(format))).c_str());
    }
  }
  if (agree) {
    std::printf(
        "\nNo granularity measured better than the recommended one (calibrate.h's "
        "recommended_granularity) beyond the spread over the seeds.\n");
  }

  if (json_file.is_open()) {
    nlohmann::ordered_json rows = nlohmann::ordered_json::array();
    for (const Case& c : cases) {
      rows.push_back({{"data", c.data},
                      {"seed", c.seed},
                      {"format", std::string(to_string(c.format))},
                      {"bits", bits_per_value(c.format, 128)},
                      {"granularity", std::string(to_string(c.granularity))},
                      {"q_mode", std::string(to_string(c.q_mode))},
                      {"p_mode", std::string(to_string(c.p_mode))},
                      {"rel_error", c.error}});
    }
    nlohmann::ordered_json document;
    document["mjolnir_accuracy_version"] = 1;
    document["date"] = utc_date();
    document["machine"] = {{"cpu", cpu_model_name()},
                           {"simd_target", cpu::dispatched_simd_target()}};
    document["backend"] = std::string(backend->name());
    document["shape"] = {{"hq", 32},
                         {"hk", 8},
                         {"d", 128},
                         {"page", 16},
                         {"layout", "B2NHD"},
                         {"batch", options.batch},
                         {"context", options.context},
                         {"q_len", 1},
                         {"queries", "bf16 values"}};
    document["headroom"] = options.headroom;
    document["seeds"] = options.seeds;
    document["compare_mode"] = {{"q_mode", std::string(to_string(kCompareQ))},
                                {"p_mode", std::string(to_string(kCompareP))}};
    document["recommended"] = recommended;
    document["rows"] = rows;
    document["block_formats"] = block_rows;
    json_file << document.dump(1) << '\n';
    MJOLNIR_REQUIRE(json_file.good(), "--json: writing '", options.json_path, "' failed");
    std::printf("results: %s\n", options.json_path.c_str());
  }
  return 0;
}

}  // namespace mjolnir::tools

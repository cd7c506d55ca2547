// The CUDA bench helper (label "gpu"): a smoke test that it measures, and — only when
// MJOLNIR_CUDA_BENCH_JSON names a file — the benchmark table scripts/device-check.sh records
// (until `mjolnir bench --backend cuda` calls cuda::bench_decode itself). Without a GPU it skips.
#include <gtest/gtest.h>

#include <string>

#include "core/gpu_devices.h"
#include "gpu_skip.h"

#if MJOLNIR_HAS_CUDA
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench/cuda_bench.h"
#endif

namespace mjolnir {
namespace {

#if MJOLNIR_HAS_CUDA

TEST(CudaBench, MeasuresASmallStep) {
  MJOLNIR_SKIP_WITHOUT_GPU();
  cuda::BenchSpec spec;
  spec.batch = 2;
  spec.context = 1000;
  spec.repeats = 3;
  spec.min_working_set_bytes = 0;  // one copy: this checks the helper, it does not time HBM
  const cuda::BenchResult r = cuda::bench_decode(spec);
  EXPECT_GT(r.median_us, 0);
  EXPECT_GT(r.gbps, 0);
  EXPECT_GT(r.num_items, 0);
  EXPECT_GE(r.copies, 1);
  const double copy = cuda::copy_bandwidth_gbps(std::size_t{256} << 20, 3);
  EXPECT_GT(copy, 0);
  const double read = cuda::read_bandwidth_gbps(std::size_t{256} << 20, 3);
  EXPECT_GT(read, 0);
  std::printf(
      "[ cuda     ] %s: smoke step %.1f us (%.1f GB/s); copy bandwidth %.0f GB/s, read %.0f GB/s\n",
      r.device.c_str(), r.median_us, r.gbps, copy, read);
}

// Today's date (UTC), YYYY-MM-DD, for the results file.
std::string today() {
  const std::time_t now = std::time(nullptr);
  char text[16];
  std::strftime(text, sizeof(text), "%Y-%m-%d", std::gmtime(&now));
  return text;
}

// The configurations of the CUDA issue's targets (Hq 32, Hk 8, D 128, page 16, q_len 1 unless
// named), fp8 first. MJOLNIR_CUDA_BENCH_SET=short keeps the first few.
std::vector<cuda::BenchSpec> bench_configs() {
  std::vector<cuda::BenchSpec> configs;
  auto add = [&](Format format, int batch, int context, int q_len = 1, int hq = 32, int d = 128) {
    cuda::BenchSpec s;
    s.format = format;
    s.batch = batch;
    s.context = context;
    s.q_len = q_len;
    s.num_q_heads = hq;
    s.head_dim = d;
    configs.push_back(s);
  };
  add(Format::fp8_e4m3, 16, 32768);
  add(Format::fp8_e4m3, 1, 32768);
  add(Format::fp8_e4m3, 16, 32768, 4);
  add(Format::bf16, 16, 32768);
  add(Format::fp4_e2m1, 16, 32768);
  add(Format::fp8_e4m3, 16, 8192);
  add(Format::fp8_e4m3, 16, 131072);
  add(Format::fp8_e4m3, 64, 8192);
  add(Format::fp8_e4m3, 64, 32768);
  add(Format::fp8_e4m3, 64, 131072);
  for (Format f : {Format::fp8_e5m2, Format::fp6_e2m3, Format::fp6_e3m2, Format::nvfp4}) {
    add(f, 16, 32768);
  }
  for (Format f : {Format::fp6_e2m3, Format::fp4_e2m1, Format::nvfp4, Format::bf16}) {
    add(f, 64, 32768);
  }
  add(Format::fp8_e4m3, 16, 32768, 1, 64);       // Hq 64, Hk 8
  add(Format::fp8_e4m3, 16, 32768, 1, 32, 256);  // D 256
  // Probes: fp8 Q (one operand term instead of two), and batch 1 capped at the old default of 16
  // chunks per sequence (128 CTAs) and at 48 (384 CTAs: one wave of three per SM, with three
  // times the tokens per CTA of the fill row's 128 chunks).
  add(Format::fp8_e4m3, 16, 32768);
  configs.back().q_mode = QMode::fp8;
  add(Format::fp8_e4m3, 1, 32768);
  configs.back().max_splits = 16;
  add(Format::fp8_e4m3, 1, 32768);
  configs.back().max_splits = 48;
  const char* set = std::getenv("MJOLNIR_CUDA_BENCH_SET");
  if (set != nullptr && std::string(set) == "short") configs.resize(5);
  return configs;
}

TEST(CudaBench, Table) {
  const char* path = std::getenv("MJOLNIR_CUDA_BENCH_JSON");
  if (path == nullptr) GTEST_SKIP() << "set MJOLNIR_CUDA_BENCH_JSON=<file> to run the table";
  MJOLNIR_SKIP_WITHOUT_GPU();
  const double copy = cuda::copy_bandwidth_gbps();
  const double read = cuda::read_bandwidth_gbps();
  const std::string device = cuda::device_name();
  std::printf(
      "device: %s, device-to-device copy bandwidth %.0f GB/s (read + write), read-only %.0f GB/s\n",
      device.c_str(), copy, read);
  std::printf("%-9s %6s %8s %6s %5s %5s %6s %12s %10s %8s %7s %7s %s\n", "format", "batch",
              "context", "q_len", "hq", "d", "chunks", "median_us", "KV_MiB", "GB/s", "of_read",
              "of_copy", "body");
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const cuda::BenchSpec& s : bench_configs()) {
    cuda::BenchResult r;
    try {
      r = cuda::bench_decode(s);
    } catch (const std::exception& e) {
      std::printf("%-9s %6d %8d failed: %s\n", std::string(to_string(s.format)).c_str(), s.batch,
                  s.context, e.what());
      ADD_FAILURE() << e.what();
      continue;
    }
    // The targets are fractions of the read-only bandwidth; the copy's is kept beside it
    // for comparison with the results measured before the read kernel existed.
    const double fraction = r.gbps / read;
    std::printf("%-9s %6d %8d %6d %5d %5d %6d %12.1f %10.1f %8.1f %6.1f%% %6.1f%% %s\n",
                std::string(to_string(s.format)).c_str(), s.batch, s.context, s.q_len,
                s.num_q_heads, s.head_dim, r.max_splits, r.median_us,
                double(r.kv_bytes) / (1 << 20), r.gbps, 100 * fraction, 100 * r.gbps / copy,
                r.body.c_str());
    std::fflush(stdout);
    results.push_back({
        {"backend", "cuda"},
        {"body", r.body},
        {"format", std::string(to_string(s.format))},
        {"batch", s.batch},
        {"context", s.context},
        {"q_len", s.q_len},
        {"hq", s.num_q_heads},
        {"hk", s.num_kv_heads},
        {"d", s.head_dim},
        {"page", s.page_size},
        {"layout", std::string(to_string(s.layout))},
        {"granularity", std::string(to_string(s.granularity))},
        {"q_mode", std::string(to_string(s.q_mode))},
        {"p_mode", std::string(to_string(s.p_mode))},
        {"max_splits", r.max_splits},
        {"split_cap", s.max_splits == 0 ? "fill" : "fixed"},  // max_splits_to_fill, or a probe's
        {"items", r.num_items},
        {"median_us", r.median_us},
        {"runs", r.runs},
        {"kv_bytes", r.kv_bytes},
        {"working_set_bytes", r.working_set_bytes},
        {"copies", r.copies},
        {"gbps", r.gbps},
        {"bandwidth_fraction", fraction},
        {"copy_fraction", r.gbps / copy},
        {"rel_error_vs_exact", nullptr},
    });
  }
  const nlohmann::ordered_json document = {
      {"machine",
       {{"gpu", device},
        {"copy_bandwidth_gbps", copy},
        {"read_bandwidth_gbps", read},
        {"bandwidth_reference", "read"},
        {"date", today()}}},
      {"results", results},
  };
  std::ofstream out(path);
  out << document.dump(2) << '\n';
  EXPECT_TRUE(out.good()) << "writing " << path;
}

#else  // !MJOLNIR_HAS_CUDA

MJOLNIR_GPU_TESTS_NOT_COMPILED(CudaBench)

#endif

}  // namespace
}  // namespace mjolnir

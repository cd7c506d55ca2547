// `mjolnir bench`: decode time of a serving-sized step against the machine's measured read
// bandwidth, with the format's error against the exact reference beside it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace mjolnir::tools {

// Defaults: a Llama-3-8B-like layer (Hq 32, Hk 8, D 128) reading a vLLM-layout fp8 cache,
// 8 sequences of 8k tokens, one new token each.
struct BenchOptions {
  std::string backend = "cpu";
  std::vector<std::string> formats = {"fp8_e4m3"};  // or "all"
  std::vector<int> contexts = {8192};
  std::vector<int> batches = {8};
  int q_len = 1;
  std::string heads = "32:8";  // Hq:Hk
  int head_dim = 128;
  int page_size = 16;
  std::string layout = "B2NHD";
  std::string granularity;  // empty: each format's recommended_granularity() (calibrate.h)
  // "auto": the backend's choice per format (Backend::auto_modes), with queries that are bf16
  // values as a bf16 model's are.
  std::string q_mode = "auto";
  std::string p_mode = "auto";
  int threads = 0;     // 0: every hardware thread
  int max_splits = 0;  // plan cap on chunks per sequence; 0: max_splits_to_fill (plan.h)
  int iterations = 0;
  double min_time_s = 1.0;
  std::uint64_t seed = 1;
  std::string json_path;
  // --sweep: the fixed sweep of docs/cpu-performance.md (formats x contexts x batches, q_len 4,
  // short contexts, the Hq 64 and D 256 shapes) instead of the grid the flags above describe;
  // its JSON goes to json_path, or to a dated file named for the machine in results_dir.
  bool sweep = false;
  std::string results_dir = "bench/results";
};

CLI::App* add_bench_command(CLI::App& app, BenchOptions& options);
int run_bench(const BenchOptions& options);

}  // namespace mjolnir::tools

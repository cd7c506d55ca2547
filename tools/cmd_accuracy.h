// `mjolnir accuracy`: the error of every format x scale granularity x numerics mode against the
// exact reference, on K with outlier channels and on plain Gaussian K, with llama.cpp's block
// formats q8_0 and q4_0 on the same data as reference lines (docs/accuracy.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace mjolnir::tools {

struct AccuracyOptions {
  std::string backend = "cpu";
  std::vector<std::string> formats = {"all"};
  int context = 4096;      // KV tokens per sequence
  int batch = 8;           // sequences: the error is taken over all their outputs
  std::uint64_t seed = 1;  // the first draw of the data
  int seeds = 4;           // draws (seed, seed + 1, ...): an error is dominated by a few tokens
  double headroom = 1.0;   // factor on the calibrated amax (scales_from_amax)
  std::string json_path;
};

CLI::App* add_accuracy_command(CLI::App& app, AccuracyOptions& options);
int run_accuracy(const AccuracyOptions& options);

}  // namespace mjolnir::tools

// What `mjolnir bench` times: the series of shapes and grids of a run (the flags' grid or the
// fixed sweep), and where a sweep's results file goes.
#pragma once

#include <string>
#include <vector>

#include "cmd_bench.h"
#include "mjolnir/decode.h"
#include "mjolnir/format.h"

namespace mjolnir::tools {

struct Heads {
  int num_q_heads = 0;
  int num_kv_heads = 0;
};

// One series of a run: a shape, and the grid of formats x contexts x batches timed on it.
struct Series {
  std::string name;  // the JSON's "series"; "" for a plain run
  Heads heads;
  int head_dim = 128;
  int q_len = 1;
  std::vector<int> batches;
  std::vector<int> contexts;
  std::vector<Format> formats;
};

// "32:8" -> {32, 8}; throws Error naming --heads otherwise.
Heads parse_heads(const std::string& text);
// --format values ("all" for every format); throws Error naming --format.
std::vector<Format> parse_formats(const std::vector<std::string>& names);
// A plain run: the grid the flags describe.
Series series_from_flags(const BenchOptions& options);
// The sweep of docs/cpu-performance.md (and docs/cuda.md for the GPU).
std::vector<Series> sweep_series(bool on_gpu);
// bench/results/<backend>-sweep-<date>-<machine>[-q<mode>][-p<mode>].json for the --q-mode and
// --p-mode given (fp32 is left out), -auto when both are "auto" (the backend's, per format).
std::string sweep_results_path(const std::string& dir, const std::string& backend,
                               const std::string& date, const std::string& machine,
                               const std::string& q_mode, const std::string& p_mode);
// `path` where no file has that name, else the first free one of path-2.json, path-3.json, ...:
// a second sweep on the same day and machine keeps the first one's results.
std::string unused_results_path(const std::string& path);

}  // namespace mjolnir::tools

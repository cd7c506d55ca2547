// One measured configuration of `mjolnir bench`: a row of its table and an entry of its JSON
// results.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_workload.h"
#include "verify/problem.h"

namespace mjolnir::tools {

struct Row {
  std::string backend;
  std::string series;
  verify::ProblemSpec spec;  // the whole step: format, layout, heads, modes, seq_lens
  Measurement measurement;
  double gbps = 0;
  // The limit this row is divided by: on the CPU the read bandwidth measured right after the
  // row's timing (on a shared host it moves by 2x within minutes, and with it the step's own
  // rate), on the GPU the card's copy bandwidth measured at the start.
  double limit_gbps = 0;
  double bandwidth_fraction = 0;
  double floor_us = 0;  // the KV bytes at the measured limit: no step can be faster
  double rel_error_vs_exact = 0;
  bool qk_bf16_dot = false;  // the CPU ran Q . K on bf16 dot products (cpu/attention_kernel.h)

  int batch() const { return static_cast<int>(spec.seq_lens.size()); }
  int context() const { return spec.seq_lens.empty() ? 0 : spec.seq_lens[0]; }
};

// How the workload line names the Q or P mode of the formats in `specs`: the option as given
// ("bf16"); "auto: bf16" where the backend picked one mode for every format; else what it picked
// for which, the most common mode last, "auto (int8 for fp4_e2m1, nvfp4; bf16 for the rest)", so
// that each row can be read against docs/accuracy.md's modes.
template <class Mode>
std::string describe_modes(const std::string& option, const std::vector<verify::ProblemSpec>& specs,
                           Mode DecodeParams::*mode);

// The table's header and one row of it, on stdout.
void print_table_header();
void print_row(const Row& row);
// The row as an entry of the results file.
nlohmann::ordered_json to_json(const Row& row);

}  // namespace mjolnir::tools

// The generated case matrix (docs/design.md; a test case is a value): one generator feeds
// the tests, `mjolnir verify` and the error bounds, every case named by all its fields and seed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mjolnir/decode.h"
#include "verify/problem.h"

namespace mjolnir::verify {

struct Case {
  ProblemSpec spec;
  int splits = 1;  // 1: plan without splitting; > 1: PlanOptions::fixed_splits
  int tile_tokens = 32;
  std::string name() const;  // every field and the seed: "fp8_e4m3/B2NHD/P16/D128/g4/q2/..."
};

// Every format x layout x page size {16,32,64,128} x D {64,128,256} x g {1,4,8} x q_len {1,2,4}
// x causal/non-causal x splits {1, several}; then ragged steps (prefill, chunked prefill and
// decodes in one batch: q_len 0 with query_lens) for every format x layout x D x g x causality.
// Numerics modes, scale granularity, padding, sequence lengths (not multiples of the page size)
// and shuffled tables vary with the seed. `quick` keeps a covering subset (every value of every
// axis, pairs of format x layout, and a ragged step per pair).
std::vector<Case> case_matrix(bool quick, std::uint64_t seed);

struct CaseResult {
  enum class Status { passed, failed, unsupported } status = Status::passed;
  std::string message;           // why it failed or is unsupported
  double error_vs_emulator = 0;  // rel L2 of O against the emulator in the same mode
  double mode_error = 0;         // rel L2 against the fp64 reference on the decoded cache
  double mode_bound = 0;         // the bound that was checked against
  double error_vs_exact = 0;     // rel L2 against the fp64 reference on the original K/V
  double bound_vs_exact = 0;     // the bound that error was checked against
};

// Runs one case on `backend` and checks it: NaN/Inf first, untouched sentinel rows, LSE,
// O against the emulator (tight) and against the exact reference (per-format bound).
CaseResult run_case(const Case& c, const Backend& backend);

}  // namespace mjolnir::verify

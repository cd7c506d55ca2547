// bf16 Q and O rows (mjolnir/rows.h) against the float32 step: a backend given a bf16 model's
// queries as bf16 bits and a bf16 output must write exactly the float32 step's O rounded to
// nearest even (NaN as 0x7FC0), with the same LSE, and nothing outside O's rows. Used by
// test_cpu_kernels (every SIMD target of the CPU kernel) and test_bf16_rows (the rest).
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/bf16_rows.h"
#include "mjolnir/decode.h"
#include "verify/problem.h"

namespace mjolnir::testing {

// spec's queries are drawn as bf16 values; nan_row >= 0 plants a NaN in that query row (of
// [query rows * Hq]) first, which the policy turns into a NaN row of O (0x7FC0 in bf16).
inline void check_bf16_rows(const Backend& backend, verify::ProblemSpec spec,
                            const PlanOptions& options, const std::string& name,
                            std::int64_t nan_row = -1) {
  spec.bf16_queries = true;
  verify::Problem problem(spec);
  const int d = spec.head_dim;
  DecodeArgs args = problem.args();
  const std::int64_t rows = args.num_query_rows() * args.params.num_q_heads;
  if (nan_row >= 0 && nan_row < rows) {
    problem.mutable_query()[std::size_t(nan_row) * d + 5] = std::numeric_limits<float>::quiet_NaN();
  }
  decode(backend, args, options);
  const std::vector<float> o32(problem.output().begin(), problem.output().end());
  const std::vector<float> lse32(problem.lse().begin(), problem.lse().end());

  // The same queries as bf16 bits (exact: their low halves are zero), O into a bf16 tensor with
  // a guard of kGuard values on each side.
  std::vector<std::uint16_t> q16(problem.query().size());
  for (std::size_t i = 0; i < q16.size(); ++i) {
    const std::uint32_t bits = std::bit_cast<std::uint32_t>(problem.query()[i]);
    ASSERT_EQ(bits & 0xFFFFu, 0u) << name << ": query value " << i << " is not a bf16 value";
    q16[i] = std::uint16_t(bits >> 16);
  }
  constexpr std::size_t kGuard = 64;
  constexpr std::uint16_t kUnwritten = 0xDEAD;
  std::vector<std::uint16_t> o16(o32.size() + 2 * kGuard, kUnwritten);
  problem.poison_outputs();
  args.q = QueryTensor{q16.data(), args.q.token_stride, args.q.head_stride, RowType::bf16};
  args.o =
      OutputTensor{o16.data() + kGuard, args.o.token_stride, args.o.head_stride, RowType::bf16};
  decode(backend, args, options);

  int mismatches = 0;
  for (std::size_t i = 0; i < o32.size() && mismatches < 5; ++i) {
    const std::uint16_t expected = bf16_from_float(o32[i]);
    if (o16[kGuard + i] != expected) {
      ADD_FAILURE() << name << ": O value " << i << " (row " << i / d << ", channel " << i % d
                    << ") is 0x" << std::hex << o16[kGuard + i] << ", the float32 step's " << o32[i]
                    << " rounds to 0x" << expected << std::dec;
      ++mismatches;
    }
  }
  for (std::size_t i = 0; i < kGuard; ++i) {
    ASSERT_EQ(o16[i], kUnwritten) << name << ": wrote before O";
    ASSERT_EQ(o16[o16.size() - 1 - i], kUnwritten) << name << ": wrote after O";
  }
  for (std::size_t i = 0; i < lse32.size(); ++i) {
    const float lse = problem.lse()[i];
    ASSERT_TRUE(std::bit_cast<std::uint32_t>(lse) == std::bit_cast<std::uint32_t>(lse32[i]) ||
                (std::isnan(lse) && std::isnan(lse32[i])))
        << name << ": LSE " << i << " is " << lse << ", the float32 step's " << lse32[i];
  }
  if (nan_row >= 0 && nan_row < rows) {
    EXPECT_EQ(o16[kGuard + std::size_t(nan_row) * d], 0x7FC0u) << name << ": the NaN query row";
  }
}

}  // namespace mjolnir::testing

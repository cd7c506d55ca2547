// The non-finite policy (docs/numerics.md, "Non-finite inputs") on the host backends and the
// exact reference: a NaN or Inf in q, K or V poisons exactly the rows that meet it (non_finite_
// cases.h), in every format, mode and plan.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string_view>
#include <vector>

#include "mjolnir/decode.h"
#include "non_finite_cases.h"
#include "reference/exact.h"
#include "test_seed.h"
#include "verify/problem.h"

namespace mjolnir {
namespace {

using testing::check_non_finite_policy;
using testing::test_seed;

// Every configuration, or every fifth with MJOLNIR_TEST_QUICK=1 (the ASan suite, and the Arm
// check under qemu, where the whole set took minutes; every target's kernel still meets all of
// them in test_cpu_kernels, and the emulator on the host).
std::vector<testing::NonFiniteConfig> non_finite_configs() {
  std::vector<testing::NonFiniteConfig> all = testing::non_finite_configs();
  const char* quick = std::getenv("MJOLNIR_TEST_QUICK");
  if (quick == nullptr || std::string_view(quick) != "1") return all;
  std::vector<testing::NonFiniteConfig> some;
  for (std::size_t i = 0; i < all.size(); i += 5) some.push_back(all[i]);  // 5: every shape
  return some;
}

TEST(NonFinite, CpuBackendPoisonsExactlyTheRowsThatMeetIt) {
  const auto backend = make_backend("cpu", {.threads = 2});
  for (const auto& config : non_finite_configs()) {
    check_non_finite_policy(*backend, config, test_seed());
  }
}

TEST(NonFinite, CpuBackendOnOneThread) {  // no token parts, one worker
  const auto backend = make_backend("cpu", {.threads = 1});
  for (const auto& config : non_finite_configs()) {
    if (config.fixed_splits == 1) {
      check_non_finite_policy(*backend, config, test_seed() + 1);
    }
  }
}

TEST(NonFinite, EmulatorPoisonsExactlyTheRowsThatMeetIt) {
  const auto backend = make_backend("reference");
  for (const auto& config : non_finite_configs()) {
    check_non_finite_policy(*backend, config, test_seed());
  }
}

// The exact fp64 reference: the same rows NaN, the others finite, for a NaN in q and in K and an
// Inf in V (bf16 cache), in a causal step of three query tokens.
TEST(NonFinite, ExactReferencePoisonsTheSameRows) {
  verify::ProblemSpec spec;
  spec.format = Format::bf16;
  spec.head_dim = 64;
  spec.num_kv_heads = 2;
  spec.group = 2;
  spec.params.q_len = 3;
  spec.params.causal = true;
  spec.seq_lens = {100, 60};
  spec.seed = test_seed();
  verify::Problem problem(spec);
  const int d = 64, hq = 4;
  DecodeArgs args = problem.args();
  // q NaN: sequence 1, token 0, head 3.
  problem.mutable_query()[(std::size_t(args.query_row(1, 0)) * hq + 3) * d + 7] = std::nanf("");
  // K NaN: sequence 0, KV head 1, position 98 (seen by tokens 1 and 2 of the step).
  problem.kv_row_bytes(0, 1, 98, 0)[10] = std::byte{0xC0};
  problem.kv_row_bytes(0, 1, 98, 0)[11] = std::byte{0x7F};
  // V +Inf: sequence 1, KV head 0, position 3 (seen by every token).
  problem.kv_row_bytes(1, 0, 3, 1)[0] = std::byte{0x80};
  problem.kv_row_bytes(1, 0, 3, 1)[1] = std::byte{0x7F};
  args = problem.args();
  const auto exact = reference::exact_attention(
      args, reference::kv_rows_from_cache(problem.cache(), problem.batch()));
  for (int seq = 0; seq < 2; ++seq) {
    for (int token = 0; token < 3; ++token) {
      for (int head = 0; head < hq; ++head) {
        const bool nan = (seq == 1 && token == 0 && head == 3) ||
                         (seq == 0 && head / 2 == 1 && token >= 1) || (seq == 1 && head / 2 == 0);
        const std::size_t r = std::size_t(args.query_row(seq, token)) * hq + head;
        SCOPED_TRACE("seq " + std::to_string(seq) + " token " + std::to_string(token) + " head " +
                     std::to_string(head));
        EXPECT_EQ(std::isnan(exact.lse[r]), nan);
        for (int c = 0; c < d; ++c) {
          ASSERT_EQ(std::isnan(exact.o[r * d + c]), nan) << "channel " << c;
          if (!nan) ASSERT_TRUE(std::isfinite(exact.o[r * d + c]));
        }
      }
    }
  }
}

}  // namespace
}  // namespace mjolnir

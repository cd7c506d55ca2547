// The generated case matrix on every CPU-side backend: the CPU backend against the emulator and
// the exact reference, and the emulator against the exact reference. Sharded so ctest runs the
// shards in parallel; every case is named with its seed.
#include <gtest/gtest.h>

#include <cstdlib>

#include "mjolnir/decode.h"
#include "test_seed.h"
#include "verify/case_matrix.h"

namespace mjolnir {
namespace {

constexpr int kShards = 32;
constexpr int kReferenceShards = 4;

// MJOLNIR_TEST_QUICK=1 runs the covering subset (sanitizer builds).
bool quick_matrix() {
  const char* env = std::getenv("MJOLNIR_TEST_QUICK");
  return env && env[0] == '1';
}

class CaseMatrix : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CaseMatrix, Shard) {
  const auto& [backend_name, shard] = GetParam();
  const auto backend = make_backend(backend_name, BackendOptions{.threads = 2});
  // The emulator is checked only against the exact references: the covering subset suffices.
  const bool quick = quick_matrix() || backend_name == "reference";
  const auto cases = verify::case_matrix(quick, testing::test_seed());
  int run = 0;
  const int shards = backend_name == "reference" ? kReferenceShards : kShards;
  for (std::size_t i = shard; i < cases.size(); i += shards) {
    const verify::Case& c = cases[i];
    const verify::CaseResult r = verify::run_case(c, *backend);
    EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
    ++run;
  }
  EXPECT_GT(run, 0);
}

INSTANTIATE_TEST_SUITE_P(Cpu, CaseMatrix,
                         ::testing::Combine(::testing::Values("cpu"),
                                            ::testing::Range(0, kShards)));
INSTANTIATE_TEST_SUITE_P(Reference, CaseMatrix,
                         ::testing::Combine(::testing::Values("reference"),
                                            ::testing::Range(0, kReferenceShards)));

}  // namespace
}  // namespace mjolnir

// verify::Problem's repeated positions (ProblemSpec::distinct_positions), which the bench's long
// caches use: position p must hold exactly the K/V of p % N, in the cache and in the originals,
// and every page must still be its own memory.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "test_seed.h"
#include "verify/problem.h"

namespace mjolnir {
namespace {

verify::ProblemSpec repeating_spec(Format format, int distinct) {
  verify::ProblemSpec spec;
  spec.format = format;
  spec.page_size = 16;
  spec.head_dim = 64;
  spec.num_kv_heads = 2;
  spec.group = 2;
  spec.seq_lens = {100, 37};
  spec.distinct_positions = distinct;
  spec.seed = testing::test_seed();
  return spec;
}

TEST(ProblemRepeats, PositionsHoldTheirRemainderModuloDistinct) {
  for (const Format format : {Format::fp8_e4m3, Format::nvfp4, Format::bf16}) {
    SCOPED_TRACE(std::string(to_string(format)));
    constexpr int kDistinct = 24;  // not a multiple of the page: repeats cross page boundaries
    verify::Problem problem(repeating_spec(format, kDistinct));
    const KvCacheView cache = problem.cache();
    const PagedBatch batch = problem.batch();
    const std::size_t row_bytes = cache.geometry.row_bytes();
    const int d = cache.geometry.head_dim;
    std::set<const std::byte*> rows_seen;
    for (int b = 0; b < 2; ++b) {
      const int len = problem.spec().seq_lens[b];
      const auto row = [&](int pos, int head, int kv) {
        const int page = batch.block_table[std::size_t(b) * batch.max_pages_per_seq + pos / 16];
        return static_cast<const std::byte*>(cache.row(page, head, pos % 16, kv));
      };
      for (int pos = 0; pos < len; ++pos) {
        for (int head = 0; head < 2; ++head) {
          for (int kv = 0; kv < 2; ++kv) {
            EXPECT_TRUE(rows_seen.insert(row(pos, head, kv)).second) << "row shared at " << pos;
            const int first = pos % kDistinct;
            ASSERT_EQ(std::memcmp(row(pos, head, kv), row(first, head, kv), row_bytes), 0)
                << "seq " << b << " pos " << pos << " head " << head << " kv " << kv;
            ASSERT_EQ(std::memcmp(problem.original_kv(b, head, pos, kv),
                                  problem.original_kv(b, head, first, kv), d * sizeof(float)),
                      0);
          }
        }
      }
    }
  }
}

TEST(ProblemRepeats, ZeroMeansEveryPositionIsDrawn) {
  verify::Problem problem(repeating_spec(Format::fp8_e4m3, 0));
  // With every position drawn, two positions a would-be period apart differ (N(0,1) floats).
  const int d = problem.spec().head_dim;
  EXPECT_NE(std::memcmp(problem.original_kv(0, 0, 3, 0), problem.original_kv(0, 0, 27, 0),
                        d * sizeof(float)),
            0);
  EXPECT_THROW(verify::Problem bad(repeating_spec(Format::fp8_e4m3, -1)), Error);
}

}  // namespace
}  // namespace mjolnir

// write_kv: every format x layout x granularity written into a sentinel-filled pool and read back
// against the scalar codecs; skipped slots and gaps stay untouched; amax recording; and every
// rejected input leaves the pool as it was.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "expect_error.h"
#include "mjolnir/cache.h"
#include "mjolnir/error.h"
#include "mjolnir/format.h"
#include "mjolnir/write_kv.h"
#include "test_seed.h"

namespace mjolnir {
namespace {

constexpr std::byte kSentinel{0xA5};

using testing::test_seed;  // fresh per run, printed; MJOLNIR_TEST_SEED replays one

using testing::expect_error;

// A dense pool of a named layout with sentinel guard bytes on both sides (one test below uses
// padded strides instead), and random positive scales of the granularity.
constexpr std::size_t kGuardBytes = 64;

struct TestCache {
  TestCache(const CacheGeometry& geometry, Layout layout, ScaleGranularity granularity,
            std::mt19937_64& rng)
      : pool(pool_bytes(geometry) + 2 * kGuardBytes, kSentinel) {
    std::uniform_real_distribution<float> scale_dist(0.25f, 2.0f);
    const std::size_t count = scale_count(granularity, geometry.num_kv_heads, geometry.head_dim);
    for (std::size_t i = 0; i < count; ++i) k_scale.push_back(scale_dist(rng));
    for (std::size_t i = 0; i < count; ++i) v_scale.push_back(scale_dist(rng));
    view.geometry = geometry;
    view.strides = layout_strides(geometry, layout);
    view.data = pool.data() + kGuardBytes;
    view.bytes = pool_bytes(geometry);
    view.granularity = granularity;
    view.k_scale = k_scale;
    view.v_scale = v_scale;
  }
  std::vector<std::byte> pool;  // guard | dense pool | guard
  std::vector<float> k_scale;
  std::vector<float> v_scale;
  KvCacheView view;
};

// New tokens [num_tokens, Hk, D] with padded strides (heads and tokens not packed), values away
// from zero so no row or nvfp4 block is all zero.
struct TestTokens {
  TestTokens(int num_tokens, const CacheGeometry& g, std::mt19937_64& rng)
      : head_stride(g.head_dim + 3),
        token_stride(std::int64_t(g.num_kv_heads) * (g.head_dim + 3) + 5),
        k(static_cast<std::size_t>(num_tokens * token_stride)),
        v(k.size()) {
    std::uniform_real_distribution<float> magnitude(0.05f, 8.0f);
    std::bernoulli_distribution negative(0.5);
    for (std::vector<float>* values : {&k, &v}) {
      for (float& x : *values) x = negative(rng) ? -magnitude(rng) : magnitude(rng);
    }
  }
  TokenRows k_rows() const { return {k.data(), token_stride, head_stride}; }
  TokenRows v_rows() const { return {v.data(), token_stride, head_stride}; }
  const float* at(int kv, int token, int head) const {
    return (kv == 0 ? k : v).data() + token * token_stride + head * head_stride;
  }
  std::int64_t head_stride;
  std::int64_t token_stride;
  std::vector<float> k;
  std::vector<float> v;
};

// What the cache should hold for one channel of a row, from the scalar element codecs: the value
// divided by its outer scale, encoded, decoded, times the scale. nvfp4 first picks the block's
// e4m3 scale e4m3(amax_block / 6) (at least the smallest positive code) and divides by it.
std::vector<float> expected_row(Format format, const float* values, int head_dim,
                                const KvCacheView& cache, int kv, int head) {
  auto outer = [&](int c) {
    return kv == 0 ? cache.k_scale_at(head, c) : cache.v_scale_at(head, c);
  };
  std::vector<float> scaled(static_cast<std::size_t>(head_dim));
  for (int c = 0; c < head_dim; ++c) scaled[c] = values[c] / outer(c);
  std::vector<float> result(scaled.size());
  for (int c = 0; c < head_dim; ++c) {
    if (format != Format::nvfp4) {
      result[c] = decode_element(format, encode_element(format, scaled[c])) * outer(c);
      continue;
    }
    const int block = c / kNvfp4BlockSize;
    float block_amax = 0;
    for (int i = block * kNvfp4BlockSize; i < (block + 1) * kNvfp4BlockSize; ++i) {
      block_amax = std::max(block_amax, std::fabs(scaled[i]));
    }
    const std::uint32_t scale_code =
        std::max<std::uint32_t>(encode_element(Format::fp8_e4m3, block_amax / 6.0f), 1);
    const float block_scale = decode_element(Format::fp8_e4m3, scale_code);
    const float element =
        decode_element(Format::fp4_e2m1, encode_element(Format::fp4_e2m1, scaled[c] / block_scale));
    result[c] = element * block_scale * outer(c);
  }
  return result;
}

bool all_sentinel(const std::byte* bytes, std::size_t count) {
  return std::all_of(bytes, bytes + count, [](std::byte b) { return b == kSentinel; });
}

CacheGeometry small_geometry(Format format) {
  CacheGeometry g;
  g.format = format;
  g.num_pages = 5;
  g.page_size = 8;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  return g;
}

// Slots spread over pages, with page boundaries (7, 8), the last slot of the pool (39), and
// skipped (negative) entries in the middle and at the end.
const std::vector<std::int64_t> kSlots{0, 7, -1, 8, 21, 39, 30, -5, 15, 16, -1};

// --- every format x layout x granularity ---------------------------------------------------------

TEST(WriteKv, EveryFormatLayoutGranularityReadsBack) {
  std::mt19937_64 rng(test_seed());
  for (Format format : kAllFormats) {
    for (Layout layout : kAllLayouts) {
      for (auto granularity :
           {ScaleGranularity::tensor, ScaleGranularity::head, ScaleGranularity::channel}) {
        const std::string name = std::string(to_string(format)) + "/" +
                                 std::string(to_string(layout)) + "/" +
                                 std::string(to_string(granularity));
        SCOPED_TRACE(name + " seed " + std::to_string(test_seed()));
        const CacheGeometry g = small_geometry(format);
        TestCache cache(g, layout, granularity, rng);
        const TestTokens tokens(static_cast<int>(kSlots.size()), g, rng);
        write_kv(cache.view, tokens.k_rows(), tokens.v_rows(), kSlots);

        // Which (page, token) slots were written, and by which input token.
        std::vector<int> writer(static_cast<std::size_t>(g.num_pages * g.page_size), -1);
        for (std::size_t i = 0; i < kSlots.size(); ++i) {
          if (kSlots[i] >= 0) writer[kSlots[i]] = static_cast<int>(i);
        }
        const std::size_t row_bytes = g.row_bytes();
        std::vector<float> decoded(static_cast<std::size_t>(g.head_dim));
        for (int page = 0; page < g.num_pages; ++page) {
          for (int offset = 0; offset < g.page_size; ++offset) {
            const int token = writer[page * g.page_size + offset];
            for (int head = 0; head < g.num_kv_heads; ++head) {
              for (int kv = 0; kv < 2; ++kv) {
                const std::byte* row = cache.view.row(page, head, offset, kv);
                if (token < 0) {
                  ASSERT_TRUE(all_sentinel(row, row_bytes))
                      << "unwritten row (page " << page << ", token " << offset << ") changed";
                  continue;
                }
                decode_row(format, std::span<const std::byte>(row, row_bytes), decoded);
                const float* input = tokens.at(kv, token, head);
                const std::vector<float> expected =
                    expected_row(format, input, g.head_dim, cache.view, kv, head);
                for (int c = 0; c < g.head_dim; ++c) {
                  const float scale =
                      kv == 0 ? cache.view.k_scale_at(head, c) : cache.view.v_scale_at(head, c);
                  ASSERT_EQ(decoded[c] * scale, expected[c])
                      << (kv == 0 ? "k" : "v") << "[" << token << "][" << head << "][" << c
                      << "] = " << input[c] << " in page " << page << " token " << offset;
                }
              }
            }
          }
        }
        EXPECT_TRUE(all_sentinel(cache.pool.data(), kGuardBytes)) << "guard before the pool";
        EXPECT_TRUE(all_sentinel(cache.pool.data() + kGuardBytes + cache.view.bytes, kGuardBytes))
            << "guard after the pool";
      }
    }
  }
}

// Padded strides (gaps between rows, tokens and pages) are honoured: gap bytes stay sentinel.
TEST(WriteKv, PaddedStridesLeaveGapsUntouched) {
  std::mt19937_64 rng(test_seed() + 1);
  const CacheGeometry g = small_geometry(Format::fp6_e2m3);
  const std::int64_t row = static_cast<std::int64_t>(g.row_bytes());
  TestCache cache(g, Layout::BHN2D, ScaleGranularity::head, rng);
  // BHN2D with 4 spare bytes after each row, 8 after each token, 16 after each page.
  CacheStrides& s = cache.view.strides;
  s.kv = row + 4;
  s.token = 2 * s.kv + 8;
  s.head = g.page_size * s.token;
  s.page = g.num_kv_heads * s.head + 16;
  const std::size_t bytes = static_cast<std::size_t>(g.num_pages * s.page);
  cache.pool.assign(bytes, kSentinel);
  cache.view.data = cache.pool.data();
  cache.view.bytes = bytes;
  const TestTokens tokens(static_cast<int>(kSlots.size()), g, rng);
  write_kv(cache.view, tokens.k_rows(), tokens.v_rows(), kSlots);

  std::vector<bool> in_written_row(bytes, false);
  for (std::int64_t slot : kSlots) {
    if (slot < 0) continue;
    for (int head = 0; head < g.num_kv_heads; ++head)
      for (int kv = 0; kv < 2; ++kv) {
        const std::ptrdiff_t start = cache.view.row(static_cast<int>(slot / g.page_size), head,
                                                    static_cast<int>(slot % g.page_size), kv) -
                                     cache.view.data;
        for (std::int64_t b = 0; b < row; ++b) in_written_row[start + b] = true;
      }
  }
  for (std::size_t b = 0; b < bytes; ++b) {
    if (in_written_row[b]) continue;
    ASSERT_EQ(cache.pool[b], kSentinel) << "byte " << b;
  }
}

// A null pointer is fine when there is nothing to read, and an all-skipped batch writes nothing.
// bf16 bits of a float, rounded to nearest even (the values are finite).
std::uint16_t bf16_bits(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  return std::uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// A bf16 model's K and V (RowType::bf16) store exactly the bytes of their float32 widening, in
// every format, layout and granularity, through padded strides; a non-finite bf16 value is
// refused by its index with nothing written.
TEST(WriteKv, Bf16RowsWriteAsTheirFloat32Widening) {
  std::mt19937_64 rng(test_seed());
  int case_index = 0;
  for (Format format : kAllFormats) {
    for (auto granularity :
         {ScaleGranularity::tensor, ScaleGranularity::head, ScaleGranularity::channel}) {
      const Layout layout = kAllLayouts[case_index++ % std::size(kAllLayouts)];
      SCOPED_TRACE(std::string(to_string(format)) + " " + std::string(to_string(layout)) +
                   " granularity " + std::to_string(int(granularity)));
      const CacheGeometry g = small_geometry(format);
      TestCache cache(g, layout, granularity, rng);
      TestTokens tokens(int(kSlots.size()), g, rng);
      std::vector<std::uint16_t> k16(tokens.k.size()), v16(tokens.v.size());
      for (std::size_t i = 0; i < k16.size(); ++i) {
        k16[i] = bf16_bits(tokens.k[i]);
        v16[i] = bf16_bits(tokens.v[i]);
        tokens.k[i] = std::bit_cast<float>(std::uint32_t(k16[i]) << 16);
        tokens.v[i] = std::bit_cast<float>(std::uint32_t(v16[i]) << 16);
      }
      write_kv(cache.view, tokens.k_rows(), tokens.v_rows(), kSlots);
      const std::vector<std::byte> from_float = cache.pool;
      std::fill(cache.pool.begin(), cache.pool.end(), kSentinel);
      const TokenRows k_rows{k16.data(), tokens.token_stride, tokens.head_stride, RowType::bf16};
      TokenRows v_rows{v16.data(), tokens.token_stride, tokens.head_stride, RowType::bf16};
      write_kv(cache.view, k_rows, v_rows, kSlots);
      ASSERT_EQ(cache.pool, from_float);

      std::fill(cache.pool.begin(), cache.pool.end(), kSentinel);
      v16[std::size_t(3 * tokens.token_stride + tokens.head_stride + 5)] = 0x7FC0;  // NaN
      expect_error([&] { write_kv(cache.view, k_rows, v_rows, kSlots); }, "v[3][1][5] is NaN");
      k16[std::size_t(8 * tokens.token_stride + 63)] = 0xFF80;  // -Inf, checked before V
      expect_error([&] { write_kv(cache.view, k_rows, v_rows, kSlots); }, "k[8][0][63] is -Inf");
      EXPECT_TRUE(all_sentinel(cache.pool.data(), cache.pool.size()));
    }
  }
}

TEST(WriteKv, NoTokensAndAllSkipped) {
  std::mt19937_64 rng(test_seed() + 2);
  const CacheGeometry g = small_geometry(Format::fp8_e4m3);
  TestCache cache(g, Layout::B2NHD, ScaleGranularity::tensor, rng);
  EXPECT_NO_THROW(write_kv(cache.view, TokenRows{}, TokenRows{}, {}));
  const TestTokens tokens(3, g, rng);
  const std::vector<std::int64_t> skipped{-1, -1, -1};
  write_kv(cache.view, tokens.k_rows(), tokens.v_rows(), skipped);
  EXPECT_TRUE(all_sentinel(cache.pool.data(), cache.pool.size()));
}

// --- amax ----------------------------------------------------------------------------------------

TEST(WriteKv, RecordsAmaxOfWrittenTokensOnly) {
  std::mt19937_64 rng(test_seed() + 3);
  const CacheGeometry g = small_geometry(Format::fp4_e2m1);
  TestCache cache(g, Layout::B2HND, ScaleGranularity::channel, rng);
  TestTokens tokens(static_cast<int>(kSlots.size()), g, rng);
  // A skipped token's huge value must not be recorded.
  tokens.k[2 * tokens.token_stride + 1] = 1000.0f;
  const std::size_t count = std::size_t(g.num_kv_heads) * g.head_dim;
  std::vector<float> k_amax(count, 0.0f);
  std::vector<float> v_amax(count, 0.0f);
  v_amax[5] = 100.0f;  // entries are only raised, never lowered
  AmaxRecorder recorder{k_amax, v_amax};
  write_kv(cache.view, tokens.k_rows(), tokens.v_rows(), kSlots, &recorder);

  for (int kv = 0; kv < 2; ++kv) {
    const std::vector<float>& recorded = kv == 0 ? k_amax : v_amax;
    for (int head = 0; head < g.num_kv_heads; ++head) {
      for (int c = 0; c < g.head_dim; ++c) {
        float expected = (kv == 1 && head == 0 && c == 5) ? 100.0f : 0.0f;
        for (std::size_t i = 0; i < kSlots.size(); ++i) {
          if (kSlots[i] >= 0) {
            expected = std::max(expected, std::fabs(tokens.at(kv, static_cast<int>(i), head)[c]));
          }
        }
        EXPECT_EQ(recorded[head * g.head_dim + c], expected)
            << (kv == 0 ? "k" : "v") << " head " << head << " channel " << c;
      }
    }
  }
  EXPECT_LT(k_amax[1], 1000.0f);
}

TEST(WriteKv, RejectsAmaxOfTheWrongSize) {
  std::mt19937_64 rng(test_seed() + 4);
  const CacheGeometry g = small_geometry(Format::fp8_e5m2);
  TestCache cache(g, Layout::B2NHD, ScaleGranularity::head, rng);
  const TestTokens tokens(static_cast<int>(kSlots.size()), g, rng);
  std::vector<float> right(128, 0.0f);
  std::vector<float> wrong(127, 0.0f);
  AmaxRecorder short_k{wrong, right};
  expect_error([&] { write_kv(cache.view, tokens.k_rows(), tokens.v_rows(), kSlots, &short_k); },
               "amax.k_amax: 127 values, expected 2 heads x 64 channels = 128");
  AmaxRecorder short_v{right, {}};
  expect_error([&] { write_kv(cache.view, tokens.k_rows(), tokens.v_rows(), kSlots, &short_v); },
               "amax.v_amax: 0 values");
  EXPECT_TRUE(all_sentinel(cache.pool.data(), cache.pool.size()));
}

// --- rejected input writes nothing ---------------------------------------------------------------

class WriteKvRejects : public ::testing::Test {
 protected:
  WriteKvRejects()
      : rng_(test_seed() + 5),
        g_(small_geometry(Format::nvfp4)),
        cache_(g_, Layout::B2NHD, ScaleGranularity::head, rng_),
        tokens_(static_cast<int>(kSlots.size()), g_, rng_) {}

  // The call must throw naming `argument`, and the pool must still be all sentinel.
  void expect_rejected(std::string_view argument, std::string_view detail = "") {
    expect_error([&] { write_kv(cache_.view, k_, v_, slots_); }, argument, detail);
    EXPECT_TRUE(all_sentinel(cache_.pool.data(), cache_.pool.size())) << "bytes were written";
  }

  std::mt19937_64 rng_;
  CacheGeometry g_;
  TestCache cache_;
  TestTokens tokens_;
  TokenRows k_ = tokens_.k_rows();
  TokenRows v_ = tokens_.v_rows();
  std::vector<std::int64_t> slots_ = kSlots;
};

TEST_F(WriteKvRejects, NonFiniteValues) {
  // v is checked after every K value and v[5] after tokens 0..4: a writer that wrote rows while
  // checking would already have changed the pool.
  tokens_.v[5 * tokens_.token_stride + 1 * tokens_.head_stride + 17] =
      std::numeric_limits<float>::infinity();
  expect_rejected("v[5][1][17] is Inf");
  tokens_.v[5 * tokens_.token_stride + 1 * tokens_.head_stride + 17] = 1.0f;
  tokens_.k[8 * tokens_.token_stride + 0 * tokens_.head_stride + 63] =
      std::numeric_limits<float>::quiet_NaN();
  expect_rejected("k[8][0][63] is NaN");
  tokens_.k[8 * tokens_.token_stride + 63] = -std::numeric_limits<float>::infinity();
  expect_rejected("k[8][0][63] is -Inf");
}

TEST_F(WriteKvRejects, NonFiniteValuesOfSkippedTokensAreIgnored) {
  tokens_.k[2 * tokens_.token_stride + 3] = std::numeric_limits<float>::quiet_NaN();  // slot -1
  EXPECT_NO_THROW(write_kv(cache_.view, k_, v_, slots_));
}

TEST_F(WriteKvRejects, SlotsOutsideThePool) {
  slots_[4] = 40;  // 5 pages x 8 tokens: slots 0..39
  expect_rejected("slot_mapping[4]: slot 40 is outside the pool of 5 pages x 8 tokens = 40 slots");
  slots_[4] = std::numeric_limits<std::int64_t>::max();
  expect_rejected("slot_mapping[4]:");
}

TEST_F(WriteKvRejects, NullTokenData) {
  k_.data = nullptr;
  expect_rejected("k.data: is null");
  k_ = tokens_.k_rows();
  v_.data = nullptr;
  expect_rejected("v.data: is null");
}

TEST_F(WriteKvRejects, OverlappingTokenStrides) {
  k_.head_stride = 63;
  expect_rejected("k.head_stride: 63 is less than head_dim 64");
  k_ = tokens_.k_rows();
  v_.token_stride = v_.head_stride;  // token t's head 1 is token t+1's head 0
  expect_rejected("v.token_stride: ", "token rows would overlap");
  v_.token_stride = -1;
  expect_rejected("v.token_stride: -1");
  v_ = tokens_.v_rows();
  v_.token_stride = std::numeric_limits<std::int64_t>::max();
  expect_rejected("v.token_stride:", "overflows");
}

TEST_F(WriteKvRejects, InvalidCache) {
  std::vector<float> wrong(3, 1.0f);
  cache_.view.k_scale = wrong;
  expect_rejected("cache.k_scale: 3 values, expected 2");
  cache_.view.k_scale = cache_.k_scale;
  cache_.view.strides.token = 1;
  expect_rejected("cache.strides.");
  cache_.view.strides = layout_strides(g_, Layout::B2NHD);
  cache_.view.bytes -= 1;
  expect_rejected("cache.strides: row");
}

}  // namespace
}  // namespace mjolnir

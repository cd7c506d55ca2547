// Cache views: layout names and dense strides (worked by hand), pool sizes, granularities, and
// every validation rule of cache views and paged batches, each checked for the argument it names.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "expect_error.h"
#include "mjolnir/cache.h"
#include "mjolnir/error.h"

namespace mjolnir {
namespace {

using testing::expect_error;

// fp8 keeps the arithmetic easy: a row of D = 32 channels is 32 bytes.
CacheGeometry small_geometry() {
  CacheGeometry geometry;
  geometry.format = Format::fp8_e4m3;
  geometry.num_pages = 3;
  geometry.page_size = 8;
  geometry.num_kv_heads = 2;
  geometry.head_dim = 32;
  return geometry;
}

// A valid view over an owned, dense pool with per-head scales.
struct OwnedCache {
  explicit OwnedCache(const CacheGeometry& geometry, Layout layout = Layout::B2NHD)
      : pool(pool_bytes(geometry)),
        k_scale(static_cast<std::size_t>(geometry.num_kv_heads), 0.5f),
        v_scale(static_cast<std::size_t>(geometry.num_kv_heads), 2.0f) {
    view.geometry = geometry;
    view.strides = layout_strides(geometry, layout);
    view.data = pool.data();
    view.bytes = pool.size();
    view.granularity = ScaleGranularity::head;
    view.k_scale = k_scale;
    view.v_scale = v_scale;
  }
  std::vector<std::byte> pool;
  std::vector<float> k_scale;
  std::vector<float> v_scale;
  KvCacheView view;
};

// --- names -------------------------------------------------------------------------------------

TEST(LayoutNames, RoundTripAndSpelling) {
  EXPECT_EQ(to_string(Layout::B2NHD), "B2NHD");
  EXPECT_EQ(to_string(Layout::_2BNHD), "2BNHD");
  EXPECT_EQ(to_string(Layout::_2BHND), "2BHND");
  for (Layout layout : kAllLayouts) EXPECT_EQ(parse_layout(to_string(layout)), layout);
  EXPECT_EQ(parse_layout("b2hnd"), Layout::B2HND);
  EXPECT_EQ(parse_layout("_2BNHD"), Layout::_2BNHD);
}

TEST(LayoutNames, UnknownNameIsRejectedWithTheChoices) {
  expect_error([] { parse_layout("NHD"); }, "layout: 'NHD'", "B2NHD");
  expect_error([] { parse_layout("B2NHDX", "--layout"); }, "--layout:", "2BHND");
  expect_error([] { parse_layout(""); }, "layout:");
}

TEST(GranularityNames, RoundTripAndUnknown) {
  for (auto g : {ScaleGranularity::tensor, ScaleGranularity::head, ScaleGranularity::channel}) {
    EXPECT_EQ(parse_granularity(to_string(g)), g);
  }
  EXPECT_EQ(to_string(ScaleGranularity::channel), "channel");
  expect_error([] { parse_granularity("block"); }, "granularity: 'block'", "channel");
  expect_error([] { parse_granularity("per_head", "--scales"); }, "--scales:");
}

TEST(ScaleCount, PerGranularity) {
  EXPECT_EQ(scale_count(ScaleGranularity::tensor, 8, 128), 1u);
  EXPECT_EQ(scale_count(ScaleGranularity::head, 8, 128), 8u);
  EXPECT_EQ(scale_count(ScaleGranularity::channel, 8, 128), 1024u);
}

// --- dense layouts, worked by hand ---------------------------------------------------------------

// small_geometry: 3 pages, 8 tokens a page, 2 heads, rows of R = 32 bytes. Walking each name from
// the right: the dimension next to D steps one row, each one further out steps over everything
// inside it.
TEST(LayoutStrides, WorkedByHand) {
  const CacheGeometry g = small_geometry();
  ASSERT_EQ(g.row_bytes(), 32u);
  struct Expected {
    Layout layout;
    std::int64_t page, head, token, kv;
  };
  const Expected cases[] = {
      // BHN2D: kv R, token 2R, head 8 * 2R, page 2 * 8 * 2R
      {Layout::BHN2D, 1024, 512, 64, 32},
      // BNH2D: kv R, head 2R, token 2 * 2R, page 8 * 2 * 2R
      {Layout::BNH2D, 1024, 64, 128, 32},
      // B2NHD: head R, token 2R, kv 8 * 2R, page 2 * 8 * 2R
      {Layout::B2NHD, 1024, 32, 64, 512},
      // B2HND: token R, head 8R, kv 2 * 8R, page 2 * 2 * 8R
      {Layout::B2HND, 1024, 256, 32, 512},
      // 2BNHD: head R, token 2R, page 8 * 2R, kv 3 * 8 * 2R
      {Layout::_2BNHD, 512, 32, 64, 1536},
      // 2BHND: token R, head 8R, page 2 * 8R, kv 3 * 2 * 8R
      {Layout::_2BHND, 512, 256, 32, 1536},
  };
  for (const Expected& e : cases) {
    SCOPED_TRACE(std::string(to_string(e.layout)));
    const CacheStrides s = layout_strides(g, e.layout);
    EXPECT_EQ(s.page, e.page);
    EXPECT_EQ(s.head, e.head);
    EXPECT_EQ(s.token, e.token);
    EXPECT_EQ(s.kv, e.kv);
  }
}

TEST(LayoutStrides, PoolBytes) {
  CacheGeometry g = small_geometry();
  EXPECT_EQ(pool_bytes(g), 3u * 8 * 2 * 2 * 32);  // pages x tokens x heads x K/V x row
  g.format = Format::bf16;                        // rows of 2D bytes
  EXPECT_EQ(pool_bytes(g), 3u * 8 * 2 * 2 * 64);
  g.format = Format::fp6_e3m2;  // rows of 3D/4 bytes
  EXPECT_EQ(pool_bytes(g), 3u * 8 * 2 * 2 * 24);
  g.page_size = 7;
  expect_error([&] { pool_bytes(g); }, "geometry.page_size: 7");
  expect_error([&] { layout_strides(g, Layout::B2NHD); }, "geometry.page_size: 7");
}

// Every dense layout tiles its pool exactly: each byte belongs to exactly one row.
TEST(LayoutStrides, DenseLayoutsTileThePool) {
  for (Format format : kAllFormats) {
    CacheGeometry g = small_geometry();
    g.format = format;
    g.head_dim = 64;
    for (Layout layout : kAllLayouts) {
      SCOPED_TRACE(std::string(to_string(format)) + " " + std::string(to_string(layout)));
      OwnedCache cache(g, layout);
      EXPECT_NO_THROW(validate(cache.view));
      std::vector<int> owners(cache.pool.size(), 0);
      for (int page = 0; page < g.num_pages; ++page)
        for (int head = 0; head < g.num_kv_heads; ++head)
          for (int token = 0; token < g.page_size; ++token)
            for (int kv = 0; kv < 2; ++kv) {
              const std::ptrdiff_t start = cache.view.row(page, head, token, kv) - cache.view.data;
              for (std::size_t b = 0; b < g.row_bytes(); ++b) ++owners[start + b];
            }
      EXPECT_TRUE(std::all_of(owners.begin(), owners.end(), [](int n) { return n == 1; }));
    }
  }
}

// --- cache view validation ---------------------------------------------------------------------

TEST(ValidateCache, AcceptsEveryGranularityAndPaddedStrides) {
  OwnedCache cache(small_geometry());
  EXPECT_NO_THROW(validate(cache.view));

  std::vector<float> one{1.0f};
  cache.view.granularity = ScaleGranularity::tensor;
  cache.view.k_scale = one;
  cache.view.v_scale = one;
  EXPECT_NO_THROW(validate(cache.view));

  std::vector<float> per_channel(2 * 32, 0.25f);
  cache.view.granularity = ScaleGranularity::channel;
  cache.view.k_scale = per_channel;
  cache.view.v_scale = per_channel;
  EXPECT_NO_THROW(validate(cache.view));

  // Gaps between rows and pages: B2NHD with 8 spare bytes after each row and page.
  std::vector<std::byte> padded(3 * (2 * 8 * 2 * 40 + 8));
  OwnedCache gappy(small_geometry());
  gappy.view.strides = {2 * 8 * 2 * 40 + 8, 40, 2 * 40, 8 * 2 * 40};
  gappy.view.data = padded.data();
  gappy.view.bytes = padded.size();
  EXPECT_NO_THROW(validate(gappy.view));

  // One head: its stride is never stepped and may be anything non-negative.
  CacheGeometry one_head = small_geometry();
  one_head.num_kv_heads = 1;
  OwnedCache single(one_head);
  single.view.strides.head = 0;
  EXPECT_NO_THROW(validate(single.view));
}

TEST(ValidateCache, Geometry) {
  for (int page_size : {0, 4, 12, 512, -16}) {
    OwnedCache cache(small_geometry());
    cache.view.geometry.page_size = page_size;
    expect_error([&] { validate(cache.view); },
                 "cache.geometry.page_size: ", "is not a power of two in [8, 256]");
  }
  expect_error(
      [] {
        OwnedCache cache(small_geometry());
        cache.view.geometry.page_size = 12;
        validate(cache.view);
      },
      "cache.geometry.page_size: 12 is not a power of two in [8, 256]");
  for (int head_dim : {0, 16, 48, 288, -32}) {
    OwnedCache cache(small_geometry());
    cache.view.geometry.head_dim = head_dim;
    expect_error([&] { validate(cache.view); },
                 "cache.geometry.head_dim: ", "multiple of 32 in [32, 256]");
  }
  {
    OwnedCache cache(small_geometry());
    cache.view.geometry.num_kv_heads = 0;
    expect_error([&] { validate(cache.view); }, "cache.geometry.num_kv_heads: 0");
  }
  {
    OwnedCache cache(small_geometry());
    cache.view.geometry.num_pages = 0;
    expect_error([&] { validate(cache.view); }, "cache.geometry.num_pages: 0");
  }
  {
    OwnedCache cache(small_geometry());
    cache.view.geometry.format = static_cast<Format>(42);
    expect_error([&] { validate(cache.view); }, "cache.geometry.format: 42");
  }
  {
    OwnedCache cache(small_geometry());
    cache.view.geometry.num_pages = std::numeric_limits<int>::max();
    cache.view.geometry.num_kv_heads = std::numeric_limits<int>::max();
    expect_error([&] { validate(cache.view); }, "cache.geometry:", "exceeds 2^63 bytes");
  }
}

TEST(ValidateCache, NullData) {
  OwnedCache cache(small_geometry());
  cache.view.data = nullptr;
  expect_error([&] { validate(cache.view); }, "cache.data:", "null");
}

TEST(ValidateCache, NegativeStride) {
  OwnedCache cache(small_geometry());
  cache.view.strides.token = -64;
  expect_error([&] { validate(cache.view); }, "cache.strides.token: -64 is negative");
  cache.view.strides = layout_strides(small_geometry(), Layout::B2NHD);
  cache.view.strides.kv = -1;
  expect_error([&] { validate(cache.view); }, "cache.strides.kv:");
}

TEST(ValidateCache, RowsOutsideThePool) {
  OwnedCache cache(small_geometry());
  cache.view.bytes -= 1;  // the last row (page 2, head 1, token 7, V) ends at 3072
  expect_error([&] { validate(cache.view); },
               "cache.strides: row (page 2, head 1, token 7, V) ends at byte 3072, outside the "
               "pool of 3071 bytes");
  cache.view.bytes += 1;
  cache.view.strides.page = std::numeric_limits<std::int64_t>::max();  // overflows 64 bits
  expect_error([&] { validate(cache.view); }, "cache.strides: row", "outside the pool");
}

TEST(ValidateCache, OverlappingRows) {
  // The token stride of B2NHD (64) steps over both heads' rows; 32 makes token t's head 1 the
  // same row as token t+1's head 0.
  OwnedCache cache(small_geometry());
  cache.view.strides.token = 32;
  expect_error([&] { validate(cache.view); }, "cache.strides.", "overlap");
  // K and V at the same place.
  OwnedCache same_kv(small_geometry());
  same_kv.view.strides.kv = 0;
  expect_error([&] { validate(same_kv.view); }, "cache.strides.kv: 0 bytes", "overlap");
  // Rows closer than a row's length.
  OwnedCache short_rows(small_geometry(), Layout::B2HND);
  short_rows.view.strides.token = 31;
  expect_error([&] { validate(short_rows.view); },
               "cache.strides.token: 31 bytes is less than the 32 bytes spanned by one row");
}

TEST(ValidateCache, ScaleCounts) {
  OwnedCache cache(small_geometry());
  std::vector<float> three(3, 1.0f);
  cache.view.k_scale = three;
  expect_error([&] { validate(cache.view); },
               "cache.k_scale: 3 values, expected 2 for granularity head with 2 heads");
  cache.view.k_scale = cache.k_scale;
  cache.view.granularity = ScaleGranularity::channel;
  std::vector<float> per_channel(64, 1.0f);
  cache.view.k_scale = per_channel;
  expect_error([&] { validate(cache.view); },
               "cache.v_scale: 2 values, expected 64 for granularity channel with 2 heads x 32 "
               "channels");
  cache.view.granularity = ScaleGranularity::tensor;
  cache.view.k_scale = {};
  expect_error([&] { validate(cache.view); },
               "cache.k_scale: 0 values, expected 1 for granularity tensor");
  cache.view.granularity = static_cast<ScaleGranularity>(9);
  expect_error([&] { validate(cache.view); }, "cache.granularity: 9");
}

TEST(ValidateCache, ScaleValues) {
  const float bad_values[] = {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  for (float bad : bad_values) {
    OwnedCache cache(small_geometry());
    cache.v_scale[1] = bad;
    expect_error([&] { validate(cache.view); },
                 "cache.v_scale[1]: ", "is not a positive finite scale");
  }
}

// --- paged batch validation --------------------------------------------------------------------

// Two sequences of a 3-page pool of 8 tokens, up to 2 pages each.
struct OwnedBatch {
  std::vector<std::int32_t> block_table{2, 0, 1, -1};
  std::vector<std::int32_t> seq_lens{9, 5};
  PagedBatch view() const { return PagedBatch{block_table, 2, seq_lens}; }
};

TEST(ValidateBatch, AcceptsUnusedEntriesAndPadding) {
  OwnedBatch batch;  // sequence 1 uses one page; its second entry is -1 and never read
  EXPECT_NO_THROW(validate(batch.view(), small_geometry(), 1));
  EXPECT_NO_THROW(validate(batch.view(), small_geometry(), 5));
  batch.seq_lens = {16, 0};  // a padding request: its whole row is unused
  batch.block_table = {1, 2, 99, -7};
  EXPECT_NO_THROW(validate(batch.view(), small_geometry(), 8));
  // An all-padding batch needs no table at all.
  const std::vector<std::int32_t> padding{0, 0};
  EXPECT_NO_THROW(validate(PagedBatch{{}, 0, padding}, small_geometry(), 1));
  EXPECT_NO_THROW(validate(PagedBatch{}, small_geometry(), 1));  // no sequences
}

TEST(ValidateBatch, QLen) {
  OwnedBatch batch;
  expect_error([&] { validate(batch.view(), small_geometry(), 0); }, "q_len: 0 is outside [1, 8]");
  expect_error([&] { validate(batch.view(), small_geometry(), 9); }, "q_len: 9 is outside [1, 8]");
}

TEST(ValidateBatch, TableShape) {
  OwnedBatch batch;
  batch.block_table.pop_back();
  expect_error([&] { validate(batch.view(), small_geometry(), 1); },
               "block_table: 3 entries, expected 2 sequences x 2 pages = 4");
  const std::vector<std::int32_t> lens{3};
  expect_error(
      [&] {
        validate(PagedBatch{{}, 0, lens}, small_geometry(), 1);
      },
      "max_pages_per_seq: 0", "3-token sequence");
  expect_error(
      [&] {
        validate(PagedBatch{{}, -1, lens}, small_geometry(), 1);
      },
      "max_pages_per_seq: -1 is negative");
}

TEST(ValidateBatch, SeqLens) {
  OwnedBatch batch;
  batch.seq_lens = {17, 5};
  expect_error([&] { validate(batch.view(), small_geometry(), 1); },
               "seq_lens[0]: 17 tokens do not fit 2 pages of 8");
  batch.seq_lens = {9, 1};
  expect_error([&] { validate(batch.view(), small_geometry(), 2); },
               "seq_lens[1]: 1 is less than q_len 2");
  batch.seq_lens = {-3, 1};
  expect_error([&] { validate(batch.view(), small_geometry(), 1); }, "seq_lens[0]: -3 is negative");
}

TEST(ValidateBatch, PagesOutsideThePool) {
  OwnedBatch batch;
  batch.block_table = {2, 3, 1, -1};  // sequence 0's second page is past the 3-page pool
  expect_error([&] { validate(batch.view(), small_geometry(), 1); },
               "block_table[0][1]: page 3 is outside the pool of 3 pages");
  batch.block_table = {2, 0, -1, 0};
  expect_error([&] { validate(batch.view(), small_geometry(), 1); },
               "block_table[1][0]: page -1 is outside the pool of 3 pages");
}

TEST(ValidateBatch, GeometryOfTheCache) {
  OwnedBatch batch;
  CacheGeometry geometry = small_geometry();
  geometry.page_size = 24;
  expect_error([&] { validate(batch.view(), geometry, 1); }, "cache.page_size: 24");
}

}  // namespace
}  // namespace mjolnir

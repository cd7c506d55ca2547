// The paged KV cache: layout names and dense strides, scale granularities, and the validation of
// cache views and block tables (docs/design.md sections 3 and 7).
#include "mjolnir/cache.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "core/batch_checks.h"
#include "mjolnir/error.h"
#include "mjolnir/plan.h"

namespace mjolnir {
namespace {

// Offsets are computed in 128 bits so that no stride or extent a caller can pass overflows
// before it is compared with the pool size (int64 stride x int extent < 2^94).
using Wide = __int128;

std::string wide_to_string(Wide value) {
  if (value == 0) return "0";
  const bool negative = value < 0;
  std::string digits;
  for (; value != 0; value /= 10) {
    const int digit = static_cast<int>(value % 10);
    digits.push_back(static_cast<char>('0' + (digit < 0 ? -digit : digit)));
  }
  if (negative) digits.push_back('-');
  std::reverse(digits.begin(), digits.end());
  return digits;
}

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::toupper(static_cast<unsigned char>(x)) ==
                  std::toupper(static_cast<unsigned char>(y));
         });
}

// A named layout's dimensions outermost first, without the innermost D: "B2NHD" -> "B2NH".
std::string_view outer_dims(Layout layout) { return to_string(layout).substr(0, 4); }

bool is_valid(Format format) { return static_cast<std::size_t>(format) < std::size(kAllFormats); }

// The geometry rules shared by cache views, batches and dense layouts. `name` is how the caller
// calls the geometry ("cache.geometry", "geometry").
void validate_geometry(const CacheGeometry& geometry, std::string_view name) {
  MJOLNIR_REQUIRE(is_valid(geometry.format), name, ".format: ", static_cast<int>(geometry.format),
                  " is not a known format");
  const int page_size = geometry.page_size;
  MJOLNIR_REQUIRE(page_size >= 8 && page_size <= 256 && (page_size & (page_size - 1)) == 0, name,
                  ".page_size: ", page_size, " is not a power of two in [8, 256]");
  const int head_dim = geometry.head_dim;
  MJOLNIR_REQUIRE(head_dim >= 32 && head_dim <= kMaxHeadDim && head_dim % 32 == 0, name,
                  ".head_dim: ", head_dim, " is not a multiple of 32 in [32, ", kMaxHeadDim, "]");
  MJOLNIR_REQUIRE(geometry.num_kv_heads >= 1, name, ".num_kv_heads: ", geometry.num_kv_heads,
                  " is less than 1");
  MJOLNIR_REQUIRE(geometry.num_pages >= 1, name, ".num_pages: ", geometry.num_pages,
                  " is less than 1");
  // A dense pool must be addressable with int64 byte offsets.
  const Wide dense_bytes = Wide(geometry.num_pages) * geometry.num_kv_heads * page_size * 2 *
                           static_cast<Wide>(geometry.row_bytes());
  MJOLNIR_REQUIRE(dense_bytes <= std::numeric_limits<std::int64_t>::max(), name, ": a pool of ",
                  geometry.num_pages, " pages x ", geometry.num_kv_heads, " heads x ", page_size,
                  " tokens x 2 rows of ", geometry.row_bytes(), " bytes exceeds 2^63 bytes");
}

// One addressed dimension of the pool: its name, byte stride and number of indices.
struct Dim {
  const char* name;
  std::int64_t stride;
  int extent;
};

// Every row lies in the pool: strides are non-negative, so the row furthest from `data` is the
// one with every index at its maximum.
void check_rows_inside_pool(const KvCacheView& cache) {
  const CacheGeometry& g = cache.geometry;
  const CacheStrides& s = cache.strides;
  const Wide last_row_end = Wide(g.num_pages - 1) * s.page + Wide(g.num_kv_heads - 1) * s.head +
                            Wide(g.page_size - 1) * s.token + Wide(s.kv) +
                            static_cast<Wide>(g.row_bytes());
  MJOLNIR_REQUIRE(last_row_end <= static_cast<Wide>(cache.bytes), "cache.strides: row (page ",
                  g.num_pages - 1, ", head ", g.num_kv_heads - 1, ", token ", g.page_size - 1,
                  ", V) ends at byte ", wide_to_string(last_row_end), ", outside the pool of ",
                  cache.bytes, " bytes");
}

// Distinct (page, head, token, kv) rows never share a byte. Sufficient condition, checked here:
// order the dimensions with more than one index by stride; each stride must be at least the span
// of everything below it (one row plus the reach of the smaller-stride dimensions). Then two
// rows whose largest differing dimension is j start at least stride_j - reach_below_j >=
// row_bytes apart. Dimensions of extent 1 are never stepped, so their stride is free. Every
// dense named layout passes; so do padded ones (gaps between rows or pages).
void check_rows_disjoint(const KvCacheView& cache) {
  const CacheGeometry& g = cache.geometry;
  std::array<Dim, 4> dims{{{"page", cache.strides.page, g.num_pages},
                           {"head", cache.strides.head, g.num_kv_heads},
                           {"token", cache.strides.token, g.page_size},
                           {"kv", cache.strides.kv, 2}}};
  std::stable_sort(dims.begin(), dims.end(),
                   [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  Wide span_below = static_cast<Wide>(g.row_bytes());
  std::string dims_below;  // "kv, token": the dimensions already inside span_below
  for (const Dim& dim : dims) {
    if (dim.extent == 1) continue;
    MJOLNIR_REQUIRE(Wide(dim.stride) >= span_below, "cache.strides.", dim.name, ": ", dim.stride,
                    " bytes is less than the ", wide_to_string(span_below),
                    " bytes spanned by one row",
                    dims_below.empty() ? "" : " and the " + dims_below + " steps below it",
                    ", so distinct rows would overlap");
    span_below += Wide(dim.extent - 1) * dim.stride;
    dims_below += (dims_below.empty() ? "" : ", ") + std::string(dim.name);
  }
}

std::string scale_count_explanation(ScaleGranularity granularity, int num_kv_heads, int head_dim) {
  std::string text = "for granularity " + std::string(to_string(granularity));
  switch (granularity) {
    case ScaleGranularity::tensor:
      break;
    case ScaleGranularity::head:
      text += " with " + std::to_string(num_kv_heads) + " heads";
      break;
    case ScaleGranularity::channel:
      text += " with " + std::to_string(num_kv_heads) + " heads x " + std::to_string(head_dim) +
              " channels";
      break;
  }
  return text;
}

void check_scales(std::span<const float> scales, const char* name, const KvCacheView& cache) {
  const CacheGeometry& g = cache.geometry;
  const std::size_t expected = scale_count(cache.granularity, g.num_kv_heads, g.head_dim);
  MJOLNIR_REQUIRE(scales.size() == expected, name, ": ", scales.size(), " values, expected ",
                  expected, " ",
                  scale_count_explanation(cache.granularity, g.num_kv_heads, g.head_dim));
  for (std::size_t i = 0; i < scales.size(); ++i) {
    MJOLNIR_REQUIRE(std::isfinite(scales[i]) && scales[i] > 0, name, "[", i, "]: ", scales[i],
                    " is not a positive finite scale");
  }
}

}  // namespace

std::string_view to_string(Layout layout) {
  switch (layout) {
    case Layout::BHN2D:
      return "BHN2D";
    case Layout::BNH2D:
      return "BNH2D";
    case Layout::B2NHD:
      return "B2NHD";
    case Layout::B2HND:
      return "B2HND";
    case Layout::_2BNHD:
      return "2BNHD";
    case Layout::_2BHND:
      return "2BHND";
  }
  return "unknown";
}

// Names are matched ignoring case ("b2nhd" works); the enum's "_2BNHD" spelling is accepted too.
Layout parse_layout(std::string_view name, std::string_view arg_name) {
  std::string_view bare = name;
  if (!bare.empty() && bare.front() == '_') bare.remove_prefix(1);
  for (Layout layout : kAllLayouts) {
    if (equals_ignoring_case(bare, to_string(layout))) return layout;
  }
  detail::throw_error(arg_name, ": '", name,
                      "' is not a layout (one of BHN2D, BNH2D, B2NHD, B2HND, 2BNHD, 2BHND)");
}

// Dense strides: walk the named dimensions from the innermost (just outside D) outwards; each
// dimension's stride is the product of the row size and the extents inside it.
CacheStrides layout_strides(const CacheGeometry& geometry, Layout layout) {
  validate_geometry(geometry, "geometry");
  CacheStrides strides;
  std::int64_t stride = static_cast<std::int64_t>(geometry.row_bytes());
  const std::string_view dims = outer_dims(layout);
  for (auto dim = dims.rbegin(); dim != dims.rend(); ++dim) {
    switch (*dim) {
      case 'B':
        strides.page = stride;
        stride *= geometry.num_pages;
        break;
      case 'H':
        strides.head = stride;
        stride *= geometry.num_kv_heads;
        break;
      case 'N':
        strides.token = stride;
        stride *= geometry.page_size;
        break;
      case '2':
        strides.kv = stride;
        stride *= 2;
        break;
    }
  }
  return strides;
}

std::size_t pool_bytes(const CacheGeometry& geometry) {
  validate_geometry(geometry, "geometry");
  return static_cast<std::size_t>(geometry.num_pages) * geometry.num_kv_heads * geometry.page_size *
         2 * geometry.row_bytes();
}

std::string_view to_string(ScaleGranularity granularity) {
  switch (granularity) {
    case ScaleGranularity::tensor:
      return "tensor";
    case ScaleGranularity::head:
      return "head";
    case ScaleGranularity::channel:
      return "channel";
  }
  return "unknown";
}

ScaleGranularity parse_granularity(std::string_view name, std::string_view arg_name) {
  for (ScaleGranularity granularity :
       {ScaleGranularity::tensor, ScaleGranularity::head, ScaleGranularity::channel}) {
    if (equals_ignoring_case(name, to_string(granularity))) return granularity;
  }
  detail::throw_error(arg_name, ": '", name,
                      "' is not a scale granularity (one of tensor, head, channel)");
}

std::size_t scale_count(ScaleGranularity granularity, int num_kv_heads, int head_dim) {
  switch (granularity) {
    case ScaleGranularity::tensor:
      return 1;
    case ScaleGranularity::head:
      return static_cast<std::size_t>(std::max(num_kv_heads, 0));
    case ScaleGranularity::channel:
      return static_cast<std::size_t>(std::max(num_kv_heads, 0)) *
             static_cast<std::size_t>(std::max(head_dim, 0));
  }
  detail::throw_error("granularity: ", static_cast<int>(granularity),
                      " is not a scale granularity");
}

void validate(const KvCacheView& cache) {
  validate_geometry(cache.geometry, "cache.geometry");
  MJOLNIR_REQUIRE(cache.data != nullptr, "cache.data: is null");
  const CacheStrides& s = cache.strides;
  for (const Dim& dim : {Dim{"page", s.page, 0}, Dim{"head", s.head, 0}, Dim{"token", s.token, 0},
                         Dim{"kv", s.kv, 0}}) {
    MJOLNIR_REQUIRE(dim.stride >= 0, "cache.strides.", dim.name, ": ", dim.stride, " is negative");
  }
  check_rows_inside_pool(cache);
  check_rows_disjoint(cache);
  MJOLNIR_REQUIRE(
      static_cast<int>(cache.granularity) <= static_cast<int>(ScaleGranularity::channel),
      "cache.granularity: ", static_cast<int>(cache.granularity), " is not a scale granularity");
  check_scales(cache.k_scale, "cache.k_scale", cache);
  check_scales(cache.v_scale, "cache.v_scale", cache);
}

void validate(const PagedBatch& batch, const CacheGeometry& cache, int q_len) {
  validate_geometry(cache, "cache");
  detail::check_batch(batch, cache, q_len);
}

void detail::check_batch(const PagedBatch& batch, const CacheGeometry& cache, int q_len) {
  const int num_seqs = batch.num_seqs();
  const bool ragged = !batch.query_start.empty();
  check_query_tokens(q_len, batch.query_start, std::size_t(num_seqs), "q_len", "batch.query_start");
  const std::int64_t max_pages = batch.max_pages_per_seq;
  MJOLNIR_REQUIRE(max_pages >= 0, "max_pages_per_seq: ", max_pages, " is negative");

  std::int32_t longest = 0;
  for (int seq = 0; seq < num_seqs; ++seq) longest = std::max(longest, batch.seq_lens[seq]);
  MJOLNIR_REQUIRE(longest == 0 || max_pages >= 1, "max_pages_per_seq: 0, but seq_lens holds a ",
                  longest, "-token sequence");
  const std::size_t expected_entries = static_cast<std::size_t>(num_seqs) * max_pages;
  MJOLNIR_REQUIRE(batch.block_table.size() == expected_entries,
                  "block_table: ", batch.block_table.size(), " entries, expected ", num_seqs,
                  " sequences x ", max_pages, " pages = ", expected_entries);

  const std::int64_t capacity = max_pages * cache.page_size;  // tokens one table row can hold
  for (int seq = 0; seq < num_seqs; ++seq) {
    const std::int32_t seq_len = batch.seq_lens[seq];
    if (ragged) {
      const std::int32_t begin = batch.query_start[seq], end = batch.query_start[seq + 1];
      MJOLNIR_REQUIRE(end - begin <= std::max(seq_len, 0), "query_start: sequence ", seq, " has ",
                      end - begin, " query tokens but seq_lens[", seq, "] is ", seq_len,
                      " (its query tokens are in the cache)");
    }
    if (seq_len == 0) continue;  // padding request: its table row is not read
    MJOLNIR_REQUIRE(seq_len > 0, "seq_lens[", seq, "]: ", seq_len, " is negative");
    MJOLNIR_REQUIRE(ragged || seq_len >= q_len, "seq_lens[", seq, "]: ", seq_len,
                    " is less than q_len ", q_len);
    MJOLNIR_REQUIRE(seq_len <= capacity, "seq_lens[", seq, "]: ", seq_len, " tokens do not fit ",
                    max_pages, " pages of ", cache.page_size);
    // Only the pages that hold the sequence's tokens are read; the rest may be anything.
    const int used_pages = (seq_len + cache.page_size - 1) / cache.page_size;
    for (int i = 0; i < used_pages; ++i) {
      const std::int32_t page = batch.page(seq, i);
      MJOLNIR_REQUIRE(page >= 0 && page < cache.num_pages, "block_table[", seq, "][", i, "]: page ",
                      page, " is outside the pool of ", cache.num_pages, " pages");
    }
  }
}

}  // namespace mjolnir

// The paged KV cache as a view: format, geometry, layout strides, scales (docs/design.md section
// 3).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "mjolnir/format.h"

namespace mjolnir {

// Named layouts list dimensions outermost first: B = page, H = KV head, N = token in page,
// 2 = K/V, D = the packed row of channels (always innermost and contiguous). vLLM's flash layout
// is B2NHD; FlashInfer's NHD / HND are B2NHD / B2HND.
enum class Layout : std::uint8_t { BHN2D, BNH2D, B2NHD, B2HND, _2BNHD, _2BHND };

inline constexpr Layout kAllLayouts[] = {Layout::BHN2D, Layout::BNH2D,  Layout::B2NHD,
                                         Layout::B2HND, Layout::_2BNHD, Layout::_2BHND};

std::string_view to_string(Layout layout);  // "B2NHD", "2BNHD", ...
Layout parse_layout(std::string_view name, std::string_view arg_name = "layout");

// Byte strides of a cache pool. Element (page, head, token, kv) starts at
//   page * page + head * head + token * token + kv * kv   (kv: 0 = K, 1 = V)
// and holds row_bytes(format, head_dim) contiguous bytes.
struct CacheStrides {
  std::int64_t page = 0;
  std::int64_t head = 0;
  std::int64_t token = 0;
  std::int64_t kv = 0;
};

// The largest head size a cache holds (CacheGeometry::head_dim): buffers of one row's channels
// can live on the stack.
inline constexpr int kMaxHeadDim = 256;

// The shape of the cache, with no memory attached.
struct CacheGeometry {
  Format format = Format::fp8_e4m3;
  int num_pages = 0;     // pages in the pool
  int page_size = 16;    // tokens per page: a power of two in [8, 256]
  int num_kv_heads = 0;  // Hk
  int head_dim = 128;    // D: a multiple of 32 in [32, kMaxHeadDim]

  std::size_t row_bytes() const { return mjolnir::row_bytes(format, head_dim); }
};

// Dense strides of a named layout for `geometry`.
CacheStrides layout_strides(const CacheGeometry& geometry, Layout layout);
// Bytes a dense pool of that layout occupies.
std::size_t pool_bytes(const CacheGeometry& geometry);

// How the outer scales are indexed. Every format has them (bf16 / fp16 usually 1.0).
enum class ScaleGranularity : std::uint8_t {
  tensor,   // one K and one V scale
  head,     // [Hk]
  channel,  // [Hk, D]; static (calibrated), K's fold into Q, V's apply to the output
};
std::string_view to_string(ScaleGranularity granularity);
ScaleGranularity parse_granularity(std::string_view name,
                                   std::string_view arg_name = "granularity");
// Number of scales per K (or V) for the granularity: 1, Hk or Hk * D.
std::size_t scale_count(ScaleGranularity granularity, int num_kv_heads, int head_dim);

// A view of a paged KV cache pool. Does not own memory. Stored value = decoded code * scale.
struct KvCacheView {
  CacheGeometry geometry;
  CacheStrides strides;
  std::byte* data = nullptr;  // the pool; every addressed row must lie inside [data, data+bytes)
  std::size_t bytes = 0;
  ScaleGranularity granularity = ScaleGranularity::tensor;
  std::span<const float> k_scale;  // scale_count() positive finite values
  std::span<const float> v_scale;

  // Start of the row of (page, head, token in page, kv). No checks: callers validate first.
  std::byte* row(int page, int head, int token, int kv) const {
    return data + page * strides.page + head * strides.head + token * strides.token +
           kv * strides.kv;
  }
  float k_scale_at(int head, int channel) const { return scale_at(k_scale, head, channel); }
  float v_scale_at(int head, int channel) const { return scale_at(v_scale, head, channel); }

 private:
  float scale_at(std::span<const float> s, int head, int channel) const {
    switch (granularity) {
      case ScaleGranularity::tensor:
        return s[0];
      case ScaleGranularity::head:
        return s[head];
      case ScaleGranularity::channel:
        return s[head * geometry.head_dim + channel];
    }
    return 1.0f;
  }
};

// Checks geometry (page size, D, counts), strides (non-negative, rows not overlapping inside a
// page-head-token-kv step, every row inside the pool) and scales (count, positive, finite).
// Throws Error naming the field, e.g. "cache.geometry.page_size: 12 is not a power of two in
// [8, 256]".
void validate(const KvCacheView& cache);

// The sequences of one decode step: which pages hold each sequence and how long it is.
struct PagedBatch {
  std::span<const std::int32_t> block_table;  // [num_seqs, max_pages_per_seq], row-major
  int max_pages_per_seq = 0;
  std::span<const std::int32_t> seq_lens;  // [num_seqs]: KV tokens, the new ones included
  // Optional [num_seqs + 1], nondecreasing from 0, for a ragged step (q_len 0): sequence b's
  // query tokens are rows [query_start[b], query_start[b + 1]) of q and o, at most seq_lens[b]
  // of them (vLLM's query_start_loc). Empty: q_len query tokens per sequence.
  std::span<const std::int32_t> query_start;
  int num_seqs() const { return static_cast<int>(seq_lens.size()); }
  std::int32_t page(int seq, int page_index) const {
    return block_table[static_cast<std::size_t>(seq) * max_pages_per_seq + page_index];
  }
};

// Checks the table shape, every used entry inside [0, cache.num_pages), and
// q_len <= seq_len <= max_pages_per_seq * page_size (seq_len 0 = padding request); with
// q_len 0, query_start (num_seqs + 1 entries from 0, nondecreasing, at most seq_len query
// tokens per sequence).
void validate(const PagedBatch& batch, const CacheGeometry& cache, int q_len);

}  // namespace mjolnir

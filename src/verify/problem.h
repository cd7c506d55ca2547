// A self-contained decode problem: a filled paged cache, a batch and queries, owning its memory.
// Built by the tests, `mjolnir verify` and `mjolnir bench` from one spec.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "mjolnir/decode.h"

namespace mjolnir::verify {

struct ProblemSpec {
  Format format = Format::fp8_e4m3;
  Layout layout = Layout::B2NHD;
  ScaleGranularity granularity = ScaleGranularity::head;
  int page_size = 16;
  int head_dim = 128;
  int num_kv_heads = 8;
  int group = 4;        // g = Hq / Hk
  DecodeParams params;  // q_len, causal, modes; num_q_heads is filled in from Hk * group
  std::vector<std::int32_t> seq_lens;  // 0 = padding request
  // A ragged step (params.q_len 0): each sequence's query tokens, at most its seq_len (prefill:
  // all of them, chunked prefill: the last few, decode: 1, or 0). Empty: params.q_len each.
  std::vector<std::int32_t> query_lens;
  int extra_pages = 0;           // unused pages added to the pool (and block table slack)
  bool shuffle_pages = true;     // block tables map to a shuffled page order
  bool keep_original_kv = true;  // keep the float K/V for the exact reference (tests, verify)
  // 0: every position of a sequence is drawn. N > 0: only the first N positions are, and
  // position p holds the K/V of p % N. Every page is still its own memory, so the bench's long
  // caches read the same bytes as distinct data would, without minutes of drawing and gigabytes
  // of floats (a batch of 8 x 128k tokens is 2G values).
  int distinct_positions = 0;
  // Queries rounded to bf16 values, as a bf16 model's are (whatever the Q mode).
  bool bf16_queries = false;
  // Distribution: K has a few outlier channels (x8) as real models do, unless this is false (then
  // K is plain N(0, 1) too); V is plain N(0, 1).
  bool k_outlier_channels = true;
  // Factor on the amax the scales are calibrated from (scales_from_amax's headroom): below 1
  // clips the largest values to give the rest finer steps.
  double scale_headroom = 1.0;
  std::uint64_t seed = 1;
};

// Owns the pool, scales, block table, queries and outputs; args() views them.
class Problem {
 public:
  explicit Problem(const ProblemSpec& spec);
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  const ProblemSpec& spec() const { return spec_; }
  // Arguments for one decode step writing into this problem's o / lse buffers.
  DecodeArgs args();
  std::span<const float> output() const;  // [query rows, Hq, D], dense
  std::span<const float> lse() const;     // [query rows, Hq]
  const std::vector<float>& query() const { return q_; }
  KvCacheView cache() const;
  PagedBatch batch() const;
  std::size_t kv_bytes_read() const;  // bytes of K/V rows the step reads (what bench divides by)
  // The float K or V written for (seq, head, position), before quantization; requires
  // keep_original_kv. kv: 0 = K, 1 = V. Returns D values.
  const float* original_kv(int seq, int head, int position, int kv) const;
  // For tests that plant a value (a NaN in q, an Inf code in the cache): the queries
  // [query rows, Hq, D], and the code bytes of one K (kv 0) or V (kv 1) row.
  std::span<float> mutable_query() { return q_; }
  std::span<std::byte> kv_row_bytes(int seq, int head, int position, int kv);
  // Fills o and lse (and their guard regions) with NaN so a row a backend forgot to write is
  // caught; guards_intact() then tells whether anything was written outside them.
  void poison_outputs();
  bool guards_intact() const;
  static constexpr std::size_t kGuardFloats = 64;

 private:
  ProblemSpec spec_;
  CacheGeometry geometry_;
  CacheStrides strides_;
  std::vector<std::byte> pool_;
  std::vector<float> k_scale_, v_scale_;
  std::vector<std::int32_t> block_table_;
  std::vector<std::int32_t> query_start_;  // [num_seqs + 1] for a ragged step, else empty
  int max_pages_per_seq_ = 0;
  std::vector<float> q_, o_, lse_;
  std::vector<float> original_;               // [seq][position][head][kv][D] when kept
  std::vector<std::size_t> original_offset_;  // per seq
};

}  // namespace mjolnir::verify

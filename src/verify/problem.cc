// Problem: builds a filled paged cache, queries and outputs from a ProblemSpec.
#include "verify/problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "core/minifloat.h"
#include "mjolnir/calibrate.h"
#include "mjolnir/error.h"
#include "mjolnir/write_kv.h"

namespace mjolnir::verify {

namespace {

// Pool bytes nobody wrote: NaN for fp8/fp16/bf16 codes and the most negative codes for fp6/fp4,
// so a kernel reading past seq_len or from an unused page shows up in the results.
constexpr std::byte kPoolSentinel{0xff};
constexpr float kOutputSentinel = std::numeric_limits<float>::quiet_NaN();

// K gets a few outlier channels, as real models' K caches have; per-channel scales exist for
// them. Which channels is fixed per head so calibration sees them.
bool is_outlier_channel(int head, int channel) { return (channel * 7 + head * 3) % 23 == 0; }

}  // namespace

Problem::Problem(const ProblemSpec& spec) : spec_(spec) {
  MJOLNIR_REQUIRE(spec.group >= 1, "group: ", spec.group, " must be at least 1");
  spec_.params.num_q_heads = spec.num_kv_heads * spec.group;
  const int num_seqs = static_cast<int>(spec.seq_lens.size());
  const int d = spec.head_dim;
  const int hk = spec.num_kv_heads;
  const int page_size = spec.page_size;
  MJOLNIR_REQUIRE(page_size > 0, "page_size: ", page_size, " must be positive");

  // Pages: each sequence's, plus unused extra ones, in a (shuffled) physical order.
  int used_pages = 0;
  max_pages_per_seq_ = 1;
  for (int len : spec.seq_lens) {
    const int pages = (len + page_size - 1) / page_size;
    used_pages += pages;
    max_pages_per_seq_ = std::max(max_pages_per_seq_, pages + 1);  // +1: an unused entry
  }
  geometry_ =
      CacheGeometry{spec.format, std::max(1, used_pages + spec.extra_pages), page_size, hk, d};
  strides_ = layout_strides(geometry_, spec.layout);
  pool_.assign(pool_bytes(geometry_), kPoolSentinel);

  std::mt19937_64 rng(spec.seed);
  std::vector<std::int32_t> physical(geometry_.num_pages);
  std::iota(physical.begin(), physical.end(), 0);
  if (spec.shuffle_pages) std::shuffle(physical.begin(), physical.end(), rng);
  block_table_.assign(std::size_t(num_seqs) * max_pages_per_seq_, -1);
  int next_page = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const int pages = (spec.seq_lens[b] + page_size - 1) / page_size;
    for (int i = 0; i < pages; ++i) {
      block_table_[std::size_t(b) * max_pages_per_seq_ + i] = physical[next_page++];
    }
  }

  // Original K/V, [seq][position][head][kv][D].
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> kv(num_seqs);
  std::vector<float> k_amax(std::size_t(hk) * d, 0.0f), v_amax(std::size_t(hk) * d, 0.0f);
  MJOLNIR_REQUIRE(spec.distinct_positions >= 0, "distinct_positions: ", spec.distinct_positions,
                  " must not be negative");
  const auto drawn_positions = [&](int len) {
    return spec.distinct_positions > 0 ? std::min(len, spec.distinct_positions) : len;
  };
  for (int b = 0; b < num_seqs; ++b) {
    const int drawn = drawn_positions(spec.seq_lens[b]);
    kv[b].resize(std::size_t(drawn) * hk * 2 * d);
    float* x = kv[b].data();
    for (int pos = 0; pos < drawn; ++pos) {
      for (int h = 0; h < hk; ++h) {
        for (int which = 0; which < 2; ++which) {
          for (int c = 0; c < d; ++c, ++x) {
            const float outlier =
                which == 0 && spec.k_outlier_channels && is_outlier_channel(h, c) ? 8.0f : 1.0f;
            *x = normal(rng) * outlier;
            float& amax = (which == 0 ? k_amax : v_amax)[std::size_t(h) * d + c];
            amax = std::max(amax, std::abs(*x));
          }
        }
      }
    }
  }

  // Scales calibrated on the data, as a serving engine's calibration would.
  if (is_quantized(spec.format)) {
    k_scale_ = scales_from_amax(k_amax, spec.format, spec.granularity, hk, d, spec.scale_headroom);
    v_scale_ = scales_from_amax(v_amax, spec.format, spec.granularity, hk, d, spec.scale_headroom);
  } else {
    k_scale_.assign(scale_count(spec.granularity, hk, d), 1.0f);
    v_scale_.assign(scale_count(spec.granularity, hk, d), 1.0f);
  }

  const KvCacheView view = cache();
  for (int b = 0; b < num_seqs; ++b) {
    const int len = spec.seq_lens[b];
    const int drawn = drawn_positions(len);
    const std::int64_t token_stride = std::int64_t(hk) * 2 * d;
    // The drawn positions, written again at every multiple of their count.
    std::vector<std::int64_t> slots;
    for (int first = 0; first < len; first += drawn) {
      const int count = std::min(drawn, len - first);
      slots.resize(count);
      for (int i = 0; i < count; ++i) {
        const int pos = first + i;
        slots[i] =
            std::int64_t(block_table_[std::size_t(b) * max_pages_per_seq_ + pos / page_size]) *
                page_size +
            pos % page_size;
      }
      write_kv(view, TokenRows{kv[b].data(), token_stride, 2 * d},
               TokenRows{kv[b].data() + d, token_stride, 2 * d}, slots);
    }
  }
  if (spec.keep_original_kv) {
    original_offset_.resize(num_seqs + 1, 0);
    for (int b = 0; b < num_seqs; ++b) original_offset_[b + 1] = original_offset_[b] + kv[b].size();
    original_.reserve(original_offset_[num_seqs]);
    for (auto& part : kv) original_.insert(original_.end(), part.begin(), part.end());
  }

  std::size_t rows = std::size_t(num_seqs) * spec.params.q_len;
  if (!spec.query_lens.empty()) {
    MJOLNIR_REQUIRE(spec.query_lens.size() == spec.seq_lens.size(),
                    "query_lens: ", spec.query_lens.size(), " entries for ", num_seqs,
                    " sequences");
    MJOLNIR_REQUIRE(spec.params.q_len == 0, "query_lens: given with q_len ", spec.params.q_len,
                    " (a ragged step has q_len 0)");
    query_start_.assign(1, 0);
    for (int n : spec.query_lens) query_start_.push_back(query_start_.back() + n);
    rows = std::size_t(query_start_.back());
  }
  const std::size_t q_floats = rows * spec_.params.num_q_heads * d;
  q_.resize(q_floats);
  for (float& x : q_) {
    x = normal(rng);
    if (spec_.bf16_queries) x = decode_minifloat<kBf16Spec>(encode_minifloat<kBf16Spec>(x));
  }
  o_.assign(q_floats + 2 * kGuardFloats, kOutputSentinel);
  lse_.assign(rows * spec_.params.num_q_heads + 2 * kGuardFloats, kOutputSentinel);
}

KvCacheView Problem::cache() const {
  KvCacheView view;
  view.geometry = geometry_;
  view.strides = strides_;
  view.data = const_cast<std::byte*>(pool_.data());
  view.bytes = pool_.size();
  view.granularity = spec_.granularity;
  view.k_scale = k_scale_;
  view.v_scale = v_scale_;
  return view;
}

PagedBatch Problem::batch() const {
  return PagedBatch{block_table_, max_pages_per_seq_, spec_.seq_lens, query_start_};
}

DecodeArgs Problem::args() {
  const int d = spec_.head_dim;
  const int hq = spec_.params.num_q_heads;
  DecodeArgs a;
  a.cache = cache();
  a.batch = batch();
  a.params = spec_.params;
  a.q = QueryTensor{q_.data(), std::int64_t(hq) * d, d};
  a.o = OutputTensor{o_.data() + kGuardFloats, std::int64_t(hq) * d, d};
  a.lse = std::span<float>(lse_.data() + kGuardFloats, lse_.size() - 2 * kGuardFloats);
  return a;
}

std::span<const float> Problem::output() const {
  return {o_.data() + kGuardFloats, o_.size() - 2 * kGuardFloats};
}
std::span<const float> Problem::lse() const {
  return {lse_.data() + kGuardFloats, lse_.size() - 2 * kGuardFloats};
}

bool Problem::guards_intact() const {
  auto intact = [](const std::vector<float>& v) {
    for (std::size_t i = 0; i < kGuardFloats; ++i) {
      if (!std::isnan(v[i]) || !std::isnan(v[v.size() - 1 - i])) return false;
    }
    return true;
  };
  return intact(o_) && intact(lse_);
}

void Problem::poison_outputs() {
  std::fill(o_.begin(), o_.end(), kOutputSentinel);
  std::fill(lse_.begin(), lse_.end(), kOutputSentinel);
}

std::size_t Problem::kv_bytes_read() const {
  std::size_t tokens = 0;
  for (int len : spec_.seq_lens) tokens += len;
  return tokens * spec_.num_kv_heads * 2 * geometry_.row_bytes();
}

const float* Problem::original_kv(int seq, int head, int position, int kv) const {
  MJOLNIR_REQUIRE(spec_.keep_original_kv, "original_kv: the problem was built without it");
  const int d = spec_.head_dim;
  if (spec_.distinct_positions > 0) position %= spec_.distinct_positions;
  return &original_[original_offset_[seq] +
                    ((std::size_t(position) * spec_.num_kv_heads + head) * 2 + kv) * d];
}

std::span<std::byte> Problem::kv_row_bytes(int seq, int head, int position, int kv) {
  MJOLNIR_REQUIRE(seq >= 0 && seq < int(spec_.seq_lens.size()) && position >= 0 &&
                      position < spec_.seq_lens[seq] && head >= 0 && head < spec_.num_kv_heads &&
                      (kv == 0 || kv == 1),
                  "kv_row_bytes: no row (", seq, ", ", head, ", ", position, ", ", kv, ")");
  const int page = batch().page(seq, position / spec_.page_size);
  return {cache().row(page, head, position % spec_.page_size, kv), geometry_.row_bytes()};
}

}  // namespace mjolnir::verify

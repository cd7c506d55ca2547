// The numerics contract, step by step, in scalar fp32 (see emulator.h).
#include "reference/emulator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "core/fused_dot.h"
#include "core/non_finite.h"
#include "core/query_codes.h"
#include "mjolnir/error.h"
#include "mjolnir/format.h"

namespace mjolnir::reference {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kFp8PScale = 256.0f;  // fp8 P = e4m3(p * 256): p in (0, 1] lands in [.., 256]

float round_to(Format format, float x) { return decode_element(format, encode_element(format, x)); }

// Decodes the K or V row of `position` of sequence `seq` (codes times nvfp4 block scales; the
// outer scale is applied by the caller where the contract says).
void decode_kv_row(const DecodeArgs& args, int seq, int kv_head, int position, int kv,
                   std::span<float> out) {
  const KvCacheView& cache = args.cache;
  const int page_size = cache.geometry.page_size;
  const int page = args.batch.page(seq, position / page_size);
  const std::byte* row = cache.row(page, kv_head, position % page_size, kv);
  decode_row(cache.geometry.format, {row, cache.geometry.row_bytes()}, out);
}

}  // namespace

PreparedQuery prepare_query(const DecodeArgs& args, int seq, int kv_head) {
  return prepare_query(
      args, WorkItem{.seq = seq, .kv_head = kv_head, .q_begin = 0, .q_count = args.query_len(seq)});
}

PreparedQuery prepare_query(const DecodeArgs& args, const WorkItem& item) {
  const KvCacheView& cache = args.cache;
  const DecodeParams& p = args.params;
  const int d = cache.geometry.head_dim;
  const int g = p.num_q_heads / cache.geometry.num_kv_heads;
  const int rows = item.q_count * g;
  const int kv_head = item.kv_head;
  const bool channel_scales = cache.granularity == ScaleGranularity::channel;

  PreparedQuery prepared;
  prepared.values.resize(std::size_t(rows) * d);
  prepared.poisoned.assign(rows, 0);
  for (int r = 0; r < rows; ++r) {
    float* out = &prepared.values[std::size_t(r) * d];
    args.read_q_row(item, r, g, out);
    if (channel_scales) {
      for (int c = 0; c < d; ++c) out[c] *= cache.k_scale_at(kv_head, c);
    }
    if (!all_finite(out, d)) {
      prepared.poisoned[r] = 1;
      std::fill(out, out + d, 0.0f);
    }
  }

  float sq = 1.0f;
  switch (p.q_mode) {
    case QMode::fp32:
      break;
    case QMode::bf16:
      for (float& x : prepared.values) x = round_to(Format::bf16, x);
      break;
    case QMode::fp8: {
      float amax = 0.0f;
      for (float x : prepared.values) amax = std::max(amax, std::abs(x));
      if (amax > 0.0f) sq = amax / kQFp8Max;
      for (float& x : prepared.values) x = round_to(Format::fp8_e4m3, x / sq);
      break;
    }
    case QMode::int8: {
      float amax = 0.0f;
      for (float x : prepared.values) amax = std::max(amax, std::abs(x));
      if (amax > 0.0f) sq = amax / kQInt8Max;
      for (float& x : prepared.values) x = int8_code(x / sq);
      break;
    }
  }
  const float k_outer = channel_scales ? 1.0f : cache.k_scale_at(kv_head, 0);
  prepared.score_scale = sq * k_outer * p.effective_softmax_scale(d) * std::numbers::log2e_v<float>;
  return prepared;
}

float round_probability(float p, PMode mode) {
  switch (mode) {
    case PMode::fp32:
      return p;
    case PMode::bf16:
      return round_to(Format::bf16, p);
    case PMode::fp8:
      return round_to(Format::fp8_e4m3, p * kFp8PScale);
    case PMode::fp16:
      return round_to(Format::fp16, p);
  }
  return p;
}

// The fp16 nearest to x (ties to even, subnormals kept, beyond 65504 + half a step +-Inf), as a
// float: x divided by its fp16 quantum (a power of two, exactly), rounded to an integer in the
// default rounding mode (to nearest even), multiplied back. From a double directly: a float in
// between could round twice. (GCC 12 has no _Float16 in C++ on aarch64.)
float round_to_half(double x) {
  if (!std::isfinite(x)) return static_cast<float>(x);
  int exponent = 0;
  std::frexp(x, &exponent);                          // |x| in [2^(exponent - 1), 2^exponent)
  const int quantum = std::max(exponent - 11, -24);  // 11 significant bits; subnormals 2^-24
  const double rounded = std::ldexp(std::nearbyint(std::ldexp(x, -quantum)), quantum);
  if (std::fabs(rounded) > 65504.0) return std::copysign(kInf, static_cast<float>(x));
  return static_cast<float>(rounded);
}

// P mode fp16's step: the fp16 nearest to p * v + sum, from the exact value. p, v and sum are
// fp16 values, so p * v is exact in double and so is the sum but where sum exceeds the product by
// more than 2^31, where the nearest fp16 is sum either way.
float half_multiply_add(float p, float v, float sum) {
  return round_to_half(double(p) * double(v) + double(sum));
}

float probability_scale(PMode mode) { return mode == PMode::fp8 ? kFp8PScale : 1.0f; }

void run_item(const DecodeArgs& args, const Plan& plan, const WorkItem& item,
              const PreparedQuery& query, std::span<float> o, std::span<float> lse) {
  const KvCacheView& cache = args.cache;
  const DecodeParams& p = args.params;
  const int d = cache.geometry.head_dim;
  const int g = p.num_q_heads / cache.geometry.num_kv_heads;
  const int rows = item.q_count * g;
  const int seq_len = plan.query_tiles[item.tile].kv_len;  // what the tile's last token sees
  const int tile = plan.tile_tokens;

  // Running state per row: max m (log2 units), sum l of fp32 p, accumulator acc [D].
  std::vector<float> m(rows, kNegInf), l(rows, 0.0f), acc(std::size_t(rows) * d, 0.0f);
  // Rows that met a non-finite q or score (K) in a token they see.
  std::vector<char> poisoned(rows, 0);
  std::vector<float> k_tile(std::size_t(tile) * d), v_tile(std::size_t(tile) * d);
  std::vector<float> s(tile);
  std::vector<float> half_sums(p.p_mode == PMode::fp16 ? d : 0);  // P mode fp16's group sums
  static const bool fused = host_fuses_dot_products();

  for (int tile_begin = item.kv_begin; tile_begin < item.kv_end; tile_begin += tile) {
    const int n = std::min(tile, item.kv_end - tile_begin);
    for (int i = 0; i < n; ++i) {
      decode_kv_row(args, item.seq, item.kv_head, tile_begin + i, 0, {&k_tile[i * d], size_t(d)});
      decode_kv_row(args, item.seq, item.kv_head, tile_begin + i, 1, {&v_tile[i * d], size_t(d)});
    }
    for (int r = 0; r < rows; ++r) {
      const int t = r / g;
      // Last KV position this query token may see.
      const int last = p.causal ? seq_len - item.q_count + t : seq_len - 1;
      const float* q = &query.values[std::size_t(r) * d];
      if (tile_begin <= last && query.poisoned[r]) poisoned[r] = 1;
      float tile_max = kNegInf;
      for (int i = 0; i < n; ++i) {
        if (tile_begin + i > last) {
          s[i] = kNegInf;
          continue;
        }
        float dot = 0.0f;
        // Fused exactly where the host's baseline ISA has FMA (core/fused_dot.h), spelled out:
        // left to contraction, GCC 12 -O2 vectorizes `dot += q * k` on aarch64 into rounded
        // vector products summed in order, unfused but for the scalar tail.
        if (fused) {
          for (int c = 0; c < d; ++c) dot = std::fma(q[c], k_tile[i * d + c], dot);
        } else {
          for (int c = 0; c < d; ++c) dot += q[c] * k_tile[i * d + c];
        }
        s[i] = dot * query.score_scale;
        if (!std::isfinite(s[i])) poisoned[r] = 1;
        tile_max = std::max(tile_max, s[i]);
      }
      if (tile_max == kNegInf) continue;  // every token of the tile is masked for this row
      const float m_new = std::max(m[r], tile_max);
      const float alpha = std::exp2(m[r] - m_new);  // exp2(-inf) = 0 on the first tile
      float* a = &acc[std::size_t(r) * d];
      float tile_sum = 0.0f;
      for (int c = 0; c < d; ++c) a[c] *= alpha;
      // P mode fp16: each channel's products summed in fp16 in key order (at half_sum_scale
      // times the values), each group of kHalfGroupKeys keys from the tile's first (and the
      // tile's last keys) then added to acc.
      const bool half = p.p_mode == PMode::fp16;
      const float in = half_sum_scale(cache.geometry.format), out = 1.0f / in;
      for (int i = 0; i < n; ++i) {
        if (s[i] != kNegInf) {
          const float prob = std::exp2(s[i] - m_new);
          tile_sum += prob;
          const float p_used = round_probability(prob, p.p_mode);
          const float* v = &v_tile[i * d];
          if (half) {
            for (int c = 0; c < d; ++c) {
              half_sums[c] = half_multiply_add(p_used, v[c] * in, half_sums[c]);
            }
          } else {
            for (int c = 0; c < d; ++c) a[c] += p_used * v[c];
          }
        }
        if (half && ((i + 1) % kHalfGroupKeys == 0 || i + 1 == n)) {
          for (int c = 0; c < d; ++c) a[c] += half_sums[c] * out;
          std::fill(half_sums.begin(), half_sums.end(), 0.0f);
        }
      }
      l[r] = l[r] * alpha + tile_sum;
      m[r] = m_new;
    }
  }

  const bool channel_scales = cache.granularity == ScaleGranularity::channel;
  for (int r = 0; r < rows; ++r) {
    float* out = &o[std::size_t(r) * d];
    if (poisoned[r]) {
      poison_row(out, d, &lse[r]);
      continue;
    }
    if (l[r] == 0.0f) {  // no visible token: the empty row of the contract
      std::fill(out, out + d, 0.0f);
      lse[r] = kNegInf;
      continue;
    }
    const float inv_l = 1.0f / (l[r] * probability_scale(p.p_mode));
    for (int c = 0; c < d; ++c) {
      const float v_scale = cache.v_scale_at(item.kv_head, channel_scales ? c : 0);
      out[c] = acc[std::size_t(r) * d + c] * v_scale * inv_l;
    }
    lse[r] = (m[r] + std::log2(l[r])) * std::numbers::ln2_v<float>;
    // A non-finite V value shows in O (p . NaN, p . Inf).
    if (!all_finite(out, d)) poison_row(out, d, &lse[r]);
  }
}

}  // namespace mjolnir::reference

// Portable CPU path of the numerics contract (docs/design.md section 4) for one work item.
//
// The loops are arranged for the hardware: a tile of T tokens is decoded to fp32 once, then
// scored against every query row of the group, so each KV byte is read once per step.
#include "cpu/attention_item.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "core/non_finite.h"
#include "core/query_codes.h"
#include "mjolnir/format.h"

namespace mjolnir::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float round_to(Format format, float x) { return decode_element(format, encode_element(format, x)); }

// Q for the QK product and the factor that turns q . decode(k) into log2-scaled scores. Rows
// with a non-finite value are flagged in `poisoned` and zeroed, so the fp8 scale of the others
// is as if they were not there.
float prepare_query(const DecodeArgs& args, const WorkItem& item, int g, std::span<float> q_out,
                    std::span<char> poisoned) {
  const KvCacheView& cache = args.cache;
  const DecodeParams& p = args.params;
  const int d = cache.geometry.head_dim;
  const int kv_head = item.kv_head;
  const bool channel_scales = cache.granularity == ScaleGranularity::channel;
  float amax = 0.0f;
  for (int r = 0; r < item.q_count * g; ++r) {
    float* out = &q_out[std::size_t(r) * d];
    args.read_q_row(item, r, g, out);
    if (channel_scales) {
      const float* ks = &cache.k_scale[std::size_t(kv_head) * d];
      for (int c = 0; c < d; ++c) out[c] *= ks[c];
    }
    poisoned[r] = !all_finite(out, d);
    if (poisoned[r]) std::fill(out, out + d, 0.0f);
    for (int c = 0; c < d; ++c) amax = std::max(amax, std::abs(out[c]));
  }
  float sq = 1.0f;
  if (p.q_mode == QMode::bf16) {
    for (float& x : q_out) x = round_to(Format::bf16, x);
  } else if (p.q_mode == QMode::fp8) {
    if (amax > 0.0f) sq = amax / kQFp8Max;
    for (float& x : q_out) x = round_to(Format::fp8_e4m3, x / sq);
  } else if (p.q_mode == QMode::int8) {
    if (amax > 0.0f) sq = amax / kQInt8Max;
    for (float& x : q_out) x = int8_code(x / sq);
  }
  const float k_outer = channel_scales ? 1.0f : cache.k_scale_at(kv_head, 0);
  return sq * k_outer * p.effective_softmax_scale(d) * std::numbers::log2e_v<float>;
}

void decode_tile(const DecodeArgs& args, int seq, int kv_head, int first, int count, int kv,
                 std::span<float> out) {
  const KvCacheView& cache = args.cache;
  const CacheGeometry& geo = cache.geometry;
  const std::size_t d = geo.head_dim;
  for (int i = 0; i < count; ++i) {
    const int position = first + i;
    const int page = args.batch.page(seq, position / geo.page_size);
    const std::byte* row = cache.row(page, kv_head, position % geo.page_size, kv);
    decode_row(geo.format, {row, geo.row_bytes()}, out.subspan(i * d, d));
  }
}

}  // namespace

void run_attention_item(const DecodeArgs& args, const Plan& plan, const WorkItem& item,
                        ItemScratch& s) {
  const KvCacheView& cache = args.cache;
  const DecodeParams& p = args.params;
  const int d = cache.geometry.head_dim;
  const int g = p.num_q_heads / cache.geometry.num_kv_heads;
  const int rows = item.q_count * g;
  const int tile = plan.tile_tokens;
  const int seq_len = plan.query_tiles[item.tile].kv_len;  // what the tile's last token sees

  s.q.resize(std::size_t(rows) * d);
  s.k_tile.resize(std::size_t(tile) * d);
  s.v_tile.resize(std::size_t(tile) * d);
  s.scores.resize(std::size_t(rows) * tile);
  s.m.assign(rows, kNegInf);
  s.l.assign(rows, 0.0f);
  s.acc.assign(std::size_t(rows) * d, 0.0f);
  s.o.resize(std::size_t(rows) * d);
  s.lse.resize(rows);
  s.q_poisoned.assign(rows, 0);
  s.poisoned.assign(rows, 0);

  const float score_scale =
      item.kv_begin < item.kv_end ? prepare_query(args, item, g, s.q, s.q_poisoned) : 0.0f;
  const float p_scale = p.p_mode == PMode::fp8 ? 256.0f : 1.0f;

  for (int first = item.kv_begin; first < item.kv_end; first += tile) {
    const int n = std::min(tile, item.kv_end - first);
    decode_tile(args, item.seq, item.kv_head, first, n, 0, s.k_tile);
    decode_tile(args, item.seq, item.kv_head, first, n, 1, s.v_tile);
    for (int r = 0; r < rows; ++r) {
      const int t = r / g;
      const int visible = (p.causal ? seq_len - item.q_count + t + 1 : seq_len) - first;
      const int live = std::clamp(visible, 0, n);  // tokens of the tile this row sees
      if (live == 0) continue;
      if (s.q_poisoned[r]) s.poisoned[r] = 1;
      const float* q = &s.q[std::size_t(r) * d];
      float* scores = &s.scores[std::size_t(r) * tile];
      float tile_max = kNegInf;
      for (int i = 0; i < live; ++i) {
        const float* k = &s.k_tile[std::size_t(i) * d];
        float dot = 0.0f;
        for (int c = 0; c < d; ++c) dot += q[c] * k[c];
        scores[i] = dot * score_scale;
        if (!std::isfinite(scores[i])) s.poisoned[r] = 1;
        tile_max = std::max(tile_max, scores[i]);
      }
      const float m_new = std::max(s.m[r], tile_max);
      const float alpha = std::exp2(s.m[r] - m_new);
      float* acc = &s.acc[std::size_t(r) * d];
      for (int c = 0; c < d; ++c) acc[c] *= alpha;
      float sum = 0.0f;
      for (int i = 0; i < live; ++i) {
        const float prob = std::exp2(scores[i] - m_new);
        sum += prob;
        float used = prob;
        if (p.p_mode == PMode::bf16) used = round_to(Format::bf16, prob);
        if (p.p_mode == PMode::fp8) used = round_to(Format::fp8_e4m3, prob * 256.0f);
        // P mode fp16's products are summed here in fp32: within the own-scores tolerance.
        if (p.p_mode == PMode::fp16) used = round_to(Format::fp16, prob);
        const float* v = &s.v_tile[std::size_t(i) * d];
        for (int c = 0; c < d; ++c) acc[c] += used * v[c];
      }
      s.l[r] = s.l[r] * alpha + sum;
      s.m[r] = m_new;
    }
  }

  const bool channel_scales = cache.granularity == ScaleGranularity::channel;
  for (int r = 0; r < rows; ++r) {
    float* o = &s.o[std::size_t(r) * d];
    if (s.poisoned[r]) {
      poison_row(o, d, &s.lse[r]);
      s.l[r] = kPoisonedRow;  // for a merge of token parts
      continue;
    }
    if (s.l[r] == 0.0f) {
      std::fill(o, o + d, 0.0f);
      s.lse[r] = kNegInf;
      continue;
    }
    const float inv_l = 1.0f / (s.l[r] * p_scale);
    const float* acc = &s.acc[std::size_t(r) * d];
    if (channel_scales) {
      const float* vs = &cache.v_scale[std::size_t(item.kv_head) * d];
      for (int c = 0; c < d; ++c) o[c] = acc[c] * vs[c] * inv_l;
    } else {
      const float vs = cache.v_scale_at(item.kv_head, 0);
      for (int c = 0; c < d; ++c) o[c] = acc[c] * vs * inv_l;
    }
    s.lse[r] = (s.m[r] + std::log2(s.l[r])) * std::numbers::ln2_v<float>;
    if (!all_finite(o, d)) {  // a non-finite V value
      poison_row(o, d, &s.lse[r]);
      s.l[r] = kPoisonedRow;
    }
  }
}

}  // namespace mjolnir::cpu

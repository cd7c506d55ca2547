// fp64 attention over given K/V rows (see exact.h).
#include "reference/exact.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/non_finite.h"

namespace mjolnir::reference {

KvRowSource kv_rows_from_cache(const KvCacheView& cache, const PagedBatch& batch) {
  return [cache, batch](int seq, int kv_head, int position, int kv, std::span<double> out) {
    const CacheGeometry& geo = cache.geometry;
    const int page = batch.page(seq, position / geo.page_size);
    std::vector<float> decoded(geo.head_dim);
    decode_row(geo.format,
               {cache.row(page, kv_head, position % geo.page_size, kv), geo.row_bytes()}, decoded);
    for (int c = 0; c < geo.head_dim; ++c) {
      const double scale = kv == 0 ? cache.k_scale_at(kv_head, c) : cache.v_scale_at(kv_head, c);
      out[c] = double(decoded[c]) * scale;
    }
  };
}

ExactResult exact_attention(const DecodeArgs& args, const KvRowSource& kv_rows) {
  const int d = args.cache.geometry.head_dim;
  const int hk = args.cache.geometry.num_kv_heads;
  const int hq = args.params.num_q_heads;
  const int g = hq / hk;
  const int num_seqs = args.batch.num_seqs();
  const double softmax_scale = args.params.effective_softmax_scale(d);
  const std::size_t rows = static_cast<std::size_t>(args.num_query_rows());

  ExactResult result;
  result.o.assign(rows * hq * d, 0.0);
  result.lse.assign(rows * hq, -std::numeric_limits<double>::infinity());

  std::vector<double> k, v, s;
  std::vector<float> q_values(d);  // one query row in float32
  for (int b = 0; b < num_seqs; ++b) {
    const int seq_len = args.batch.seq_lens[b];
    if (seq_len == 0) continue;
    for (int h = 0; h < hk; ++h) {
      k.resize(std::size_t(seq_len) * d);
      v.resize(std::size_t(seq_len) * d);
      for (int pos = 0; pos < seq_len; ++pos) {
        kv_rows(b, h, pos, 0, {&k[std::size_t(pos) * d], std::size_t(d)});
        kv_rows(b, h, pos, 1, {&v[std::size_t(pos) * d], std::size_t(d)});
      }
      const int q_len = args.query_len(b);
      for (int t = 0; t < q_len; ++t) {
        const int visible = args.params.causal ? seq_len - q_len + t + 1 : seq_len;
        for (int j = 0; j < g; ++j) {
          const int head = h * g + j;
          const std::size_t row = static_cast<std::size_t>(args.query_row(b, t));
          const WorkItem token{.seq = b, .kv_head = h, .q_begin = t, .q_count = 1};
          args.read_q_row(token, j, g, q_values.data());
          const float* q = q_values.data();
          s.assign(visible, 0.0);
          double max_s = -std::numeric_limits<double>::infinity();
          // The non-finite policy (core/non_finite.h): a NaN or Inf in q, or in K (its score)
          // or V (O) of a token the row sees, makes the row NaN.
          bool poisoned = visible > 0 && !all_finite(q, std::size_t(d));
          for (int pos = 0; pos < visible; ++pos) {
            double dot = 0.0;
            for (int c = 0; c < d; ++c) dot += double(q[c]) * k[std::size_t(pos) * d + c];
            s[pos] = dot * softmax_scale;
            poisoned = poisoned || !std::isfinite(s[pos]);
            max_s = std::max(max_s, s[pos]);
          }
          double* o = &result.o[(row * hq + head) * d];
          double& lse = result.lse[row * hq + head];
          if (visible == 0) continue;  // the empty row: O = 0, LSE = -inf
          if (!poisoned) {
            double sum = 0.0;
            for (int pos = 0; pos < visible; ++pos) sum += std::exp(s[pos] - max_s);
            for (int pos = 0; pos < visible; ++pos) {
              const double w = std::exp(s[pos] - max_s) / sum;
              for (int c = 0; c < d; ++c) o[c] += w * v[std::size_t(pos) * d + c];
            }
            lse = max_s + std::log(sum);
            poisoned = !std::isfinite(lse) ||
                       !std::all_of(o, o + d, [](double x) { return std::isfinite(x); });
          }
          if (poisoned) {
            std::fill(o, o + d, std::numeric_limits<double>::quiet_NaN());
            lse = std::numeric_limits<double>::quiet_NaN();
          }
        }
      }
    }
  }
  return result;
}

}  // namespace mjolnir::reference

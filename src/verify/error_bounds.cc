// Error bounds (see docs/numerics.md for the derivation and the measured margins).
#include "verify/error_bounds.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/format_table.h"

namespace mjolnir::verify {

namespace {

double mode_roundoff(QMode mode, double query_crest) {
  switch (mode) {
    case QMode::fp32:
      return 0;
    case QMode::bf16:
      return std::ldexp(1.0, -9);
    case QMode::fp8:
      return std::ldexp(1.0, -4);
    case QMode::int8:  // half a step of amax / 127, relative to the rms of the values
      return query_crest / (2 * 127.0);
  }
  return 0;
}

double mode_roundoff(PMode mode) {
  switch (mode) {
    case PMode::fp32:
      return 0;
    case PMode::bf16:
      return std::ldexp(1.0, -9);
    case PMode::fp8:
      return std::ldexp(1.0, -4);
    case PMode::fp16:  // p's rounding (2^-11) and the group's fp16 sums: up to 31 additions,
                       // each rounding by up to 2^-11 of its partial sum; 2^-7 bounds both
      return std::ldexp(1.0, -7);
  }
  return 0;
}

// fp32 accumulation over up to a few thousand terms: a few ulps of the result.
constexpr double kFp32Floor = 1e-5;
// Sensitivities of O's relative error to the unit roundoff of each rounding step: the
// first-order analysis in docs/numerics.md gives their form; the values are the worst ratios
// measured over the case matrix (Q 2.5, P 0.55, format 2.7) with about 2.2x margin.
constexpr double kQModeFactor = 6;
constexpr double kPModeFactor = 2;
constexpr double kFormatFactor = 6;

}  // namespace

double unit_roundoff(Format format) { return format_facts(format).unit_roundoff(); }

double emulator_tolerance(const DecodeParams& params, bool p_from_own_scores) {
  // A backend that rounds P from its own scores (Backend::rounds_p_from_own_scores) may round a
  // p that sits within its scores' last-bit difference of a bf16 tie the other way: one unit,
  // up to 2^-7 of p, moves its row's O by up to 2^-7 w_i |v_i| / |O| (w_i = p_i / l), up to
  // 1e-3 where a few tokens carry a single-row step (the full case matrix measured 1.0e-3 worst
  // over 43200 cases, 2^-8 leaves 4x). Bugs move O by far more (a wrong channel order or a
  // missed rescale by 1e-1 and up), and a bias in the rounding shows against the exact
  // reference's mode bound. docs/numerics.md.
  // P mode fp16 the same way (one unit is 2^-10 of p), and a backend without fp16 sums may sum
  // its fp16 P in fp32, which differs from the emulator's fp16 sums by their rounding (rel L2
  // 5-8e-4 measured, docs/cpu-experiments.md).
  if (p_from_own_scores && (params.p_mode == PMode::bf16 || params.p_mode == PMode::fp16)) {
    return std::ldexp(1.0, -8);
  }
  return params.p_mode == PMode::fp8 || params.q_mode == QMode::fp8 ? 1e-4 : 1e-5;
}

double mode_error_bound(const DecodeParams& params, double query_crest) {
  return kFp32Floor + kQModeFactor * mode_roundoff(params.q_mode, query_crest) +
         kPModeFactor * mode_roundoff(params.p_mode);
}

double format_error_bound(Format format, const DecodeParams& params, double query_crest) {
  return mode_error_bound(params, query_crest) + kFormatFactor * unit_roundoff(format);
}

double query_crest(const DecodeArgs& args) {
  const KvCacheView& cache = args.cache;
  const int hk = cache.geometry.num_kv_heads, d = cache.geometry.head_dim;
  const int g = args.params.num_q_heads / hk;
  const bool channel = cache.granularity == ScaleGranularity::channel;
  double crest = 0;
  std::vector<float> q(d);  // one query row in float32
  for (int b = 0; b < args.batch.num_seqs(); ++b) {
    for (int h = 0; h < hk; ++h) {
      double amax = 0, squares = 0;
      std::int64_t count = 0;
      for (int t = 0; t < args.query_len(b); ++t) {
        const WorkItem token{.seq = b, .kv_head = h, .q_begin = t, .q_count = 1};
        for (int j = 0; j < g; ++j) {
          args.read_q_row(token, j, g, q.data());
          for (int c = 0; c < d; ++c) {
            const double x = double(q[c]) * (channel ? cache.k_scale_at(h, c) : 1.0);
            amax = std::max(amax, std::abs(x));
            squares += x * x;
            ++count;
          }
        }
      }
      if (squares > 0) crest = std::max(crest, amax / std::sqrt(squares / double(count)));
    }
  }
  return crest;
}

}  // namespace mjolnir::verify

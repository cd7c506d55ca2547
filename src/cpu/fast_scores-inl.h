// The fast score path (kernel_paths-inl.h): Q . K on fp32 FMAs over K decoded in registers, in
// any order, for P in fp32 or bf16 where no dot product instruction applies. Q is kept in the
// decoder's channel order times a power of two that meets K's raw decoded values, so decoding
// needs no multiply (kv_decode-inl.h). Per-target header, see kv_decode-inl.h.

#if defined(MJOLNIR_CPU_FAST_SCORES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_FAST_SCORES_INL_H_
#undef MJOLNIR_CPU_FAST_SCORES_INL_H_
#else
#define MJOLNIR_CPU_FAST_SCORES_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cpu/item_context.h"
#include "cpu/kernel_blocks-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/tile_prefetcher.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// Largest |q| of the prepared rows.
inline float MaxAbs(const float* HWY_RESTRICT x, std::size_t count) {
  const WideFloatTag df;
  auto m = hn::Zero(df);
  for (std::size_t i = 0; i < count; i += hn::Lanes(df))
    m = hn::Max(m, hn::Abs(hn::Load(df, x + i)));
  return hn::GetLane(hn::MaxOfLanes(df, m));
}

// Q of the fast path: q [R][ld] from qn [R][D] (natural channel order), in the decoder's channel
// order (channel_of, natural when it is the identity) and times 2^q_exp, which meets K's raw
// decoded values (k 2^kRawExp) and keeps every q finite. Returns the scale that turns q . raw k
// back into score_scale * q . k.
template <class Dec>
float PrepareFastQuery(const float* HWY_RESTRICT qn, int rows, std::size_t d, std::size_t ld,
                       const std::int32_t* channel_of, bool natural, float score_scale,
                       float* HWY_RESTRICT q) {
  const WideFloatTag df;
  int q_top = 0;
  std::frexp(MaxAbs(qn, std::size_t(rows) * d), &q_top);  // max |q| < 2^q_top
  const int q_exp = std::min({-Dec::kRawExp, kMaxFoldExp, 125 - q_top});
  const float fold = std::ldexp(1.0f, q_exp);
  for (int r = 0; r < rows; ++r) {
    const float* src = qn + std::size_t(r) * d;
    float* dst = q + r * ld;
    if (natural) {
      const auto vf = hn::Set(df, fold);
      for (std::size_t c = 0; c < d; c += hn::Lanes(df))
        hn::Store(hn::Mul(hn::Load(df, src + c), vf), df, dst + c);
    } else {
      for (std::size_t i = 0; i < d; ++i) dst[i] = src[channel_of[i]] * fold;
    }
  }
  return std::ldexp(score_scale, -(q_exp + Dec::kRawExp));
}

// Stores the scores of 4 rows (`stride` apart) for keys t (a0) and t + 1 (a1) at out[row * stride]
// and out[row * stride + 1]: each row's two scores sit side by side, so two shuffles and four
// 8-byte stores do it, where eight single-lane stores cost a shuffle each.
HWY_INLINE void StoreRowPairs(Float4 a0, Float4 a1, float* out, std::size_t stride) {
  const Float4Tag d4;
  const hn::CappedTag<float, 2> d2;
  const auto rows01 = hn::InterleaveLower(d4, a0, a1);  // r0 t, r0 t+1, r1 t, r1 t+1
  const auto rows23 = hn::InterleaveUpper(d4, a0, a1);
  hn::StoreU(hn::LowerHalf(d2, rows01), d2, out);
  hn::StoreU(hn::UpperHalf(d2, rows01), d2, out + stride);
  hn::StoreU(hn::LowerHalf(d2, rows23), d2, out + 2 * stride);
  hn::StoreU(hn::UpperHalf(d2, rows23), d2, out + 3 * stride);
}

// Stores the scores of 4 rows for one key at out[row * stride].
HWY_INLINE void StoreRowColumn(Float4 a, float* out, std::size_t stride) {
  alignas(16) float s[4];
  hn::Store(a, Float4Tag(), s);
  for (int j = 0; j < 4; ++j) out[j * stride] = s[j];
}

// Fast path: scores[r][first + t] = scale * q_r . k_t for the count K rows at bases[t] + offset,
// with kernel-ready Q [R][D] (the decoder's channel order, folded power of two). The K rows of
// the next tile are prefetched along the way, `prefetch_per_key` rows per key.
template <class Dec>
void ScoresFast(const ItemContext& it, const float* HWY_RESTRICT q,
                const std::uint8_t* const* bases, std::int64_t offset, int count, float scale,
                float* HWY_RESTRICT scores, std::size_t stride, TilePrefetcher& prefetch,
                int prefetch_per_key) {
  const std::size_t d = std::size_t(it.d);
  const std::size_t chunks = d / ChunkChannels<Dec>();
  const auto scale4 = hn::Set(Float4Tag(), scale);
  // Keys per block of 4 rows: 4 where 32 registers hold a 4 x 4 block (whose loop takes 4
  // vectors per step), else 2.
  constexpr int kKeys = kWideRegisterFile ? 4 : 2;
  const bool quads = d % (4 * hn::Lanes(typename Dec::Tag())) == 0;
  // Keys t .. t + keys - 1 (keys 1 to kKeys) against every row.
  const auto score_keys = [&](int t, int keys) HWY_ATTR {
    prefetch.Issue(keys * prefetch_per_key);
    const std::uint8_t* k[4];
    for (int i = 0; i < 4; ++i) k[i] = bases[t + std::min(i, keys - 1)] + offset;
    int r = 0;
    for (; r + 8 <= it.rows; r += 8) {
      for (int i = 0; i < keys; ++i) {
        ScoreBlock8x1<Dec>(q + r * it.ld, it.ld, d, k[i], scale, scores + r * stride + t + i,
                           stride);
      }
    }
    for (; r + 4 <= it.rows; r += 4) {
      float* out = scores + r * stride + t;
      if constexpr (kKeys == 4) {
        if (keys == 4 && quads) {
          ScoreBlock4x4<Dec>(q + r * it.ld, it.ld, d, k, scale, out, stride);
          continue;
        }
      }
      for (int i = 0; i < keys; i += 2) {
        Float4 a0, a1;
        ScoreBlock4x2<Dec>(q + r * it.ld, it.ld, d, k[i], k[i + 1], 0, chunks, a0, a1);
        if (i + 1 < keys) {
          StoreRowPairs(hn::Mul(a0, scale4), hn::Mul(a1, scale4), out + i, stride);
        } else {
          StoreRowColumn(hn::Mul(a0, scale4), out + i, stride);
        }
      }
    }
    for (; r < it.rows; ++r) {
      for (int i = 0; i < keys; i += 2) {
        float s0, s1;
        ScoreBlock1x2<Dec>(q + r * it.ld, d, k[i], k[i + 1], &s0, &s1);
        scores[r * stride + t + i] = s0 * scale;
        if (i + 1 < keys) scores[r * stride + t + i + 1] = s1 * scale;
      }
    }
  };
  for (int t = 0; t < count; t += kKeys) score_keys(t, std::min(kKeys, count - t));
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_FAST_SCORES_INL_H_

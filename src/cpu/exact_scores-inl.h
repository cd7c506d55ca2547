// Scores in the emulator's exact order, for P modes that round P (bf16, fp8): there a score one
// ulp away from the emulator's could round p to a different code, so the dot products repeat the
// emulator's summation exactly (attention_kernel.cc). Per-target header, see kv_decode-inl.h.

#if defined(MJOLNIR_CPU_EXACT_SCORES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_EXACT_SCORES_INL_H_
#undef MJOLNIR_CPU_EXACT_SCORES_INL_H_
#else
#define MJOLNIR_CPU_EXACT_SCORES_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu/item_context.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/tile_prefetcher.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// The product as its own rounded value: an empty asm the compiler cannot see through, so GCC
// (which contracts C++ expressions into FMAs by default where the target has them) cannot fuse
// it with the following add.
template <class V>
HWY_INLINE V RoundedProduct(V a, V b) {
  V product = hn::Mul(a, b);
#if HWY_ARCH_X86
  asm("" : "+x"(product.raw));
#elif HWY_ARCH_ARM_A64 && (HWY_TARGET == HWY_NEON)
  asm("" : "+w"(product.raw));
#elif HWY_ARCH_ARM_A64
  asm("" : "+w"(product));
#endif
  return product;
}

template <bool kFused, class V>
HWY_INLINE V AccumulateProduct(V sum, V a, V b) {
  if constexpr (kFused) {
    return hn::MulAdd(a, b, sum);
  } else {
    return hn::Add(sum, RoundedProduct(a, b));
  }
}

// Exact path: the emulator's dot product, dot = ((0 + q0 k0) + q1 k1) + ..., in channel order and
// fused or not as the emulator's build does it, for every row at once: lanes are query rows
// (qt [D][rows_padded], the transpose of Q), four keys at a time for four independent add
// chains. Keys are true decoded values in natural channel order.
template <bool kFused, class DE>
void ScoresExactT(DE de, const ItemContext& it, const float* HWY_RESTRICT qt,
                  std::size_t rows_padded, const float* HWY_RESTRICT keys, int count, float scale,
                  float* HWY_RESTRICT scores, std::size_t stride, int first) {
  const std::size_t ne = hn::Lanes(de);
  const int d = it.d;
  alignas(64) float lanes[4][16];
  for (std::size_t rv = 0; rv < rows_padded; rv += ne) {
    for (int t = 0; t < count; t += 4) {
      const float* k0 = keys + std::size_t(t) * d;
      const float* k1 = keys + std::size_t(std::min(t + 1, count - 1)) * d;
      const float* k2 = keys + std::size_t(std::min(t + 2, count - 1)) * d;
      const float* k3 = keys + std::size_t(std::min(t + 3, count - 1)) * d;
      auto a0 = hn::Zero(de), a1 = hn::Zero(de), a2 = hn::Zero(de), a3 = hn::Zero(de);
      for (int c = 0; c < d; ++c) {
        const auto qv = hn::Load(de, qt + std::size_t(c) * rows_padded + rv);
        a0 = AccumulateProduct<kFused>(a0, qv, hn::Set(de, k0[c]));
        a1 = AccumulateProduct<kFused>(a1, qv, hn::Set(de, k1[c]));
        a2 = AccumulateProduct<kFused>(a2, qv, hn::Set(de, k2[c]));
        a3 = AccumulateProduct<kFused>(a3, qv, hn::Set(de, k3[c]));
      }
      const auto sv = hn::Set(de, scale);
      hn::Store(hn::Mul(a0, sv), de, lanes[0]);
      hn::Store(hn::Mul(a1, sv), de, lanes[1]);
      hn::Store(hn::Mul(a2, sv), de, lanes[2]);
      hn::Store(hn::Mul(a3, sv), de, lanes[3]);
      for (int j = 0; j < 4 && t + j < count; ++j) {
        for (std::size_t lane = 0; lane < ne && rv + lane < std::size_t(it.rows); ++lane) {
          scores[(rv + lane) * stride + first + t + j] = lanes[j][lane];
        }
      }
    }
  }
}

// Keys decoded per pass of the exact path: their fp32 rows (16 x D floats, 8 KiB at D = 128)
// stay in L1 while every query row uses them.
inline constexpr int kSubTokens = 16;

// Query rows per vector of the exact path: 4 lanes for up to 4 rows, else the widest vector.
inline std::size_t ExactLanes(int rows) {
  return rows <= 4 ? hn::Lanes(hn::CappedTag<float, 4>()) : hn::Lanes(WideFloatTag());
}
inline std::size_t ExactPaddedRows(int rows) {
  const std::size_t lanes = ExactLanes(rows);
  return (std::size_t(rows) + lanes - 1) / lanes * lanes;
}

// Q of the exact path: qt [D][ExactPaddedRows(rows)], the transpose of qn [R][D] (true values,
// natural channel order), zero in the padding rows: lanes are query rows.
inline void PrepareExactQuery(const float* HWY_RESTRICT qn, int rows, std::size_t d,
                              float* HWY_RESTRICT qt) {
  const std::size_t rows_padded = ExactPaddedRows(rows);
  std::fill(qt, qt + rows_padded * d, 0.0f);
  for (int r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < d; ++c) qt[c * rows_padded + r] = qn[std::size_t(r) * d + c];
  }
}

// The scratch of the exact path: one decoded K row (decoder order) and kSubTokens rows of true
// values in natural channel order.
struct ExactKeys {
  float* decoded;                  // [D]
  float* natural;                  // [kSubTokens][D]
  const std::int32_t* channel_of;  // the decoder's channel order (kv_decode-inl.h)
  bool natural_order;              // channel_of is the identity
};

// Exact path, one tile of one head: scores[r][t] for the count K rows at bases[t] +
// offset, kSubTokens keys at a time decoded to true values in natural order, then
// ScoresExactT in the emulator's order, fused or not as the emulator's build (fused).
template <class Dec>
void ScoresExact(const ItemContext& it, const float* HWY_RESTRICT qt,
                 const std::uint8_t* const* bases, std::int64_t offset, int count, float scale,
                 const ExactKeys& keys, bool fused, float* HWY_RESTRICT scores, std::size_t stride,
                 TilePrefetcher& prefetch, int prefetch_per_key) {
  const WideFloatTag df;
  const hn::CappedTag<float, 4> de4;
  const int d = it.d;
  const std::size_t rows_padded = ExactPaddedRows(it.rows);
  const float raw_k_to_true = std::ldexp(1.0f, -Dec::kRawExp);
  for (int t0 = 0; t0 < count; t0 += kSubTokens) {
    const int sub = std::min(kSubTokens, count - t0);
    for (int t = 0; t < sub; ++t) {
      prefetch.Issue(prefetch_per_key);
      DecodeRow<Dec>(bases[t0 + t] + offset, std::size_t(d), keys.decoded);
      float* dst = keys.natural + std::size_t(t) * d;
      if (keys.natural_order) {
        const auto f = hn::Set(df, raw_k_to_true);
        for (int c = 0; c < d; c += int(hn::Lanes(df))) {  // x * f + (-0): see DecodeNvfp4
          hn::Store(hn::MulAdd(hn::Load(df, keys.decoded + c), f, hn::Set(df, -0.0f)), df, dst + c);
        }
      } else {
        for (int i = 0; i < d; ++i) dst[keys.channel_of[i]] = keys.decoded[i] * raw_k_to_true;
      }
    }
    const auto scores_exact = [&](auto de, auto fused_tag) {
      ScoresExactT<decltype(fused_tag)::value>(de, it, qt, rows_padded, keys.natural, sub, scale,
                                               scores, stride, t0);
    };
    if (it.rows <= 4) {
      fused ? scores_exact(de4, std::true_type()) : scores_exact(de4, std::false_type());
    } else {
      fused ? scores_exact(df, std::true_type()) : scores_exact(df, std::false_type());
    }
  }
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_EXACT_SCORES_INL_H_

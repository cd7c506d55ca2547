// The online softmax of one tile (docs/design.md section 4, steps 3 and 4), vectorized over the
// tile's tokens, for the CPU kernel (attention_kernel.cc). Per-target header, see kv_decode-inl.h.

#if defined(MJOLNIR_CPU_ONLINE_SOFTMAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_ONLINE_SOFTMAX_INL_H_
#undef MJOLNIR_CPU_ONLINE_SOFTMAX_INL_H_
#else
#define MJOLNIR_CPU_ONLINE_SOFTMAX_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "core/minifloat.h"
#include "core/non_finite.h"
#include "cpu/exp2-inl.h"
#include "cpu/item_context.h"
#include "cpu/kernel_blocks-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/minifloat_simd-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

struct RowState {
  float* m;      // [R] running max, log2 units
  float* l;      // [R] running sum of fp32 p
  float* alpha;  // [R] this tile's rescale of the accumulator
};

// Tokens of the tile [first, first + count) that row r may see.
HWY_INLINE int LiveTokens(const ItemContext& it, int r, int first, int count) {
  const int t = r / it.g;
  const int last = it.causal ? it.seq_len - it.q_len + t : it.seq_len - 1;
  return std::clamp(last - first + 1, 0, count);
}

// The power of two 2^exp folded into P (and its inverse, for the running sum), worked out once
// per tile: std::ldexp is a libm call.
struct PFold {
  int exp;
  float scale, inverse;
};

// One row of SoftmaxTile.
HWY_INLINE void SoftmaxRow(const ItemContext& it, int r, float* HWY_RESTRICT scores,
                           float* HWY_RESTRICT probs, std::size_t stride, int live, int count,
                           const PFold& fold, const RowState& state) {
  const WideFloatTag df;
  const std::size_t n = hn::Lanes(df);
  const std::size_t padded = (std::size_t(count) + n - 1) / n * n;
  float* s = scores + std::size_t(r) * stride;
  float* p = probs + std::size_t(r) * stride;
  if (live == 0) {
    state.alpha[r] = 1.0f;
    std::fill(p, p + padded, 0.0f);
    return;
  }
  const bool finite = FiniteValues(s, std::size_t(live));  // else a non-finite q . k
  std::fill(s + live, s + padded, -std::numeric_limits<float>::infinity());
  auto vmax = hn::Set(df, -std::numeric_limits<float>::infinity());
  for (std::size_t i = 0; i < padded; i += n) vmax = hn::Max(vmax, hn::Load(df, s + i));
  const float m_old = state.m[r];
  const float m_new = std::max(m_old, hn::GetLane(hn::MaxOfLanes(df, vmax)));
  const auto vm = hn::Set(df, m_new);
  auto sum = hn::Zero(df);
  float tile_sum;
  if (it.p_mode == PMode::fp32) {
    for (std::size_t i = 0; i < padded; i += n) {
      const auto pv = Exp2Fast(df, hn::Sub(hn::Load(df, s + i), vm), fold.exp);
      sum = hn::Add(sum, pv);
      hn::Store(pv, df, p + i);
    }
    tile_sum = hn::GetLane(hn::SumOfLanes(df, sum)) * fold.inverse;
  } else {
    const auto vscale = hn::Set(df, fold.scale);
    const auto fp8_scale = hn::Set(df, 256.0f);
    // P in bf16 or fp16 is rounded from the kernel's own scores (attention_kernel.cc), so the
    // exact exp2 would buy nothing there; fp8 P follows the emulator bit for bit.
    const bool exact_exp2 = it.p_mode == PMode::fp8;
    for (std::size_t i = 0; i < padded; i += n) {
      const auto x = hn::Sub(hn::Load(df, s + i), vm);
      const auto pv = exact_exp2 ? Exp2Exact(df, x) : Exp2Fast(df, x, 0);
      sum = hn::Add(sum, pv);
      const auto used = it.p_mode == PMode::bf16 ? RoundToMinifloat<kBf16Spec>(df, pv)
                        : it.p_mode == PMode::fp16
                            ? RoundToMinifloat<kFp16Spec>(df, pv)
                            : RoundToMinifloat<kE4M3Spec>(df, hn::Mul(pv, fp8_scale));
      hn::Store(hn::Mul(used, vscale), df, p + i);
    }
    tile_sum = hn::GetLane(hn::SumOfLanes(df, sum));
  }
  // 0 on the row's first tile (m_old = -inf). With P in fp32 the polynomial, as for P: a libm
  // call per row and tile cost more than the row's exponentials for the short tiles of the
  // 16-bit formats.
  const float alpha = it.p_mode == PMode::fp32
                          ? hn::GetLane(Exp2Fast(df, hn::Set(df, m_old - m_new), 0))
                          : std::exp2(m_old - m_new);
  state.alpha[r] = alpha;
  state.l[r] = finite ? state.l[r] * alpha + tile_sum : kPoisonedRow;  // NaN l: a poisoned row
  state.m[r] = m_new;
}

// Rows r .. r + 3 of SoftmaxTile with P in fp32 or fp16, each seeing live[j] > 0 tokens: as
// SoftmaxRow, with the four rows' maxima, sums, rescales and state updates done together (one
// transpose-and-reduce for four rows instead of a reduction each, one exp2 for the four alphas),
// so the rows' dependency chains overlap. P in fp16 is rounded from the true p (the sums are of
// the unrounded p, as in step 3 of docs/numerics.md) and then takes the fold.
template <PMode kPMode>
HWY_INLINE void SoftmaxRows4(int r, float* HWY_RESTRICT scores, float* HWY_RESTRICT probs,
                             std::size_t stride, const int* live, int count, const PFold& fold,
                             const RowState& state) {
  static_assert(kPMode == PMode::fp32 || kPMode == PMode::fp16);
  const WideFloatTag df;
  const Float4Tag d4;
  const std::size_t n = hn::Lanes(df);
  const std::size_t padded = (std::size_t(count) + n - 1) / n * n;
  float* s[4];
  float* p[4];
  bool finite[4];
  for (int j = 0; j < 4; ++j) {
    s[j] = scores + std::size_t(r + j) * stride;
    p[j] = probs + std::size_t(r + j) * stride;
    finite[j] = FiniteValues(s[j], std::size_t(live[j]));
    std::fill(s[j] + live[j], s[j] + padded, -std::numeric_limits<float>::infinity());
  }
  // Four named vectors, not arrays: SVE's sizeless vectors cannot be array elements.
  const auto neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
  auto max0 = neg_inf, max1 = neg_inf, max2 = neg_inf, max3 = neg_inf;
  for (std::size_t i = 0; i < padded; i += n) {
    max0 = hn::Max(max0, hn::Load(df, s[0] + i));
    max1 = hn::Max(max1, hn::Load(df, s[1] + i));
    max2 = hn::Max(max2, hn::Load(df, s[2] + i));
    max3 = hn::Max(max3, hn::Load(df, s[3] + i));
  }
  const auto m_old = hn::LoadU(d4, state.m + r);
  const auto m_new = hn::Max(m_old, Reduce4By(df, MaxLanesOp(), max0, max1, max2, max3));
  alignas(16) float m[4];
  hn::Store(m_new, d4, m);
  const auto m0 = hn::Set(df, m[0]), m1 = hn::Set(df, m[1]), m2 = hn::Set(df, m[2]),
             m3 = hn::Set(df, m[3]);
  auto sum0 = hn::Zero(df), sum1 = hn::Zero(df), sum2 = hn::Zero(df), sum3 = hn::Zero(df);
  const auto scale = hn::Set(df, fold.scale);
  const auto exp_row = [&](float* HWY_RESTRICT si, float* HWY_RESTRICT pi, auto mi, auto& sum,
                           std::size_t i) HWY_ATTR {
    if constexpr (kPMode == PMode::fp32) {
      const auto pv = Exp2Fast(df, hn::Sub(hn::Load(df, si + i), mi), fold.exp);
      sum = hn::Add(sum, pv);
      hn::Store(pv, df, pi + i);
    } else {
      const auto pv = Exp2Fast(df, hn::Sub(hn::Load(df, si + i), mi), 0);
      sum = hn::Add(sum, pv);
      hn::Store(hn::Mul(RoundToMinifloat<kFp16Spec>(df, pv), scale), df, pi + i);
    }
  };
  for (std::size_t i = 0; i < padded; i += n) {
    exp_row(s[0], p[0], m0, sum0, i);
    exp_row(s[1], p[1], m1, sum1, i);
    exp_row(s[2], p[2], m2, sum2, i);
    exp_row(s[3], p[3], m3, sum3, i);
  }
  const auto tile_sum = hn::Mul(Reduce4(df, sum0, sum1, sum2, sum3),
                                hn::Set(d4, kPMode == PMode::fp32 ? fold.inverse : 1.0f));
  const auto alpha = Exp2Fast(d4, hn::Sub(m_old, m_new), 0);  // 0 on a row's first tile
  hn::StoreU(alpha, d4, state.alpha + r);
  hn::StoreU(hn::MulAdd(hn::LoadU(d4, state.l + r), alpha, tile_sum), d4, state.l + r);
  hn::StoreU(m_new, d4, state.m + r);
  for (int j = 0; j < 4; ++j) {
    if (!finite[j]) state.l[r + j] = kPoisonedRow;
  }
}

// Step 3 (and 4) for one tile of `count` tokens starting at KV position `first`: per row, mask
// what it may not see, update max and sum, and write P (rounded per mode, times 2^p_exp) into
// probs [R][stride]; rows that see none of the tile keep their state (alpha = 1, P = 0). A row
// with a non-finite score among those it sees gets l = NaN, which stays NaN and poisons it.
void SoftmaxTile(const ItemContext& it, float* HWY_RESTRICT scores, float* HWY_RESTRICT probs,
                 std::size_t stride, int first, int count, int p_exp, const RowState& state) {
  const PFold fold{p_exp, std::ldexp(1.0f, p_exp), std::ldexp(1.0f, -p_exp)};  // exact
  int r = 0;
  if (it.p_mode == PMode::fp32 || it.p_mode == PMode::fp16) {
    for (; r + 4 <= it.rows; r += 4) {
      int live[4];
      bool all_live = true;
      for (int j = 0; j < 4; ++j) {
        live[j] = LiveTokens(it, r + j, first, count);
        all_live &= live[j] > 0;
      }
      if (all_live) {
        if (it.p_mode == PMode::fp32) {
          SoftmaxRows4<PMode::fp32>(r, scores, probs, stride, live, count, fold, state);
        } else {
          SoftmaxRows4<PMode::fp16>(r, scores, probs, stride, live, count, fold, state);
        }
      } else {
        for (int j = 0; j < 4; ++j) {
          SoftmaxRow(it, r + j, scores, probs, stride, live[j], count, fold, state);
        }
      }
    }
  }
  for (; r < it.rows; ++r) {
    SoftmaxRow(it, r, scores, probs, stride, LiveTokens(it, r, first, count), count, fold, state);
  }
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_ONLINE_SOFTMAX_INL_H_

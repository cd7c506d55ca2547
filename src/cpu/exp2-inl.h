// Vectorized 2^x for the online softmax (docs/design.md section 4, step 3). Per-target header, see
// kv_decode-inl.h.
//
// Two versions, chosen by the P mode (docs/cpu-performance.md, "Numerics"):
//   Exp2Fast     fp32 polynomial, within 2 ulp of 2^x. Used when P stays fp32: an ulp there
//                moves O by ~1e-7 relative, far inside the emulator tolerance, and the scores
//                themselves already differ from the emulator's by fp32 accumulation order.
//   Exp2AsLibm   bit for bit the result of glibc's exp2f (which std::exp2(float) calls), by
//                following its algorithm in double precision: a 32-entry table of 2^(i/32) and a
//                cubic polynomial. Used when P is rounded to bf16 or fp8, where a p one ulp away
//                from the emulator's could round to a different code.

#if defined(MJOLNIR_CPU_EXP2_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_EXP2_INL_H_
#undef MJOLNIR_CPU_EXP2_INL_H_
#else
#define MJOLNIR_CPU_EXP2_INL_H_
#endif

#include <cmath>
#include <cstdint>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// 2^x * 2^scale_exp for x <= 0; exactly 0 for x < -126 (and x = -inf). scale_exp in [0, 126]
// folds a power of two into the result for free (it is added to the exponent field).
//
// x = n + f with n = round(x), |f| <= 1/2; 2^f by a degree-6 polynomial (Chebyshev fit on
// [-1/2, 1/2], error 2e-9, below fp32 rounding); 2^n built in the exponent field.
template <class DF>
HWY_INLINE hn::Vec<DF> Exp2Fast(DF df, hn::Vec<DF> x, int scale_exp) {
  const hn::RebindToSigned<DF> di;
  const auto xc = hn::Max(x, hn::Set(df, -127.0f));
  const auto n = hn::Round(xc);
  const auto f = hn::Sub(xc, n);
  auto p = hn::Set(df, 1.546144469856913e-4f);
  p = hn::MulAdd(p, f, hn::Set(df, 1.3400428177615838e-3f));
  p = hn::MulAdd(p, f, hn::Set(df, 9.618056678524637e-3f));
  p = hn::MulAdd(p, f, hn::Set(df, 5.550327226670302e-2f));
  p = hn::MulAdd(p, f, hn::Set(df, 2.4022650922288757e-1f));
  p = hn::MulAdd(p, f, hn::Set(df, 6.931472067028326e-1f));
  p = hn::MulAdd(p, f, hn::Set(df, 1.0f));
  // n in [-127, 0]: the field n + 127 + scale_exp stays in [0, 253].
  const auto field = hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127 + scale_exp));
  const auto r = hn::Mul(p, hn::BitCast(df, hn::ShiftLeft<23>(field)));
  return hn::IfThenZeroElse(hn::Lt(x, hn::Set(df, -126.0f)), r);
}

#if HWY_HAVE_FLOAT64

namespace exp2_detail {

// bits(2^(i/32)) - (i << 47), correctly rounded doubles (computed with mpmath at 200 bits):
// adding k << 47 for k = 32 q + i gives bits(2^(k/32)).
alignas(64) inline constexpr std::uint64_t kTable[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};
// glibc's exp2f polynomial for 2^r - 1 on |r| <= 1/64 (sysdeps/ieee754/flt-32/e_exp2f_data.c).
constexpr double kC0 = 0x1.c6af84b912394p-5;
constexpr double kC1 = 0x1.ebfce50fac4f3p-3;
constexpr double kC2 = 0x1.62e42ff0c52d6p-1;
// 1.5 * 2^52 / 32: adding it rounds x to a multiple of 1/32 and leaves k = round(32 x) in the low
// bits of the double.
constexpr double kShift = 0x1.8p+52 / 32;

template <class DD>
HWY_INLINE hn::Vec<DD> Exp2Double(DD dd, hn::Vec<DD> x) {
  const hn::RebindToUnsigned<DD> du;
  const hn::RebindToSigned<DD> di;
  const auto shifted = hn::Add(x, hn::Set(dd, kShift));
  const auto k = hn::BitCast(du, shifted);
  const auto r = hn::Sub(x, hn::Sub(shifted, hn::Set(dd, kShift)));
  const auto index = hn::BitCast(di, hn::And(k, hn::Set(du, 31u)));
  const auto t = hn::Add(hn::GatherIndex(du, kTable, index), hn::ShiftLeft<47>(k));
  const auto s = hn::BitCast(dd, t);
  const auto z = hn::MulAdd(hn::Set(dd, kC0), r, hn::Set(dd, kC1));
  const auto r2 = hn::Mul(r, r);
  auto y = hn::MulAdd(hn::Set(dd, kC2), r, hn::Set(dd, 1.0));
  y = hn::MulAdd(z, r2, y);
  return hn::Mul(y, s);
}

}  // namespace exp2_detail

// std::exp2(x) of glibc for every x <= 0 (0 for x <= -150 and -inf). On targets with FMA the
// polynomial uses it, as glibc's FMA variant (chosen on such CPUs) does; the double results of
// the two variants differ in the last bits and round to the same float in all but extremely rare
// cases (tests/test_cpu_kernels.cc counts them).
template <class DF>
HWY_INLINE hn::Vec<DF> Exp2AsLibm(DF df, hn::Vec<DF> x) {
  const hn::Repartition<double, DF> dd;
  const hn::Half<DF> dh;
  const auto xc = hn::Max(x, hn::Set(df, -150.0f));
  const auto lo = exp2_detail::Exp2Double(dd, hn::PromoteTo(dd, hn::LowerHalf(dh, xc)));
  const auto hi = exp2_detail::Exp2Double(dd, hn::PromoteTo(dd, hn::UpperHalf(dh, xc)));
  const auto y = hn::Combine(df, hn::DemoteTo(dh, hi), hn::DemoteTo(dh, lo));
  return hn::IfThenZeroElse(hn::Le(x, hn::Set(df, -150.0f)), y);
}

#endif  // HWY_HAVE_FLOAT64

// std::exp2 per lane, bit for bit: Exp2AsLibm where doubles are vectorized, else the library.
template <class DF>
HWY_INLINE hn::Vec<DF> Exp2Exact(DF df, hn::Vec<DF> x) {
#if HWY_HAVE_FLOAT64
  return Exp2AsLibm(df, x);
#else
  alignas(64) float lanes[hn::MaxLanes(df)];
  hn::Store(x, df, lanes);
  for (size_t i = 0; i < hn::Lanes(df); ++i) lanes[i] = std::exp2(lanes[i]);
  return hn::Load(df, lanes);
#endif
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_EXP2_INL_H_

// SIMD rounding and encoding of fp32 into the small float formats of core/minifloat.h, bit for
// bit equal to the scalar codecs (round to nearest even, subnormals, saturation to the largest
// finite value, NaN to the format's NaN encoding): Q in bf16 / fp8 mode, P in bf16 / fp8 mode
// and the fast row encoder behind write_kv; and the check that floats are finite, which write_kv
// and the kernel's non-finite policy share. Per-target header, see kv_decode-inl.h.

#if defined(MJOLNIR_CPU_MINIFLOAT_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_MINIFLOAT_SIMD_INL_H_
#undef MJOLNIR_CPU_MINIFLOAT_SIMD_INL_H_
#else
#define MJOLNIR_CPU_MINIFLOAT_SIMD_INL_H_
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/minifloat.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

namespace minifloat_simd_detail {

constexpr int kFloatMantissaBits = 23;
constexpr int kFloatBias = 127;

// Largest finite value of the format, as a float.
template <MinifloatSpec kSpec>
constexpr float max_finite() {
  return decode_minifloat<kSpec>(kSpec.max_finite_code());
}
// 2^min_normal_exponent: below it the format is subnormal with a fixed quantum.
template <MinifloatSpec kSpec>
constexpr float min_normal() {
  return minifloat_detail::exact_power_of_two(kSpec.min_normal_exponent());
}
// 1.5 * 2^(23 + emin - m): adding and subtracting it rounds |x| < 2^emin to a multiple of the
// subnormal quantum 2^(emin - m), ties to even (its fp32 ulp is exactly that quantum).
template <MinifloatSpec kSpec>
constexpr float subnormal_rounder() {
  return 1.5f * minifloat_detail::exact_power_of_two(
                    kFloatMantissaBits + kSpec.min_normal_exponent() - kSpec.mantissa_bits);
}

// |x| rounded onto the format's grid, for |x| <= max_finite (no NaN).
template <MinifloatSpec kSpec, class DF>
HWY_INLINE hn::Vec<DF> RoundMagnitude(DF df, hn::Vec<DF> a) {
  const hn::RebindToUnsigned<DF> du;
  constexpr int kDrop = kFloatMantissaBits - kSpec.mantissa_bits;  // fp32 bits rounded away
  // Normal range: round the fp32 bit pattern at bit kDrop, ties to even, then clear below it.
  const auto bits = hn::BitCast(du, a);
  const auto odd = hn::And(hn::ShiftRight<kDrop>(bits), hn::Set(du, 1u));
  const auto rounded_bits =
      hn::And(hn::Add(bits, hn::Add(hn::Set(du, (1u << (kDrop - 1)) - 1), odd)),
              hn::Set(du, ~((1u << kDrop) - 1)));
  const auto normal = hn::BitCast(df, rounded_bits);
  const auto rounder = hn::Set(df, subnormal_rounder<kSpec>());
  const auto subnormal = hn::Sub(hn::Add(a, rounder), rounder);
  return hn::IfThenElse(hn::Lt(a, hn::Set(df, min_normal<kSpec>())), subnormal, normal);
}

}  // namespace minifloat_simd_detail

// decode(encode(x)) of the scalar codecs, per lane: the nearest value of the format (ties to
// even), saturated to +-max; NaN becomes what the NaN encoding decodes to (NaN, or the format's
// max for formats without NaN).
template <MinifloatSpec kSpec, class DF>
HWY_INLINE hn::Vec<DF> RoundToMinifloat(DF df, hn::Vec<DF> x) {
  namespace detail = minifloat_simd_detail;
  const auto a = hn::Min(hn::Abs(x), hn::Set(df, detail::max_finite<kSpec>()));
  const auto r = hn::CopySignToAbs(detail::RoundMagnitude<kSpec>(df, a), x);
  const float nan_value = decode_minifloat<kSpec>(kSpec.nan_encoding());
  return hn::IfThenElse(hn::IsNaN(x), hn::Set(df, nan_value), r);
}

// encode_minifloat<kSpec>(x) per lane: the code in the low bits of each 32-bit lane.
template <MinifloatSpec kSpec, class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> EncodeMinifloat(DF df, hn::Vec<DF> x) {
  namespace detail = minifloat_simd_detail;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto a = hn::Min(hn::Abs(x), hn::Set(df, detail::max_finite<kSpec>()));
  const auto r = detail::RoundMagnitude<kSpec>(df, a);
  // Normal: re-bias the fp32 exponent and keep the top mantissa bits.
  constexpr int kDrop = detail::kFloatMantissaBits - kSpec.mantissa_bits;
  const auto normal_code = hn::Sub(
      hn::ShiftRight<kDrop>(hn::BitCast(du, r)),
      hn::Set(du, std::uint32_t(detail::kFloatBias - kSpec.exponent_bias) << kSpec.mantissa_bits));
  auto code = normal_code;
  if constexpr (kSpec.exponent_bias != detail::kFloatBias) {
    // Subnormal: the multiple of the quantum, exactly (r is already on the grid). A format with
    // fp32's exponent range (bf16) has fp32's subnormals, which the normal path already covers.
    const float inverse_quantum =
        minifloat_detail::exact_power_of_two(kSpec.mantissa_bits - kSpec.min_normal_exponent());
    const auto subnormal_code =
        hn::BitCast(du, hn::ConvertTo(di, hn::Mul(r, hn::Set(df, inverse_quantum))));
    code = hn::IfThenElse(hn::RebindMask(du, hn::Lt(r, hn::Set(df, detail::min_normal<kSpec>()))),
                          subnormal_code, normal_code);
  }
  const auto sign = hn::ShiftRight<31>(hn::BitCast(du, x));
  code = hn::Or(code, hn::ShiftLeft<kSpec.exponent_bits + kSpec.mantissa_bits>(sign));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)), hn::Set(du, kSpec.nan_encoding()), code);
}

// Whether the n floats at x (any alignment) are all finite: x - x is 0 for a finite x and NaN
// otherwise, summed over whole vectors (two ops a vector), the rest one by one. write_kv refuses
// a row that is not; the kernel poisons a row whose live scores or O are not (core/non_finite.h).
// For the output rows a scalar std::isfinite loop instead made a 256-token nvfp4 step at batch 1
// 5.8% slower than no check; this, 2.2% (mjolnir bench, interleaved medians).
HWY_INLINE bool FiniteValues(const float* HWY_RESTRICT x, std::size_t n) {
  const hn::ScalableTag<float> df;
  const std::size_t lanes = hn::Lanes(df);
  auto sum = hn::Zero(df);
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto v = hn::LoadU(df, x + i);
    sum = hn::Add(sum, hn::Sub(v, v));
  }
  bool finite = hn::AllFalse(df, hn::IsNaN(sum));
  for (; i < n; ++i) finite = finite && std::isfinite(x[i]);
  return finite;
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_MINIFLOAT_SIMD_INL_H_

// One descriptor for every small float format the KV cache stores (docs/design.md section 3) and
// the scalar encode/decode over it. Header-inline and constexpr so the CPU, SIMD and CUDA paths can
// all reuse these exact definitions; format.cc dispatches a runtime Format onto them.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MJOLNIR_HOST_DEVICE __host__ __device__
#else
#define MJOLNIR_HOST_DEVICE
#endif

namespace mjolnir {

// Which codes of a format are not finite numbers.
enum class NonFiniteEncoding : std::uint8_t {
  // IEEE 754: exponent all ones is Inf (mantissa 0) or NaN (mantissa != 0). fp16, bf16, e5m2.
  ieee,
  // OCP "FN": no Inf; only exponent and mantissa all ones is NaN, so the top binade is finite
  // except for that one code. e4m3.
  nan_only_all_ones,
  // Every code is a finite number. OCP MX fp6 and fp4.
  none,
};

// A signed binary float with `exponent_bits` + `mantissa_bits` + 1 sign bit, stored in the low
// bits of a code. The sign is the top bit, then the biased exponent, then the mantissa. An
// exponent field of 0 is subnormal: value = mantissa * 2^(1 - bias - mantissa_bits).
struct MinifloatSpec {
  int exponent_bits;
  int mantissa_bits;
  int exponent_bias;
  NonFiniteEncoding non_finite;

  MJOLNIR_HOST_DEVICE constexpr int total_bits() const { return 1 + exponent_bits + mantissa_bits; }
  MJOLNIR_HOST_DEVICE constexpr std::uint32_t sign_mask() const {
    return 1u << (exponent_bits + mantissa_bits);
  }
  // Every bit but the sign.
  MJOLNIR_HOST_DEVICE constexpr std::uint32_t magnitude_mask() const { return sign_mask() - 1; }
  MJOLNIR_HOST_DEVICE constexpr std::uint32_t mantissa_mask() const {
    return (1u << mantissa_bits) - 1;
  }
  MJOLNIR_HOST_DEVICE constexpr std::uint32_t max_exponent_field() const {
    return (1u << exponent_bits) - 1;
  }
  // Unbiased exponent of the smallest normal binade (subnormals share it).
  MJOLNIR_HOST_DEVICE constexpr int min_normal_exponent() const { return 1 - exponent_bias; }

  // Magnitude bits of the largest finite value.
  MJOLNIR_HOST_DEVICE constexpr std::uint32_t max_finite_code() const {
    switch (non_finite) {
      case NonFiniteEncoding::ieee:  // top exponent is Inf/NaN: one binade lower, mantissa full
        return magnitude_mask() - mantissa_mask() - 1;
      case NonFiniteEncoding::nan_only_all_ones:  // all ones is NaN: the code just below it
        return magnitude_mask() - 1;
      case NonFiniteEncoding::none:
        break;
    }
    return magnitude_mask();
  }

  // The code a NaN input encodes to: sign clear, every other bit set. This is what CUDA's
  // __NV_SATFINITE and round-to-nearest conversions produce in every format: the canonical quiet
  // NaN 0x7FFF for fp16/bf16, 0x7F for e4m3 and e5m2 (the sign of the NaN is dropped), and, for
  // fp6/fp4, which have no NaN, the positive largest finite value.
  MJOLNIR_HOST_DEVICE constexpr std::uint32_t nan_encoding() const { return magnitude_mask(); }

  MJOLNIR_HOST_DEVICE constexpr bool is_nan_code(std::uint32_t code) const {
    const std::uint32_t magnitude = code & magnitude_mask();
    switch (non_finite) {
      case NonFiniteEncoding::ieee:
        return (magnitude >> mantissa_bits) == max_exponent_field() &&
               (magnitude & mantissa_mask()) != 0;
      case NonFiniteEncoding::nan_only_all_ones:
        return magnitude == magnitude_mask();
      case NonFiniteEncoding::none:
        break;
    }
    return false;
  }
  MJOLNIR_HOST_DEVICE constexpr bool is_inf_code(std::uint32_t code) const {
    return non_finite == NonFiniteEncoding::ieee &&
           (code & magnitude_mask()) == max_exponent_field() << mantissa_bits;
  }
};

// The formats of docs/design.md section 3 (OCP 8-bit FP and MX specifications; IEEE 754 binary16;
// bfloat16 is the top half of a binary32).
inline constexpr MinifloatSpec kBf16Spec{8, 7, 127, NonFiniteEncoding::ieee};
inline constexpr MinifloatSpec kFp16Spec{5, 10, 15, NonFiniteEncoding::ieee};
inline constexpr MinifloatSpec kE4M3Spec{4, 3, 7, NonFiniteEncoding::nan_only_all_ones};
inline constexpr MinifloatSpec kE5M2Spec{5, 2, 15, NonFiniteEncoding::ieee};
inline constexpr MinifloatSpec kE2M3Spec{2, 3, 1, NonFiniteEncoding::none};
inline constexpr MinifloatSpec kE3M2Spec{3, 2, 3, NonFiniteEncoding::none};
inline constexpr MinifloatSpec kE2M1Spec{2, 1, 1, NonFiniteEncoding::none};

namespace minifloat_detail {

// binary32 layout: 1 sign, 8 exponent (bias 127), 23 mantissa bits.
inline constexpr int kFloatMantissaBits = 23;
inline constexpr int kFloatBias = 127;

// Bit casts usable in constant expressions on the host and in CUDA device code (nvcc treats
// std::bit_cast as host-only without --expt-relaxed-constexpr; the builtin has no such limit).
MJOLNIR_HOST_DEVICE constexpr float float_from_bits(std::uint32_t bits) {
  return __builtin_bit_cast(float, bits);
}
MJOLNIR_HOST_DEVICE constexpr std::uint32_t bits_from_float(float value) {
  return __builtin_bit_cast(std::uint32_t, value);
}

// 2^exponent as a float, exact for exponent in [-149, 127] (normals and subnormals).
MJOLNIR_HOST_DEVICE constexpr float exact_power_of_two(int exponent) {
  if (exponent >= 1 - kFloatBias) {
    return float_from_bits(static_cast<std::uint32_t>(exponent + kFloatBias) << kFloatMantissaBits);
  }
  return float_from_bits(1u << (exponent + kFloatBias - 1 + kFloatMantissaBits));
}

// Every format here must be exactly representable in float, and its codes must fit the
// integer arithmetic of encode_minifloat (uint32 with headroom).
MJOLNIR_HOST_DEVICE constexpr bool spec_fits_float(MinifloatSpec spec) {
  const int max_exponent =
      static_cast<int>(spec.max_finite_code() >> spec.mantissa_bits) - spec.exponent_bias;
  const int min_subnormal_exponent = spec.min_normal_exponent() - spec.mantissa_bits;
  return spec.exponent_bits >= 1 && spec.exponent_bits <= 8 && spec.mantissa_bits >= 1 &&
         spec.mantissa_bits <= 10 && max_exponent <= kFloatBias &&
         min_subnormal_exponent >= 1 - kFloatBias - kFloatMantissaBits && spec.exponent_bias >= 1 &&
         spec.exponent_bias <= kFloatBias;
}

}  // namespace minifloat_detail

// Value of `code` (only its low spec.total_bits() bits are read). NaN codes decode to a positive
// quiet NaN; Inf codes to +-Inf. Every finite code is exact in float.
template <MinifloatSpec kSpec>
MJOLNIR_HOST_DEVICE constexpr float decode_minifloat(std::uint32_t code) {
  static_assert(minifloat_detail::spec_fits_float(kSpec));
  const bool negative = (code & kSpec.sign_mask()) != 0;
  if (kSpec.is_nan_code(code)) return minifloat_detail::float_from_bits(0x7FC0'0000u);
  if (kSpec.is_inf_code(code)) {
    return minifloat_detail::float_from_bits(negative ? 0xFF80'0000u : 0x7F80'0000u);
  }
  const std::uint32_t magnitude = code & kSpec.magnitude_mask();
  const std::uint32_t exponent_field = magnitude >> kSpec.mantissa_bits;
  std::uint32_t significand = magnitude & kSpec.mantissa_mask();
  int exponent = kSpec.min_normal_exponent();  // subnormal: no implicit bit, minimum exponent
  if (exponent_field != 0) {
    significand |= 1u << kSpec.mantissa_bits;
    exponent = static_cast<int>(exponent_field) - kSpec.exponent_bias;
  }
  // significand < 2^11 converts exactly, and the product is a representable float, so the
  // multiplication is exact (no rounding) on every IEEE target without flush-to-zero.
  const float value = static_cast<float>(significand) *
                      minifloat_detail::exact_power_of_two(exponent - kSpec.mantissa_bits);
  return negative ? -value : value;
}

// Nearest code to `value`, ties to even, saturating: finite values beyond the largest finite
// code and +-Inf become +-max (CUDA's "satfinite"; for fp16/bf16 this differs from CUDA's plain
// __float2half_rn / __float2bfloat16_rn, which return Inf). Values at or below half the smallest
// subnormal become a zero of the input's sign. NaN becomes kSpec.nan_encoding().
template <MinifloatSpec kSpec>
MJOLNIR_HOST_DEVICE constexpr std::uint32_t encode_minifloat(float value) {
  static_assert(minifloat_detail::spec_fits_float(kSpec));
  using minifloat_detail::kFloatBias;
  using minifloat_detail::kFloatMantissaBits;
  constexpr std::uint32_t kFloatAbsMask = 0x7FFF'FFFFu;
  constexpr std::uint32_t kFloatInfBits = 0x7F80'0000u;

  const std::uint32_t bits = minifloat_detail::bits_from_float(value);
  const std::uint32_t abs_bits = bits & kFloatAbsMask;
  if (abs_bits > kFloatInfBits) return kSpec.nan_encoding();
  const std::uint32_t sign = (bits >> 31) != 0 ? kSpec.sign_mask() : 0u;
  if (abs_bits == kFloatInfBits) return sign | kSpec.max_finite_code();

  // |value| = float_significand * 2^(float_exponent - 23), with float_significand < 2^24.
  const int float_exponent_field = static_cast<int>(abs_bits >> kFloatMantissaBits);
  std::uint32_t float_significand = abs_bits & ((1u << kFloatMantissaBits) - 1);
  int float_exponent = 1 - kFloatBias;  // float subnormal
  if (float_exponent_field != 0) {
    float_significand |= 1u << kFloatMantissaBits;
    float_exponent = float_exponent_field - kFloatBias;
  }

  // Express |value| in units of the target's ulp at its binade (subnormals: the minimum
  // binade), then round that to an integer: right-shift by `shift`, ties to even.
  const int target_exponent =
      float_exponent > kSpec.min_normal_exponent() ? float_exponent : kSpec.min_normal_exponent();
  const int shift = kFloatMantissaBits - kSpec.mantissa_bits + (target_exponent - float_exponent);
  std::uint32_t rounded = 0;  // shift >= 25: below half of one ulp (float_significand < 2^24)
  if (shift <= kFloatMantissaBits + 1) {
    const std::uint32_t remainder = float_significand & ((1u << shift) - 1);
    const std::uint32_t half = 1u << (shift - 1);  // shift >= 13 here: mantissa_bits <= 10
    rounded = float_significand >> shift;
    if (remainder > half || (remainder == half && (rounded & 1u) != 0)) ++rounded;
  }
  // Normal: `rounded` in [2^m, 2^(m+1)] carries the implicit bit (and a rounding carry) into the
  // exponent field, so add the field minus one. Subnormal: that term is 0 and `rounded` may
  // carry into the smallest normal binade by itself.
  const std::uint32_t exponent_base =
      static_cast<std::uint32_t>(target_exponent + kSpec.exponent_bias - 1) << kSpec.mantissa_bits;
  std::uint32_t magnitude = exponent_base + rounded;
  if (magnitude > kSpec.max_finite_code()) magnitude = kSpec.max_finite_code();
  return sign | magnitude;
}

}  // namespace mjolnir

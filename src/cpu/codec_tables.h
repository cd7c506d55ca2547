// Small constant tables derived from the scalar codecs (core/minifloat.h) at compile time, shared
// by every SIMD target of the CPU kernels.
#pragma once

#include <array>
#include <cstdint>

#include "core/code_values.h"
#include "core/minifloat.h"

namespace mjolnir::cpu {

// Every e4m3 code's value times 2^scale_exp (nvfp4 block scales are decoded through it).
template <int kScaleExp>
constexpr std::array<float, 256> e4m3_value_table() {
  std::array<float, 256> table = minifloat_values<kE4M3Spec>();
  const float scale = minifloat_detail::exact_power_of_two(kScaleExp);
  for (float& value : table) {
    // NaN codes stay NaN without arithmetic on them: clang rejects NaN-producing arithmetic in
    // a constant expression.
    if (value == value) value *= scale;
  }
  return table;
}

// The bf16 word of every nvfp4 value: e2m1 code c times the block-scale e4m3 code s at
// words[16 s + c], so that one block's 16 values are one 32-byte row. Every product is exact in
// bf16: e2m1 has 2 significant bits and e4m3 4, and the products lie within bf16's normal range
// (2^-10 .. 2688). A NaN scale gives NaN words, as multiplying by it would.
struct Nvfp4ScaledWords {
  alignas(64) std::array<std::uint16_t, 256 * 16> words{};
  constexpr Nvfp4ScaledWords() {
    for (std::uint32_t s = 0; s < 256; ++s) {
      const float scale = decode_minifloat<kE4M3Spec>(s);
      for (std::uint32_t c = 0; c < 16; ++c) {
        if (scale != scale) {
          words[16 * s + c] = 0x7FC0;  // no arithmetic on NaN in a constant expression (clang)
          continue;
        }
        const std::uint32_t bits =
            minifloat_detail::bits_from_float(decode_minifloat<kE2M1Spec>(c) * scale);
        if ((bits & 0xFFFFu) != 0) throw "an nvfp4 value that is not a bf16 value";
        words[16 * s + c] = static_cast<std::uint16_t>(bits >> 16);
      }
    }
  }
};
inline constexpr Nvfp4ScaledWords kNvfp4ScaledWords{};

}  // namespace mjolnir::cpu

// Small constant tables derived from the scalar codecs (core/minifloat.h) at compile time, shared
// by every SIMD target of the CPU kernels.
#pragma once

#include <array>
#include <cstdint>

#include "core/minifloat.h"

namespace mjolnir::cpu {

// Every e4m3 code's value times 2^scale_exp (nvfp4 block scales are decoded through it).
template <int kScaleExp>
constexpr std::array<float, 256> e4m3_value_table() {
  std::array<float, 256> table{};
  const float scale = minifloat_detail::exact_power_of_two(kScaleExp);
  for (std::uint32_t code = 0; code < 256; ++code) {
    const float value = decode_minifloat<kE4M3Spec>(code);
    // NaN codes stay NaN without arithmetic on them: clang rejects NaN-producing arithmetic in
    // a constant expression.
    table[code] = value != value ? value : value * scale;
  }
  return table;
}

}  // namespace mjolnir::cpu

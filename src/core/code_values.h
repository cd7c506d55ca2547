// Every code's value of an element format of at most 8 bits, made at compile time by the scalar
// decoder (core/minifloat.h), so a lookup gives its bits: for code-by-code row decoding
// (core/format.cc) and the CPU kernels' constant tables (cpu/codec_tables.h).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "core/minifloat.h"

namespace mjolnir {

template <MinifloatSpec kSpec>
constexpr std::array<float, std::size_t{1} << kSpec.total_bits()> minifloat_values() {
  static_assert(kSpec.total_bits() <= 8, "a table of every code is for formats of 8 bits or less");
  std::array<float, std::size_t{1} << kSpec.total_bits()> values{};
  for (std::uint32_t code = 0; code < values.size(); ++code) {
    values[code] = decode_minifloat<kSpec>(code);
  }
  return values;
}

}  // namespace mjolnir

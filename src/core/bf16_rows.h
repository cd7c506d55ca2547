// bf16 <-> float32 for the rows of mjolnir/rows.h, one value or one row at a time. The loops are
// branch-free so the compiler vectorizes them; the SIMD kernels have their own (kernel-side)
// versions of the same arithmetic.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "mjolnir/rows.h"

namespace mjolnir {

inline float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(std::uint32_t(bits) << 16);
}

// Round to nearest, ties to even; every NaN becomes 0x7FC0 (PyTorch's rounding, c10::BFloat16).
inline std::uint16_t bf16_from_float(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? std::uint16_t(0x7FC0) : std::uint16_t(rounded);
}

// n values of a row of `type` as float32.
inline void widen_row(const void* src, RowType type, float* __restrict dst, std::size_t n) {
  if (type == RowType::f32) {
    const float* s = static_cast<const float*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = s[i];
    return;
  }
  const std::uint16_t* s = static_cast<const std::uint16_t*>(src);
  for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
}

// n float32 values stored as a row of `type`.
inline void narrow_row(const float* __restrict src, RowType type, void* dst, std::size_t n) {
  if (type == RowType::f32) {
    float* o = static_cast<float*>(dst);
    for (std::size_t i = 0; i < n; ++i) o[i] = src[i];
    return;
  }
  std::uint16_t* o = static_cast<std::uint16_t*>(dst);
  for (std::size_t i = 0; i < n; ++i) o[i] = bf16_from_float(src[i]);
}

}  // namespace mjolnir

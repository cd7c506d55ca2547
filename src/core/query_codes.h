// The codes of the quantized Q modes (docs/numerics.md, step 1), one definition for the emulator
// and the backends' scalar code. Both quantize per (query tile, KV head) with sq = amax / max.
#pragma once

#include <algorithm>
#include <cmath>

namespace mjolnir {

// fp8: e4m3 codes over their full range.
inline constexpr float kQFp8Max = 448.0f;
// int8: the integers -127..127 (symmetric: -128 is left out, so the codes negate exactly).
inline constexpr float kQInt8Max = 127.0f;

// The int8 code of x / sq: the nearest integer, ties to even, within +-127 (x / sq can exceed
// 127 by a rounding of the division).
inline float int8_code(float scaled) {
  return std::clamp(std::nearbyint(scaled), -kQInt8Max, kQInt8Max);
}

}  // namespace mjolnir

// The non-finite policy every backend follows (docs/numerics.md, "Non-finite inputs"): a query
// row that meets a NaN or an infinity, in its q or in a K or V value of a token it attends,
// comes out NaN in every channel of O and in its LSE; every other row is computed as if that
// value were not there. A row that attends no token stays the empty row (O = 0, LSE = -inf).
//
// The scalar pieces the host backends share; the SIMD and CUDA kernels apply the same rules in
// their own code (cpu/online_softmax-inl.h, cuda/decode_item.cuh).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace mjolnir {

// What a poisoned row's O channels and LSE hold.
inline constexpr float kPoisonedRow = std::numeric_limits<float>::quiet_NaN();

inline bool all_finite(const float* x, std::size_t count) {
  return std::all_of(x, x + count, [](float v) { return std::isfinite(v); });
}

// O = NaN in all `d` channels, and the LSE where there is one.
inline void poison_row(float* o, std::size_t d, float* lse) {
  std::fill(o, o + d, kPoisonedRow);
  if (lse != nullptr) *lse = kPoisonedRow;
}

}  // namespace mjolnir

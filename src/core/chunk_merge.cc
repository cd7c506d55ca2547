// Step 6 of the numerics contract: see chunk_merge.h.
#include "core/chunk_merge.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/non_finite.h"

namespace mjolnir {

void merge_chunks(const float* partial_o, std::size_t o_stride, const float* partial_lse,
                  std::size_t lse_stride, int chunks, int head_dim, float* o, float* lse) {
  const std::size_t d = std::size_t(head_dim);
  for (int s = 0; s < chunks; ++s) {
    if (std::isnan(partial_lse[s * lse_stride])) return poison_row(o, d, lse);
  }
  float max_lse = -std::numeric_limits<float>::infinity();
  for (int s = 0; s < chunks; ++s) max_lse = std::max(max_lse, partial_lse[s * lse_stride]);
  std::fill(o, o + d, 0.0f);
  if (max_lse == -std::numeric_limits<float>::infinity()) {
    if (lse != nullptr) *lse = max_lse;
    return;
  }
  float weight_sum = 0.0f;
  for (int s = 0; s < chunks; ++s) weight_sum += std::exp(partial_lse[s * lse_stride] - max_lse);
  for (int s = 0; s < chunks; ++s) {
    const float w = std::exp(partial_lse[s * lse_stride] - max_lse) / weight_sum;
    const float* src = partial_o + s * o_stride;
    for (std::size_t c = 0; c < d; ++c) o[c] += w * src[c];
  }
  if (lse != nullptr) *lse = max_lse + std::log(weight_sum);
}

}  // namespace mjolnir

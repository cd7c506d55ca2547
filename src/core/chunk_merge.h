// Step 6 of the numerics contract (docs/numerics.md): a split query tile's chunks merged into its
// output, one query row at a time. One function for the host: the emulator defines the contract
// with it and the CPU backend merges with it, so their merges are the same arithmetic. The CUDA
// merge kernel (cuda/decode_kernel.cuh) computes the same sums with the rounding of each step
// explicit, shared by a CTA's threads.
#pragma once

#include <cstddef>

namespace mjolnir {

// The chunks' normalized O rows (chunk s at partial_o + s * o_stride, head_dim floats) and
// natural-log LSEs (partial_lse[s * lse_stride]) merged into one row:
//   M = max_s lse_s,  w_s = exp(lse_s - M) / sum_t exp(lse_t - M),
//   o = sum_s w_s O_s (chunk by chunk, in order),  lse = M + log(sum_t exp(lse_t - M)).
// Chunks that saw nothing (lse -inf) weigh 0; when all did, the row is the empty row (O = 0,
// lse = -inf); a poisoned chunk (lse NaN) poisons the row (core/non_finite.h). lse may be null.
void merge_chunks(const float* partial_o, std::size_t o_stride, const float* partial_lse,
                  std::size_t lse_stride, int chunks, int head_dim, float* o, float* lse);

}  // namespace mjolnir

// The stacked MMA layout of the tensor-core decode body (decode_mma_kernel.cuh): up to 8 query
// rows with f16 operands, row r's two operand terms on M rows r and r + 8, half the plain
// layout's MMAs. Its warp state is published as the plain layout's (mma_layout_plain.cuh).
// Part of decode_mma_kernel.cuh, which includes it after the class.
#pragma once

#include <cstdint>

#include "cuda/decode_mma_kernel.cuh"

namespace mjolnir::cuda {

// consume_step with stacked terms (q_len * g <= 8, two f16 terms): each MMA carries both
// operand terms of the lane's row gid, term 0 in M row gid and term 1 in M row gid + 8, so a
// step takes half the MMAs of the plain layout, whose rows 8..15 would be empty. The QK
// accumulators of the two terms are added once per score (as the plain layout adds its
// per-term accumulators); the PV ones are added once, in merge_and_write.
template <Format kFormat, int kHeadDim>
__device__ inline void MmaDecodeCta<kFormat, kHeadDim>::consume_stacked_step(int first,
                                                                             const StepData& data,
                                                                             int visible,
                                                                             WarpState& s) const {
  const int tid = lane() & 3;
  float acc[2][4] = {};  // n-block kb: c0, c1 term 0 and c2, c3 term 1 of tokens 2tid, 2tid + 1
#pragma unroll
  for (int j = 0; j < kKSteps; ++j) {
    std::uint32_t b[2][2];
    k_operand(data.k[0], data.k_scales[0], j, b[0][0], b[0][1]);
    k_operand(data.k[1], data.k_scales[1], j, b[1][0], b[1][1]);
    std::uint32_t a[4];
    const std::uint32_t* from = q_frags_ + (j * 32 + lane()) * 4;
    for (int i = 0; i < 4; ++i) a[i] = from[i];
    mma_16816<kType>(acc[0], a, b[0][0], b[0][1]);
    mma_16816<kType>(acc[1], a, b[1][0], b[1][1]);
  }
  float score[4];  // tokens 2tid, 2tid + 1 of n-block 0, then of n-block 1
  float row_max = -INFINITY;
  bool non_finite = false;
  for (int kb = 0; kb < 2; ++kb) {
    for (int i = 0; i < 2; ++i) {
      const int position = first + kb * 8 + tid * 2 + i;
      const float x = acc[kb][i] + acc[kb][i + 2];
      score[2 * kb + i] = position <= visible ? x * score_scale_ : -INFINITY;
      non_finite |= position <= visible && !isfinite(score[2 * kb + i]);
      row_max = fmaxf(row_max, score[2 * kb + i]);
    }
  }
  row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
  row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
  const float alpha = online_softmax(score, row_max, s.m[0], s.l[0]);
  if (non_finite) s.l[0] = NAN;
  if (__any_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
    for (int n = 0; n < kNBlocks; ++n) {
      for (int i = 0; i < 4; ++i) s.o[n][i] *= alpha;
    }
  }

  // O += P V with P's two terms stacked as Q's were: a0 / a2 term 0 of tokens (2tid,
  // 2tid + 1) / (2tid + 8, 2tid + 9), a1 / a3 their term 1.
  std::uint32_t first_pair[2], second_pair[2];
  split2<kType, 2>(score[0], score[1], first_pair);
  split2<kType, 2>(score[2], score[3], second_pair);
  const std::uint32_t a[4] = {first_pair[0], first_pair[1], second_pair[0], second_pair[1]};
#pragma unroll
  for (int n = 0; n < kNBlocks; ++n) {
    const std::uint32_t b0 = v_operand(data.v[0], data.v[1], data.v_scales[0], n);
    const std::uint32_t b1 = v_operand(data.v[2], data.v[3], data.v_scales[1], n);
    mma_16816<kType>(s.o[n], a, b0, b1);
  }
}

}  // namespace mjolnir::cuda

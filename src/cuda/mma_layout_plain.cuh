// The plain MMA layout of the tensor-core decode body (decode_mma_kernel.cuh): the item's query
// rows (up to 16) on M, KV tokens on N (scores) and K (P.V), one MMA per operand term. Also how the
// layouts with query rows on M (plain and stacked) publish a warp's state for the in-CTA merge.
// Part of decode_mma_kernel.cuh, which includes it after the class.
#pragma once

#include <cstdint>

#include "cuda/decode_mma_kernel.cuh"

namespace mjolnir::cuda {

// One step of 16 tokens: S = Q K^T, the online softmax, O += P V.
template <Format kFormat, int kHeadDim>
__device__ inline void MmaDecodeCta<kFormat, kHeadDim>::consume_step(int first,
                                                                     const StepData& data,
                                                                     const int (&visible)[2],
                                                                     WarpState& s) const {
  const int tid = lane() & 3;
  // S = Q K^T for the step's 16 tokens: n-block kb holds tokens first + kb*8 + 0..7.
  // Each Q term accumulates on its own (independent MMA chains), summed at the end.
  float term_score[kTerms][2][4] = {};
#pragma unroll
  for (int j = 0; j < kKSteps; ++j) {
    std::uint32_t b[2][2];
    k_operand(data.k[0], data.k_scales[0], j, b[0][0], b[0][1]);
    k_operand(data.k[1], data.k_scales[1], j, b[1][0], b[1][1]);
#pragma unroll
    for (int t = 0; t < kTerms; ++t) {
      if (t >= q_terms_) break;  // a constant bound keeps term_score in registers
      std::uint32_t a[4];
      const std::uint32_t* from = q_frags_ + ((t * kKSteps + j) * 32 + lane()) * 4;
      for (int i = 0; i < 4; ++i) a[i] = from[i];
      mma_16816<kType>(term_score[t][0], a, b[0][0], b[0][1]);
      mma_16816<kType>(term_score[t][1], a, b[1][0], b[1][1]);
    }
  }
  float score[2][4];
  for (int kb = 0; kb < 2; ++kb) {
    for (int i = 0; i < 4; ++i) {
      score[kb][i] = term_score[0][kb][i];
      for (int t = 1; t < kTerms; ++t) score[kb][i] += term_score[t][kb][i];
    }
  }

  // Scale, mask, and the online softmax per row (a row's 16 scores sit in its 4 lanes).
  float alpha[2];
  for (int ri = 0; ri < 2; ++ri) {
    float row_max = -INFINITY;
    bool non_finite = false;
    for (int kb = 0; kb < 2; ++kb) {
      for (int i = 0; i < 2; ++i) {
        const int position = first + kb * 8 + tid * 2 + i;
        float& x = score[kb][2 * ri + i];
        x = position <= visible[ri] ? x * score_scale_ : -INFINITY;
        non_finite |= position <= visible[ri] && !isfinite(x);
        row_max = fmaxf(row_max, x);
      }
    }
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    float row[4] = {score[0][2 * ri], score[0][2 * ri + 1], score[1][2 * ri], score[1][2 * ri + 1]};
    alpha[ri] = online_softmax(row, row_max, s.m[ri], s.l[ri]);
    if (non_finite) s.l[ri] = NAN;  // the lane's share: the row's sum is NaN from here on
    score[0][2 * ri] = row[0], score[0][2 * ri + 1] = row[1];
    score[1][2 * ri] = row[2], score[1][2 * ri + 1] = row[3];
  }
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int n = 0; n < kNBlocks; ++n) {
      s.o[n][0] *= alpha[0];
      s.o[n][1] *= alpha[0];
      s.o[n][2] *= alpha[1];
      s.o[n][3] *= alpha[1];
    }
  }

  // O += P V: P's A fragments are the score fragments (rows gid, gid + 8; tokens 2tid,
  // 2tid + 1 of each n-block), split into operand terms.
  std::uint32_t pa[4][kTerms];
  split2<kType, kTerms>(score[0][0], score[0][1], pa[0]);
  split2<kType, kTerms>(score[0][2], score[0][3], pa[1]);
  split2<kType, kTerms>(score[1][0], score[1][1], pa[2]);
  split2<kType, kTerms>(score[1][2], score[1][3], pa[3]);
#pragma unroll
  for (int n = 0; n < kNBlocks; ++n) {
    const std::uint32_t b0 = v_operand(data.v[0], data.v[1], data.v_scales[0], n);
    const std::uint32_t b1 = v_operand(data.v[2], data.v[3], data.v_scales[1], n);
#pragma unroll
    for (int t = 0; t < kTerms; ++t) {
      const std::uint32_t a[4] = {pa[0][t], pa[1][t], pa[2][t], pa[3][t]};
      mma_16816<kType>(s.o[n], a, b0, b1);
    }
  }
}

// A warp's state into the merge buffers: merge_o_ [warp][row][channel], merge_m_ and merge_l_
// [warp][row]. The layouts with query rows on M (plain, stacked).
template <Format kFormat, int kHeadDim>
__device__ inline void MmaDecodeCta<kFormat, kHeadDim>::publish_rows_on_m(WarpState& s) {
  const int warp = threadIdx.x >> 5, gid = lane() >> 2, tid = lane() & 3;
  if (layout_ == MmaLayout::stacked) {  // M row gid + 8 held the second term of row gid's P
    for (int n = 0; n < kNBlocks; ++n) {
      s.o[n][0] += s.o[n][2];
      s.o[n][1] += s.o[n][3];
      s.o[n][2] = s.o[n][3] = 0.0f;
    }
  }
  for (int ri = 0; ri < 2; ++ri) {
    s.l[ri] += __shfl_xor_sync(0xffffffffu, s.l[ri], 1);
    s.l[ri] += __shfl_xor_sync(0xffffffffu, s.l[ri], 2);
  }
  __syncthreads();  // the merge buffers alias Q's, which every warp has finished reading
  float* o = merge_o_ + warp * kMmaRows * kHeadDim;
#pragma unroll
  for (int n = 0; n < kNBlocks; ++n) {
    for (int i = 0; i < 4; ++i) {
      const int r = gid + 8 * (i >> 1), c = (tid * 2 + (i & 1)) * kNBlocks + n;
      o[r * kHeadDim + c] = s.o[n][i];
    }
  }
  if (tid == 0) {
    for (int ri = 0; ri < 2; ++ri) {
      merge_m_[warp * kMmaRows + gid + 8 * ri] = s.m[ri];
      merge_l_[warp * kMmaRows + gid + 8 * ri] = s.l[ri];
    }
  }
}

}  // namespace mjolnir::cuda

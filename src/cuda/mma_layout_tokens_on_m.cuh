// The tokens-on-M MMA layout of the tensor-core decode body (decode_mma_kernel.cuh): up to 4
// query rows with f16 operands, S^T = K Q^T and O^T += V^T P^T with 16 tokens or channels on M
// and each row's two terms on N, a quarter of the plain layout's MMAs; and how it publishes a
// warp's state for the in-CTA merge. Part of decode_mma_kernel.cuh, which includes it after the
// class.
#pragma once

#include <cstdint>

#include "cuda/decode_mma_kernel.cuh"

namespace mjolnir::cuda {

// consume_step with tokens on M (q_len * g <= 4, two f16 terms): S^T = K Q^T with the step's
// 16 tokens on M and N column 2r + t holding term t of query row r, then O^T += V^T P^T with
// 16 channels on M, the tokens on K and the same N columns. Every lane of a quad-column tid
// works for row tid. Per 16-token step: D/16 MMAs for the scores and D/16 for the values, a
// quarter of the plain layout's. K and V are the same registers as in the other layouts, in
// the A operand's places: K tokens gid and gid + 8 as its rows, and V's token pairs at channel
// gid * D/8 + n as rows gid (n = 2mt) and gid + 8 (n = 2mt + 1) of M tile mt.
template <Format kFormat, int kHeadDim>
__device__ inline void MmaDecodeCta<kFormat, kHeadDim>::consume_tokens_on_m_step(
    int first, const StepData& data, int visible, WarpState& s) const {
  const int gid = lane() >> 2, tid = lane() & 3;
  // Two accumulator chains (even and odd k-steps) halve the chain of dependent MMAs.
  float acc[2][4] = {};
#pragma unroll
  for (int j = 0; j < kKSteps; ++j) {
    std::uint32_t k0[2], k1[2];
    k_operand(data.k[0], data.k_scales[0], j, k0[0], k0[1]);  // token gid
    k_operand(data.k[1], data.k_scales[1], j, k1[0], k1[1]);  // token gid + 8
    const std::uint32_t a[4] = {k0[0], k1[0], k0[1], k1[1]};
    const std::uint32_t* q = q_frags_ + (j * 32 + lane()) * 4;
    mma_16816<kType>(acc[j & 1], a, q[0], q[1]);
  }
  // Lane (gid, tid): tokens gid (c0 term 0, c1 term 1) and gid + 8 (c2, c3) of row tid.
  float score[2];
  float row_max = -INFINITY;
  bool non_finite = false;
  for (int half = 0; half < 2; ++half) {
    const int position = first + 8 * half + gid;
    const float x =
        (acc[0][2 * half] + acc[1][2 * half]) + (acc[0][2 * half + 1] + acc[1][2 * half + 1]);
    score[half] = position <= visible ? x * score_scale_ : -INFINITY;
    non_finite |= position <= visible && !isfinite(score[half]);
    row_max = fmaxf(row_max, score[half]);
  }
  for (int mask = 4; mask < 32; mask <<= 1) {
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, mask));
  }
  // l: the lane's share of the row's sum; the lanes' shares are added in publish_tokens_on_m.
  const float alpha = online_softmax(score, row_max, s.m[0], s.l[0]);
  if (non_finite) s.l[0] = NAN;
  if (__any_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      for (int i = 0; i < 4; ++i) s.o[mt][i] *= alpha;
    }
  }

  // P^T's B fragment: tokens (2tid, 2tid + 1) in b0 and (2tid + 8, 2tid + 9) in b1, of N
  // column gid (term gid % 2 of row gid / 2), gathered from the lanes holding those tokens.
  const int from = 8 * tid + (gid >> 1);  // lane (2tid, row gid / 2); + 4: token 2tid + 1
  const float p00 = __shfl_sync(0xffffffffu, score[0], from);
  const float p01 = __shfl_sync(0xffffffffu, score[0], from + 4);
  const float p10 = __shfl_sync(0xffffffffu, score[1], from);
  const float p11 = __shfl_sync(0xffffffffu, score[1], from + 4);
  std::uint32_t low[2], high[2];
  split2<kType, 2>(p00, p01, low);
  split2<kType, 2>(p10, p11, high);
  // A select, not an index: indexed by a runtime value, the two arrays became an 8-way chain
  // of predicated moves in the SASS.
  const bool second_term = (gid & 1) != 0;
  const std::uint32_t b0 = second_term ? low[1] : low[0];
  const std::uint32_t b1 = second_term ? high[1] : high[0];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const std::uint32_t a[4] = {v_operand(data.v[0], data.v[1], data.v_scales[0], 2 * mt),
                                v_operand(data.v[0], data.v[1], data.v_scales[0], 2 * mt + 1),
                                v_operand(data.v[2], data.v[3], data.v_scales[1], 2 * mt),
                                v_operand(data.v[2], data.v[3], data.v_scales[1], 2 * mt + 1)};
    mma_16816<kType>(s.o[mt], a, b0, b1);
  }
}

// publish_rows_on_m for tokens on M: lane (gid, tid) holds row tid's terms (c0 + c1 at
// channel gid * D/8 + 2mt, c2 + c3 at the next one) and its share of row tid's sum.
template <Format kFormat, int kHeadDim>
__device__ inline void MmaDecodeCta<kFormat, kHeadDim>::publish_tokens_on_m(WarpState& s) {
  const int warp = threadIdx.x >> 5, gid = lane() >> 2, tid = lane() & 3;
  for (int mask = 4; mask < 32; mask <<= 1) {
    s.l[0] += __shfl_xor_sync(0xffffffffu, s.l[0], mask);
  }
  __syncthreads();  // the merge buffers alias Q's, which every warp has finished reading
  float* o = merge_o_ + (warp * kMmaRows + tid) * kHeadDim + gid * (kHeadDim / 8);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    o[2 * mt] = s.o[mt][0] + s.o[mt][1];
    o[2 * mt + 1] = s.o[mt][2] + s.o[mt][3];
  }
  if (gid == 0) {
    merge_m_[warp * kMmaRows + tid] = s.m[0];
    merge_l_[warp * kMmaRows + tid] = s.l[0];
  }
}

}  // namespace mjolnir::cuda

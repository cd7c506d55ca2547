// One work item of a decode step as every decode kernel body sees it: where its K/V rows, query
// rows and outputs live, its scales, the Q scale of step 1, and the rows of an empty item. The
// exact-order CTA (decode_kernel.cuh) and the tensor-core CTA (decode_mma_kernel.cuh) both build
// on it, so the addressing and the contract's step 1 are written once.
#pragma once

#if defined(MJOLNIR_CUDA_EMULATION)
#include "cuda/cpu_emulation.h"
#else
#include <cuda_runtime.h>
#endif

#include <cstdint>

#include "cuda/decode_params.h"
#include "cuda/kv_codec.cuh"

namespace mjolnir::cuda {

// sq (fp8 Q's scale, 1 otherwise) and sq * k_outer * softmax_scale * log2(e).
struct QueryScales {
  float sq = 1.0f;
  float score_scale = 0.0f;
};

class DecodeItem {
 public:
  __device__ DecodeItem(const DecodeKernelParams& p, const StepHeader& header, const WorkItem& item)
      : p_(p), item_(item) {
    const SeqEntry seq = reinterpret_cast<const SeqEntry*>(p.step + header.seqs_offset)[item.seq];
    seq_len_ = seq.seq_len;
    pages_ = reinterpret_cast<const std::int32_t*>(p.step + header.pages_offset) + seq.page_start;
  }

  // A padding request or an empty chunk: O = 0, LSE = -inf, nothing read.
  template <int kThreads>
  __device__ void write_empty_rows() const {
    const int d = p_.head_dim;
    for (int e = threadIdx.x; e < p_.rows * d; e += kThreads) {
      const int r = e / d;
      output_row(r)[e - r * d] = 0.0f;
    }
    for (int r = threadIdx.x; r < p_.rows; r += kThreads) {
      if (float* lse = lse_slot(r)) *lse = -INFINITY;
    }
  }

 protected:
  // Start of the packed K (kv 0) or V (kv 1) row of sequence position `position`.
  __device__ const std::uint8_t* kv_row(int position, int kv) const {
    const std::int64_t page = pages_[position >> p_.page_shift];
    return p_.pool + page * p_.page_stride + std::int64_t(item_.kv_head) * p_.head_stride +
           std::int64_t(position & (p_.page_size - 1)) * p_.token_stride +
           std::int64_t(kv) * p_.kv_stride;
  }

  // Query row r = t * g + j of the item: token t of the sequence, head j of the group.
  __device__ const float* query_row(int r) const {
    const int t = r / p_.group, j = r - t * p_.group;
    return p_.q + (std::int64_t(item_.seq) * p_.q_len + t) * p_.q_token_stride +
           std::int64_t(item_.kv_head * p_.group + j) * p_.q_head_stride;
  }

  // Where row r's O goes: the output tensor, or the item's partial slot (PartialLayout).
  __device__ float* output_row(int r) const {
    if (item_.partial_slot < 0) {
      const int t = r / p_.group, j = r - t * p_.group;
      return p_.o + (std::int64_t(item_.seq) * p_.q_len + t) * p_.o_token_stride +
             std::int64_t(item_.kv_head * p_.group + j) * p_.o_head_stride;
    }
    return p_.partial_o +
           ((std::int64_t(item_.partial_slot) * p_.num_kv_heads + item_.kv_head) * p_.rows + r) *
               p_.head_dim;
  }
  __device__ float* lse_slot(int r) const {
    if (item_.partial_slot < 0) {
      if (p_.lse == nullptr) return nullptr;
      const int t = r / p_.group, j = r - t * p_.group;
      return p_.lse + (std::int64_t(item_.seq) * p_.q_len + t) * p_.num_q_heads +
             item_.kv_head * p_.group + j;
    }
    return p_.partial_lse +
           (std::int64_t(item_.partial_slot) * p_.num_kv_heads + item_.kv_head) * p_.rows + r;
  }

  // The K or V scale of channel c of this item's head, at the cache's granularity.
  __device__ float scale_at(const float* scales, int c) const {
    switch (static_cast<ScaleGranularity>(p_.granularity)) {
      case ScaleGranularity::tensor:
        return scales[0];
      case ScaleGranularity::head:
        return scales[item_.kv_head];
      case ScaleGranularity::channel:
        return scales[item_.kv_head * p_.head_dim + c];
    }
    return 1.0f;
  }
  __device__ float k_scale_at(int c) const { return scale_at(p_.k_scale, c); }
  __device__ float v_scale_at(int c) const { return scale_at(p_.v_scale, c); }
  __device__ bool channel_scales() const {
    return static_cast<ScaleGranularity>(p_.granularity) == ScaleGranularity::channel;
  }

  // q[c], times the K channel scale when scales are per channel.
  __device__ float folded_query(int r, int c) const {
    const float x = query_row(r)[c];
    return channel_scales() ? __fmul_rn(x, k_scale_at(c)) : x;
  }

  // Whether query row r (folded) holds a NaN or an Inf, which makes the row NaN (the
  // non-finite policy, docs/numerics.md): the lanes of a warp scan it together; all 32 call it.
  __device__ bool warp_row_poisoned(int r) const {
    bool bad = false;
    for (int c = threadIdx.x & 31; c < p_.head_dim; c += 32) bad |= !isfinite(folded_query(r, c));
    return __any_sync(0xffffffffu, bad);
  }

  // flags[i] = 1 where row first + i is poisoned, 0 elsewhere, for i < count, a warp per row;
  // then a barrier. Every thread of the CTA calls it. Such a row is staged as zeros.
  template <int kThreads>
  __device__ void mark_poisoned_rows(int first, int count, float* flags) const {
    for (int i = threadIdx.x >> 5; i < count; i += kThreads / 32) {
      const bool bad = warp_row_poisoned(first + i);
      if ((threadIdx.x & 31) == 0) flags[i] = bad ? 1.0f : 0.0f;
    }
    __syncthreads();
  }

  // Step 1's scales. fp8 Q: sq = amax / 448 (int8 Q: / 127) over all q_len * g rows and channels,
  // poisoned rows left out (as if they were zero, so the other rows keep their codes). Then
  // score_scale = sq * k_outer * softmax_scale * log2(e), multiplied in that order as the
  // emulator does. Every thread of the CTA calls it; `reduce` holds 32 floats of shared memory.
  template <int kThreads>
  __device__ QueryScales query_scales(float* reduce) const {
    QueryScales scales;
    const QMode q_mode = static_cast<QMode>(p_.q_mode);
    if (q_mode == QMode::fp8 || q_mode == QMode::int8) {
      float amax = 0.0f;
      for (int r = threadIdx.x >> 5; r < p_.rows; r += kThreads / 32) {  // a warp per row
        float row_max = 0.0f;
        bool bad = false;
        for (int c = threadIdx.x & 31; c < p_.head_dim; c += 32) {
          const float x = folded_query(r, c);
          row_max = host_max(row_max, fabsf(x));
          bad |= !isfinite(x);
        }
        if (!__any_sync(0xffffffffu, bad)) amax = host_max(amax, row_max);
      }
      amax = block_max<kThreads>(amax, reduce);
      if (amax > 0.0f) scales.sq = __fdiv_rn(amax, q_mode == QMode::fp8 ? kFp8Max : kInt8Max);
    }
    const float k_outer = channel_scales() ? 1.0f : k_scale_at(0);
    scales.score_scale =
        __fmul_rn(__fmul_rn(__fmul_rn(scales.sq, k_outer), p_.softmax_scale), kLog2e);
    return scales;
  }

  // The maximum of x over the CTA's threads (host_max, so a NaN does not win), through
  // `reduce` (32 floats of shared memory).
  template <int kThreads>
  static __device__ float block_max(float x, float* reduce) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset /= 2) {
      x = host_max(x, __shfl_xor_sync(0xffffffffu, x, offset));
    }
    if (lane == 0) reduce[warp] = x;
    __syncthreads();
    float total = reduce[0];
    for (int w = 1; w < kThreads / 32; ++w) total = host_max(total, reduce[w]);
    __syncthreads();
    return total;
  }

  const DecodeKernelParams& p_;
  const WorkItem item_;
  int seq_len_ = 0;
  const std::int32_t* pages_ = nullptr;  // the sequence's physical pages, in order
};

// The body of a decode kernel over a fixed grid: CTAs past the uploaded plan's item count exit
// (so a captured graph replays any plan that fits the capacity), empty items write their empty
// rows, and the others run their item's CTA body `Cta` (constructed from the parameters, the
// dynamic shared memory, the step header and the item).
template <typename Cta>
__device__ void run_work_item(const DecodeKernelParams& p, std::uint8_t* smem) {
  const StepHeader header = *reinterpret_cast<const StepHeader*>(p.step);
  if (static_cast<int>(blockIdx.x) >= header.num_items) return;
  const WorkItem item = reinterpret_cast<const WorkItem*>(p.step + header.items_offset)[blockIdx.x];
  if (item.kv_begin >= item.kv_end) {  // a padding request: writes O = 0, LSE = -inf, reads nothing
    DecodeItem(p, header, item).write_empty_rows<Cta::kThreads>();
    return;
  }
  Cta cta(p, smem, header, item);
  cta.run();
}

}  // namespace mjolnir::cuda

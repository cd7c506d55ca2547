// The exact-order decode kernel (one CTA per work item) and the LSE merge kernel of split
// sequences.
//
// This body runs the numerics contract on CUDA cores in fp32, in the emulator's order of
// operations (docs/cuda.md, "Numerics"): the QK dot products sum channels 0..D-1 one at a time,
// P.V adds tokens in order, l sums the tile's p in order, and exp2 / log2 / exp / log are
// correctly rounded. Only the format decode is parallel, and it is exact. So the Q codes and P
// codes are the emulator's, and O matches it to the last bit except where the host's libm rounds
// differently. It serves every format and mode; the tensor-core body (decode_mma_kernel.cuh)
// takes the fp32-P launches it can (decode_config.h chooses).
//
// Per work item (sequence, KV head, KV range [kv_begin, kv_end)) the CTA holds up to
// pass_rows of the q_len * g query rows (more rows take several passes over the range) and
// walks the range in tiles of T = tile_tokens (the online softmax's tile), each tile in
// sub-tiles of sub_tokens: stage the raw K rows (cp.async, two stages in flight), decode them
// once into fp32 shared memory, score every row against them; after the tile's last K
// sub-tile, update the softmax state; then stage and decode the V sub-tiles and accumulate P.V.
#pragma once

#if defined(MJOLNIR_CUDA_EMULATION)
#include "cuda/cpu_emulation.h"  // the kernels on CPU threads, for tests without a GPU
#else
#include <cuda_runtime.h>
#endif

#include <cstdint>

#include "cuda/decode_item.cuh"
#include "cuda/decode_params.h"
#include "cuda/kv_codec.cuh"

namespace mjolnir::cuda {

// --- cp.async (sm_80+; every architecture this project builds for has it) ----------------------

__device__ __forceinline__ void copy_async(void* smem, const void* global, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  switch (bytes) {
    case 16:
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global)
                   : "memory");
      return;
    case 8:
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(address), "l"(global)
                   : "memory");
      return;
    default:
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(address), "l"(global)
                   : "memory");
      return;
  }
#else
  auto* dst = static_cast<std::uint8_t*>(smem);
  const auto* src = static_cast<const std::uint8_t*>(global);
  for (int i = 0; i < bytes; ++i) dst[i] = src[i];
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most one committed group (the newest) is still in flight.
__device__ __forceinline__ void copy_async_wait_all_but_newest() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// --- the decode CTA -----------------------------------------------------------------------------

// Position in a work item's walk: tile `tile` of the range, K (kv 0) or V (kv 1), sub-tile `sub`.
struct Stage {
  int tile = 0;
  int kv = 0;
  int sub = 0;
};

template <Format kFormat>
class DecodeCta : DecodeItem {
 public:
  static constexpr int kThreads = kDecodeThreads;
  static constexpr int kWarps = kThreads / 32;

  __device__ DecodeCta(const DecodeKernelParams& p, std::uint8_t* smem, const StepHeader& header,
                       const WorkItem& item)
      : DecodeItem(p, header, item), tile_tokens_(header.tile_tokens) {
    const DecodeSmem layout =
        decode_smem(p.pass_rows, p.head_dim, p.sub_tokens, p.score_stride, p.raw_row_stride);
    raw_ = smem + layout.raw;
    dec_ = reinterpret_cast<float*>(smem + layout.dec);
    q_ = reinterpret_cast<float*>(smem + layout.q);
    acc_ = reinterpret_cast<float*>(smem + layout.acc);
    scores_ = reinterpret_cast<float*>(smem + layout.scores);
    m_ = reinterpret_cast<float*>(smem + layout.m);
    l_ = reinterpret_cast<float*>(smem + layout.l);
    alpha_ = reinterpret_cast<float*>(smem + layout.alpha);
    poisoned_ = reinterpret_cast<float*>(smem + layout.poisoned);
    reduce_ = reinterpret_cast<float*>(smem + layout.reduce);
  }

  // A non-empty item (run_work_item writes the rows of empty ones).
  __device__ void run() {
    prepare_query_scale();
    for (pass_begin_ = 0; pass_begin_ < p_.rows; pass_begin_ += p_.pass_rows) {
      pass_rows_ = min(p_.pass_rows, p_.rows - pass_begin_);
      load_query_rows();
      walk_range();
      write_rows();
      __syncthreads();  // the next pass overwrites q, acc and the softmax state
    }
  }

 private:
  // fp8 Q: sq over all rows (every pass and every chunk recomputes the same amax), and the
  // score scale, as DecodeItem computes them.
  __device__ void prepare_query_scale() {
    const QueryScales scales = query_scales<kThreads>(reduce_);
    sq_ = scales.sq;
    score_scale_ = scales.score_scale;
  }

  // The pass's rows of Q, a row with a NaN or an Inf as zeros (flagged in poisoned_).
  __device__ void load_query_rows() {
    const int d = p_.head_dim;
    mark_poisoned_rows<kThreads>(pass_begin_, pass_rows_, poisoned_);
    for (int e = threadIdx.x; e < pass_rows_ * d; e += kThreads) {
      const int r = e / d, c = e - r * d;
      q_[e] = poisoned_[r] != 0.0f ? 0.0f
                                   : round_query(folded_query(pass_begin_ + r, c), p_.q_mode, sq_);
      acc_[e] = 0.0f;
    }
    for (int r = threadIdx.x; r < pass_rows_; r += kThreads) {
      m_[r] = -INFINITY;
      l_[r] = 0.0f;
      alpha_[r] = 1.0f;
    }
    __syncthreads();
  }

  // --- the walk over the item's range ---

  __device__ int tile_begin(int tile) const { return item_.kv_begin + tile * tile_tokens_; }
  __device__ int tile_count(int tile) const {
    return min(tile_tokens_, item_.kv_end - tile_begin(tile));
  }
  __device__ int sub_first(const Stage& s) const {
    return tile_begin(s.tile) + s.sub * p_.sub_tokens;
  }
  __device__ int sub_count(const Stage& s) const {
    return min(p_.sub_tokens, tile_count(s.tile) - s.sub * p_.sub_tokens);
  }
  __device__ bool last_sub(const Stage& s) const {
    return (s.sub + 1) * p_.sub_tokens >= tile_count(s.tile);
  }
  // The stage after `s`: the tile's next K sub-tile, its V sub-tiles, then the next tile.
  __device__ bool advance(Stage& s) const {
    if (!last_sub(s)) {
      ++s.sub;
      return true;
    }
    if (s.kv == 0) {
      s.kv = 1;
      s.sub = 0;
      return true;
    }
    if (item_.kv_end - tile_begin(s.tile) > tile_tokens_) {
      ++s.tile;
      s.kv = 0;
      s.sub = 0;
      return true;
    }
    return false;
  }

  __device__ std::uint8_t* raw_stage(int buffer) const {
    return raw_ + std::size_t(buffer) * p_.sub_tokens * p_.raw_row_stride;
  }

  // Starts copying the stage's rows into raw buffer `buffer` (cp.async when the rows allow
  // 16-, 8- or 4-byte chunks; plain byte copies otherwise), then commits the group.
  __device__ void issue_load(const Stage& s, int buffer) {
    const int first = sub_first(s), count = sub_count(s);
    std::uint8_t* dst = raw_stage(buffer);
    const int chunk = p_.copy_bytes;
    const int chunks_per_row = p_.row_bytes / chunk;
    for (int e = threadIdx.x; e < count * chunks_per_row; e += kThreads) {
      const int i = e / chunks_per_row;
      const int offset = (e - i * chunks_per_row) * chunk;
      const std::uint8_t* src = kv_row(first + i, s.kv) + offset;
      std::uint8_t* to = dst + i * p_.raw_row_stride + offset;
      if (chunk >= 4) {
        copy_async(to, src, chunk);
      } else {
        *to = *src;
      }
    }
    copy_async_commit();
  }

  // Raw rows of the stage -> dec_ [count][D + 1] floats, each channel decoded once.
  __device__ void decode_stage(const Stage& s, int buffer) {
    const int count = sub_count(s), d = p_.head_dim;
    const std::uint8_t* src = raw_stage(buffer);
    for (int e = threadIdx.x; e < count * d; e += kThreads) {
      const int i = e / d, c = e - i * d;
      dec_[i * (d + 1) + c] = decode_channel<kFormat>(src + i * p_.raw_row_stride, c, d);
    }
  }

  // Step 2: s = (sum_c q[c] k[c]) * score_scale for every (row, token) of the K sub-tile, summed
  // in channel order; masked positions get -inf, and a score that is not finite (a NaN or Inf
  // in K) NaN, which softmax_tile turns into a poisoned row. Lanes take consecutive tokens (the
  // padded dec_ rows keep them on distinct banks) and share a row (Q broadcast).
  __device__ void score_stage(const Stage& s) {
    const int first = sub_first(s), count = sub_count(s), d = p_.head_dim;
    const int column = first - tile_begin(s.tile);
    for (int e = threadIdx.x; e < pass_rows_ * p_.sub_tokens; e += kThreads) {
      const int r = e / p_.sub_tokens, i = e - r * p_.sub_tokens;
      if (i >= count) continue;
      const int row = pass_begin_ + r;
      const int t = row / p_.group;
      const int last = p_.causal ? seq_len_ - p_.q_len + t : seq_len_ - 1;
      float score = -INFINITY;
      if (first + i <= last) {
        const float* q = q_ + r * d;
        const float* k = dec_ + i * (d + 1);
        float dot = 0.0f;
        if (p_.fused_dot) {  // as the emulator's host computes it (core/fused_dot.h)
#pragma unroll 4
          for (int c = 0; c < d; ++c) dot = __fmaf_rn(q[c], k[c], dot);
        } else {
#pragma unroll 4
          for (int c = 0; c < d; ++c) dot = __fadd_rn(dot, __fmul_rn(q[c], k[c]));
        }
        score = __fmul_rn(dot, score_scale_);
        if (!isfinite(score)) score = NAN;
      }
      scores_[r * p_.score_stride + column + i] = score;
    }
  }

  // Steps 3 and 4 for one tile, a warp per row: m_new, alpha, p = exp2(s - m_new), l, then P
  // rounded in place. A row that sees no token of the tile keeps its state (alpha = 1, P = 0).
  __device__ void softmax_tile(int tile) {
    const int n = tile_count(tile);
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < pass_rows_; r += kWarps) {
      float* row = scores_ + r * p_.score_stride;
      float tile_max = -INFINITY;
      bool non_finite = false;  // a NaN score: the row is poisoned, l = NaN from here on
      for (int i = lane; i < n; i += 32) {
        tile_max = fmaxf(tile_max, row[i]);
        non_finite |= isnan(row[i]);
      }
      tile_max = warp_max(tile_max);
      non_finite = __any_sync(0xffffffffu, non_finite);
      if (tile_max == -INFINITY) {
        for (int i = lane; i < n; i += 32) row[i] = 0.0f;
        if (lane == 0) {
          alpha_[r] = 1.0f;
          if (non_finite) l_[r] = NAN;
        }
        continue;
      }
      const float m_old = m_[r];
      const float m_new = host_max(m_old, tile_max);
      for (int i = lane; i < n; i += 32) {
        const float score = row[i];
        row[i] = score == -INFINITY ? 0.0f : exp2_rn(__fsub_rn(score, m_new));
      }
      __syncwarp();
      if (lane == 0) {
        float tile_sum = 0.0f;  // the fp32 p, in token order (masked ones add +0)
        for (int i = 0; i < n; ++i) tile_sum = __fadd_rn(tile_sum, row[i]);
        const float alpha = exp2_rn(__fsub_rn(m_old, m_new));  // 0 on the row's first tile
        l_[r] = non_finite ? NAN : __fadd_rn(__fmul_rn(l_[r], alpha), tile_sum);
        m_[r] = m_new;
        alpha_[r] = alpha;
      }
      __syncwarp();
      for (int i = lane; i < n; i += 32) row[i] = round_probability(row[i], p_.p_mode);
    }
  }

  // Step 4's P.V for the V sub-tile: each thread owns fixed (row, channel) accumulators and adds
  // the sub-tile's tokens in order; the tile's first V sub-tile first scales by alpha.
  __device__ void accumulate_stage(const Stage& s) {
    const int first = sub_first(s), count = sub_count(s), d = p_.head_dim;
    const int column = first - tile_begin(s.tile);
    for (int e = threadIdx.x; e < pass_rows_ * d; e += kThreads) {
      const int r = e / d, c = e - r * d;
      float a = acc_[e];
      if (s.sub == 0) a = __fmul_rn(a, alpha_[r]);
      const float* prob = scores_ + r * p_.score_stride + column;
      const float* v = dec_ + c;
      for (int i = 0; i < count; ++i) a = __fadd_rn(a, __fmul_rn(prob[i], v[i * (d + 1)]));
      acc_[e] = a;
    }
  }

  // Two raw buffers: stage n + 1 is in flight while stage n is decoded and used.
  __device__ void walk_range() {
    Stage current;
    int buffer = 0;
    issue_load(current, buffer);
    for (;;) {
      Stage next = current;
      const bool has_next = advance(next);
      if (has_next) {
        issue_load(next, buffer ^ 1);
      } else {
        copy_async_commit();  // an empty group keeps the wait count uniform
      }
      copy_async_wait_all_but_newest();
      __syncthreads();  // every thread's copies of `current` have landed
      decode_stage(current, buffer);
      __syncthreads();
      if (current.kv == 0) {
        score_stage(current);
        if (last_sub(current)) {
          __syncthreads();
          softmax_tile(current.tile);
        }
      } else {
        accumulate_stage(current);
      }
      __syncthreads();  // dec_ and the raw buffer are reused by the next stages
      if (!has_next) break;
      current = next;
      buffer ^= 1;
    }
  }

  // Step 5: o = acc * v_scale * (1 / (l * p_scale)), lse = (m + log2 l) * ln 2; rows that saw
  // nothing: O = 0, LSE = -inf; poisoned rows that saw a token (a non-finite q, score or, in
  // O, V value): O = LSE = NaN.
  __device__ void write_rows() {
    const int d = p_.head_dim;
    const float p_scale = static_cast<PMode>(p_.p_mode) == PMode::fp8 ? kFp8PScale : 1.0f;
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < pass_rows_; r += kWarps) {
      bool non_finite = false;
      for (int c = lane; c < d; c += 32) non_finite |= !isfinite(acc_[r * d + c]);
      non_finite = __any_sync(0xffffffffu, non_finite);
      if (lane == 0) {
        const float l = l_[r];
        poisoned_[r] = l != 0.0f && (non_finite || isnan(l) || poisoned_[r] != 0.0f) ? 1.0f : 0.0f;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < pass_rows_ * d; e += kThreads) {
      const int r = e / d, c = e - r * d;
      const float l = l_[r];
      float value = 0.0f;
      if (poisoned_[r] != 0.0f) {
        value = NAN;
      } else if (l != 0.0f) {
        const float inv_l = __fdiv_rn(1.0f, __fmul_rn(l, p_scale));
        value = __fmul_rn(__fmul_rn(acc_[e], v_scale_at(c)), inv_l);
      }
      output_row(pass_begin_ + r)[c] = value;
    }
    for (int r = threadIdx.x; r < pass_rows_; r += kThreads) {
      float* lse = lse_slot(pass_begin_ + r);
      if (lse == nullptr) continue;
      const float l = l_[r];
      *lse = poisoned_[r] != 0.0f ? NAN
             : l == 0.0f          ? -INFINITY
                                  : __fmul_rn(__fadd_rn(m_[r], log2_rn(l)), kLn2);
    }
  }

  const int tile_tokens_;
  std::uint8_t* raw_ = nullptr;
  float* dec_ = nullptr;
  float* q_ = nullptr;
  float* acc_ = nullptr;
  float* scores_ = nullptr;
  float* m_ = nullptr;
  float* l_ = nullptr;
  float* alpha_ = nullptr;
  float* poisoned_ = nullptr;
  float* reduce_ = nullptr;
  float sq_ = 1.0f;
  float score_scale_ = 0.0f;
  int pass_begin_ = 0;
  int pass_rows_ = 0;
};

// One CTA per work item of a fixed grid: CTAs past the uploaded plan's item count exit, so a
// captured graph replays any plan that fits the capacity.
template <Format kFormat>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const DecodeKernelParams p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  run_work_item<DecodeCta<kFormat>>(p, smem);
}

inline constexpr int kMergeWarps = kMergeThreads / 32;
// Channels of a row each lane owns: D <= 256.
inline constexpr int kMergeChannelsPerLane = 256 / 32;
// [kMergeWarps] floats for the reductions, then [kMergeWarps][256] for the warps' partial sums.
inline constexpr std::size_t kMergeSmemBytes = kMergeWarps * (1 + 256) * sizeof(float);

// A reduction over the CTA in a fixed order (xor butterflies in each warp, whose lanes end equal
// since the operations commute, then the warps in order), so every replay gives the same bits.
// Every thread returns the result.
template <class Op>
__device__ float merge_block_reduce(float x, float* scratch, Op op) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  const int warp = static_cast<int>(threadIdx.x) / 32;
  __syncthreads();  // scratch is free: the previous reduction's readers are done
  if (threadIdx.x % 32 == 0) scratch[warp] = x;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kMergeWarps; ++w) total = op(total, scratch[w]);
  return total;
}

// Step 6, one CTA per (sequence, KV head, query row) of a fixed grid: M = max lse_i,
// w_i = exp(lse_i - M) / sum_j exp(lse_j - M), O = sum_i w_i O_i, L = M + log(sum_j exp(lse_j -
// M)); all chunks empty: O = 0, L = -inf. The chunks are spread over the CTA's threads (the sums)
// and warps (O: warp w adds chunks w, w + kMergeWarps, ..., its lanes own channels), so a
// sequence cut into a hundred chunks at batch 1 merges in a few rounds of loads, not a hundred.
static __global__ void __launch_bounds__(kMergeThreads) merge_kernel(const DecodeKernelParams p) {
  const StepHeader header = *reinterpret_cast<const StepHeader*>(p.step);
  const int r = static_cast<int>(blockIdx.x % unsigned(p.rows));
  const int pair = static_cast<int>(blockIdx.x / unsigned(p.rows));
  const int b = pair / p.num_kv_heads, h = pair - b * p.num_kv_heads;
  if (b >= header.num_seqs) return;
  const SeqEntry seq = reinterpret_cast<const SeqEntry*>(p.step + header.seqs_offset)[b];
  if (seq.num_splits <= 1) return;
  extern __shared__ __align__(16) std::uint8_t smem[];  // kMergeSmemBytes
  float* scratch = reinterpret_cast<float*>(smem);
  float* warp_o = scratch + kMergeWarps;  // [kMergeWarps][d]
  const int d = p.head_dim;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const std::int64_t lse_step = std::int64_t(p.num_kv_heads) * p.rows;  // one slot further
  const std::int64_t o_step = lse_step * d;
  const std::int64_t base = (std::int64_t(seq.first_partial) * p.num_kv_heads + h) * p.rows + r;
  const float* partial_lse = p.partial_lse + base;
  const float* partial_o = p.partial_o + base * d;
  const int t = r / p.group, j = r - t * p.group;
  float* out = p.o + (std::int64_t(b) * p.q_len + t) * p.o_token_stride +
               std::int64_t(h * p.group + j) * p.o_head_stride;
  float* lse = p.lse == nullptr
                   ? nullptr
                   : p.lse + (std::int64_t(b) * p.q_len + t) * p.num_q_heads + h * p.group + j;

  // A poisoned chunk (LSE NaN) poisons the row (the non-finite policy, docs/numerics.md).
  float poisoned = 0.0f;
  float max_lse = -INFINITY;
  for (int s = tid; s < seq.num_splits; s += kMergeThreads) {
    const float x = partial_lse[s * lse_step];
    max_lse = host_max(max_lse, x);
    if (isnan(x)) poisoned = 1.0f;
  }
  poisoned = merge_block_reduce(poisoned, scratch, [](float a, float b) { return a > b ? a : b; });
  if (poisoned != 0.0f) {
    for (int c = tid; c < d; c += kMergeThreads) out[c] = NAN;
    if (tid == 0 && lse != nullptr) *lse = NAN;
    return;
  }
  max_lse = merge_block_reduce(max_lse, scratch, [](float a, float b) { return host_max(a, b); });
  if (max_lse == -INFINITY) {
    for (int c = tid; c < d; c += kMergeThreads) out[c] = 0.0f;
    if (tid == 0 && lse != nullptr) *lse = -INFINITY;
    return;
  }
  float weight_sum = 0.0f;
  for (int s = tid; s < seq.num_splits; s += kMergeThreads) {
    weight_sum = __fadd_rn(weight_sum, exp_rn(__fsub_rn(partial_lse[s * lse_step], max_lse)));
  }
  weight_sum =
      merge_block_reduce(weight_sum, scratch, [](float a, float b) { return __fadd_rn(a, b); });

  // Each warp's chunks, lanes over channels (coalesced rows of the partial O).
  float o[kMergeChannelsPerLane] = {};
#pragma unroll 4
  for (int s = warp; s < seq.num_splits; s += kMergeWarps) {
    const float weight =
        __fdiv_rn(exp_rn(__fsub_rn(partial_lse[s * lse_step], max_lse)), weight_sum);
    const float* chunk = partial_o + s * o_step;
#pragma unroll
    for (int i = 0; i < kMergeChannelsPerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < d) o[i] = __fadd_rn(o[i], __fmul_rn(weight, chunk[c]));
    }
  }
#pragma unroll
  for (int i = 0; i < kMergeChannelsPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < d) warp_o[warp * d + c] = o[i];
  }
  __syncthreads();
  for (int c = tid; c < d; c += kMergeThreads) {
    float sum = warp_o[c];
    for (int w = 1; w < kMergeWarps; ++w) sum = __fadd_rn(sum, warp_o[w * d + c]);
    out[c] = sum;
  }
  if (tid == 0 && lse != nullptr) *lse = __fadd_rn(max_lse, log_rn(weight_sum));
}

}  // namespace mjolnir::cuda

// The tensor-core decode body: one CTA of four warps per work item on mma.sync m16n8k16, in one
// of three layouts (MmaLayout, chosen per launch by mma_layout()):
//   - plain: the item's (q_len * g <= 16) query rows on M, KV tokens on N (scores) and K (P.V),
//     one MMA per operand term (consume_step);
//   - stacked (<= 8 rows, f16 operands): row r's two operand terms on M rows r and r + 8, half
//     the MMAs (consume_stacked_step);
//   - tokens on M (<= 4 rows, f16 operands): S^T = K Q^T and O^T += V^T P^T, 16 tokens or
//     channels on M and each row's two terms on N, a quarter of the MMAs
//     (consume_tokens_on_m_step).
// Each warp walks every fourth 16-token step of the item's range with its own online-softmax state;
// the four states are merged through shared memory at the end (the split-KV merge, in-CTA).
//
// The K and V codes go from global memory straight into registers (8- or 16-byte loads) and are
// converted there, once per element and never per fragment: fp8 to f16x2 by the hardware
// conversion, fp16 and bf16 as they are, fp6 / fp4 by placing the codes' bits into f16 (a power
// of two times the value), nvfp4 then times its block scale; all exact. Each lane's K slice is
// read whole (interleaved 16-byte chunks for 8- and 16-bit rows, contiguous for packed ones) and
// the channel order of the dot product is permuted to match it (Q's fragments use the same
// permutation); V's token pairs are interleaved with byte permutes. Numerics (docs/cuda.md): the
// QK and PV products use fp32 values split into 2 (f16) or 3 (bf16) operand terms, so the
// products carry 22-24 significant bits and accumulate in fp32; Q is scaled by a power of two
// into f16's range, undone in the score scale. This is the contract's fp32-P mode with a
// reordered fp32 sum: within the emulator tolerance, not bit-identical to it. P modes that round
// P (bf16, fp8) need the emulator's exact order and run on the exact-order CTA instead.
//
// The files: this one holds the CTA (Q's fragments, the walk over the steps, the in-CTA merge);
// mma_operands.cuh the K and V loads and conversions, one scheme per packing of the codes; and
// mma_layout_plain.cuh, mma_layout_stacked.cuh and mma_layout_tokens_on_m.cuh each layout's step.
#pragma once

#include <cstdint>

#include "cuda/decode_item.cuh"
#include "cuda/decode_params.h"
#include "cuda/format_dispatch.h"
#include "cuda/kv_codec.cuh"
#include "cuda/mma_fragments.cuh"
#include "cuda/mma_operands.cuh"
#include "mjolnir/error.h"

namespace mjolnir::cuda {

template <Format kFormat, int kHeadDim>
class MmaDecodeCta : DecodeItem, MmaOperands<kFormat, kHeadDim> {
  using Operands = MmaOperands<kFormat, kHeadDim>;
  using Operands::k_channel;
  using Operands::k_operand;
  using Operands::kBits;
  using Operands::kKWords;
  using Operands::kValueScale;
  using Operands::kVWords;
  using Operands::lane;
  using Operands::load_rows;
  using Operands::v_operand;
  using typename Operands::StepData;

 public:
  static constexpr int kThreads = kMmaThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kStep = kMmaStepTokens;
  static constexpr MmaType kType = kFormat == Format::bf16 ? MmaType::bf16 : MmaType::f16;
  static constexpr int kTerms = kType == MmaType::f16 ? 2 : 3;
  static constexpr int kKSteps = kHeadDim / 16;  // k-steps of the QK product
  static constexpr int kNBlocks = kHeadDim / 8;  // n-blocks of the O tile
  static constexpr int kMTiles = kHeadDim / 16;  // M tiles of O^T (tokens_on_m), in o[0..)
  // Prefetch the next step where the registers allow it (up to 32 words of K and V a step).
  static constexpr bool kPrefetch = kBits <= 8 && 2 * kKWords + 4 * kVWords <= 32;
  static_assert(mma_shape(kFormat, kHeadDim));

  __device__ MmaDecodeCta(const DecodeKernelParams& p, std::uint8_t* smem, const StepHeader& header,
                          const WorkItem& item)
      : DecodeItem(p, header, item) {
    const MmaSmem layout = mma_smem(kHeadDim);
    q_values_ = reinterpret_cast<float*>(smem + layout.q_values);
    q_frags_ = reinterpret_cast<std::uint32_t*>(smem + layout.q_frags);
    merge_o_ = reinterpret_cast<float*>(smem + layout.merge_o);
    merge_m_ = reinterpret_cast<float*>(smem + layout.merge_m);
    merge_l_ = reinterpret_cast<float*>(smem + layout.merge_l);
    row_weight_ = reinterpret_cast<float*>(smem + layout.row_weight);
    poisoned_ = reinterpret_cast<float*>(smem + layout.poisoned);
    reduce_ = reinterpret_cast<float*>(smem + layout.reduce);
    k_head_ = p.pool + std::int64_t(item.kv_head) * p.head_stride;
    token_stride_ = static_cast<std::uint32_t>(p.token_stride);
    one_page_steps_ = p.page_size >= kStep && item.kv_begin % kStep == 0 && p.token_stride >= 0 &&
                      p.token_stride * p.page_size < (std::int64_t{1} << 31);
  }

  // A non-empty item (run_work_item writes the rows of empty ones).
  __device__ void run() {
    prepare_query();
    WarpState state;
    if constexpr (kType == MmaType::f16) {
      switch (layout_) {
        case MmaLayout::plain:
          walk<MmaLayout::plain>(state);
          break;
        case MmaLayout::stacked:
          walk<MmaLayout::stacked>(state);
          break;
        case MmaLayout::tokens_on_m:
          walk<MmaLayout::tokens_on_m>(state);
          break;
      }
    } else {
      walk<MmaLayout::plain>(state);  // bf16: three operand terms fit only the plain layout
    }
    merge_and_write(state);
  }

 private:
  // One warp's online-softmax state: its lane's O fragments and, for the lane's rows gid and
  // gid + 8, the running max and the lane's share of the sum.
  struct WarpState {
    float o[kNBlocks][4];
    float m[2];
    float l[2];
  };

  // Step 1 into shared memory as A fragments: the prepared rows (rows past q_len * g are zero),
  // scaled by a power of two into f16's range, split into q_terms_ operand terms. Fragment
  // (term, k-step j) of a lane (gid, tid) holds rows gid and gid + 8 at the channels c, c + 1
  // (a0, a1) and c + 2, c + 3 (a2, a3) of the lane's K slice for that k-step (k_operand), so the
  // dot product runs over a permutation of the channels that both operands share.
  // A row with a NaN or an Inf is staged as zeros and flagged in poisoned_ (docs/numerics.md).
  __device__ void prepare_query() {
    mark_poisoned_rows<kThreads>(0, p_.rows, poisoned_);
    const QueryScales scales = query_scales<kThreads>(reduce_);
    float amax = 0.0f;
    for (int e = threadIdx.x; e < kMmaRows * kHeadDim; e += kThreads) {
      const int r = e / kHeadDim, c = e - r * kHeadDim;
      const float q = r < p_.rows && poisoned_[r] == 0.0f
                          ? round_query(folded_query(r, c), p_.q_mode, scales.sq)
                          : 0.0f;
      q_values_[e] = q;
      amax = host_max(amax, fabsf(q));
    }
    amax = block_max<kThreads>(amax, reduce_);  // its barrier also publishes q_values_
    float q_scale = 1.0f;
    if (kType == MmaType::f16 && amax > 0.0f) {  // |q| * q_scale in [2^14, 2^15)
      int exponent = 0;
      frexpf(amax, &exponent);
      q_scale = minifloat_detail::exact_power_of_two(min(max(15 - exponent, -126), 127));
    }
    score_scale_ = __fmul_rn(__fdiv_rn(scales.score_scale, q_scale), kValueScale);
    // fp8 and int8 Q codes are exact in either operand type, bf16 Q too (f16 keeps 11 bits); fp32 Q
    // needs every term.
    q_terms_ = static_cast<QMode>(p_.q_mode) == QMode::fp32 ? kTerms : 1;
    // The host's choice, never beyond what the rows and operand type allow.
    layout_ = mma_layout(kFormat, p_.rows, static_cast<MmaLayout>(p_.mma_layout));
    static_assert(kType == MmaType::f16 || mma_layout(kFormat, 1) == MmaLayout::plain);
    for (int e = threadIdx.x; e < kKSteps * 32; e += kThreads) {
      const int j = e / 32, l = e - j * 32, gid = l >> 2, tid = l & 3;
      const int c[4] = {k_channel(tid, j, 0), k_channel(tid, j, 1), k_channel(tid, j, 2),
                        k_channel(tid, j, 3)};
      const float* row0 = q_values_ + gid * kHeadDim;
      const float* row1 = row0 + 8 * kHeadDim;
      if (layout_ == MmaLayout::stacked) {  // row gid's terms 0, 1 in M rows gid, gid + 8
        std::uint32_t low[2], high[2];
        split2<kType, 2>(row0[c[0]] * q_scale, row0[c[1]] * q_scale, low);
        split2<kType, 2>(row0[c[2]] * q_scale, row0[c[3]] * q_scale, high);
        std::uint32_t* to = q_frags_ + (j * 32 + l) * 4;
        to[0] = low[0], to[1] = low[1], to[2] = high[0], to[3] = high[1];
        continue;
      }
      if (layout_ == MmaLayout::tokens_on_m) {  // B fragments: N column gid is row gid / 2's
        const float* row = q_values_ + (gid >> 1) * kHeadDim;  // term gid % 2
        std::uint32_t low[2], high[2];
        split2<kType, 2>(row[c[0]] * q_scale, row[c[1]] * q_scale, low);
        split2<kType, 2>(row[c[2]] * q_scale, row[c[3]] * q_scale, high);
        std::uint32_t* to = q_frags_ + (j * 32 + l) * 4;
        to[0] = low[gid & 1], to[1] = high[gid & 1];
        continue;
      }
      std::uint32_t regs[4][kTerms];
      split2<kType, kTerms>(row0[c[0]] * q_scale, row0[c[1]] * q_scale, regs[0]);
      split2<kType, kTerms>(row1[c[0]] * q_scale, row1[c[1]] * q_scale, regs[1]);
      split2<kType, kTerms>(row0[c[2]] * q_scale, row0[c[3]] * q_scale, regs[2]);
      split2<kType, kTerms>(row1[c[2]] * q_scale, row1[c[3]] * q_scale, regs[3]);
      for (int t = 0; t < kTerms; ++t) {
        std::uint32_t* to = q_frags_ + ((t * kKSteps + j) * 32 + l) * 4;
        for (int i = 0; i < 4; ++i) to[i] = regs[i][t];
      }
    }
    __syncthreads();
  }

  // Loads the step at `first`; positions past the range read its last row (masked later).
  // A whole step inside one page (the common case: pages of 16 tokens or more, items starting on
  // a multiple of 16) reads its page number once and addresses each row by a 32-bit offset in
  // the page; otherwise every row is looked up on its own (kv_row). By the SASS of fp8 at D 128,
  // the per-row lookups and 64-bit products took about 140 of the step loop's 450 instructions.
  __device__ void load_step(int first, StepData& data) const {
    if (one_page_steps_ && first + kStep <= item_.kv_end) {
      const std::int64_t page = pages_[first >> p_.page_shift];
      const std::uint8_t* k_page = k_head_ + page * p_.page_stride;
      const std::uint8_t* v_page = k_page + p_.kv_stride;
      // Unsigned: added to the pointers without sign extension.
      const std::uint32_t first_offset = std::uint32_t(first & (p_.page_size - 1)) * token_stride_;
      load_rows(data, [&](int offset, int kv) {
        return (kv == 0 ? k_page : v_page) + (first_offset + std::uint32_t(offset) * token_stride_);
      });
    } else {
      const int last_position = item_.kv_end - 1;
      load_rows(data,
                [&](int offset, int kv) { return kv_row(min(first + offset, last_position), kv); });
    }
  }

  // Each warp takes every fourth step. With kPrefetch, the next step's rows are loaded before
  // this one is computed, so twice the bytes are in flight per warp (fp8 rows are half as wide
  // as 16-bit ones, and their registers allow it).
  template <MmaLayout kLayout>
  __device__ void walk(WarpState& s) const {
    const int warp = threadIdx.x >> 5, gid = lane() >> 2;
#pragma unroll
    for (int n = 0; n < kNBlocks; ++n) {
      for (int i = 0; i < 4; ++i) s.o[n][i] = 0.0f;
    }
    // The last position each of the lane's rows may see (causal), inside the item's range; -1
    // for rows past q_len * g.
    int visible[2];
    for (int ri = 0; ri < 2; ++ri) {
      // tokens_on_m: the lane's one row is tid (its N columns 2tid, 2tid + 1).
      const int r =
          kLayout == MmaLayout::tokens_on_m ? (ri == 0 ? (lane() & 3) : kMmaRows) : gid + 8 * ri;
      s.m[ri] = -INFINITY;
      s.l[ri] = 0.0f;
      const int last = p_.causal ? seq_len_ - p_.q_len + r / p_.group : seq_len_ - 1;
      visible[ri] = r < p_.rows ? min(last, item_.kv_end - 1) : -1;
    }
    const auto consume = [&](int step_first, const StepData& data) {
      if constexpr (kLayout == MmaLayout::tokens_on_m) {
        consume_tokens_on_m_step(step_first, data, visible[0], s);
      } else if constexpr (kLayout == MmaLayout::stacked) {
        consume_stacked_step(step_first, data, visible[0], s);
      } else {
        consume_step(step_first, data, visible, s);
      }
    };
    constexpr int kStride = kWarps * kStep;
    int first = item_.kv_begin + warp * kStep;
    if constexpr (kPrefetch) {
      StepData current;
      if (first < item_.kv_end) load_step(first, current);
      for (; first < item_.kv_end; first += kStride) {
        StepData next;
        if (first + kStride < item_.kv_end) load_step(first + kStride, next);
        consume(first, current);
        current = next;
      }
    } else {
      for (; first < item_.kv_end; first += kStride) {
        StepData current;
        load_step(first, current);
        consume(first, current);
      }
    }
  }

  // One row's online-softmax update from the lane's scores of a step (scaled, -inf where masked)
  // and the row's maximum over them: the scores become P = exp2(x - m_new), the lane's sum of
  // them joins l, and the returned factor rescales the row's O (1 while the row has seen nothing,
  // 0 at its first scores).
  template <int kCount>
  __device__ static float online_softmax(float (&x)[kCount], float row_max, float& m, float& l) {
    const float m_new = fmaxf(m, row_max);
    float sum = 0.0f;
    for (float& v : x) {
      v = m_new == -INFINITY ? 0.0f : exp2_flush(v - m_new);  // masked: exp2(-inf) = 0
      sum += v;
    }
    const float alpha = m_new == -INFINITY ? 1.0f : exp2_flush(m - m_new);
    l = l * alpha + sum;
    m = m_new;
    return alpha;
  }

  // One step of 16 tokens in the plain layout (mma_layout_plain.cuh): S = Q K^T, the online
  // softmax, O += P V.
  __device__ void consume_step(int first, const StepData& data, const int (&visible)[2],
                               WarpState& s) const;

  // consume_step with stacked terms (mma_layout_stacked.cuh).
  __device__ void consume_stacked_step(int first, const StepData& data, int visible,
                                       WarpState& s) const;

  // consume_step with tokens on M (mma_layout_tokens_on_m.cuh).
  __device__ void consume_tokens_on_m_step(int first, const StepData& data, int visible,
                                           WarpState& s) const;

  // A warp's state into the merge buffers, query rows on M (mma_layout_plain.cuh).
  __device__ void publish_rows_on_m(WarpState& s);

  // A warp's state into the merge buffers, tokens on M (mma_layout_tokens_on_m.cuh).
  __device__ void publish_tokens_on_m(WarpState& s);

  // The four warps' states merged per row (the LSE merge of step 6 inside the CTA), then
  // step 5: o = acc * v_scale / l, lse = (m + log2 l) * ln 2; rows that saw nothing: O = 0,
  // LSE = -inf; poisoned rows that saw a token (a non-finite q, score, or V value in O): NaN.
  __device__ void merge_and_write(WarpState& s) {
    if (layout_ == MmaLayout::tokens_on_m) {
      publish_tokens_on_m(s);
    } else {
      publish_rows_on_m(s);
    }
    __syncthreads();
    // A non-finite V value shows in a warp's O: a warp per row looks.
    for (int r = threadIdx.x >> 5; r < p_.rows; r += kWarps) {
      bool non_finite = false;
      for (int e = lane(); e < kWarps * kHeadDim; e += 32) {
        const int w = e / kHeadDim, c = e - w * kHeadDim;
        non_finite |= !isfinite(merge_o_[(w * kMmaRows + r) * kHeadDim + c]);
      }
      if (__any_sync(0xffffffffu, non_finite) && lane() == 0) poisoned_[r] = 1.0f;
    }
    __syncthreads();
    // Per row: the warps' weights exp2(m_w - M) / L, kept in row_weight_.
    for (int r = threadIdx.x; r < p_.rows; r += kThreads) {
      float m = -INFINITY;
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge_m_[w * kMmaRows + r]);
      float weights[kWarps], total = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        weights[w] = m == -INFINITY ? 0.0f : exp2f(merge_m_[w * kMmaRows + r] - m);
        total += weights[w] * merge_l_[w * kMmaRows + r];
      }
      // A warp that saw a non-finite score left l NaN (its weight may be 0: m is the max).
      bool nan_l = false;
      for (int w = 0; w < kWarps; ++w) nan_l |= isnan(merge_l_[w * kMmaRows + r]);
      const bool seen = total != 0.0f || nan_l;
      if (seen && (nan_l || isnan(total) || poisoned_[r] != 0.0f)) {
        for (int w = 0; w < kWarps; ++w) row_weight_[w * kMmaRows + r] = NAN;
        if (float* lse = lse_slot(r)) *lse = NAN;
        continue;
      }
      const float inv_l = total > 0.0f ? __fdiv_rn(1.0f, total) : 0.0f;
      for (int w = 0; w < kWarps; ++w) row_weight_[w * kMmaRows + r] = weights[w] * inv_l;
      if (float* lse = lse_slot(r)) *lse = total > 0.0f ? (m + log2f(total)) * kLn2 : -INFINITY;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < p_.rows * kHeadDim; e += kThreads) {
      const int r = e / kHeadDim, c = e - r * kHeadDim;
      float acc = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        acc += row_weight_[w * kMmaRows + r] * merge_o_[(w * kMmaRows + r) * kHeadDim + c];
      }
      output_row(r)[c] = acc * v_scale_at(c) * kValueScale;
    }
  }

  float* q_values_ = nullptr;
  std::uint32_t* q_frags_ = nullptr;
  float* merge_o_ = nullptr;
  float* merge_m_ = nullptr;
  float* merge_l_ = nullptr;
  float* row_weight_ = nullptr;
  float* poisoned_ = nullptr;
  float* reduce_ = nullptr;
  float score_scale_ = 0.0f;
  int q_terms_ = 1;
  // load_step's one-page path: whether every whole step lies in one page, the item's K rows
  // at page 0 and the token stride, whose products within a page fit 32 bits when it is taken.
  bool one_page_steps_ = false;
  const std::uint8_t* k_head_ = nullptr;
  std::uint32_t token_stride_ = 0;
  MmaLayout layout_ = MmaLayout::plain;  // mma_layout(): which consume_*_step walks the item
};

}  // namespace mjolnir::cuda

#include "cuda/mma_layout_plain.cuh"
#include "cuda/mma_layout_stacked.cuh"
#include "cuda/mma_layout_tokens_on_m.cuh"

namespace mjolnir::cuda {

// One CTA per work item of a fixed grid, as decode_kernel. At D <= 128, three CTAs per SM, as
// the first (plain-only) kernel measured on an H200 had: left free, ptxas gives the three-layout
// kernel more registers (192 at fp8 D 128), which fits only two CTAs, a third fewer loads in
// flight; capped at 168 it spills 4 bytes at fp8 D 128 and nothing elsewhere. At D 256 the cap
// would spill hundreds of bytes.
template <Format kFormat, int kHeadDim>
__global__ void __launch_bounds__(kMmaThreads, kHeadDim <= 128 ? 3 : 1)
    decode_mma_kernel(const DecodeKernelParams p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  run_work_item<MmaDecodeCta<kFormat, kHeadDim>>(p, smem);
}

// The body's instantiations: calls visit.template operator()<kFormat, kHeadDim>() for a format
// and head dimension it takes (make_decode_config() picks it only for those); throws otherwise.
template <typename Visit>
void with_mma_shape(Format format, int head_dim, Visit&& visit) {
  MJOLNIR_REQUIRE(mma_shape(format, head_dim), "cuda: no tensor-core body for ", to_string(format),
                  " at head_dim ", head_dim);
  auto dim = [&]<Format kFormat>() {
    if (head_dim == 128) return visit.template operator()<kFormat, 128>();
    if (head_dim == 256) return visit.template operator()<kFormat, 256>();
    if constexpr (mma_shape(kFormat, 64)) return visit.template operator()<kFormat, 64>();
  };
  with_format(format, dim);
}

}  // namespace mjolnir::cuda
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
#pragma once

#include <cstdint>

#include "cuda/decode_item.cuh"
#include "cuda/decode_params.h"
#include "cuda/format_dispatch.h"
#include "cuda/kv_codec.cuh"
#include "cuda/mma_fragments.cuh"
#include "mjolnir/error.h"

namespace mjolnir::cuda {

template <Format kFormat, int kHeadDim>
class MmaDecodeCta : DecodeItem {
 public:
  static constexpr int kThreads = kMmaThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kStep = kMmaStepTokens;
  static constexpr MmaType kType = kFormat == Format::bf16 ? MmaType::bf16 : MmaType::f16;
  static constexpr int kTerms = kType == MmaType::f16 ? 2 : 3;
  static constexpr int kBits = kFormatFacts<kFormat>.element_bits();
  static constexpr int kElementBytes = kBits / 8;  // 0 for the 4- and 6-bit formats
  static constexpr bool kPacked = kBits < 8;       // contiguous K slices, codes placed into f16
  static constexpr bool kNibbles = kBits == 4;     // fp4_e2m1, nvfp4
  static constexpr bool kSixBit = kBits == 6;      // fp6_e2m3, fp6_e3m2: 4 codes in 3 bytes
  static constexpr bool kBlockScaled = kFormatFacts<kFormat>.has_block_scales();
  static constexpr int kKSteps = kHeadDim / 16;  // k-steps of the QK product
  static constexpr int kNBlocks = kHeadDim / 8;  // n-blocks of the O tile
  static constexpr int kMTiles = kHeadDim / 16;  // M tiles of O^T (tokens_on_m), in o[0..)
  static constexpr int kKSliceBytes = kHeadDim / 4 * kBits / 8;  // a lane's K slice: D/4 channels
  static constexpr int kVSliceBytes = kHeadDim / 8 * kBits / 8;  // a lane's V slice: D/8 channels
  static constexpr int kKWords = kKSliceBytes / 4;
  static constexpr int kVWords = kVSliceBytes / 4;
  // Load widths: the largest that divides the slice (and its offsets) and the row alignment
  // (nvfp4 rows, D/2 code bytes and D/16 scales, are 72 bytes at D 128: 8-byte aligned).
  static constexpr int load_width(int slice_bytes) {
    int width = mma_row_alignment(kFormat);
    while (slice_bytes % width != 0) width /= 2;
    return width;
  }
  static constexpr int kKLoadBytes = load_width(kKSliceBytes);
  static constexpr int kVLoadBytes = load_width(kVSliceBytes);
  // 4- and 6-bit codes become f16 by placing their bits (subnormals included): the code's value
  // times 2^-14 (e2m1, e2m3) or 2^-12 (e3m2), exactly. The inverse is multiplied back into the
  // score scale and the output.
  static constexpr float kValueScale = kFormat == Format::fp6_e3m2 ? 4096.0f
                                       : kPacked                   ? 16384.0f
                                                                   : 1.0f;
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

  __device__ static int lane() { return threadIdx.x & 31; }

  // The channel of value i of k-step j of lane tid, in the order of k_operand: i = 2r + h is
  // register r's (b0, b1) half h. 8- and 16-bit formats: four consecutive channels. 4-bit
  // formats: k-step j takes the even (j even) or odd codes of its slice's word j / 2, paired
  // (code p, p + 4) in b0 and (p + 2, p + 6) in b1, p = j % 2: one e2m1_bytes per k-step, then
  // a logic operation per pair (and a shift for b0). fp6: codes m and m + 16 of a 32-code block
  // of the slice are 96 bits, three words, apart, at the same bit of their words, so one byte
  // permute brings both together (fp6_pair); k-step j takes the pairs m = 2j and 2j + 1 of
  // block j / 8 (j % 8 in the formula).
  __device__ static int k_channel(int tid, int j, int i) {
    const int slice = tid * (kHeadDim / 4);
    if constexpr (kNibbles) {
      return slice + 8 * (j >> 1) + (j & 1) + 2 * (i >> 1) + 4 * (i & 1);
    } else if constexpr (kSixBit) {
      return slice + 32 * (j >> 3) + 2 * (j & 7) + (i >> 1) + 16 * (i & 1);
    } else {
      return k_slice_byte(tid, kElementBytes == 1 ? j : 2 * j) / kElementBytes + i;
    }
  }

  // Byte offset in a K row of word w of lane tid's slice (8- and 16-bit formats): 16-byte chunks,
  // the quad's four lanes side by side in each 64 bytes, so one load instruction reads whole
  // 32-byte sectors.
  __device__ static int k_slice_byte(int tid, int w) {
    return (w >> 2) * 64 + tid * 16 + (w & 3) * 4;
  }

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

  // kWords words of row memory, in loads of kChunk bytes (16, 8 or 4; at most the size).
  template <int kChunk, int kWords>
  __device__ static void load_words(const std::uint8_t* from, std::uint32_t (&words)[kWords]) {
#if defined(MJOLNIR_CUDA_EMULATION)
    std::memcpy(words, from, sizeof(words));
#else
    constexpr int kStep = kChunk < 4 * kWords ? kChunk / 4 : kWords;  // words per load
#pragma unroll
    for (int i = 0; i < kWords; i += kStep) {
      if constexpr (kStep == 4) {
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(from + 4 * i));
        words[i] = x.x, words[i + 1] = x.y, words[i + 2] = x.z, words[i + 3] = x.w;
      } else if constexpr (kStep == 2) {
        const uint2 x = __ldg(reinterpret_cast<const uint2*>(from + 4 * i));
        words[i] = x.x, words[i + 1] = x.y;
      } else {
        words[i] = __ldg(reinterpret_cast<const unsigned*>(from + 4 * i));
      }
    }
#endif
  }

  // `count` bytes (at most 4) from `from`, little-endian, as one word.
  template <int kCount>
  __device__ static std::uint32_t load_bytes(const std::uint8_t* from) {
    std::uint32_t word = 0;
    for (int i = 0; i < kCount; ++i) word |= std::uint32_t(from[i]) << (8 * i);
    return word;
  }

  // Lane tid's K slice of a row: its 16-byte chunks at k_slice_byte(), or (4-bit formats) its
  // contiguous D/8 bytes.
  __device__ static void load_k_slice(const std::uint8_t* row, int tid,
                                      std::uint32_t (&words)[kKWords]) {
    if constexpr (kPacked) {
      load_words<kKLoadBytes>(row + tid * kKSliceBytes, words);
    } else {
#pragma unroll
      for (int chunk = 0; chunk < kKWords / 4; ++chunk) {
        std::uint32_t part[4];
        load_words<kKLoadBytes>(row + k_slice_byte(tid, 4 * chunk), part);
        for (int i = 0; i < 4; ++i) words[4 * chunk + i] = part[i];
      }
    }
  }

  // fp6: the code at `bit` of x's words from wx on (low half) and the code at the same bit of
  // y's words from wy on (high half), as f16x2. A byte permute brings the one or two bytes
  // holding each code together; a code that crosses into the next word (bit 28 or 30) is first
  // funnel-shifted down 16 bits out of its word pair.
  template <int kXWords, int kYWords>
  __device__ static std::uint32_t fp6_pair(const std::uint32_t (&x)[kXWords], int wx,
                                           const std::uint32_t (&y)[kYWords], int wy, int bit) {
    std::uint32_t x_word = x[wx], y_word = y[wy];
    if (bit > 26) {
      x_word = funnel_right(x_word, x[wx + 1], 16);
      y_word = funnel_right(y_word, y[wy + 1], 16);
      bit -= 16;
    }
    const int byte = bit >> 3, within = bit & 7;
    if (within <= 2) {  // in one byte: to bytes 1 and 3, the code at bit 8 + within of each half
      return fp6x2_to_f16x2<kFormat>(byte_perm(x_word, y_word, byte_pair_selector(byte)),
                                     8 + within);
    }
    const std::uint32_t selector = std::uint32_t(byte) | std::uint32_t(byte + 1) << 4 |
                                   std::uint32_t(4 + byte) << 8 | std::uint32_t(5 + byte) << 12;
    return fp6x2_to_f16x2<kFormat>(byte_perm(x_word, y_word, selector), within);
  }

  // nvfp4: the e4m3 block scale `code` (low byte) as an f16x2 of two equal halves.
  __device__ static std::uint32_t scale_pair(std::uint32_t code) {
    return fp8x2_to_f16x2<Format::fp8_e4m3>((code & 0xFFu) * 0x101u);
  }

  // The K operand (b0, b1) of k-step j from a lane's K slice (and, nvfp4, its block scales).
  __device__ static void k_operand(const std::uint32_t (&k)[kKWords], std::uint32_t scales, int j,
                                   std::uint32_t& b0, std::uint32_t& b1) {
    if constexpr (kNibbles) {
      // k_channel's order: codes p, p + 2, p + 4, p + 6 of word j / 2 (p = j % 2) in bytes 0-3;
      // (p, p + 4) shifted to bytes 1 and 3 in b0, (p + 2, p + 6) in b1.
      const std::uint32_t bytes = e2m1_bytes(k[j >> 1], (j & 1) != 0);
      b0 = e2m1x2_from_bytes(bytes << 8);
      b1 = e2m1x2_from_bytes(bytes);
      if constexpr (kBlockScaled) {
        const std::uint32_t scale = scale_pair(scales >> (8 * (j >> 2)));  // 16 channels a block
        b0 = hmul2(b0, scale);
        b1 = hmul2(b1, scale);
      }
    } else if constexpr (kSixBit) {
      // k_channel's order: code pairs (m, m + 16), m = 32 (j / 8) + 2 (j % 8), in b0, and
      // (m + 1, m + 17) in b1. Code m is at bit 6m of the slice; m + 16 three words later.
      const int m = 32 * (j >> 3) + 2 * (j & 7);
      b0 = fp6_pair(k, 6 * m >> 5, k, (6 * m >> 5) + 3, 6 * m & 31);
      b1 = fp6_pair(k, 6 * (m + 1) >> 5, k, (6 * (m + 1) >> 5) + 3, 6 * (m + 1) & 31);
    } else if constexpr (kElementBytes == 1) {
      b0 = fp8x2_to_f16x2<kFormat>(k[j]);
      b1 = fp8x2_high_to_f16x2<kFormat>(k[j]);
    } else {
      b0 = k[2 * j];
      b1 = k[2 * j + 1];
    }
  }

  // The V operand of n-block n: tokens (2tid, 2tid + 1) of the step in b0 and (2tid + 8,
  // 2tid + 9) in b1, at the lane's channel gid * D/8 + n. `first` and `second` are those two
  // tokens' slices.
  __device__ static std::uint32_t v_operand(const std::uint32_t (&first)[kVWords],
                                            const std::uint32_t (&second)[kVWords],
                                            std::uint32_t scales, int n) {
    if constexpr (kNibbles) {
      // Channel n of the slice is code n % 8 of word n / 8: both tokens' codes of its parity in
      // bytes (e2m1_bytes), then byte n % 8 / 2 of each into bytes 1 and 3.
      const int w = n >> 3, byte = (n & 7) >> 1;
      const bool odd = (n & 1) != 0;
      std::uint32_t pair = e2m1x2_from_bytes(byte_perm(
          e2m1_bytes(first[w], odd), e2m1_bytes(second[w], odd), byte_pair_selector(byte)));
      if constexpr (kBlockScaled) {
        // The two tokens' scales of this channel's block, byte (slice offset + n) / 16.
        const int block = ((kHeadDim / 8 * (lane() >> 2)) % 16 + n) / 16;
        pair = hmul2(pair, fp8x2_to_f16x2<Format::fp8_e4m3>((scales >> (16 * block)) & 0xFFFFu));
      }
      return pair;
    } else if constexpr (kSixBit) {
      // Channel n of the slice is the code at its bit 6n, in both tokens' slices.
      return fp6_pair(first, 6 * n >> 5, second, 6 * n >> 5, 6 * n & 31);
    } else if constexpr (kElementBytes == 1) {
      const int w = n >> 2, within = n & 3;
      const std::uint32_t pair = byte_perm(first[w], second[w], within < 2 ? 0x5140u : 0x7362u);
      return (within & 1) != 0 ? fp8x2_high_to_f16x2<kFormat>(pair) : fp8x2_to_f16x2<kFormat>(pair);
    } else {
      const int w = n >> 1;
      return byte_perm(first[w], second[w], (n & 1) != 0 ? 0x7632u : 0x5410u);
    }
  }

  // A step's K and V slices of one lane.
  struct StepData {
    std::uint32_t k[2][kKWords];  // tokens first + kb * 8 + gid
    std::uint32_t v[4][kVWords];  // tokens first + (vt / 2) * 8 + 2 tid + vt % 2
    // nvfp4 block scales: k_scales[kb] the K slice's (byte i: block i of the slice); v_scales[p]
    // the token pair p's (vt 2p, 2p + 1), 16 bits per block: the first token's code low.
    std::uint32_t k_scales[2] = {};
    std::uint32_t v_scales[2] = {};
  };

  // nvfp4: the scale bytes a lane reads per row (its slice's blocks) and where they start.
  static constexpr int kKScaleBytes = kHeadDim / 64;                            // D/4 channels
  static constexpr int kVScaleBytes = kHeadDim / 8 >= 16 ? kHeadDim / 128 : 1;  // D/8 channels

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

  // The step's loads, with `row_at(offset, kv)` the K (kv 0) or V (kv 1) row of the step's
  // position first + offset.
  template <typename RowAt>
  __device__ static void load_rows(StepData& data, const RowAt& row_at) {
    const int gid = lane() >> 2, tid = lane() & 3;
    for (int kb = 0; kb < 2; ++kb) {
      const std::uint8_t* row = row_at(kb * 8 + gid, 0);
      load_k_slice(row, tid, data.k[kb]);
      if constexpr (kBlockScaled) {
        data.k_scales[kb] = load_bytes<kKScaleBytes>(row + kHeadDim / 2 + tid * kKScaleBytes);
      }
    }
    for (int vt = 0; vt < 4; ++vt) {
      const std::uint8_t* row = row_at((vt >> 1) * 8 + tid * 2 + (vt & 1), 1);
      load_words<kVLoadBytes>(row + gid * kVSliceBytes, data.v[vt]);
      if constexpr (kBlockScaled) {
        const std::uint32_t codes =
            load_bytes<kVScaleBytes>(row + kHeadDim / 2 + kHeadDim / 8 * gid / 16);
        // Interleave the pair's codes per block: block i at bits 16i (first) and 16i + 8.
        std::uint32_t& pair = data.v_scales[vt >> 1];
        if ((vt & 1) == 0) pair = 0;
        for (int i = 0; i < kVScaleBytes; ++i) {
          pair |= ((codes >> (8 * i)) & 0xFFu) << (16 * i + 8 * (vt & 1));
        }
      }
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

  // One step of 16 tokens: S = Q K^T, the online softmax, O += P V.
  __device__ void consume_step(int first, const StepData& data, const int (&visible)[2],
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
      float row[4] = {score[0][2 * ri], score[0][2 * ri + 1], score[1][2 * ri],
                      score[1][2 * ri + 1]};
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

  // consume_step with stacked terms (q_len * g <= 8, two f16 terms): each MMA carries both
  // operand terms of the lane's row gid, term 0 in M row gid and term 1 in M row gid + 8, so a
  // step takes half the MMAs of the plain layout, whose rows 8..15 would be empty. The QK
  // accumulators of the two terms are added once per score (as the plain layout adds its
  // per-term accumulators); the PV ones are added once, in merge_and_write.
  __device__ void consume_stacked_step(int first, const StepData& data, int visible,
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

  // consume_step with tokens on M (q_len * g <= 4, two f16 terms): S^T = K Q^T with the step's
  // 16 tokens on M and N column 2r + t holding term t of query row r, then O^T += V^T P^T with
  // 16 channels on M, the tokens on K and the same N columns. Every lane of a quad-column tid
  // works for row tid. Per 16-token step: D/16 MMAs for the scores and D/16 for the values, a
  // quarter of the plain layout's. K and V are the same registers as in the other layouts, in
  // the A operand's places: K tokens gid and gid + 8 as its rows, and V's token pairs at channel
  // gid * D/8 + n as rows gid (n = 2mt) and gid + 8 (n = 2mt + 1) of M tile mt.
  __device__ void consume_tokens_on_m_step(int first, const StepData& data, int visible,
                                           WarpState& s) const {
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

  // A warp's state into the merge buffers: merge_o_ [warp][row][channel], merge_m_ and merge_l_
  // [warp][row]. The layouts with query rows on M (plain, stacked).
  __device__ void publish_rows_on_m(WarpState& s) {
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

  // publish_rows_on_m for tokens on M: lane (gid, tid) holds row tid's terms (c0 + c1 at
  // channel gid * D/8 + 2mt, c2 + c3 at the next one) and its share of row tid's sum.
  __device__ void publish_tokens_on_m(WarpState& s) {
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

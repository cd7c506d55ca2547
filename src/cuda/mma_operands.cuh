// The tensor-core decode body's operands (decode_mma_kernel.cuh): how one lane loads its slices
// of a step's K and V rows and turns the codes into mma.sync B (and, tokens on M, A) fragments, in
// one scheme per packing of the codes: 16-bit (bf16, fp16: the words as they are), 8-bit (fp8:
// the hardware conversion to f16x2), 6-bit (four codes in three bytes: a byte permute per pair,
// fp6_pair) and 4-bit (e2m1 nibbles placed into f16, nvfp4 then times its e4m3 block scales).
// All conversions are exact. The three MMA layouts (mma_layout_*.cuh) share these operands.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda/decode_params.h"
#include "cuda/kv_codec.cuh"
#include "cuda/mma_fragments.cuh"

namespace mjolnir::cuda {

template <Format kFormat, int kHeadDim>
struct MmaOperands {
  static constexpr int kBits = kFormatFacts<kFormat>.element_bits();
  static constexpr int kElementBytes = kBits / 8;  // 0 for the 4- and 6-bit formats
  static constexpr bool kPacked = kBits < 8;       // contiguous K slices, codes placed into f16
  static constexpr bool kNibbles = kBits == 4;     // fp4_e2m1, nvfp4
  static constexpr bool kSixBit = kBits == 6;      // fp6_e2m3, fp6_e3m2: 4 codes in 3 bytes
  static constexpr bool kBlockScaled = kFormatFacts<kFormat>.has_block_scales();
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
};

}  // namespace mjolnir::cuda

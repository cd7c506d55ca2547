// Q . K with AVX-512 BF16 dot products for the CPU kernel (attention_kernel.cc): vdpbf16ps does
// 32 multiply-adds of bf16 pairs into 16 fp32 lanes, twice the rate of fp32 FMAs. It applies where
// both operands are exact in bf16: Q in bf16 or fp8 mode (e4m3 values are bf16 values), and K
// codes of bf16, fp8, fp6, fp4 e2m1 or nvfp4 (every such code's value is a bf16 value; nvfp4's
// block scales multiply the sums of their blocks, see DotNvfp4). Each product of two bf16 values
// is exact in fp32 and the sums are fp32, so the scores differ from the emulator's only in the
// order of their fp32 additions (and, for nvfp4, where the block scale multiplies), as the
// contract allows. (vdpbf16ps treats subnormal inputs and results as zero: the K decoders below
// produce true values, whose smallest, 2^-16 for e5m2, is a normal bf16, and a q or a running sum
// below 2^-126 changes no score.)
//
// Only the AVX3_DL target compiles it (its K decoders into bf16 words, word_decoders-inl.h, need
// AVX512_VBMI), and it runs only on CPUs with AVX512_BF16 too: Zen 4 and later, Sapphire Rapids
// and later. Highway 1.0.3 has no op for vdpbf16ps, so this file uses its intrinsic, with
// Highway's ops for everything else. Per-target header, see kv_decode-inl.h.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(MJOLNIR_CPU_BF16_DOT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_BF16_DOT_INL_H_
#undef MJOLNIR_CPU_BF16_DOT_INL_H_
#else
#define MJOLNIR_CPU_BF16_DOT_INL_H_
#endif

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu/kernel_blocks-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/tile_prefetcher.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"
#include "mjolnir/format.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef MJOLNIR_BF16_DOT
#if MJOLNIR_BF16_WORDS
#define MJOLNIR_BF16_DOT 1

// True when this CPU executes vdpbf16ps and vpermi2b.
inline bool CpuHasBf16Dot() {
  static const bool has =
      __builtin_cpu_supports("avx512bf16") != 0 && __builtin_cpu_supports("avx512vbmi") != 0;
  return has;
}

HWY_PUSH_ATTRIBUTES("avx512bf16")

// acc + sum over word pairs: lane i += a[2i] b[2i] + a[2i+1] b[2i+1].
HWY_INLINE hn::Vec<WideFloatTag> DotPairs(hn::Vec<WideFloatTag> acc, Words a, Words b) {
  acc.raw = _mm512_dpbf16_ps(acc.raw, reinterpret_cast<__m512bh>(a.raw),
                             reinterpret_cast<__m512bh>(b.raw));
  return acc;
}

// The dot decoder of an fp32 decoder's format, or void where Q . K stays on fp32 FMAs.
template <class Decoder>
struct DotDecoderOf {
  using type = void;
};
template <>
struct DotDecoderOf<DecodeBf16> {
  using type = DotBf16;
};
// The fp8 and fp6 kernel decoders (VisitKernelDecoder) are their word decoders widened.
template <class W>
struct DotDecoderOf<DecodeViaWords<W>> {
  using type = W;
};
template <>
struct DotDecoderOf<DecodeE2M1> {
  using type = DotE2M1;
};
template <>
struct DotDecoderOf<DecodeNvfp4> {
  using type = DotNvfp4;
};

// The channel order of Dot's two word vectors as vpermt2w indices into a chunk's words in
// natural order (0..31 in the first source, 32..63 in the second): index[j][w] = Channel(j, w).
template <class Dot>
struct DotChannelIndex {
  alignas(64) std::array<std::uint16_t, 32> index[2]{};
  constexpr DotChannelIndex() {
    for (std::size_t j = 0; j < 2; ++j) {
      for (std::size_t w = 0; w < 32; ++w) {
        index[j][w] = static_cast<std::uint16_t>(Dot::Channel(j, w));
      }
    }
  }
};

// q_words [R][2 ld] (bf16 words in Dot's channel order) from qn [R][D] (natural order, every
// value a bf16 value: Q in bf16 or fp8 mode). Per chunk of 64 channels: the floats' high halves
// (their bf16 words, exactly), narrowed to words in natural order, then one two-source word
// permute per vector. It runs for every head of every work unit, so at short contexts its cost
// is a visible part of a step (a scalar loop was a third of a 16-token step on Zen 4).
template <class Dot>
void PrepareDotQuery(const float* HWY_RESTRICT qn, int rows, std::size_t d, std::size_t ld,
                     std::uint16_t* HWY_RESTRICT q_words) {
  static constexpr DotChannelIndex<Dot> kOrder;
  const WordTag dw;
  const Words index0 = hn::Load(dw, kOrder.index[0].data());
  const Words index1 = hn::Load(dw, kOrder.index[1].data());
  const auto high_words = [](const float* x) HWY_ATTR {  // 16 floats' bf16 words
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_loadu_si512(x), 16));
  };
  for (int r = 0; r < rows; ++r) {
    const float* src = qn + std::size_t(r) * d;
    std::uint16_t* dst = q_words + std::size_t(r) * 2 * ld;
    for (std::size_t c = 0; c < d; c += kDotChunk) {
      const __m512i natural0 = _mm512_inserti64x4(_mm512_castsi256_si512(high_words(src + c)),
                                                  high_words(src + c + 16), 1);
      const __m512i natural1 = _mm512_inserti64x4(_mm512_castsi256_si512(high_words(src + c + 32)),
                                                  high_words(src + c + 48), 1);
      hn::Store(Words{_mm512_permutex2var_epi16(natural0, index0.raw, natural1)}, dw, dst + c);
      hn::Store(Words{_mm512_permutex2var_epi16(natural0, index1.raw, natural1)}, dw, dst + c + 32);
    }
  }
}

// Scores of kRows query rows (qs words apart) against the 4 K rows k[0..3]: kRows x 4
// accumulators, each K chunk decoded once for all rows and each Q vector loaded once for the 4
// keys. Writes scale times row r's sum for key i to out[r * stride + i].
template <class Dot, int kRows>
HWY_INLINE void DotBlock(const std::uint16_t* HWY_RESTRICT q, std::size_t qs, std::size_t d,
                         const std::uint8_t* const* k, const typename Dot::State& state,
                         float scale, float* out, std::size_t stride) {
  const WideFloatTag df;
  const WordTag dw;
  hn::Vec<WideFloatTag> a[kRows][4];
  for (auto& row : a) {
    for (auto& acc : row) acc = hn::Zero(df);
  }
  if constexpr (std::is_same_v<Dot, DotNvfp4>) {
    // Key by key, the Q vectors taken from L1 as the dot products' memory operands and each
    // chunk's scale vectors from a small buffer filled once per 16 blocks: 4 keys' codes, scales
    // and sums would not fit in the registers beside the 16 accumulators.
    alignas(64) float chunk_scales[4][4][16];  // [key][chunk of the group][lane]
    const std::size_t chunks = d / kDotChunk;
    for (std::size_t c0 = 0; c0 < chunks; c0 += 4) {
      const std::size_t group_chunks = chunks - c0 < 4 ? chunks - c0 : 4;
      for (int i = 0; i < 4; ++i) {
        const auto group_scales = Dot::GroupScales(k[i], c0 / 4, d);
        for (std::size_t cc = 0; cc < group_chunks; ++cc) {
          hn::Store(Dot::ChunkScales(group_scales, cc), df, chunk_scales[i][cc]);
        }
      }
      for (std::size_t cc = 0; cc < group_chunks; ++cc) {
        const std::size_t c = c0 + cc;
        for (int i = 0; i < 4; ++i) {
          Words x0, x1;
          Dot::Decode(state, k[i], c, x0, x1);
          const auto scales = hn::Load(df, chunk_scales[i][cc]);
          for (int r = 0; r < kRows; ++r) {
            const std::uint16_t* qr = q + r * qs + c * kDotChunk;
            const auto sum =
                DotPairs(DotPairs(hn::Zero(df), hn::Load(dw, qr), x0), hn::Load(dw, qr + 32), x1);
            a[r][i] = hn::MulAdd(sum, scales, a[r][i]);
          }
        }
      }
    }
  } else {
    for (std::size_t c = 0; c < d / kDotChunk; ++c) {
      Words x0[4], x1[4];
      for (int i = 0; i < 4; ++i) Dot::Decode(state, k[i], c, x0[i], x1[i]);
      for (int r = 0; r < kRows; ++r) {
        const std::uint16_t* qr = q + r * qs + c * kDotChunk;
        const Words q0 = hn::Load(dw, qr);
        for (int i = 0; i < 4; ++i) a[r][i] = DotPairs(a[r][i], q0, x0[i]);
        const Words q1 = hn::Load(dw, qr + 32);
        for (int i = 0; i < 4; ++i) a[r][i] = DotPairs(a[r][i], q1, x1[i]);
      }
    }
  }
  if constexpr (kRows == 4) {
    StoreSums4x4(df, a, scale, out, stride);
  } else {
    const Float4 sums = Reduce4(df, a[0][0], a[0][1], a[0][2], a[0][3]);
    hn::StoreU(hn::Mul(sums, hn::Set(Float4Tag(), scale)), Float4Tag(), out);
  }
}

// The count K rows at bases[t] + offset decoded into Dot's words, row t at out + t * stride
// (64-byte aligned; d / 64 chunks of two 64-byte vectors), which ScoresDot<DotBf16> then reads as
// they are: a unit of many query rows (a prompt's query tile) decodes each key of a tile once
// instead of once per block of 4 rows. Q is in Dot's word order already (PrepareDotQuery), and so
// are the stored words. Not inlined, as ScoresDot.
template <class Dot>
HWY_NOINLINE void DecodeWordRows(const std::uint8_t* const* bases, std::int64_t offset, int count,
                                 std::size_t d, std::uint8_t* HWY_RESTRICT out,
                                 std::size_t stride) {
  const WordTag dw;
  const auto state = Dot::MakeState();
  for (int t = 0; t < count; ++t) {
    const std::uint8_t* row = bases[t] + offset;
    std::uint8_t* words = out + std::size_t(t) * stride;
    for (std::size_t c = 0; c < d / kDotChunk; ++c) {
      Words x0, x1;
      Dot::Decode(state, row, c, x0, x1);
      hn::Store(x0, dw, reinterpret_cast<std::uint16_t*>(words + c * 128));
      hn::Store(x1, dw, reinterpret_cast<std::uint16_t*>(words + c * 128 + 64));
    }
  }
}

// scores[r][t] = scale * q_r . k_t for the count K rows at bases[t] + offset, as ScoresFast does
// it with fp32 FMAs (fast_scores-inl.h); q_words from PrepareDotQuery. Keys go in groups of
// 4; a group of fewer repeats its last key and writes up to 3 scores past `count`, inside each
// scores row's padding (the softmax overwrites them). Not inlined: its callers are compiled
// without AVX512_BF16.
template <class Dot>
HWY_NOINLINE void ScoresDot(const std::uint16_t* HWY_RESTRICT q_words, std::size_t qs, int rows,
                            std::size_t d, const std::uint8_t* const* bases, std::int64_t offset,
                            int count, float scale, float* HWY_RESTRICT scores, std::size_t stride,
                            TilePrefetcher& prefetch, int prefetch_per_key) {
  const auto state = Dot::MakeState();
  for (int t = 0; t < count; t += 4) {
    const int keys = count - t < 4 ? count - t : 4;
    prefetch.Issue(keys * prefetch_per_key);
    const std::uint8_t* k[4];
    for (int i = 0; i < 4; ++i) k[i] = bases[t + (i < keys ? i : keys - 1)] + offset;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      DotBlock<Dot, 4>(q_words + r * qs, qs, d, k, state, scale, scores + r * stride + t, stride);
    }
    for (; r < rows; ++r) {
      DotBlock<Dot, 1>(q_words + r * qs, qs, d, k, state, scale, scores + r * stride + t, stride);
    }
  }
}

HWY_POP_ATTRIBUTES

#else
#define MJOLNIR_BF16_DOT 0
#endif  // AVX-512 targets

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_BF16_DOT_INL_H_

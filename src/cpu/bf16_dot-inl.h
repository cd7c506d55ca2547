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
// Only AVX-512 targets compile it, and it runs only on CPUs with AVX512_BF16 and AVX512_VBMI
// (the fp8 and fp6 decoders look codes up with vpermi2b / vpermb): Zen 4 and later, Sapphire Rapids
// and later. Highway 1.0.3 has no op for either instruction, so this file uses their intrinsics,
// with Highway's ops for everything else. Per-target header, see kv_decode-inl.h.

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

#include "core/minifloat.h"
#include "cpu/kernel_blocks-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/tile_prefetcher.h"
#include "hwy/highway.h"
#include "mjolnir/format.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef MJOLNIR_BF16_DOT
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define MJOLNIR_BF16_DOT 1

// True when this CPU executes vdpbf16ps and vpermi2b.
inline bool CpuHasBf16Dot() {
  static const bool has =
      __builtin_cpu_supports("avx512bf16") != 0 && __builtin_cpu_supports("avx512vbmi") != 0;
  return has;
}

HWY_PUSH_ATTRIBUTES("avx512bf16,avx512vbmi")

using WordTag = hn::Repartition<std::uint16_t, WideFloatTag>;  // 32 bf16 words
using Words = hn::Vec<WordTag>;

// acc + sum over word pairs: lane i += a[2i] b[2i] + a[2i+1] b[2i+1].
HWY_INLINE hn::Vec<WideFloatTag> DotPairs(hn::Vec<WideFloatTag> acc, Words a, Words b) {
  acc.raw = _mm512_dpbf16_ps(acc.raw, reinterpret_cast<__m512bh>(a.raw),
                             reinterpret_cast<__m512bh>(b.raw));
  return acc;
}

// --- K decoders into bf16 words ------------------------------------------------------------
// Each works in chunks of 64 channels, two vectors of 32 words; Channel(j, w) is the channel
// (within the chunk) of word w of vector j. Q is laid out in the same order once per item.

// bf16 rows are bf16 words already: natural order, nothing to decode.
struct DotBf16 {
  struct State {};
  static HWY_INLINE State MakeState() { return {}; }
  static HWY_INLINE void Decode(const State&, const std::uint8_t* row, std::size_t chunk, Words& x0,
                                Words& x1) {
    const WordTag dw;
    x0 = LoadBytesAs(dw, row + chunk * 128);
    x1 = LoadBytesAs(dw, row + chunk * 128 + 64);
  }
  static constexpr std::size_t Channel(std::size_t j, std::size_t w) { return 32 * j + w; }
};

// High and low bytes of the bf16 value of every magnitude code (sign bit clear) of an 8-bit
// format; codes past the largest finite one (NaN, Inf) never reach a cache, and take the largest.
template <MinifloatSpec kSpec>
struct Fp8Bf16Table {
  alignas(64) std::array<std::uint8_t, 128> high{}, low{};
  constexpr Fp8Bf16Table() {
    for (std::uint32_t code = 0; code < 128; ++code) {
      const std::uint32_t finite = code <= kSpec.max_finite_code() ? code : kSpec.max_finite_code();
      const std::uint32_t bits = minifloat_detail::bits_from_float(decode_minifloat<kSpec>(finite));
      if ((bits & 0xFFFFu) != 0) throw "an fp8 value that is not a bf16 value";
      high[code] = static_cast<std::uint8_t>(bits >> 24);
      low[code] = static_cast<std::uint8_t>(bits >> 16);
    }
  }
};

// fp8 (e4m3, e5m2): 64 codes per chunk. Two vpermi2b look up the high and low bytes of each
// code's magnitude (they index with the low 7 bits, so the sign bit is ignored), a ternary-logic
// op puts the sign back into the high byte, and two byte unpacks pair the bytes into words:
// 5 ops per 64 channels, against 12 for the fp32 decoder (kv_decode-inl.h). The unpacks work
// within 128-bit blocks: word w of vector j is channel 16 (w / 8) + 8 j + w % 8.
template <MinifloatSpec kSpec>
struct DotFp8 {
  struct State {
    hn::Vec<hn::Repartition<std::uint8_t, WideFloatTag>> high0, high1, low0, low1, sign;
  };
  static HWY_INLINE State MakeState() {
    static constexpr Fp8Bf16Table<kSpec> kTable;
    const hn::Repartition<std::uint8_t, WideFloatTag> d8;
    return {hn::Load(d8, kTable.high.data()), hn::Load(d8, kTable.high.data() + 64),
            hn::Load(d8, kTable.low.data()), hn::Load(d8, kTable.low.data() + 64),
            hn::Set(d8, 0x80)};
  }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                Words& x0, Words& x1) {
    const hn::Repartition<std::uint8_t, WideFloatTag> d8;
    const WordTag dw;
    const __m512i codes = hn::LoadU(d8, row + chunk * 64).raw;
    const __m512i high = _mm512_permutex2var_epi8(s.high0.raw, codes, s.high1.raw);
    const __m512i low = _mm512_permutex2var_epi8(s.low0.raw, codes, s.low1.raw);
    // high | (codes & 0x80): truth table 0xF8 over (high, codes, sign mask).
    const __m512i signed_high = _mm512_ternarylogic_epi32(high, codes, s.sign.raw, 0xF8);
    x0 = hn::BitCast(dw, hn::Vec<decltype(d8)>{_mm512_unpacklo_epi8(low, signed_high)});
    x1 = hn::BitCast(dw, hn::Vec<decltype(d8)>{_mm512_unpackhi_epi8(low, signed_high)});
  }
  static constexpr std::size_t Channel(std::size_t j, std::size_t w) {
    return 16 * (w / 8) + 8 * j + w % 8;
  }
};

// bf16 bits of every code of a format of up to 6 bits (sign included), `count` entries: code
// i % 2^bits, so a lookup may ignore the index bits above the code's.
template <MinifloatSpec kSpec, std::size_t kCount>
struct SmallBf16Table {
  alignas(64) std::array<std::uint16_t, kCount> words{};
  constexpr SmallBf16Table() {
    for (std::uint32_t i = 0; i < kCount; ++i) {
      const std::uint32_t code = i % (1u << kSpec.total_bits());
      const std::uint32_t bits = minifloat_detail::bits_from_float(decode_minifloat<kSpec>(code));
      if ((bits & 0xFFFFu) != 0) throw "a code whose value is not a bf16 value";
      words[i] = static_cast<std::uint16_t>(bits >> 16);
    }
  }
};

// fp4 e2m1: 64 codes (32 bytes) per chunk. The bytes are widened to words, and one vpermw looks
// each word's low nibble up in a 32-entry table (which repeats its 16 codes, so the bit above the
// nibble does not matter); the high nibbles, shifted down, take a second lookup. 4 ops per 64
// channels. Vector 0 holds the even channels, vector 1 the odd ones.
struct DotE2M1 {
  struct State {
    Words table;
  };
  static HWY_INLINE State MakeState() {
    static constexpr SmallBf16Table<kE2M1Spec, 32> kTable;
    return {hn::Load(WordTag(), kTable.words.data())};
  }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                Words& x0, Words& x1) {
    const hn::Repartition<std::uint8_t, hn::Half<WideFloatTag>> d8;  // 32 bytes
    const __m512i words = _mm512_cvtepu8_epi16(hn::LoadU(d8, row + chunk * 32).raw);
    x0.raw = _mm512_permutexvar_epi16(words, s.table.raw);
    x1.raw = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), s.table.raw);
  }
  static constexpr std::size_t Channel(std::size_t j, std::size_t w) { return 2 * w + j; }
};

// nvfp4: the e2m1 codes as DotE2M1 decodes them, each 16-channel block times its e4m3 scale
// (one byte per block, after the D / 2 code bytes). The products e2m1 x scale are bf16 values
// too, but forming them would take a multiply per code; the scales multiply the dot products'
// sums instead. Lane i of a chunk's two vectors sums channels 4i .. 4i + 3 (Channel: 2w + j),
// all of block 4 chunk + i / 4, so a (row, key, chunk) takes two dot products into a zeroed sum
// and one FMA by the chunk's scale vector, against 4 FMAs on the fp32 path, and no decode of the
// codes to fp32.
struct DotNvfp4 : DotE2M1 {
  // The true values of the scales of blocks [16 group, 16 group + 16) of a row of d channels, in
  // lanes 0..15 (lanes past the row's last block are zero: the masked load reads nothing past
  // the row).
  static HWY_INLINE hn::Vec<WideFloatTag> GroupScales(const std::uint8_t* row, std::size_t group,
                                                      std::size_t d) {
    const WideFloatTag df;
    const hn::RebindToUnsigned<WideFloatTag> du;
    const hn::Rebind<std::uint8_t, WideFloatTag> d8;
    const std::size_t blocks = d / kNvfp4BlockSize - 16 * group;
    const auto mask = static_cast<__mmask16>(blocks >= 16 ? 0xFFFFu : (1u << blocks) - 1);
    const auto b = hn::PromoteTo(
        du, hn::Vec<decltype(d8)>{_mm_maskz_loadu_epi8(mask, row + d / 2 + 16 * group)});
    // S.EEEE.MMM with exponent and mantissa at fp32 bit 20 and the sign at bit 31 is 2^-120
    // times the value, subnormals included (as fp32 subnormals, exact); the FMA by 2^120 (an FMA
    // takes subnormal operands at full speed) gives the value. S.1111.111 is NaN.
    const auto magnitude = hn::And(b, hn::Set(du, 0x7Fu));
    const auto bits =
        hn::Or(hn::ShiftLeft<20>(magnitude), hn::ShiftLeft<24>(hn::And(b, hn::Set(du, 0x80u))));
    const auto values =
        hn::MulAdd(hn::BitCast(df, bits), hn::Set(df, 0x1p120f), hn::Set(df, -0.0f));
    return hn::IfThenElse(hn::RebindMask(df, hn::Eq(magnitude, hn::Set(du, 0x7Fu))),
                          hn::Set(df, __builtin_nanf("")), values);
  }
  // Lane i: the scale of block 4 (chunk % 4) + i / 4 of GroupScales(row, chunk / 4, d).
  static HWY_INLINE hn::Vec<WideFloatTag> ChunkScales(hn::Vec<WideFloatTag> group_scales,
                                                      std::size_t chunk) {
    const WideFloatTag df;
    const hn::RebindToSigned<WideFloatTag> di;
    alignas(64) static constexpr std::int32_t kBlockOfLane[16] = {0, 0, 0, 0, 1, 1, 1, 1,
                                                                  2, 2, 2, 2, 3, 3, 3, 3};
    const auto lanes = hn::Add(hn::Load(di, kBlockOfLane),
                               hn::Set(di, static_cast<std::int32_t>(4 * (chunk % 4))));
    return hn::TableLookupLanes(group_scales, hn::IndicesFromVec(df, lanes));
  }
};

// fp6 (e2m3, e3m2): 64 codes (48 bytes, one masked load that reads nothing past them) per
// chunk, natural order. For each vector of 32 words, vpermb brings the two bytes that hold a
// code into its word, a variable shift puts the code at the word's low bits, and vpermi2w looks
// the 6-bit code up in a 64-entry table (it ignores the bits above). 7 ops per 64 channels.
template <MinifloatSpec kSpec>
struct DotFp6 {
  struct State {
    Words table0, table1;
    hn::Vec<hn::Repartition<std::uint8_t, WideFloatTag>> pairs0, pairs1;  // vpermb indices
    Words shifts0, shifts1;
  };
  // Byte pairs and shifts of channels 32 j + w, w < 32: the code starts at bit 6 c.
  struct Layout {
    alignas(64) std::array<std::uint8_t, 64> pairs[2]{};
    alignas(64) std::array<std::uint16_t, 32> shifts[2]{};
    constexpr Layout() {
      for (std::size_t j = 0; j < 2; ++j) {
        for (std::size_t w = 0; w < 32; ++w) {
          const std::size_t bit = 6 * (32 * j + w);
          pairs[j][2 * w] = static_cast<std::uint8_t>(bit / 8);
          pairs[j][2 * w + 1] = static_cast<std::uint8_t>(bit / 8 + 1);  // 48 at most: zeroed
          shifts[j][w] = static_cast<std::uint16_t>(bit % 8);
        }
      }
    }
  };
  static HWY_INLINE State MakeState() {
    static constexpr SmallBf16Table<kSpec, 64> kTable;
    static constexpr Layout kLayout;
    const WordTag dw;
    const hn::Repartition<std::uint8_t, WideFloatTag> d8;
    return {hn::Load(dw, kTable.words.data()),      hn::Load(dw, kTable.words.data() + 32),
            hn::Load(d8, kLayout.pairs[0].data()),  hn::Load(d8, kLayout.pairs[1].data()),
            hn::Load(dw, kLayout.shifts[0].data()), hn::Load(dw, kLayout.shifts[1].data())};
  }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                Words& x0, Words& x1) {
    const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64{1} << 48) - 1, row + chunk * 48);
    // (The maskz form of vpermb with every lane kept: GCC 12 warns on the unmasked one.)
    const __m512i codes0 = _mm512_srlv_epi16(
        _mm512_maskz_permutexvar_epi8(~__mmask64{0}, s.pairs0.raw, bytes), s.shifts0.raw);
    const __m512i codes1 = _mm512_srlv_epi16(
        _mm512_maskz_permutexvar_epi8(~__mmask64{0}, s.pairs1.raw, bytes), s.shifts1.raw);
    x0.raw = _mm512_permutex2var_epi16(s.table0.raw, codes0, s.table1.raw);
    x1.raw = _mm512_permutex2var_epi16(s.table0.raw, codes1, s.table1.raw);
  }
  static constexpr std::size_t Channel(std::size_t j, std::size_t w) { return 32 * j + w; }
};

// The dot decoder of an fp32 decoder's format, or void where Q . K stays on fp32 FMAs.
template <class Decoder>
struct DotDecoderOf {
  using type = void;
};
template <>
struct DotDecoderOf<DecodeBf16> {
  using type = DotBf16;
};
template <>
struct DotDecoderOf<DecodeE4M3> {
  using type = DotFp8<kE4M3Spec>;
};
template <>
struct DotDecoderOf<DecodeE5M2> {
  using type = DotFp8<kE5M2Spec>;
};
template <>
struct DotDecoderOf<DecodeE2M1> {
  using type = DotE2M1;
};
template <>
struct DotDecoderOf<DecodeNvfp4> {
  using type = DotNvfp4;
};
template <>
struct DotDecoderOf<DecodeE2M3> {
  using type = DotFp6<kE2M3Spec>;
};
template <>
struct DotDecoderOf<DecodeE3M2> {
  using type = DotFp6<kE3M2Spec>;
};

inline constexpr std::size_t kDotChunk = 64;

// q_words [R][2 ld] (bf16 words in Dot's channel order) from qn [R][D] (natural order, every
// value a bf16 value: Q in bf16 or fp8 mode).
template <class Dot>
void PrepareDotQuery(const float* HWY_RESTRICT qn, int rows, std::size_t d, std::size_t ld,
                     std::uint16_t* HWY_RESTRICT q_words) {
  for (int r = 0; r < rows; ++r) {
    const float* src = qn + std::size_t(r) * d;
    std::uint16_t* dst = q_words + std::size_t(r) * 2 * ld;
    for (std::size_t c = 0; c < d; c += kDotChunk) {
      for (std::size_t j = 0; j < 2; ++j) {
        for (std::size_t w = 0; w < 32; ++w) {
          const std::uint32_t bits = minifloat_detail::bits_from_float(src[c + Dot::Channel(j, w)]);
          dst[c + 32 * j + w] = static_cast<std::uint16_t>(bits >> 16);
        }
      }
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

// scores[r][t] = scale * q_r . k_t for the count K rows at bases[t] + offset, as ScoresFast does
// it with fp32 FMAs (attention_kernel.cc); q_words from PrepareDotQuery. Keys go in groups of
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

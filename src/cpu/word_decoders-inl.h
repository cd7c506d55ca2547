// Decoders of packed KV rows into bf16 words holding each code's true value, for AVX3_DL
// (AVX-512 with VBMI): byte and word permutes look codes up in small tables, 4 to 7 ops per 64
// channels. Two users:
//   - Q . K on bf16 dot products (bf16_dot-inl.h) takes the words as they are.
//   - The fp32 FMA paths (P . V always, Q . K off the dot products) widen each fp8 or fp6 word
//     vector into two fp32 vectors with one op each (DecodeViaWords below), in place of
//     kv_decode-inl.h's bit placements. Those place codes straight into fp32 bit fields, so the
//     subnormal codes become fp32 subnormals, and Intel cores take a microcode assist for every
//     FMA with a subnormal operand (fp6_e2m3 steps ran 1216 ns per token-head on a Xeon with
//     AVX-512, against 36 now), where AMD's take them at full speed. True values are never fp32
//     subnormals: the smallest is e5m2's 2^-16. The widened decode is also shorter than the bit
//     placement (fp8: 9 ops per 4 vectors against 12).
// Per-target header, see kv_decode-inl.h.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(MJOLNIR_CPU_WORD_DECODERS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_WORD_DECODERS_INL_H_
#undef MJOLNIR_CPU_WORD_DECODERS_INL_H_
#else
#define MJOLNIR_CPU_WORD_DECODERS_INL_H_
#endif

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/format_table.h"
#include "core/minifloat.h"
#include "cpu/codec_tables.h"
#include "cpu/kv_decode-inl.h"
#include "hwy/highway.h"
#include "mjolnir/format.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef MJOLNIR_BF16_WORDS
#if HWY_TARGET == HWY_AVX3_DL
#define MJOLNIR_BF16_WORDS 1

using WordTag = hn::Repartition<std::uint16_t, WideFloatTag>;  // 32 bf16 words
using Words = hn::Vec<WordTag>;

inline constexpr std::size_t kDotChunk = 64;  // channels per chunk of every word decoder

// --- decoders into bf16 words -----------------------------------------------------------------
// Each works in chunks of 64 channels, two vectors of 32 words; Channel(j, w) is the channel
// (within the chunk) of word w of vector j. For the dot products Q is laid out in the same order
// once per item.

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

// The words an fp8 code's value is looked up as: bf16 (the dot products, the fp32 paths) or fp16
// (P mode fp16's fp16 FMAs, half_values-inl.h; e4m3 only: every e4m3 value is an fp16).
enum class Fp8Word { bf16, fp16 };

// High and low bytes of the bf16 (or fp16) value of every magnitude code (sign bit clear) of an
// 8-bit format. NaN and Inf codes keep their value (bf16 holds both; e4m3 has no Inf), so a cache
// that holds one follows the non-finite policy (core/non_finite.h) at no cost.
template <MinifloatSpec kSpec, Fp8Word kWord = Fp8Word::bf16>
struct Fp8WordTable {
  alignas(64) std::array<std::uint8_t, 128> high{}, low{};
  constexpr Fp8WordTable() {
    for (std::uint32_t code = 0; code < 128; ++code) {
      const float value = decode_minifloat<kSpec>(code);
      std::uint32_t word = 0;
      if constexpr (kWord == Fp8Word::bf16) {
        const std::uint32_t bits = minifloat_detail::bits_from_float(value);
        if ((bits & 0xFFFFu) != 0) throw "an fp8 value that is not a bf16 value";
        word = bits >> 16;
      } else if (value != value) {
        word = kFp16Spec.nan_encoding();
      } else {
        word = encode_minifloat<kFp16Spec>(value);
        if (decode_minifloat<kFp16Spec>(word) != value) throw "an fp8 value that is not an fp16";
      }
      high[code] = static_cast<std::uint8_t>(word >> 8);
      low[code] = static_cast<std::uint8_t>(word);
    }
  }
};

// fp8 (e4m3, e5m2): 64 codes per chunk. Two vpermi2b look up the high and low bytes of each
// code's magnitude (they index with the low 7 bits, so the sign bit is ignored), a ternary-logic
// op puts the sign back into the high byte, and two byte unpacks pair the bytes into words:
// 5 ops per 64 channels, against 12 for the fp32 decoder (kv_decode-inl.h). The unpacks work
// within 128-bit blocks: word w of vector j is channel 16 (w / 8) + 8 j + w % 8. The words are
// bf16, or with kWord fp16 (both keep the sign in bit 15).
template <MinifloatSpec kSpec, Fp8Word kWord = Fp8Word::bf16>
struct DotFp8 {
  struct State {
    hn::Vec<hn::Repartition<std::uint8_t, WideFloatTag>> high0, high1, low0, low1, sign;
  };
  static HWY_INLINE State MakeState() {
    static constexpr Fp8WordTable<kSpec, kWord> kTable;
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
    const hn::Rebind<std::uint8_t, WideFloatTag> d8;
    const std::size_t blocks = d / kNvfp4BlockSize - 16 * group;
    const auto mask = static_cast<__mmask16>(blocks >= 16 ? 0xFFFFu : (1u << blocks) - 1);
    const hn::Vec<decltype(d8)> codes{_mm_maskz_loadu_epi8(mask, row + d / 2 + 16 * group)};
    return E4M3Values(WideFloatTag(), codes);  // kv_decode-inl.h
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
  // Decode's words, each times its block's scale, for the users that cannot scale sums (AMX tiles
  // sum across blocks; P . V pairs two keys' words): the true values, exact in bf16
  // (kNvfp4ScaledWords). Word w of either vector is in the chunk's block w / 8, so one vpermi2w
  // looks both vectors' words up in the four blocks' own 16-word rows of the table, two blocks
  // per register: index = code + 16 x block. 7 ops per 64 channels and four loads of a table row,
  // where scaling Decode's words in fp32 took 20.
  static HWY_INLINE void DecodeScaled(const std::uint8_t* row, std::size_t chunk, std::size_t d,
                                      Words& x0, Words& x1) {
    const std::uint8_t* scales = row + d / 2 + 4 * chunk;  // blocks 4 chunk .. 4 chunk + 3
    const std::uint16_t* table = kNvfp4ScaledWords.words.data();
    const auto block_row = [&](int b) {
      return _mm256_load_si256(reinterpret_cast<const __m256i*>(table + 16 * scales[b]));
    };
    const __m512i blocks01 =
        _mm512_inserti64x4(_mm512_castsi256_si512(block_row(0)), block_row(1), 1);
    const __m512i blocks23 =
        _mm512_inserti64x4(_mm512_castsi256_si512(block_row(2)), block_row(3), 1);
    alignas(64) static constexpr std::uint16_t kBlockOfWord[32] = {
        0,  0,  0,  0,  0,  0,  0,  0,  16, 16, 16, 16, 16, 16, 16, 16,
        32, 32, 32, 32, 32, 32, 32, 32, 48, 48, 48, 48, 48, 48, 48, 48};
    const __m512i block = _mm512_load_si512(kBlockOfWord);
    const hn::Repartition<std::uint8_t, hn::Half<WideFloatTag>> d8;  // 32 bytes
    const __m512i bytes = _mm512_cvtepu8_epi16(hn::LoadU(d8, row + chunk * 32).raw);
    // (bytes & 0xF) | block: ternary-logic truth table (A & B) | C.
    const __m512i low = _mm512_ternarylogic_epi32(bytes, _mm512_set1_epi16(0x0F), block, 0xEA);
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), block);
    x0.raw = _mm512_permutex2var_epi16(blocks01, low, blocks23);
    x1.raw = _mm512_permutex2var_epi16(blocks01, high, blocks23);
  }
};

// Chunk c's true values as bf16 words, whatever the format: Decode's, and nvfp4's times their
// block scales (DecodeScaled). For the users that cannot scale blocks' sums afterwards: the AMX
// tiles, which sum across blocks, and P . V over key pairs.
template <class Dot>
HWY_INLINE void DecodeTrueWords(const typename Dot::State& state, const std::uint8_t* row,
                                std::size_t chunk, std::size_t d, Words& x0, Words& x1) {
  if constexpr (std::is_same_v<Dot, DotNvfp4>) {
    Dot::DecodeScaled(row, chunk, d, x0, x1);
  } else {
    Dot::Decode(state, row, chunk, x0, x1);
  }
}

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

// --- fp32 decoders through the words -------------------------------------------------------

// The kv_decode-inl.h decoder interface over a word decoder: a chunk of 64 channels is its two
// word vectors, each widened into two fp32 vectors, the even words (shifted up) and the odd ones
// (masked), as DecodeBf16 does. True values: kRawExp 0.
template <class W>
struct DecodeViaWords {
  static constexpr int kRawExp = 0;
  static constexpr std::size_t kVectors = 4;
  using Tag = WideFloatTag;
  struct Pair {
    Words x0, x1;
  };

  // Channel (within its chunk) of lane `lane` of fp32 vector j.
  static constexpr std::size_t Channel(std::size_t j, std::size_t lane, std::size_t /* n */) {
    return W::Channel(j / 2, 2 * lane + j % 2);
  }
  template <class DF>
  static HWY_INLINE Pair Load(DF, const std::uint8_t* row, std::size_t chunk, std::size_t) {
    Pair p;
    W::Decode(W::MakeState(), row, chunk, p.x0, p.x1);
    return p;
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF>
  static HWY_INLINE hn::Vec<DF> Get(DF df, const Pair& p, hn::Vec<DF>) {
    const hn::RebindToUnsigned<DF> du;
    const auto words = hn::BitCast(du, kJ < 2 ? p.x0 : p.x1);
    if constexpr (kJ % 2 == 0) return hn::BitCast(df, hn::ShiftLeft<16>(words));
    return hn::BitCast(df, hn::And(words, hn::Set(du, 0xFFFF0000u)));
  }
};

// VisitDecoder's choice for the fast kernels: the decoders through words for fp8 and fp6 where
// rows have whole 64-channel chunks (head_dim % 64 == 0), else VisitDecoder's. (e2m1 and nvfp4
// keep kv_decode-inl.h's, which on AVX-512 look nibbles up as true values with vpermps, 2 ops a
// vector as through the words, and ran as fast: kernel_rates A/B, 3 rounds, within 2-5%.)
// These never make an fp32 subnormal, so avoid_subnormals changes nothing here.
template <class Visitor>
HWY_INLINE decltype(auto) VisitKernelDecoder(Format format, std::size_t head_dim,
                                             bool /*avoid_subnormals*/, Visitor&& visit) {
  if (head_dim % kDotChunk == 0) {
    return visit_format(format, [&]<Format kFormat>() -> decltype(auto) {
      constexpr const FormatFacts& kFacts = kFormatFacts<kFormat>;
      if constexpr (kFacts.quantized && kFacts.packing == CodePacking::byte) {
        return visit.template operator()<DecodeViaWords<DotFp8<kFacts.element>>>();
      } else if constexpr (kFacts.packing == CodePacking::fp6_groups) {
        return visit.template operator()<DecodeViaWords<DotFp6<kFacts.element>>>();
      } else {
        return visit.template operator()<KvDecoder<kFormat>>();
      }
    });
  }
  return VisitDecoder(format, visit);
}

#elif !MJOLNIR_PORTABLE_TARGET
#define MJOLNIR_BF16_WORDS 0

// VisitDecoder's choice, except with avoid_subnormals (KernelConfig::avoid_fp32_subnormals, where
// the CPU's subnormal FMAs are slow): then fp6 on AVX2 goes through fp16 (DecodeFp6Half) and
// every placed format on SSE4 is lifted (DecodeLifted), which never make an fp32 subnormal.
// Without it (AMD's cores), x86's e2m1 lookup gives way to the bit placement, subnormals and
// all: on an AVX2 Zen 3 fp4_e2m1 and nvfp4 decode steps took 0.91-0.93x the time, call by call
// (docs/cpu-experiments.md; fp8 placed into fp32 fields gained nothing over its fp16 fields).
template <class Visitor>
HWY_INLINE decltype(auto) VisitKernelDecoder(Format format, std::size_t,
                                             [[maybe_unused]] bool avoid_subnormals,
                                             Visitor&& visit) {
#if MJOLNIR_E2M1_LOOKUP
  if (!avoid_subnormals) {
    if (format == Format::fp4_e2m1) return visit.template operator()<DecodeE2M1Of<false>>();
    if (format == Format::nvfp4) return visit.template operator()<DecodeNvfp4Of<false>>();
  }
#endif
#if MJOLNIR_FP6_HALF
  if (avoid_subnormals) {
    if (format == Format::fp6_e2m3) return visit.template operator()<DecodeFp6Half<2>>();
    if (format == Format::fp6_e3m2) return visit.template operator()<DecodeFp6Half<3>>();
  }
#elif MJOLNIR_LIFTED_DECODERS
  if (avoid_subnormals) {
    return visit_format(format, [&]<Format kFormat>() -> decltype(auto) {
      if constexpr (kFormatFacts<kFormat>.has_block_scales()) {
        return visit.template operator()<DecodeNvfp4Lifted>();
      } else if constexpr (kFormatFacts<kFormat>.quantized) {
        return visit.template operator()<DecodeLifted<KvDecoder<kFormat>>>();
      } else {
        return visit.template operator()<KvDecoder<kFormat>>();
      }
    });
  }
#endif
  return VisitDecoder(format, visit);
}
#else
#define MJOLNIR_BF16_WORDS 0
#endif  // HWY_TARGET == HWY_AVX3_DL

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_WORD_DECODERS_INL_H_

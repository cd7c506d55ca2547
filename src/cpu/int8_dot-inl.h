// Q . K in integers for the CPU kernel (attention_kernel.cc), Q mode int8 (docs/numerics.md
// step 1): Q holds the integers -127..127, and the codes of fp4 e2m1 and fp6 e2m3 are small
// integers after a factor (e2m1 x 2: -12..12; e2m3 x 8: -60..60), so each score is an integer
// sum, exact in any order (nvfp4's codes are e2m1's; its block scales multiply the blocks'
// integer sums, IntNvfp4). AVX-512 VNNI's vpdpbusd does 64 multiply-adds of unsigned x signed
// bytes into 16 int32 lanes: the K codes go in as unsigned bytes k + bias (looked up in a table
// of the format's codes), Q as signed bytes, and each row's sum starts at -bias * sum(q), which
// takes the bias back out. On the Intel
// Xeon this was written on, 32 vpdpbusd (a 4 x 4 block of 128 channels) took 6.5 ns where 32
// vdpbf16ps (64 channels) took 18.7 (bench/micro/vector_op_costs, docs/cpu-experiments.md).
//
// The sums are converted to fp32 (exact: |sum| < 2^24) and reduced like the other blocks' sums,
// then times the kernel's scale (the score scale / factor): the emulator's scores bit for bit.
// The AVX3_DL target runs it on CPUs with AVX512_VNNI (Ice Lake and later, Zen 4 and later); the
// AVX2 and AVX3 targets, which have no vpdpbusd, run the same formats with vpmaddubsw and
// vpmaddwd, and the Arm targets (NEON, SVE, SVE2) with sdot on CPUs with the dot-product
// extension (at the end of this file). It applies from 128 channels a chunk (D a multiple of 128).
// Per-target header, see kv_decode-inl.h.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#if defined(MJOLNIR_CPU_INT8_DOT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_INT8_DOT_INL_H_
#undef MJOLNIR_CPU_INT8_DOT_INL_H_
#else
#define MJOLNIR_CPU_INT8_DOT_INL_H_
#endif

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "core/minifloat.h"
#include "cpu/kernel_blocks-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/tile_prefetcher.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef MJOLNIR_INT8_DOT
#undef MJOLNIR_INT8_DOT_ARM
#undef MJOLNIR_INT8_DECODED_KEYS
#if HWY_ARCH_ARM_A64 && HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128
#define MJOLNIR_INT8_DOT_ARM 1
#else
#define MJOLNIR_INT8_DOT_ARM 0
#endif
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2 || \
    MJOLNIR_INT8_DOT_ARM
#define MJOLNIR_INT8_DOT 1

// Channels per chunk: 128, decoded into vectors of unsigned bytes (two of 64 with AVX-512 VNNI,
// four of 32 on AVX2, eight of 16 on Arm).
inline constexpr std::size_t kInt8Chunk = 128;

// The unsigned byte value * kFactor + kBias of every code of a format, repeated to 64 entries
// (vpshufb reads 16 of each 128-bit block, vpermb all 64).
template <MinifloatSpec kSpec, int kFactor, int kBias>
struct IntCodeTable {
  alignas(64) std::array<std::uint8_t, 64> bytes{};
  constexpr IntCodeTable() {
    for (std::uint32_t i = 0; i < 64; ++i) {
      const float value = decode_minifloat<kSpec>(i % (1u << kSpec.total_bits())) * kFactor;
      if (value != static_cast<float>(static_cast<int>(value)) || value + kBias < 0 ||
          value + kBias > 255) {
        throw "a code that is not a small integer after the factor";
      }
      bytes[i] = static_cast<std::uint8_t>(static_cast<int>(value) + kBias);
    }
  }
};

// e2m1's integers, for the decoders of every target: codes times 2, plus 12, as unsigned bytes.
struct E2M1Integers {
  static constexpr int kFactor = 2, kBias = 12;
  static constexpr bool kBlockScales = false;
  static constexpr IntCodeTable<kE2M1Spec, kFactor, kBias> kTable{};
};

// e2m3's integers: codes times 8 (-60..60), plus 60, as unsigned bytes (0..120: also valid signed
// bytes, for Arm's sdot).
struct E2M3Integers {
  static constexpr int kFactor = 8, kBias = 60;
  static constexpr bool kBlockScales = false;
  static constexpr IntCodeTable<kE2M3Spec, kFactor, kBias> kTable{};
};

// The part of DecodedInt (below, per target) that is the same on every target: no decoder state,
// and a row's bytes, its chunks' integer bytes then, with block scales, each chunk's 16 fp32
// scale lanes.
template <class Dec>
struct DecodedIntRows : Dec {
  struct State {};
  static HWY_INLINE State MakeState() { return {}; }
  static constexpr std::size_t RowBytes(std::size_t d) {
    return d + (Dec::kBlockScales ? d / kInt8Chunk * 64 : 0);
  }
};

#if HWY_TARGET == HWY_AVX3_DL

// True when this CPU executes vpdpbusd (Highway 1.0.3's AVX3_DL does not require it).
inline bool CpuHasInt8Dot() {
  static const bool has = __builtin_cpu_supports("avx512vnni") != 0;
  return has;
}

// fp4 e2m1: values 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2 are -12..12. A chunk is one 64-byte row of
// codes: the low nibbles (even channels) by one vpshufb, the high ones (odd channels) by another.
struct IntE2M1 : E2M1Integers {
  static constexpr std::size_t kVectors = 2, kVectorBytes = 64;
  struct State {
    __m512i table;
  };
  static HWY_INLINE State MakeState() { return {_mm512_load_si512(kTable.bytes.data())}; }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                __m512i& x0, __m512i& x1) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i codes = _mm512_loadu_si512(row + chunk * 64);
    x0 = _mm512_shuffle_epi8(s.table, _mm512_and_si512(codes, nibble));
    x1 = _mm512_shuffle_epi8(s.table, _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble));
  }
  // Channel (within its chunk) of byte i of vector j.
  static constexpr std::size_t Channel(std::size_t j, std::size_t i) { return 2 * i + j; }
};

// fp6 e2m3: values in steps of 1/8 up to 7.5, times 8 are -60..60. Code c of a row starts at bit
// 6 c, so each 8 codes fill 6 bytes: vpermb spreads them to a qword each, vpmultishiftqb moves
// code k of a qword to its byte k, and vpermb looks the low 6 bits up (4 ops per 64 channels, in
// natural order; e3m2, up to 28 x 16, does not fit a byte).
struct IntE2M3 : E2M3Integers {
  static constexpr std::size_t kVectors = 2, kVectorBytes = 64;
  struct State {
    __m512i table, spread, shifts;
  };
  struct Layout {
    alignas(64) std::array<std::uint8_t, 64> spread{}, shifts{};
    constexpr Layout() {
      for (std::size_t q = 0; q < 8; ++q) {
        for (std::size_t b = 0; b < 8; ++b) {
          spread[8 * q + b] = static_cast<std::uint8_t>(b < 6 ? 6 * q + b : 0);
          shifts[8 * q + b] = static_cast<std::uint8_t>(6 * b);
        }
      }
    }
  };
  static HWY_INLINE State MakeState() {
    static constexpr Layout kLayout;
    return {_mm512_load_si512(kTable.bytes.data()), _mm512_load_si512(kLayout.spread.data()),
            _mm512_load_si512(kLayout.shifts.data())};
  }
  static HWY_INLINE __m512i Decode64(const State& s, const std::uint8_t* codes) {
    const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64{1} << 48) - 1, codes);
    // (The maskz forms of vpermb with every lane kept: GCC 12 warns on the unmasked one.)
    const __m512i spread = _mm512_maskz_permutexvar_epi8(~__mmask64{0}, s.spread, bytes);
    return _mm512_maskz_permutexvar_epi8(~__mmask64{0},
                                         _mm512_multishift_epi64_epi8(s.shifts, spread), s.table);
  }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                __m512i& x0, __m512i& x1) {
    x0 = Decode64(s, row + chunk * 96);
    x1 = Decode64(s, row + chunk * 96 + 48);
  }
  static constexpr std::size_t Channel(std::size_t j, std::size_t i) { return 64 * j + i; }
};

// nvfp4: the e2m1 codes as IntE2M1 decodes them, and each 16-channel block's e4m3 scale (after
// the D / 2 code bytes) multiplies its integer sums. Lane l of a chunk's vpdpbusd sums channels
// 8 l .. 8 l + 7 (4 even, 4 odd), all of block 8 chunk + l / 2, so each (row, key, chunk) takes
// its own int32 sums, converted and multiplied into fp32 by the chunk's scale vector; each row's
// lanes start at -12 times the sum of their own 8 channels of q. The scores are fp32 sums of
// block products then, as the bf16 dot products' are (bf16_dot-inl.h).
struct IntNvfp4 : IntE2M1 {
  static constexpr bool kBlockScales = true;
  // The int32 lane of a chunk's sums that byte i of vector j goes into (channels 8 l .. 8 l + 7).
  static constexpr std::size_t Lane(std::size_t, std::size_t i) { return i / 4; }
  // Lane l: the true value of the scale of block 8 chunk + l / 2 of a row of d channels.
  static HWY_INLINE hn::Vec<WideFloatTag> ChunkScales(const std::uint8_t* row, std::size_t chunk,
                                                      std::size_t d) {
    const WideFloatTag df;
    const hn::RebindToSigned<WideFloatTag> di;
    alignas(64) static constexpr std::int32_t kBlockOfLane[16] = {0, 0, 1, 1, 2, 2, 3, 3,
                                                                  4, 4, 5, 5, 6, 6, 7, 7};
    const auto lanes = hn::Add(hn::Load(di, kBlockOfLane),
                               hn::Set(di, static_cast<std::int32_t>(8 * (chunk % 2))));
    return hn::TableLookupLanes(DotNvfp4::GroupScales(row, chunk / 2, d),
                                hn::IndicesFromVec(df, lanes));
  }
};

#define MJOLNIR_INT8_DECODED_KEYS 1
// K rows that Dec decoded into `out` (DecodeKeyRow), read back through Dec's interface: a unit of
// many query rows (a prompt's query tile) decodes each key of a tile once instead of once per
// block of 4 rows. A chunk is two 64-byte vectors.
template <class Dec>
struct DecodedInt : DecodedIntRows<Dec> {
  using State = typename DecodedIntRows<Dec>::State;
  static HWY_INLINE void Decode(const State&, const std::uint8_t* row, std::size_t chunk,
                                __m512i& x0, __m512i& x1) {
    x0 = _mm512_load_si512(row + chunk * kInt8Chunk);
    x1 = _mm512_load_si512(row + chunk * kInt8Chunk + 64);
  }
  static HWY_INLINE hn::Vec<WideFloatTag> ChunkScales(const std::uint8_t* row, std::size_t chunk,
                                                      std::size_t d) {
    return hn::Load(WideFloatTag(), reinterpret_cast<const float*>(row + d + chunk * 64));
  }
};

// Decodes the K row at `row` into out (64-byte aligned, DecodedInt<Dec>::RowBytes(d) bytes).
template <class Dec>
HWY_INLINE void DecodeKeyRow(const typename Dec::State& state, const std::uint8_t* row,
                             std::size_t d, std::uint8_t* HWY_RESTRICT out) {
  for (std::size_t c = 0; c < d / kInt8Chunk; ++c) {
    __m512i x0, x1;
    Dec::Decode(state, row, c, x0, x1);
    _mm512_store_si512(out + c * kInt8Chunk, x0);
    _mm512_store_si512(out + c * kInt8Chunk + 64, x1);
    if constexpr (Dec::kBlockScales) {
      hn::Store(Dec::ChunkScales(row, c, d), WideFloatTag(),
                reinterpret_cast<float*>(out + d + c * 64));
    }
  }
}

#elif MJOLNIR_INT8_DOT_ARM

// True when this CPU executes sdot (Armv8.2's dot-product extension; Armv8.4 and later have it).
inline bool CpuHasInt8Dot() {
  static const bool has = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  return has;
}

// As the AVX2 IntE2M1, in eight vectors of 16 bytes: the even and the odd channels of each
// quarter of a chunk. The table's bytes k + 12 (0..24) are the same values as signed bytes, which
// sdot multiplies by Q's signed bytes.
struct IntE2M1 : E2M1Integers {
  static constexpr std::size_t kVectors = 8, kVectorBytes = 16;
  struct State {
    uint8x16_t table;
  };
  static HWY_INLINE State MakeState() { return {vld1q_u8(kTable.bytes.data())}; }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                int8x16_t (&x)[8]) {
    const uint8x16_t nibble = vdupq_n_u8(0x0F);
    for (int m = 0; m < 4; ++m) {
      const uint8x16_t codes = vld1q_u8(row + chunk * 64 + 16 * m);
      x[2 * m] = vreinterpretq_s8_u8(vqtbl1q_u8(s.table, vandq_u8(codes, nibble)));
      x[2 * m + 1] = vreinterpretq_s8_u8(vqtbl1q_u8(s.table, vshrq_n_u8(codes, 4)));
    }
  }
  // Channel (within its chunk) of byte i of vector j.
  static constexpr std::size_t Channel(std::size_t j, std::size_t i) {
    return 32 * (j / 2) + 2 * i + j % 2;
  }
};

// nvfp4: the e2m1 codes as IntE2M1 decodes them, each 16-channel block's e4m3 scale
// multiplying its integer sums, as on x86. sdot's int32 lane l of quarter m of a chunk sums
// channels 32 m + 8 l .. 32 m + 8 l + 7 (bytes 4 l .. 4 l + 3 of the quarter's even and odd
// vectors), all of block 8 chunk + 2 m + l / 2: lane 4 m + l of the chunk, as x86's lane of the
// same channels.
struct IntNvfp4 : IntE2M1 {
  static constexpr bool kBlockScales = true;
  static constexpr std::size_t Lane(std::size_t j, std::size_t i) { return 4 * (j / 2) + i / 4; }
  // quarter[m] lane l: the true value of the scale of block 8 chunk + 2 m + l / 2 of a row of d
  // channels (looked up: the scales' table of codec_tables.h, NaN for the NaN codes).
  static HWY_INLINE void QuarterScales(const std::uint8_t* row, std::size_t chunk, std::size_t d,
                                       float32x4_t quarter[4]) {
    static constexpr auto kScales = e4m3_value_table<0>();
    const std::uint8_t* codes = row + d / 2 + 8 * chunk;  // the chunk's 8 blocks
    for (int m = 0; m < 4; ++m) {
      quarter[m] =
          vcombine_f32(vdup_n_f32(kScales[codes[2 * m]]), vdup_n_f32(kScales[codes[2 * m + 1]]));
    }
  }
};

// fp6 e2m3: each 3 bytes of a row hold 4 codes (code c at bit 6 c). vld3q_u8 splits 48 bytes into
// the groups' first, second and third bytes, shifts and inserts take each group's 4 codes, and
// one 64-byte table lookup (vqtbl4q_u8) their integers: vector 4 h + k holds code k of the 16
// groups of half h of the chunk.
struct IntE2M3 : E2M3Integers {
  static constexpr std::size_t kVectors = 8, kVectorBytes = 16;
  struct State {
    uint8x16x4_t table;
  };
  static HWY_INLINE State MakeState() { return {vld1q_u8_x4(kTable.bytes.data())}; }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                int8x16_t (&x)[8]) {
    const uint8x16_t low6 = vdupq_n_u8(0x3F);
    for (int h = 0; h < 2; ++h) {
      const uint8x16x3_t b = vld3q_u8(row + chunk * 96 + 48 * h);
      const uint8x16_t codes[4] = {vandq_u8(b.val[0], low6),
                                   vandq_u8(vsliq_n_u8(vshrq_n_u8(b.val[0], 6), b.val[1], 2), low6),
                                   vandq_u8(vsliq_n_u8(vshrq_n_u8(b.val[1], 4), b.val[2], 4), low6),
                                   vshrq_n_u8(b.val[2], 2)};
      for (int k = 0; k < 4; ++k) {
        x[4 * h + k] = vreinterpretq_s8_u8(vqtbl4q_u8(s.table, codes[k]));
      }
    }
  }
  // Channel (within its chunk) of byte i of vector j.
  static constexpr std::size_t Channel(std::size_t j, std::size_t i) {
    return 64 * (j / 4) + 4 * i + j % 4;
  }
};

#else  // AVX2, and AVX-512 without VNNI (the AVX3 target)

// vpmaddubsw and vpmaddwd: every CPU of these targets has them.
inline bool CpuHasInt8Dot() { return true; }

// As the AVX-512 IntE2M1, in four vectors of 32 bytes: the even and the odd channels of each half
// of a chunk.
struct IntE2M1 : E2M1Integers {
  static constexpr std::size_t kVectors = 4, kVectorBytes = 32;
  struct State {
    __m256i table;
  };
  static HWY_INLINE State MakeState() {
    return {_mm256_load_si256(reinterpret_cast<const __m256i*>(kTable.bytes.data()))};
  }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                __m256i (&x)[4]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int m = 0; m < 2; ++m) {
      const __m256i codes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + chunk * 64 + 32 * m));
      x[2 * m] = _mm256_shuffle_epi8(s.table, _mm256_and_si256(codes, nibble));
      x[2 * m + 1] =
          _mm256_shuffle_epi8(s.table, _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble));
    }
  }
  // Channel (within its chunk) of byte i of vector j.
  static constexpr std::size_t Channel(std::size_t j, std::size_t i) {
    return 64 * (j / 2) + 2 * i + j % 2;
  }
};

// nvfp4: the e2m1 codes as IntE2M1 decodes them, each 16-channel block's e4m3 scale
// multiplying its integer sums, as on AVX-512. vpmaddwd's int32 lane l of half m of a chunk sums
// channels 64 m + 8 l .. 64 m + 8 l + 7 (Channel: byte pairs 2 l, 2 l + 1 of the half's even and
// odd vectors), all of block 8 chunk + 4 m + l / 2: lane 8 m + l of the chunk, as AVX-512's lane
// of the same channels.
struct IntNvfp4 : IntE2M1 {
  static constexpr bool kBlockScales = true;
  static constexpr std::size_t Lane(std::size_t j, std::size_t i) { return 8 * (j / 2) + i / 4; }
  // half[m] lane l: the true value of the scale of block 8 chunk + 4 m + l / 2 of a row of d
  // channels: the chunk's 8 scale codes decoded at once (E4M3Values), each lane then doubled.
  static HWY_INLINE void HalfScales(const std::uint8_t* row, std::size_t chunk, std::size_t d,
                                    __m256 half[2]) {
    const hn::Full256<float> df;
    const hn::Rebind<std::uint8_t, decltype(df)> d8;
    const auto scales = E4M3Values(df, hn::LoadU(d8, row + d / 2 + 8 * chunk));  // 8 blocks
    half[0] = _mm256_permutevar8x32_ps(scales.raw, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    half[1] = _mm256_permutevar8x32_ps(scales.raw, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
  }
};

// fp6 e2m3: each 3 bytes of a row hold 4 codes (code c at bit 6 c). Vector j of a chunk takes its
// 24 bytes (codes 32 j ..) in one load, vpermd puts 12 of them in each 128-bit half, vpshufb
// spreads each 3 bytes b0 b1 b2 to a dword b0 b1 b1 b2, and one vpmullw and one vpmulhuw move
// each code to a byte of its own (in the order 1 0 3 2 within the dword). The integers: the
// magnitude by two vpshufb (the exponent's high bit clear, set) and a blend on that bit, the sign
// by vpsignb, then the bias: 15 ops for 32 channels.
struct IntE2M3 : E2M3Integers {
  static constexpr std::size_t kVectors = 4, kVectorBytes = 32;
  struct State {
    __m256i magnitude_low, magnitude_high;
  };
  // Magnitudes times 8 of codes 0..15 and 16..31 (codes 32..63 are their negatives), in both
  // 128-bit halves.
  struct Magnitudes {
    alignas(32) std::array<std::uint8_t, 32> low{}, high{};
    constexpr Magnitudes() {
      for (std::uint32_t i = 0; i < 32; ++i) {
        const float value = decode_minifloat<kE2M3Spec>(i) * kFactor;
        if (decode_minifloat<kE2M3Spec>(i + 32) * kFactor != -value) throw "bit 5 is not the sign";
        (i < 16 ? low : high)[i % 16] = (i < 16 ? low : high)[i % 16 + 16] =
            static_cast<std::uint8_t>(value);
      }
    }
  };
  static HWY_INLINE State MakeState() {
    static constexpr Magnitudes kMagnitudes;
    return {_mm256_load_si256(reinterpret_cast<const __m256i*>(kMagnitudes.low.data())),
            _mm256_load_si256(reinterpret_cast<const __m256i*>(kMagnitudes.high.data()))};
  }
  static HWY_INLINE void Decode(const State& s, const std::uint8_t* row, std::size_t chunk,
                                __m256i (&x)[4]) {
    const std::uint8_t* bytes = row + chunk * 96;
    // Vector 0 loads from its first byte, the others from 8 bytes before theirs, so that no load
    // reads past the chunk: their 24 bytes are dwords 0..5 and 2..7 of the load.
    const __m256i first = _mm256_setr_epi32(0, 1, 2, 0, 3, 4, 5, 0);
    const __m256i later = _mm256_setr_epi32(2, 3, 4, 0, 5, 6, 7, 0);
    const __m256i spread = _mm256_setr_epi8(0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11, 0, 1,
                                            1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11);
    // Per dword (words b0 b1 and b1 b2): code 0 (bits 0..5 of the first word) times 256 and code
    // 2 (bits 4..9 of the second) times 16 by vpmullw, to bits 8..13; code 1 (bits 6..11) and
    // code 3 (bits 10..15) by vpmulhuw, to bits 0..5.
    const __m256i low_codes = _mm256_set1_epi32(0x03F0003F);
    const __m256i low_shifts = _mm256_set1_epi32(0x00100100);
    const __m256i high_codes = _mm256_set1_epi32(static_cast<int>(0xFC000FC0u));
    const __m256i high_shifts = _mm256_set1_epi32(0x00400400);
    for (int j = 0; j < 4; ++j) {
      const __m256i loaded =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + (j == 0 ? 0 : 24 * j - 8)));
      const __m256i groups =
          _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(loaded, j == 0 ? first : later), spread);
      const __m256i codes =
          _mm256_or_si256(_mm256_mullo_epi16(_mm256_and_si256(groups, low_codes), low_shifts),
                          _mm256_mulhi_epu16(_mm256_and_si256(groups, high_codes), high_shifts));
      // Bit 4 (the exponent's high bit) and bit 5 (the sign) of each code moved to bit 7.
      const __m256i magnitude = _mm256_blendv_epi8(_mm256_shuffle_epi8(s.magnitude_low, codes),
                                                   _mm256_shuffle_epi8(s.magnitude_high, codes),
                                                   _mm256_slli_epi16(codes, 3));
      x[j] = _mm256_add_epi8(_mm256_sign_epi8(magnitude, _mm256_slli_epi16(codes, 2)),
                             _mm256_set1_epi8(kBias));
    }
  }
  // Channel (within its chunk) of byte i of vector j.
  static constexpr std::size_t Channel(std::size_t j, std::size_t i) { return 32 * j + (i ^ 1); }
};

#define MJOLNIR_INT8_DECODED_KEYS 1
// As on AVX3_DL: K rows that Dec decoded into `out` (DecodeKeyRow), a chunk four 32-byte vectors
// (and its scale lanes in two halves of 8).
template <class Dec>
struct DecodedInt : DecodedIntRows<Dec> {
  using State = typename DecodedIntRows<Dec>::State;
  static HWY_INLINE void Decode(const State&, const std::uint8_t* row, std::size_t chunk,
                                __m256i (&x)[4]) {
    for (int j = 0; j < 4; ++j) {
      x[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(row + chunk * kInt8Chunk + 32 * j));
    }
  }
  static HWY_INLINE void HalfScales(const std::uint8_t* row, std::size_t chunk, std::size_t d,
                                    __m256 half[2]) {
    const auto* scales = reinterpret_cast<const float*>(row + d + chunk * 64);
    half[0] = _mm256_load_ps(scales);
    half[1] = _mm256_load_ps(scales + 8);
  }
};

template <class Dec>
HWY_INLINE void DecodeKeyRow(const typename Dec::State& state, const std::uint8_t* row,
                             std::size_t d, std::uint8_t* HWY_RESTRICT out) {
  for (std::size_t c = 0; c < d / kInt8Chunk; ++c) {
    __m256i x[4];
    Dec::Decode(state, row, c, x);
    for (int j = 0; j < 4; ++j) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + c * kInt8Chunk + 32 * j), x[j]);
    }
    if constexpr (Dec::kBlockScales) {
      __m256 half[2];
      Dec::HalfScales(row, c, d, half);
      auto* scales = reinterpret_cast<float*>(out + d + c * 64);
      _mm256_store_ps(scales, half[0]);
      _mm256_store_ps(scales + 8, half[1]);
    }
  }
}

#endif  // HWY_TARGET == HWY_AVX3_DL

// The formats with an integer decoder (on every target with integer dot products).
inline bool HasIntDecoder(Format format) {
  return format == Format::fp4_e2m1 || format == Format::fp6_e2m3 || format == Format::nvfp4;
}
// Calls f.template operator()<Dec>() with the integer decoder of `format` (HasIntDecoder).
template <class F>
HWY_INLINE void VisitIntDecoder(Format format, F&& f) {
  if (format == Format::fp6_e2m3) {
    f.template operator()<IntE2M3>();
  } else if (format == Format::nvfp4) {
    f.template operator()<IntNvfp4>();
  } else {
    f.template operator()<IntE2M1>();
  }
}

// int32 starts a row keeps (PrepareInt8Query): one, or 16 lanes per chunk with block scales.
template <class Dec>
constexpr std::size_t StartsPerRow(std::size_t d) {
  return Dec::kBlockScales ? d / kInt8Chunk * 16 : 1;
}

// q_bytes [R][d] (signed int8 in Dec's channel order per chunk of 128) and start
// [R][StartsPerRow] (-kBias times the row's sum, or with block scales times each chunk lane's
// sum) from qn [R][D]: the int8 codes of Q mode int8, as floats in natural order.
template <class Dec>
void PrepareInt8Query(const float* HWY_RESTRICT qn, int rows, std::size_t d,
                      std::int8_t* HWY_RESTRICT q_bytes, std::int32_t* HWY_RESTRICT start) {
  for (int r = 0; r < rows; ++r) {
    const float* src = qn + std::size_t(r) * d;
    std::int8_t* dst = q_bytes + std::size_t(r) * d;
    std::int32_t* row_start = start + r * StartsPerRow<Dec>(d);
    std::fill(row_start, row_start + StartsPerRow<Dec>(d), 0);
    for (std::size_t c0 = 0; c0 < d; c0 += kInt8Chunk) {
      // The chunk's codes first, then the sums: stores through dst (bytes, which may alias
      // anything) between the sums' updates would send each update through memory, one
      // store-to-load chain per lane (a fifth of a 16-token decode call's time, perf).
      std::int32_t codes[kInt8Chunk];
      for (std::size_t j = 0; j < Dec::kVectors; ++j) {
        for (std::size_t i = 0; i < Dec::kVectorBytes; ++i) {
          codes[j * Dec::kVectorBytes + i] =
              static_cast<std::int32_t>(src[c0 + Dec::Channel(j, i)]);
        }
      }
      for (std::size_t p = 0; p < kInt8Chunk; ++p) dst[c0 + p] = static_cast<std::int8_t>(codes[p]);
      if constexpr (Dec::kBlockScales) {
        // A lane takes 4 consecutive bytes of a vector: byte k of every group in the inner
        // loop, so that consecutive updates go to different lanes.
        std::int32_t lanes[16] = {};
        for (std::size_t k = 0; k < 4; ++k) {
          for (std::size_t j = 0; j < Dec::kVectors; ++j) {
            for (std::size_t i = k; i < Dec::kVectorBytes; i += 4) {
              lanes[Dec::Lane(j, i)] += codes[j * Dec::kVectorBytes + i];
            }
          }
        }
        for (std::size_t l = 0; l < 16; ++l) {
          row_start[c0 / kInt8Chunk * 16 + l] -= Dec::kBias * lanes[l];
        }
      } else {
        std::int32_t sum = 0;
        for (std::size_t p = 0; p < kInt8Chunk; ++p) sum += codes[p];
        row_start[0] -= Dec::kBias * sum;
      }
    }
  }
}

#if HWY_TARGET == HWY_AVX3_DL
HWY_PUSH_ATTRIBUTES("avx512vnni")

// Scores of kRows query rows (q_bytes d apart) against the 4 K rows k[0..3]: kRows x 4 int32
// accumulators, each K chunk decoded once for all rows. Writes scale times row r's sum for key i
// to out[r * stride + i].
template <class Dec, int kRows>
HWY_INLINE void Int8Block(const std::int8_t* HWY_RESTRICT q, std::size_t d,
                          const std::int32_t* start, const std::uint8_t* const* k,
                          const typename Dec::State& state, float scale, float* out,
                          std::size_t stride) {
  const WideFloatTag df;
  hn::Vec<WideFloatTag> sums[kRows][4];
  if constexpr (Dec::kBlockScales) {
    for (auto& row : sums) {
      for (auto& sum : row) sum = hn::Zero(df);
    }
    const std::size_t chunks = d / kInt8Chunk;
    for (std::size_t c = 0; c < chunks; ++c) {
      __m512i even[4], odd[4];
      hn::Vec<WideFloatTag> scales[4];
      for (int i = 0; i < 4; ++i) {
        Dec::Decode(state, k[i], c, even[i], odd[i]);
        scales[i] = Dec::ChunkScales(k[i], c, d);
      }
      for (int r = 0; r < kRows; ++r) {
        const std::int8_t* qr = q + r * d + c * kInt8Chunk;
        const __m512i q0 = _mm512_loadu_si512(qr), q1 = _mm512_loadu_si512(qr + kInt8Chunk / 2);
        const __m512i first = _mm512_loadu_si512(start + (r * chunks + c) * 16);
        for (int i = 0; i < 4; ++i) {
          const __m512i block_sums =
              _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(first, even[i], q0), odd[i], q1);
          sums[r][i] = hn::MulAdd(hn::Vec<WideFloatTag>{_mm512_cvtepi32_ps(block_sums)}, scales[i],
                                  sums[r][i]);
        }
      }
    }
  } else {
    __m512i a[kRows][4];
    for (int r = 0; r < kRows; ++r) {
      const __m512i first = _mm512_maskz_set1_epi32(__mmask16{1}, start[r]);
      for (auto& acc : a[r]) acc = first;
    }
    for (std::size_t c = 0; c < d / kInt8Chunk; ++c) {
      __m512i even[4], odd[4];  // the chunk's two vectors of each key
      for (int i = 0; i < 4; ++i) Dec::Decode(state, k[i], c, even[i], odd[i]);
      for (int r = 0; r < kRows; ++r) {
        const std::int8_t* qr = q + r * d + c * kInt8Chunk;
        const __m512i q0 = _mm512_loadu_si512(qr);
        for (int i = 0; i < 4; ++i) a[r][i] = _mm512_dpbusd_epi32(a[r][i], even[i], q0);
        const __m512i q1 = _mm512_loadu_si512(qr + kInt8Chunk / 2);
        for (int i = 0; i < 4; ++i) a[r][i] = _mm512_dpbusd_epi32(a[r][i], odd[i], q1);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int i = 0; i < 4; ++i) sums[r][i].raw = _mm512_cvtepi32_ps(a[r][i]);
    }
  }
  if constexpr (kRows == 4) {
    StoreSums4x4(df, sums, scale, out, stride);
  } else {
    const Float4 s = Reduce4(df, sums[0][0], sums[0][1], sums[0][2], sums[0][3]);
    hn::StoreU(hn::Mul(s, hn::Set(Float4Tag(), scale)), Float4Tag(), out);
  }
}

// scores[r][t] = scale * q_r . k_t for the count K rows at bases[t] + offset, as ScoresDot
// does it with bf16 dot products (bf16_dot-inl.h), keys in groups of 4 (a group of fewer repeats
// its last key and writes up to 3 scores past `count`, inside each scores row's padding);
// q_bytes and start from PrepareInt8Query, scale the score scale / Dec::kFactor.
template <class Dec>
HWY_NOINLINE void ScoresInt8(const std::int8_t* HWY_RESTRICT q_bytes,
                             const std::int32_t* HWY_RESTRICT start, int rows, std::size_t d,
                             const std::uint8_t* const* bases, std::int64_t offset, int count,
                             float scale, float* HWY_RESTRICT scores, std::size_t stride,
                             TilePrefetcher& prefetch, int prefetch_per_key) {
  const auto state = Dec::MakeState();
  for (int t = 0; t < count; t += 4) {
    const int keys = count - t < 4 ? count - t : 4;
    prefetch.Issue(keys * prefetch_per_key);
    const std::uint8_t* k[4];
    for (int i = 0; i < 4; ++i) k[i] = bases[t + (i < keys ? i : keys - 1)] + offset;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      Int8Block<Dec, 4>(q_bytes + r * d, d, start + r * StartsPerRow<Dec>(d), k, state, scale,
                        scores + r * stride + t, stride);
    }
    for (; r < rows; ++r) {
      Int8Block<Dec, 1>(q_bytes + r * d, d, start + r * StartsPerRow<Dec>(d), k, state, scale,
                        scores + r * stride + t, stride);
    }
  }
}

HWY_POP_ATTRIBUTES

#else  // AVX2, AVX3 and Arm: 4 rows at a time

#if MJOLNIR_INT8_DOT_ARM
// sdot needs the dot-product extension, which the Arm targets' own options (Highway's NEON:
// +crypto; SVE: +sve; SVE2: +sve2-aes) do not include: these functions add it, at the
// architecture that introduced it (CpuHasInt8Dot checks for it at run time).
#if HWY_TARGET == HWY_NEON
HWY_PUSH_ATTRIBUTES("arch=armv8.2-a+crypto+dotprod")
#elif HWY_TARGET == HWY_SVE || HWY_TARGET == HWY_SVE_256
HWY_PUSH_ATTRIBUTES("arch=armv8.2-a+sve+dotprod")
#else
HWY_PUSH_ATTRIBUTES("arch=armv8.2-a+sve2-aes+dotprod")
#endif

// The scores (scale times the sums) of kRows query rows (q_bytes d apart, starting at start[0 ..
// kRows)) for one key: each chunk decoded once for all of them, then per row 8 sdot, each int32
// lane adding 4 byte products, and the lanes summed (4 rows by two pairwise adds).
template <class Dec, int kRows>
HWY_INLINE void Int8RowScores(const std::int8_t* HWY_RESTRICT q, std::size_t d,
                              const std::int32_t* start, const std::uint8_t* k,
                              const typename Dec::State& state, float scale, float* out) {
  if constexpr (Dec::kBlockScales) {
    // Each quarter's int32 lanes (blocks' sums, from the row's per-lane starts) converted and
    // multiplied into fp32 by their blocks' scales; the lanes summed at the end.
    const std::size_t chunks = d / kInt8Chunk;
    float32x4_t f[kRows];
    for (int r = 0; r < kRows; ++r) f[r] = vdupq_n_f32(0.0f);
    for (std::size_t c = 0; c < chunks; ++c) {
      int8x16_t x[8];
      Dec::Decode(state, k, c, x);
      float32x4_t scales[4];
      Dec::QuarterScales(k, c, d, scales);
      for (int r = 0; r < kRows; ++r) {
        const std::int8_t* qc = q + r * d + c * kInt8Chunk;
        const std::int32_t* first = start + (r * chunks + c) * 16;
        for (int m = 0; m < 4; ++m) {
          int32x4_t sums = vld1q_s32(first + 4 * m);
          sums = vdotq_s32(sums, x[2 * m], vld1q_s8(qc + 32 * m));
          sums = vdotq_s32(sums, x[2 * m + 1], vld1q_s8(qc + 32 * m + 16));
          f[r] = vfmaq_f32(f[r], vcvtq_f32_s32(sums), scales[m]);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) out[r] = vaddvq_f32(f[r]) * scale;
    return;
  }
  int32x4_t a[kRows];
  for (int r = 0; r < kRows; ++r) a[r] = vsetq_lane_s32(start[r], vdupq_n_s32(0), 0);
  for (std::size_t c = 0; c < d / kInt8Chunk; ++c) {
    int8x16_t x[8];
    Dec::Decode(state, k, c, x);
    for (int r = 0; r < kRows; ++r) {
      const std::int8_t* qc = q + r * d + c * kInt8Chunk;
      for (int j = 0; j < 8; ++j) a[r] = vdotq_s32(a[r], x[j], vld1q_s8(qc + 16 * j));
    }
  }
  if constexpr (kRows == 4) {
    const int32x4_t sums = vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3]));
    vst1q_f32(out, vmulq_f32(vcvtq_f32_s32(sums), vdupq_n_f32(scale)));
  } else {
    for (int r = 0; r < kRows; ++r) out[r] = static_cast<float>(vaddvq_s32(a[r])) * scale;
  }
}

// As the AVX-512 ScoresInt8, key by key, 4 rows at a time: each key's chunk is decoded once per
// 4 rows.
template <class Dec>
HWY_NOINLINE void ScoresInt8(const std::int8_t* HWY_RESTRICT q_bytes,
                             const std::int32_t* HWY_RESTRICT start, int rows, std::size_t d,
                             const std::uint8_t* const* bases, std::int64_t offset, int count,
                             float scale, float* HWY_RESTRICT scores, std::size_t stride,
                             TilePrefetcher& prefetch, int prefetch_per_key) {
  const auto state = Dec::MakeState();
  for (int t = 0; t < count; ++t) {
    prefetch.Issue(prefetch_per_key);
    const std::uint8_t* k = bases[t] + offset;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      alignas(16) float s[4];
      Int8RowScores<Dec, 4>(q_bytes + r * d, d, start + r * StartsPerRow<Dec>(d), k, state, scale,
                            s);
      for (int i = 0; i < 4; ++i) scores[(r + i) * stride + t] = s[i];
    }
    for (; r < rows; ++r) {
      Int8RowScores<Dec, 1>(q_bytes + r * d, d, start + r * StartsPerRow<Dec>(d), k, state, scale,
                            &scores[r * stride + t]);
    }
  }
}

#else  // AVX2 and AVX3

// The lanes of kRows query rows' sums (q_bytes d apart, starting at start[0 .. kRows)) for one
// key, whose lane sum is the row's score over the scale: each chunk decoded once for all of
// them, then per row 4 vpmaddubsw and vpmaddwd into int32 lanes (returned as their bits), or
// with block scales each half's int32 lanes (blocks' sums, from the row's per-lane starts)
// converted and multiplied into fp32 lanes by their blocks' scales. A vpmaddubsw int16 lane is
// at most 2 x 2 kBias x 127: for e2m1 (2 x 24 x 127) the four add up below 2^15 and take one
// vpmaddwd; for e2m3 (2 x 120 x 127) each takes its own.
template <class Dec, int kRows>
HWY_INLINE void Int8RowLanes(const std::int8_t* HWY_RESTRICT q, std::size_t d,
                             const std::int32_t* start, const std::uint8_t* k,
                             const typename Dec::State& state, __m256 (&lanes)[kRows]) {
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int kLaneMax = 2 * 2 * Dec::kBias * 127;  // of one vpmaddubsw's int16 lanes
  static_assert(kLaneMax < 32768, "vpmaddubsw would saturate");
  if constexpr (Dec::kBlockScales) {
    static_assert(2 * kLaneMax < 32768, "two vpmaddubsw are added in int16");
    const std::size_t chunks = d / kInt8Chunk;
    for (int r = 0; r < kRows; ++r) lanes[r] = _mm256_setzero_ps();
    for (std::size_t c = 0; c < chunks; ++c) {
      __m256i x[4];
      Dec::Decode(state, k, c, x);
      __m256 scales[2];
      Dec::HalfScales(k, c, d, scales);
      for (int r = 0; r < kRows; ++r) {
        const auto* qc = reinterpret_cast<const __m256i*>(q + r * d + c * kInt8Chunk);
        const auto* first = reinterpret_cast<const __m256i*>(start + (r * chunks + c) * 16);
        for (int m = 0; m < 2; ++m) {
          const __m256i pairs = _mm256_add_epi16(
              _mm256_maddubs_epi16(x[2 * m], _mm256_loadu_si256(qc + 2 * m)),
              _mm256_maddubs_epi16(x[2 * m + 1], _mm256_loadu_si256(qc + 2 * m + 1)));
          const __m256i sums =
              _mm256_add_epi32(_mm256_loadu_si256(first + m), _mm256_madd_epi16(pairs, ones));
          lanes[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scales[m], lanes[r]);
        }
      }
    }
    return;
  }
  __m256i a[kRows];
  for (int r = 0; r < kRows; ++r) a[r] = _mm256_setr_epi32(start[r], 0, 0, 0, 0, 0, 0, 0);
  for (std::size_t c = 0; c < d / kInt8Chunk; ++c) {
    __m256i x[4];
    Dec::Decode(state, k, c, x);
    for (int r = 0; r < kRows; ++r) {
      const auto* qc = reinterpret_cast<const __m256i*>(q + r * d + c * kInt8Chunk);
      __m256i products[4];
      for (int j = 0; j < 4; ++j) {
        products[j] = _mm256_maddubs_epi16(x[j], _mm256_loadu_si256(qc + j));
      }
      if constexpr (4 * kLaneMax < 32768) {
        const __m256i s01 = _mm256_add_epi16(products[0], products[1]);
        const __m256i s23 = _mm256_add_epi16(products[2], products[3]);
        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_add_epi16(s01, s23), ones));
      } else {
        for (const __m256i& p : products) a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(p, ones));
      }
    }
  }
  for (int r = 0; r < kRows; ++r) lanes[r] = _mm256_castsi256_ps(a[r]);
}

// The lane sums of 8 vectors, v[i]'s in lane i: int32 lanes (kInt, as their bits) or fp32 ones,
// each summed in the order of SumLanes1 (lanes l and l + 4, then l and l + 2, then 0 and 1), so
// the fp32 sums are the same bits. 22 ops for 8 sums, where summing each vector alone took 6 and
// a chain of their latencies.
template <bool kInt>
HWY_INLINE __m256 SumLanes8(const __m256 (&v)[8]) {
  const auto add = [](__m256 a, __m256 b) {
    if constexpr (kInt) {
      return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
    } else {
      return _mm256_add_ps(a, b);
    }
  };
  __m256 halves[4];  // vectors 2i (low 128 bits) and 2i + 1 (high): lanes l + (l + 4)
  for (int i = 0; i < 4; ++i) {
    halves[i] = add(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                    _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  }
  __m256 pairs[2];  // vectors 4i, 4i + 2 | 4i + 1, 4i + 3: two partial sums each
  for (int i = 0; i < 2; ++i) {
    pairs[i] = add(_mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                   _mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m256 sums =  // vectors 0, 2, 4, 6 | 1, 3, 5, 7
      add(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
          _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The lane sum of one vector, in SumLanes8's order.
template <bool kInt>
HWY_INLINE float SumLanes1(__m256 v) {
  if constexpr (kInt) {
    const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(_mm256_castps_si256(v)),
                                       _mm256_extracti128_si256(_mm256_castps_si256(v), 1));
    const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
    return static_cast<float>(_mm_cvtsi128_si32(two) + _mm_extract_epi32(two, 1));
  } else {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
  }
}

// As the AVX-512 ScoresInt8, 4 rows at a time (16 registers on AVX2), each key's chunk decoded
// once per 4 rows. Keys go in groups of 8 whose lanes wait in L1 and are summed together
// (SumLanes8): summing each key's lanes on its own put a chain of shuffles and a scattered store
// after every key, and a third of the function's time on them (perf, docs/cpu-experiments.md).
template <class Dec>
HWY_NOINLINE void ScoresInt8(const std::int8_t* HWY_RESTRICT q_bytes,
                             const std::int32_t* HWY_RESTRICT start, int rows, std::size_t d,
                             const std::uint8_t* const* bases, std::int64_t offset, int count,
                             float scale, float* HWY_RESTRICT scores, std::size_t stride,
                             TilePrefetcher& prefetch, int prefetch_per_key) {
  constexpr bool kInt = !Dec::kBlockScales;
  constexpr int kGroup = 8;
  const auto state = Dec::MakeState();
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int t0 = 0; t0 < count; t0 += kGroup) {
    const int keys = std::min(kGroup, count - t0);
    prefetch.Issue(keys * prefetch_per_key);
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      __m256 lanes[4][kGroup];
      for (int i = 0; i < keys; ++i) {
        __m256 key_lanes[4];
        Int8RowLanes<Dec, 4>(q_bytes + r * d, d, start + r * StartsPerRow<Dec>(d),
                             bases[t0 + i] + offset, state, key_lanes);
        for (int j = 0; j < 4; ++j) lanes[j][i] = key_lanes[j];
      }
      for (int i = keys; i < kGroup; ++i) {
        for (auto& row : lanes) row[i] = _mm256_setzero_ps();
      }
      for (int j = 0; j < 4; ++j) {
        __m256 sums = SumLanes8<kInt>(lanes[j]);
        if constexpr (kInt) sums = _mm256_cvtepi32_ps(_mm256_castps_si256(sums));
        sums = _mm256_mul_ps(sums, scale8);
        float* out = scores + (r + j) * stride + t0;
        if (keys == kGroup) {
          _mm256_storeu_ps(out, sums);
        } else {
          alignas(32) float s[kGroup];
          _mm256_store_ps(s, sums);
          std::copy_n(s, keys, out);
        }
      }
    }
    for (; r < rows; ++r) {
      for (int i = 0; i < keys; ++i) {
        __m256 row_lanes[1];
        Int8RowLanes<Dec, 1>(q_bytes + r * d, d, start + r * StartsPerRow<Dec>(d),
                             bases[t0 + i] + offset, state, row_lanes);
        scores[r * stride + t0 + i] = SumLanes1<kInt>(row_lanes[0]) * scale;
      }
    }
  }
}

#endif  // MJOLNIR_INT8_DOT_ARM

#if MJOLNIR_INT8_DOT_ARM
HWY_POP_ATTRIBUTES
#endif

#endif  // HWY_TARGET == HWY_AVX3_DL

#else
#define MJOLNIR_INT8_DOT 0
#endif  // AVX3_DL, AVX3, AVX2, Arm
#ifndef MJOLNIR_INT8_DECODED_KEYS
#define MJOLNIR_INT8_DECODED_KEYS 0
#endif

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_INT8_DOT_INL_H_

// P . V on AVX512-FP16's fp16 FMAs, for P mode fp16 (docs/numerics.md): a vfmadd231ph does 32
// multiply-adds for the cost of one fp32 FMA's 16, and at a decode step's 4 query rows P . V is
// most of the kernel. V's codes are looked up as fp16 words (every e2m1, fp6 and e4m3 value, every
// nvfp4 value times 2^-4 and every e5m2 value times 2^-8 is an fp16), each key's 4 rows x 128
// channels take 16 fp16 FMAs against 32 fp32 FMAs and 8 fp32 decodes, and the products of each
// group of kHalfGroupKeys keys of the tile are summed in fp16 in key order, as the emulator sums
// them, then added into the fp32 accumulators (times 16 for nvfp4, 256 for e5m2).
// docs/cpu-experiments.md, "P . V on AVX512-FP16 FMAs". AVX3_DL target, on CPUs with AVX512-FP16
// (Intel since Sapphire Rapids), fp4_e2m1, nvfp4, fp6 and fp8, D a multiple of 128; elsewhere P
// mode fp16 sums its fp16 P on the fp32 FMAs (fma_values-inl.h). Per-target header, see
// kv_decode-inl.h.

#if defined(MJOLNIR_CPU_HALF_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_HALF_VALUES_INL_H_
#undef MJOLNIR_CPU_HALF_VALUES_INL_H_
#else
#define MJOLNIR_CPU_HALF_VALUES_INL_H_
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/minifloat.h"
#include "cpu/codec_tables.h"
#include "cpu/tile_prefetcher.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"
#include "mjolnir/decode.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {

#undef MJOLNIR_HALF_VALUES
#if HWY_TARGET == HWY_AVX3_DL
#define MJOLNIR_HALF_VALUES 1

// True when this CPU executes AVX512-FP16 (Highway 1.0.3's AVX3_DL does not require it).
inline bool CpuHasHalfFma() {
  static const bool has = __builtin_cpu_supports("avx512fp16") != 0;
  return has;
}

// The formats with a decoder into fp16 words below.
inline bool HasHalfDecoder(Format format) {
  return format == Format::fp4_e2m1 || format == Format::nvfp4 || format == Format::fp6_e2m3 ||
         format == Format::fp6_e3m2 || format == Format::fp8_e4m3 || format == Format::fp8_e5m2;
}

HWY_PUSH_ATTRIBUTES("avx512fp16")

// The fp16 bits of a value that must be an fp16 value (a constant expression fails otherwise).
constexpr std::uint16_t HalfBits(float value) {
  const std::uint32_t code = encode_minifloat<kFp16Spec>(value);
  if (decode_minifloat<kFp16Spec>(code) != value) throw "a value that is not an fp16 value";
  return static_cast<std::uint16_t>(code);
}

// The fp16 words of every code of a format of up to 6 bits, `count` entries: code i % 2^bits, so
// a lookup may ignore the index bits above the code's (as SmallBf16Table for bf16 words).
template <MinifloatSpec kSpec, std::size_t kCount>
struct SmallHalfTable {
  alignas(64) std::array<std::uint16_t, kCount> words{};
  constexpr SmallHalfTable() {
    for (std::uint32_t i = 0; i < kCount; ++i) {
      words[i] = HalfBits(decode_minifloat<kSpec>(i % (1u << kSpec.total_bits())));
    }
  }
};

// A 32-channel vector v of an e2m1 row is its bytes 16 v .. 16 v + 15: lanes 0..15 the low
// nibbles (even channels), 16..31 the high ones, the order of kv_decode-inl.h's DecodeE2M1 and
// DecodeNvfp4 chunks, in which the fp32 accumulators are kept. The bytes are broadcast to both
// halves, widened to words and the high half shifted down by 4: each word holds its nibble in its
// low 4 bits (lanes 0..15 also the next nibble above them). kHighHalfBy4: the shifts.
alignas(64) inline constexpr std::uint16_t kHighHalfBy4[32] = {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4};
HWY_INLINE __m512i NibbleWords(const std::uint8_t* row, std::size_t v, __m512i shifts) {
  const __m256i bytes =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
  return _mm512_srlv_epi16(_mm512_cvtepu8_epi16(bytes), shifts);
}

// fp4 e2m1: vpermw looks the words' low 5 bits up in the 16 values, repeated (so the bit above the
// nibble does not matter): 3 ops a vector.
struct HalfE2M1 {
  static constexpr float kFold = 1.0f;         // 1 / half_sum_scale(fp4_e2m1)
  static constexpr bool kFoldEvenOdd = false;  // lanes in the accumulators' order already
  struct State {
    __m512i table, shifts;
  };
  static HWY_INLINE State MakeState() {
    static constexpr SmallHalfTable<kE2M1Spec, 32> kTable;
    return {_mm512_load_si512(kTable.words.data()), _mm512_load_si512(kHighHalfBy4)};
  }
  static HWY_INLINE __m512h Decode(const State& s, const std::uint8_t* row, std::size_t v,
                                   std::size_t /*d*/) {
    return _mm512_castsi512_ph(_mm512_permutexvar_epi16(NibbleWords(row, v, s.shifts), s.table));
  }
};

// nvfp4: code c times block scale s times 2^-4 (half_sum_scale: 32 keys' sums then stay below
// 168 x 32, far from fp16's 65504) at words[16 s + c]; every product is an fp16 (2 + 4
// significant bits, 2^-14 .. 168), a NaN scale's NaN. As codec_tables.h's kNvfp4ScaledWords for
// bf16 words.
struct HalfNvfp4Words {
  alignas(64) std::array<std::uint16_t, 256 * 16> words{};
  constexpr HalfNvfp4Words() {
    constexpr auto kScales = e4m3_value_table<0>();
    for (std::uint32_t s = 0; s < 256; ++s) {
      for (std::uint32_t c = 0; c < 16; ++c) {
        const float scale = kScales[s];
        words[16 * s + c] = scale != scale
                                ? std::uint16_t(kFp16Spec.nan_encoding())
                                : HalfBits(decode_minifloat<kE2M1Spec>(c) * scale * 0.0625f);
      }
    }
  }
};
inline constexpr HalfNvfp4Words kHalfNvfp4Words{};

// A vector spans blocks 2 v and 2 v + 1: their two table rows fill the register, and the index
// is the nibble plus 16 in the lanes of the second block (lanes 8..15 and 24..31).
struct HalfNvfp4 {
  static constexpr float kFold = 16.0f;  // 1 / half_sum_scale(nvfp4)
  static constexpr bool kFoldEvenOdd = false;
  struct State {
    __m512i shifts, second_block;
  };
  static HWY_INLINE State MakeState() {
    alignas(64) static constexpr std::uint16_t kSecondBlock[32] = {
        0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16,
        0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16};
    return {_mm512_load_si512(kHighHalfBy4), _mm512_load_si512(kSecondBlock)};
  }
  static HWY_INLINE __m512h Decode(const State& s, const std::uint8_t* row, std::size_t v,
                                   std::size_t d) {
    // (nibble & 0x0F) | block offset
    const __m512i index = _mm512_ternarylogic_epi32(NibbleWords(row, v, s.shifts),
                                                    _mm512_set1_epi16(0x0F), s.second_block, 0xEA);
    const std::uint16_t* table = kHalfNvfp4Words.words.data();
    const std::uint8_t* scale_codes = row + d / 2 + 2 * v;
    const __m512i rows = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_load_si256(
            reinterpret_cast<const __m256i*>(table + 16 * std::size_t(scale_codes[0])))),
        _mm256_load_si256(
            reinterpret_cast<const __m256i*>(table + 16 * std::size_t(scale_codes[1]))),
        1);
    return _mm512_castsi512_ph(_mm512_permutexvar_epi16(index, rows));
  }
};

// fp6 (e2m3, e3m2): the codes of a 64-channel chunk are its 48 bytes (code c at bit 6 c), read
// with word_decoders-inl.h's DotFp6 layout: vpermb brings the two bytes holding a code into its
// word, a variable shift puts the code at the word's low bits, and vpermi2w looks the 6 bits up in
// the 64 fp16 values (it ignores the bits above). Vector v is half v % 2 of chunk v / 2, in natural
// order; the fp32 accumulators keep DecodeViaWords' order (each 32 channels' even ones, then the
// odd ones), so the fold separates the lanes first (kFoldEvenOdd).
template <MinifloatSpec kSpec>
struct HalfFp6 {
  static constexpr float kFold = 1.0f;
  static constexpr bool kFoldEvenOdd = true;
  struct State {
    __m512i table0, table1, pairs[2], shifts[2];
  };
  static HWY_INLINE State MakeState() {
    static constexpr SmallHalfTable<kSpec, 64> kTable;
    static constexpr typename DotFp6<kSpec>::Layout kLayout;
    return {
        _mm512_load_si512(kTable.words.data()),
        _mm512_load_si512(kTable.words.data() + 32),
        {_mm512_load_si512(kLayout.pairs[0].data()), _mm512_load_si512(kLayout.pairs[1].data())},
        {_mm512_load_si512(kLayout.shifts[0].data()), _mm512_load_si512(kLayout.shifts[1].data())}};
  }
  static HWY_INLINE __m512h Decode(const State& s, const std::uint8_t* row, std::size_t v,
                                   std::size_t /*d*/) {
    const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64{1} << 48) - 1, row + v / 2 * 48);
    // (The maskz form of vpermb with every lane kept: GCC 12 warns on the unmasked one.)
    const __m512i codes = _mm512_srlv_epi16(
        _mm512_maskz_permutexvar_epi8(~__mmask64{0}, s.pairs[v % 2], bytes), s.shifts[v % 2]);
    return _mm512_castsi512_ph(_mm512_permutex2var_epi16(s.table0, codes, s.table1));
  }
};

// fp8 e4m3: DotFp8's lookup (5 ops per 64 channels) into fp16 words, every e4m3 value being an
// fp16; a chunk's two vectors at once (DecodePair). The words come in DotFp8's order, and the fp32
// accumulators keep DecodeViaWords' (each word vector's even words, then its odd ones), so the fold
// separates the lanes first, as for fp6.
struct HalfE4M3 {
  using Lookup = DotFp8<kE4M3Spec, Fp8Word::fp16>;
  static constexpr float kFold = 1.0f;
  static constexpr bool kFoldEvenOdd = true;
  using State = Lookup::State;
  static HWY_INLINE State MakeState() { return Lookup::MakeState(); }
  static HWY_INLINE void DecodePair(const State& s, const std::uint8_t* row, std::size_t chunk,
                                    __m512h& x0, __m512h& x1) {
    Words w0, w1;
    Lookup::Decode(s, row, chunk, w0, w1);
    x0 = _mm512_castsi512_ph(w0.raw);
    x1 = _mm512_castsi512_ph(w1.raw);
  }
};

// fp8 e5m2: a code is the high byte of its value's fp16, so two byte unpacks against zero make
// the words (in DotFp8's order, which the fp32 accumulators keep as for e4m3), and one exact fp16
// multiply a vector scales them by half_sum_scale's 2^-8 (every e5m2 value times 2^-8 is an fp16,
// 2^-16 becoming fp16's smallest subnormal): 4 ops per 64 channels. Inf and NaN codes stay so.
struct HalfE5M2 {
  static constexpr float kFold = 256.0f;  // 1 / half_sum_scale(fp8_e5m2)
  static constexpr bool kFoldEvenOdd = true;
  struct State {
    __m512h scale;
  };
  static HWY_INLINE State MakeState() { return {_mm512_set1_ph(static_cast<_Float16>(0x1p-8f))}; }
  static HWY_INLINE void DecodePair(const State& s, const std::uint8_t* row, std::size_t chunk,
                                    __m512h& x0, __m512h& x1) {
    const __m512i codes = _mm512_loadu_si512(row + chunk * 64);
    const __m512i zero = _mm512_setzero_si512();
    x0 = _mm512_mul_ph(_mm512_castsi512_ph(_mm512_unpacklo_epi8(zero, codes)), s.scale);
    x1 = _mm512_mul_ph(_mm512_castsi512_ph(_mm512_unpackhi_epi8(zero, codes)), s.scale);
  }
};

// Vectors v0 and v0 + 1 of a V row (64 channels; v0 even) as fp16 words: by chunk pairs where the
// decoder decodes a chunk's two vectors together, else one at a time.
template <class Half>
HWY_INLINE void DecodeTwo(const typename Half::State& s, const std::uint8_t* row, std::size_t v0,
                          std::size_t d, __m512h& x0, __m512h& x1) {
  if constexpr (requires(__m512h & x) { Half::DecodePair(s, row, v0, x, x); }) {
    Half::DecodePair(s, row, v0 / 2, x0, x1);
  } else {
    x0 = Half::Decode(s, row, v0, d);
    x1 = Half::Decode(s, row, v0 + 1, d);
  }
}

// Vectors v0 .. v0 + 3 of a V row (128 channels) as fp16 words.
template <class Half>
HWY_INLINE void DecodeFour(const typename Half::State& s, const std::uint8_t* row, std::size_t v0,
                           std::size_t d, __m512h& x0, __m512h& x1, __m512h& x2, __m512h& x3) {
  DecodeTwo<Half>(s, row, v0, d, x0, x1);
  DecodeTwo<Half>(s, row, v0 + 2, d, x2, x3);
}

// The fp16 half of an fp16 FMA with p broadcast from memory (embedded broadcast: a load, not a
// shuffle; GCC writes vpbroadcastw plus the FMA for the intrinsics).
HWY_INLINE __m512h HalfMulAddBroadcast(const std::uint16_t* p, __m512h x, __m512h acc) {
  asm("vfmadd231ph %2%{1to32%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*p));
  return acc;
}

// sums[r][i] = the fp16 sums over keys [k0, k1) of p[r][t] * vector v0 + i of V row t, for 4
// rows (p rows p_stride apart) and 4 vectors (128 channels). Named accumulators, stored once at
// the end: with an array GCC kept them on the stack and stored every key.
template <class Half>
HWY_INLINE void GroupSums4(const typename Half::State& state, const std::uint8_t* const* bases,
                           std::int64_t offset, int k0, int k1, std::size_t v0, std::size_t d,
                           const std::uint16_t* p, std::size_t p_stride,
                           std::uint16_t (*sums)[32]) {
  __m512h a00 = _mm512_setzero_ph(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00,
          a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00,
          a32 = a00, a33 = a00;
  const std::uint16_t* p0 = p;
  const std::uint16_t* p1 = p + p_stride;
  const std::uint16_t* p2 = p + 2 * p_stride;
  const std::uint16_t* p3 = p + 3 * p_stride;
  for (int t = k0; t < k1; ++t) {
    __m512h x0, x1, x2, x3;
    DecodeFour<Half>(state, bases[t] + offset, v0, d, x0, x1, x2, x3);
    a00 = HalfMulAddBroadcast(p0 + t, x0, a00);
    a01 = HalfMulAddBroadcast(p0 + t, x1, a01);
    a02 = HalfMulAddBroadcast(p0 + t, x2, a02);
    a03 = HalfMulAddBroadcast(p0 + t, x3, a03);
    a10 = HalfMulAddBroadcast(p1 + t, x0, a10);
    a11 = HalfMulAddBroadcast(p1 + t, x1, a11);
    a12 = HalfMulAddBroadcast(p1 + t, x2, a12);
    a13 = HalfMulAddBroadcast(p1 + t, x3, a13);
    a20 = HalfMulAddBroadcast(p2 + t, x0, a20);
    a21 = HalfMulAddBroadcast(p2 + t, x1, a21);
    a22 = HalfMulAddBroadcast(p2 + t, x2, a22);
    a23 = HalfMulAddBroadcast(p2 + t, x3, a23);
    a30 = HalfMulAddBroadcast(p3 + t, x0, a30);
    a31 = HalfMulAddBroadcast(p3 + t, x1, a31);
    a32 = HalfMulAddBroadcast(p3 + t, x2, a32);
    a33 = HalfMulAddBroadcast(p3 + t, x3, a33);
  }
  const __m512h all[16] = {a00, a01, a02, a03, a10, a11, a12, a13,
                           a20, a21, a22, a23, a30, a31, a32, a33};
  for (int k = 0; k < 16; ++k) _mm512_store_ph(sums[k], all[k]);
}

// As GroupSums4 for 8 rows and 2 vectors (64 channels; v0 even): each V vector decoded once for 8
// rows, against once for 4 in GroupSums4, with as many accumulators. sums[2 r + i]: row r, vector
// v0 + i.
template <class Half>
HWY_INLINE void GroupSums8(const typename Half::State& state, const std::uint8_t* const* bases,
                           std::int64_t offset, int k0, int k1, std::size_t v0, std::size_t d,
                           const std::uint16_t* p, std::size_t p_stride,
                           std::uint16_t (*sums)[32]) {
  __m512h a00 = _mm512_setzero_ph(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
          a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00, a61 = a00,
          a70 = a00, a71 = a00;
  const std::uint16_t* p0 = p;
  const std::uint16_t* p1 = p + p_stride;
  const std::uint16_t* p2 = p + 2 * p_stride;
  const std::uint16_t* p3 = p + 3 * p_stride;
  const std::uint16_t* p4 = p + 4 * p_stride;
  const std::uint16_t* p5 = p + 5 * p_stride;
  const std::uint16_t* p6 = p + 6 * p_stride;
  const std::uint16_t* p7 = p + 7 * p_stride;
  for (int t = k0; t < k1; ++t) {
    __m512h x0, x1;
    DecodeTwo<Half>(state, bases[t] + offset, v0, d, x0, x1);
    a00 = HalfMulAddBroadcast(p0 + t, x0, a00);
    a01 = HalfMulAddBroadcast(p0 + t, x1, a01);
    a10 = HalfMulAddBroadcast(p1 + t, x0, a10);
    a11 = HalfMulAddBroadcast(p1 + t, x1, a11);
    a20 = HalfMulAddBroadcast(p2 + t, x0, a20);
    a21 = HalfMulAddBroadcast(p2 + t, x1, a21);
    a30 = HalfMulAddBroadcast(p3 + t, x0, a30);
    a31 = HalfMulAddBroadcast(p3 + t, x1, a31);
    a40 = HalfMulAddBroadcast(p4 + t, x0, a40);
    a41 = HalfMulAddBroadcast(p4 + t, x1, a41);
    a50 = HalfMulAddBroadcast(p5 + t, x0, a50);
    a51 = HalfMulAddBroadcast(p5 + t, x1, a51);
    a60 = HalfMulAddBroadcast(p6 + t, x0, a60);
    a61 = HalfMulAddBroadcast(p6 + t, x1, a61);
    a70 = HalfMulAddBroadcast(p7 + t, x0, a70);
    a71 = HalfMulAddBroadcast(p7 + t, x1, a71);
  }
  const __m512h all[16] = {a00, a01, a10, a11, a20, a21, a30, a31,
                           a40, a41, a50, a51, a60, a61, a70, a71};
  for (int k = 0; k < 16; ++k) _mm512_store_ph(sums[k], all[k]);
}

// As GroupSums4 for one row.
template <class Half>
HWY_INLINE void GroupSums1(const typename Half::State& state, const std::uint8_t* const* bases,
                           std::int64_t offset, int k0, int k1, std::size_t v0, std::size_t d,
                           const std::uint16_t* p, std::uint16_t (*sums)[32]) {
  __m512h a0 = _mm512_setzero_ph(), a1 = a0, a2 = a0, a3 = a0;
  for (int t = k0; t < k1; ++t) {
    __m512h x0, x1, x2, x3;
    DecodeFour<Half>(state, bases[t] + offset, v0, d, x0, x1, x2, x3);
    a0 = HalfMulAddBroadcast(p + t, x0, a0);
    a1 = HalfMulAddBroadcast(p + t, x1, a1);
    a2 = HalfMulAddBroadcast(p + t, x2, a2);
    a3 = HalfMulAddBroadcast(p + t, x3, a3);
  }
  _mm512_store_ph(sums[0], a0);
  _mm512_store_ph(sums[1], a1);
  _mm512_store_ph(sums[2], a2);
  _mm512_store_ph(sums[3], a3);
}

// ValuesHalf's blocks over the count V rows at bases[t] + offset as Half reads them, P as fp16
// words [rows][p_stride].
template <class Half>
HWY_INLINE void HalfGroups(const typename Half::State& state, const std::uint16_t* words,
                           std::size_t p_stride, int rows, const std::uint8_t* const* bases,
                           std::int64_t offset, int count, std::size_t d, float* HWY_RESTRICT acc,
                           std::size_t ld, const float* alpha, TilePrefetcher& prefetch,
                           std::size_t tile_prefetch) {
  alignas(64) std::uint16_t sums[16][32];
  // Adds row r's group sums of vectors v0 .. v0 + vectors - 1 (row_sums[i]: vector v0 + i) into
  // its accumulators.
  const auto fold = [&](int r, int k0, std::size_t v0, int vectors,
                        std::uint16_t(*row_sums)[32]) HWY_ATTR {
    float* a = acc + std::size_t(r) * ld;
    const bool rescale = k0 == 0 && alpha != nullptr;  // the tile's alpha, once
    const __m512 scale = _mm512_set1_ps(rescale ? alpha[r] : 1.0f);
    const __m512 half_fold = _mm512_set1_ps(Half::kFold);
    alignas(64) static constexpr std::uint16_t kEvenThenOdd[32] = {
        0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
        1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    for (int i = 0; i < vectors; ++i) {
      std::uint16_t* s = row_sums[i];
      if constexpr (Half::kFoldEvenOdd) {  // into the accumulators' order: even lanes, odd lanes
        _mm512_store_si512(
            s, _mm512_permutexvar_epi16(_mm512_load_si512(kEvenThenOdd), _mm512_load_si512(s)));
      }
      float* dst = a + (v0 + i) * 32;
      for (int h = 0; h < 2; ++h) {
        const __m512 sum =
            _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(s + 16 * h)));
        __m512 kept = _mm512_loadu_ps(dst + 16 * h);
        if (rescale) kept = _mm512_mul_ps(kept, scale);
        _mm512_storeu_ps(dst + 16 * h, _mm512_fmadd_ps(sum, half_fold, kept));
      }
    }
  };
  for (int k0 = 0; k0 < count; k0 += kHalfGroupKeys) {
    const int k1 = k0 + kHalfGroupKeys < count ? k0 + kHalfGroupKeys : count;
    prefetch.Issue(
        int((tile_prefetch * std::size_t(k1 - k0) + std::size_t(count) - 1) / std::size_t(count)));
    // Blocks of 8 rows x 64 channels, then the rows left in blocks of 4 (and 1) x 128 channels.
    const int rows8 = rows / 8 * 8;
    for (std::size_t v0 = 0; v0 < d / 32; v0 += 2) {
      for (int r = 0; r < rows8; r += 8) {
        GroupSums8<Half>(state, bases, offset, k0, k1, v0, d, words + r * p_stride, p_stride, sums);
        for (int j = 0; j < 8; ++j) fold(r + j, k0, v0, 2, sums + 2 * j);
      }
    }
    for (std::size_t v0 = 0; v0 < d / 32; v0 += 4) {
      int r = rows8;
      for (; r + 4 <= rows; r += 4) {
        GroupSums4<Half>(state, bases, offset, k0, k1, v0, d, words + r * p_stride, p_stride, sums);
        for (int j = 0; j < 4; ++j) fold(r + j, k0, v0, 4, sums + 4 * j);
      }
      for (; r < rows; ++r) {
        GroupSums1<Half>(state, bases, offset, k0, k1, v0, d, words + r * p_stride, sums);
        fold(r, k0, v0, 4, sums);
      }
    }
  }
}

// V rows that ValuesHalf decoded into fp16 words once per tile, read back as they are: the
// decoder's lanes, order and scale, so the fold is Half's.
template <class Half>
struct HalfStored {
  static constexpr float kFold = Half::kFold;
  static constexpr bool kFoldEvenOdd = Half::kFoldEvenOdd;
  struct State {};
  static HWY_INLINE State MakeState() { return {}; }
  static HWY_INLINE __m512h Decode(const State&, const std::uint8_t* row, std::size_t v,
                                   std::size_t /*d*/) {
    return _mm512_castsi512_ph(_mm512_load_si512(row + 64 * v));
  }
};

// acc [rows][ld] (the fp32 decoder's channel order) = alpha * acc + P . V over the tile's count
// V rows at bases[t] + offset, P [rows][stride] already rounded to fp16 values (SoftmaxTile);
// alpha null: no rescale. prefetch_rows: the rows of the next tile to prefetch per pair of fp32
// vectors, as AccumulateValues issues them. stored_rows: where the unit decodes V once per tile
// (UnitPaths::decoded_values; row t at stored_rows + t * stored_stride, listed in stored_bases),
// the rows are decoded into fp16 words there first, where the blocks would decode each V vector
// once per block of rows (16 times a key for a prompt's 128); null: the blocks decode.
template <class Half>
HWY_NOINLINE void ValuesHalf(const float* HWY_RESTRICT probs, std::size_t stride, int rows,
                             const std::uint8_t* const* bases, std::int64_t offset, int count,
                             std::size_t d, float* HWY_RESTRICT acc, std::size_t ld,
                             const float* alpha, TilePrefetcher& prefetch, int prefetch_rows,
                             std::uint8_t* stored_rows, std::size_t stored_stride,
                             const std::uint8_t* const* stored_bases) {
  // P as fp16 words (exact: P was rounded to fp16 values), 32 words of padding a row.
  thread_local std::vector<std::uint16_t> words;
  const std::size_t p_stride = (std::size_t(count) + 31) / 32 * 32;
  if (words.size() < std::size_t(rows) * p_stride) words.resize(std::size_t(rows) * p_stride);
  for (int r = 0; r < rows; ++r) {
    for (int t = 0; t < count; t += 16) {
      const __m512 p = _mm512_loadu_ps(probs + std::size_t(r) * stride + t);  // padded rows
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words.data() + r * p_stride + t),
                          _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  const auto state = Half::MakeState();
  // The fp32 path issues d / 32 x prefetch_rows rows over a tile; as many here, by group.
  const std::size_t tile_prefetch = d / 32 * std::size_t(prefetch_rows);
  if (stored_rows == nullptr) {
    HalfGroups<Half>(state, words.data(), p_stride, rows, bases, offset, count, d, acc, ld, alpha,
                     prefetch, tile_prefetch);
    return;
  }
  for (int t = 0; t < count; ++t) {
    auto* out = reinterpret_cast<std::uint16_t*>(stored_rows + std::size_t(t) * stored_stride);
    for (std::size_t v = 0; v < d / 32; v += 4) {
      __m512h x0, x1, x2, x3;
      DecodeFour<Half>(state, bases[t] + offset, v, d, x0, x1, x2, x3);
      _mm512_store_ph(out + 32 * v, x0);
      _mm512_store_ph(out + 32 * (v + 1), x1);
      _mm512_store_ph(out + 32 * (v + 2), x2);
      _mm512_store_ph(out + 32 * (v + 3), x3);
    }
  }
  HalfGroups<HalfStored<Half>>({}, words.data(), p_stride, rows, stored_bases, 0, count, d, acc, ld,
                               alpha, prefetch, tile_prefetch);
}

HWY_POP_ATTRIBUTES

// Calls f.template operator()<Half>() with the fp16 decoder of `format` (HasHalfDecoder).
template <class F>
HWY_INLINE void VisitHalfDecoder(Format format, F&& f) {
  if (format == Format::nvfp4) {
    f.template operator()<HalfNvfp4>();
  } else if (format == Format::fp6_e2m3) {
    f.template operator()<HalfFp6<kE2M3Spec>>();
  } else if (format == Format::fp6_e3m2) {
    f.template operator()<HalfFp6<kE3M2Spec>>();
  } else if (format == Format::fp8_e4m3) {
    f.template operator()<HalfE4M3>();
  } else if (format == Format::fp8_e5m2) {
    f.template operator()<HalfE5M2>();
  } else {
    f.template operator()<HalfE2M1>();
  }
}

#else
#define MJOLNIR_HALF_VALUES 0
#endif  // HWY_TARGET == HWY_AVX3_DL

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_HALF_VALUES_INL_H_

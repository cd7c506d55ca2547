// SIMD decoders of packed KV rows (docs/design.md section 3) into fp32, one per format, for the CPU
// kernels. Per-target header (Highway "-inl" convention): included once per foreach_target pass.
//
// A decoder turns the codes of a row into fp32 vectors in registers, with as few instructions as
// the format allows, so the kernels can feed them straight into FMAs (a decoded row is never
// stored). It works in chunks: Load() reads the bytes of chunk c (one or a few 8-32 byte loads)
// and Get<j>() produces vector j of the chunk (kVectors of them). Two liberties, which the
// kernel undoes for free:
//   - Channel order. A row decodes to the channel order ChannelOrder() gives: formats whose
//     codes are cheaper to unpack in another order (bf16 even/odd halves of a 32-bit word, fp4
//     low/high nibbles, fp6 the four codes of a 3-byte group) keep that order. The kernel
//     permutes Q into the same order once per work item and O back once at the end, so q . k
//     and p . v see matching channels and nothing is shuffled per token.
//   - A power-of-two scale. Output = value * 2^kRawExp exactly (every decoded value is exactly
//     representable, subnormal fp32 included, so the scaling loses nothing). Codes are placed
//     straight into fp32 bit fields (sign, exponent, mantissa) without re-biasing the exponent;
//     the bias difference is the power of two, which the kernel folds into Q and the score
//     scale (for K) or into P and the output scale (for V).
// Subnormal fp32 values cost nothing on AMD and Arm cores but a microcode assist per FMA on
// Intel's, so the x86 AVX2 and AVX-512 decoders avoid them: e2m1 and nvfp4 by table lookup,
// fp8 through fp16 and F16C, fp6 (AVX-512) by looking its magnitude up; on AVX3_DL the kernels
// take word_decoders-inl.h's decoders for fp8 and fp6 (VisitKernelDecoder), and on AVX2 fp6
// through fp16 (DecodeFp6Half) where subnormals are slow (Intel); on SSE4 there the placed values
// are lifted out of the subnormal range (DecodeLifted). Arm keeps the fp32 subnormals (its cores
// take them at full speed).
// Codes that never reach a cache written by write_kv (Inf/NaN codes of e4m3 and e5m2) decode to
// finite values here (e5m2's to Inf/NaN through F16C); every finite code decodes exactly
// (tests/test_cpu_kernels.cc checks every code against decode_row).

#if defined(MJOLNIR_CPU_KV_DECODE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_KV_DECODE_INL_H_
#undef MJOLNIR_CPU_KV_DECODE_INL_H_
#else
#define MJOLNIR_CPU_KV_DECODE_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/format_table.h"
#include "core/minifloat.h"
#include "cpu/codec_tables.h"
#include "hwy/highway.h"
#include "mjolnir/format.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// The widest float vectors the kernels use: a row has a multiple of 32 channels, so 16 lanes
// (AVX-512) always divide it.
using WideFloatTag = hn::CappedTag<float, 16>;

// Lanes of the fp6 and nvfp4 decoders: 16 on AVX-512; on AVX2 8, two 128-bit blocks (fp6
// unpacks each block on its own; nvfp4's vectors must not span two scale blocks there); 4
// elsewhere (SSE4, NEON, SVE).
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define MJOLNIR_WIDE_FP6 1
inline constexpr std::size_t kBlockLanes = 16;
#elif HWY_TARGET == HWY_AVX2
#define MJOLNIR_WIDE_FP6 0
inline constexpr std::size_t kBlockLanes = 8;
#else
#define MJOLNIR_WIDE_FP6 0
inline constexpr std::size_t kBlockLanes = 4;
#endif
using BlockFloatTag = hn::CappedTag<float, kBlockLanes>;

// Rows are addressed by byte strides chosen by the caller, so every load is a byte load
// reinterpreted (no alignment assumed beyond one byte).
template <class D>
HWY_INLINE hn::Vec<D> LoadBytesAs(D d, const std::uint8_t* p) {
  const hn::Repartition<std::uint8_t, D> d8;
  return hn::BitCast(d, hn::LoadU(d8, p));
}

// x * 2^kLift for an fp32 x whose exponent field is at most 254 - kLift (the raw values of the bit
// placements below, subnormals included, are all far smaller), exactly and never subnormal, with
// 8 integer and fp32 ops that take no assist: the decoders of SSE4 on CPUs with slow subnormals
// (DecodeLifted). A normal x takes kLift on its exponent field. A subnormal, m 2^-149, gets the
// exponent field kLift + 1, which reads 2^(kLift-126) + m 2^(kLift-149), and the first term is
// subtracted (exact: both lie in [2^(kLift-126), 2^(kLift-125))); zero stays zero. The sign is
// set apart first and put back last.
template <int kLift, class DF>
HWY_INLINE hn::Vec<DF> LiftToNormal(DF df, hn::Vec<DF> x) {
  static_assert(kLift >= 1 && kLift <= 126);
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(di, x);
  const auto magnitude = hn::And(bits, hn::Set(di, 0x7FFFFFFF));
  const auto sign = hn::Xor(bits, magnitude);
  const auto subnormal = hn::RebindMask(df, hn::Lt(magnitude, hn::Set(di, 1 << 23)));
  const auto normal = hn::BitCast(df, hn::Add(magnitude, hn::Set(di, kLift << 23)));
  const auto leading = hn::BitCast(df, hn::Set(di, (kLift + 1) << 23));  // 2^(kLift-126)
  const auto from_subnormal =
      hn::Sub(hn::BitCast(df, hn::Add(magnitude, hn::Set(di, (kLift + 1) << 23))), leading);
  return hn::Or(hn::IfThenElse(subnormal, from_subnormal, normal), hn::BitCast(df, sign));
}

// --- fp8 -----------------------------------------------------------------------------------------
// One byte per channel, sign-extended into a 32-bit lane and shifted so the sign lands in bit
// 31 and exponent + mantissa in the top of the fp32 exponent and mantissa fields; the AND drops
// the copies of the sign that the extension left between them. Three instructions per vector.

template <int kShift, std::uint32_t kMask, int kRaw>
struct DecodeFp8 {
  static constexpr int kRawExp = kRaw;
  static constexpr std::size_t kVectors = 1;
  using Tag = WideFloatTag;

  template <class DF>
  static HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> Load(DF df, const std::uint8_t* row,
                                                         std::size_t chunk, std::size_t) {
    const hn::RebindToSigned<DF> di;
    const hn::Rebind<std::int8_t, DF> d8;
    const std::size_t n = hn::Lanes(df);
    return hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const std::int8_t*>(row) + chunk * n));
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR raw, hn::Vec<DF>) {
    const hn::RebindToSigned<DF> di;
    return hn::BitCast(
        df, hn::And(hn::ShiftLeft<kShift>(raw), hn::Set(di, static_cast<std::int32_t>(kMask))));
  }
};

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
#define MJOLNIR_FP8_HALF 1
// x86 with F16C: the codes are placed into fp16 bit fields instead, and the hardware conversion
// to fp32 turns fp16 subnormals into normal fp32 values, so no FMA meets an fp32 subnormal (an
// Intel microcode assist each; see E2M1Value). The byte is sign-extended to 16 bits, shifted
// (kShift) and masked (kMask16, e4m3 only): for e4m3 one op more than the fp32 placement, for
// e5m2 as many.
template <int kShift, std::uint16_t kMask16, int kRaw>
struct DecodeFp8Half {
  static constexpr int kRawExp = kRaw;
  static constexpr std::size_t kVectors = 1;
  using Tag = WideFloatTag;

  template <class DF>
  static HWY_INLINE hn::Vec<hn::Rebind<std::int16_t, DF>> Load(DF df, const std::uint8_t* row,
                                                               std::size_t chunk, std::size_t) {
    const hn::Rebind<std::int16_t, DF> d16;
    const hn::Rebind<std::int8_t, DF> d8;
    const std::size_t n = hn::Lanes(df);
    return hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const std::int8_t*>(row) + chunk * n));
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR raw, hn::Vec<DF>) {
    const hn::Rebind<std::int16_t, DF> d16;
    const hn::Rebind<hwy::float16_t, DF> dh;
    auto bits = hn::ShiftLeft<kShift>(raw);
    if constexpr (kMask16 != 0xFFFFu) {
      bits = hn::And(bits, hn::Set(d16, static_cast<std::int16_t>(kMask16)));
    }
    return hn::PromoteTo(df, hn::BitCast(dh, bits));
  }
};
// s.eeee.mmm -> fp16 bits 15 | 13..10 | 9..7: 2^(e-15) (1.m) for a true 2^(e-7) (1.m), the
// subnormal m 2^-9 the fp16 subnormal m 2^-17: both 2^-8.
using DecodeE4M3 = DecodeFp8Half<7, 0xBF80u, -8>;
// s.eeeee.mm is the high byte of the fp16 of the same value: no mask, true values.
using DecodeE5M2 = DecodeFp8Half<8, 0xFFFFu, 0>;

// The true values of e4m3 codes, one a lane: nvfp4's block scales for the kernels that multiply
// blocks' sums by them. DecodeE4M3's fp16 placement and conversion (value times 2^-8, no fp32
// subnormal for an Intel FMA to take an assist on), times 2^8; S.1111.111 is NaN.
template <class DF>
HWY_INLINE hn::Vec<DF> E4M3Values(DF df, hn::Vec<hn::Rebind<std::uint8_t, DF>> codes) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<std::int16_t, DF> d16;
  const hn::Rebind<std::int8_t, DF> d8;
  static_assert(DecodeE4M3::kRawExp == -8);
  const auto wide = hn::PromoteTo(d16, hn::BitCast(d8, codes));
  const auto values = hn::Mul(DecodeE4M3::Get<0>(df, wide, hn::Zero(df)), hn::Set(df, 0x1p8f));
  const auto magnitude = hn::And(hn::PromoteTo(du, codes), hn::Set(du, 0x7Fu));
  return hn::IfThenElse(hn::RebindMask(df, hn::Eq(magnitude, hn::Set(du, 0x7Fu))),
                        hn::Set(df, __builtin_nanf("")), values);
}
#else
#define MJOLNIR_FP8_HALF 0
// s.eeee.mmm -> fp32 bits 31 | 26..23 | 22..20: 2^(e-127) (1.m) for a true 2^(e-7) (1.m), and
// the subnormal m 2^-9 lands on the fp32 subnormal m 2^-129: both 2^-120.
using DecodeE4M3 = DecodeFp8<20, 0x87F00000u, -120>;
// s.eeeee.mm -> bits 31 | 27..23 | 22..21: 2^(e-127) for 2^(e-15).
using DecodeE5M2 = DecodeFp8<21, 0x8FE00000u, -112>;
#endif

// --- bf16 / fp16 ---------------------------------------------------------------------------------

struct DecodeBf16 {
  // A 32-bit word holds channels 2i (low half) and 2i+1 (high half): the high half already is an
  // fp32 once the low half is masked off, the low half once shifted up. One instruction per
  // vector; each chunk of 2n channels comes out as its n even channels, then its n odd ones.
  static constexpr int kRawExp = 0;
  static constexpr std::size_t kVectors = 2;
  using Tag = WideFloatTag;

  template <class DF>
  static HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> Load(DF df, const std::uint8_t* row,
                                                           std::size_t chunk, std::size_t) {
    const hn::RebindToUnsigned<DF> du;
    return LoadBytesAs(du, row + chunk * 4 * hn::Lanes(df));
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR words, hn::Vec<DF>) {
    const hn::RebindToUnsigned<DF> du;
    if constexpr (kJ == 0) return hn::BitCast(df, hn::ShiftLeft<16>(words));
    return hn::BitCast(df, hn::And(words, hn::Set(du, 0xFFFF0000u)));
  }
};

struct DecodeFp16 {
  // The hardware conversion (F16C on x86, FCVTL on Arm) is exact, subnormals included.
  static constexpr int kRawExp = 0;
  static constexpr std::size_t kVectors = 1;
  using Tag = WideFloatTag;

  template <class DF>
  static HWY_INLINE hn::Vec<hn::Rebind<hwy::float16_t, DF>> Load(DF df, const std::uint8_t* row,
                                                                 std::size_t chunk, std::size_t) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    return LoadBytesAs(dh, row + chunk * 2 * hn::Lanes(df));
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR halves, hn::Vec<DF>) {
    return hn::PromoteTo(df, halves);
  }
};

// --- fp4 e2m1 and nvfp4 --------------------------------------------------------------------------
// A byte holds channels 2i (low nibble) and 2i+1 (high nibble). Shifting a nibble to the top of
// its 32-bit lane puts its sign in bit 31; an arithmetic shift right by 6 then drops exponent and
// mantissa (3 bits) into fp32 bits 24..22, and the AND clears the sign copies above them:
// 2^(e-127) (1.m) for a true 2^(e-1) (1.m), the subnormal m/2 as the fp32 subnormal m 2^-127.
// Each chunk of 2n channels (n bytes) comes out as its n even channels, then its n odd ones.

template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> LoadNibbleBytes(DF /* d */, const std::uint8_t* p) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<std::uint8_t, DF> d8;
  return hn::PromoteTo(du, hn::LoadU(d8, p));
}

template <std::size_t kJ, class DF, class VU>
HWY_INLINE hn::Vec<DF> E2M1Nibble(DF df, VU bytes32) {
  const hn::RebindToSigned<DF> di;
  const auto x = hn::BitCast(di, bytes32);
  const auto top = kJ == 0 ? hn::ShiftLeft<28>(x) : hn::ShiftLeft<24>(x);
  return hn::BitCast(
      df, hn::And(hn::ShiftRight<6>(top), hn::Set(di, static_cast<std::int32_t>(0x81C00000u))));
}

// On x86 with AVX2 or AVX-512 a nibble is instead looked up in a table of the 16 true values
// (vpermps: AVX-512 indexes 16 entries with the low 4 bits of a lane; AVX2 8 entries with the low
// 3, the magnitude, and the sign is put back from bit 3): e2m1's 0.5 is then not the fp32
// subnormal 2^-127, which Intel cores multiply through a microcode assist at 40-80x the cost.
// (SSE4 keeps the bit placement, lifted where subnormals are slow: DecodeLifted; Arm cores take
// subnormals at full speed.)
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
#define MJOLNIR_E2M1_LOOKUP 1
template <std::size_t kJ, class DF, class VU>
HWY_INLINE hn::Vec<DF> E2M1Value(DF df, VU bytes32) {
  const hn::RebindToUnsigned<DF> du;
  const auto index = kJ == 0 ? bytes32 : hn::ShiftRight<4>(bytes32);
#if HWY_TARGET == HWY_AVX2
  alignas(32) static constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f,
                                                       2.0f, 3.0f, 4.0f, 6.0f};
  const auto magnitude =
      hn::Vec<DF>{_mm256_permutevar8x32_ps(hn::Load(df, kMagnitudes).raw, index.raw)};
  const auto sign = hn::And(kJ == 0 ? hn::ShiftLeft<28>(bytes32) : hn::ShiftLeft<24>(bytes32),
                            hn::Set(du, 0x80000000u));
  return hn::Or(magnitude, hn::BitCast(df, sign));
#else
  alignas(64) static constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                                    4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                                    -2.0f, -3.0f, -4.0f, -6.0f};
  (void)du;
  return hn::Vec<DF>{_mm512_permutexvar_ps(index.raw, hn::Load(df, kValues).raw)};
#endif
}
#else
#define MJOLNIR_E2M1_LOOKUP 0
#endif

// kLookup: the nibbles looked up as true values (x86: E2M1Value), else placed as bits, the
// subnormal ones included (the placement is the one decoder elsewhere; on x86 the kernels take it
// where the CPU multiplies fp32 subnormals at full speed, VisitKernelDecoder).
template <bool kLookup>
struct DecodeE2M1Of {
  static constexpr int kRawExp = kLookup ? 0 : -126;
  static constexpr std::size_t kVectors = 2;
  using Tag = WideFloatTag;

  template <class DF>
  static HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> Load(DF df, const std::uint8_t* row,
                                                           std::size_t chunk, std::size_t) {
    return LoadNibbleBytes(df, row + chunk * hn::Lanes(df));
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR bytes32, hn::Vec<DF>) {
#if MJOLNIR_E2M1_LOOKUP
    if constexpr (kLookup) return E2M1Value<kJ>(df, bytes32);
#else
    static_assert(!kLookup);
#endif
    return E2M1Nibble<kJ>(df, bytes32);
  }
};
using DecodeE2M1 = DecodeE2M1Of<bool(MJOLNIR_E2M1_LOOKUP)>;

// kTrueElements: the e2m1 elements as true values (looked up, or lifted out of the subnormal
// range by LiftToNormal: DecodeNvfp4Lifted), else as placed bits.
template <bool kTrueElements>
struct DecodeNvfp4Of {
  // value = e2m1 * block scale. The block scale (e4m3, one per 16 channels, after the D/2 code
  // bytes) is looked up times 2^64, so the exact product raw(e2m1) * scale * 2^64 =
  // value * 2^-62 is a normal fp32 for every non-zero code. One FMA per vector. A chunk of 2n
  // channels spans 2n / 16 scale blocks, and lane l of both its vectors comes from byte l, so
  // its scale vector holds each block's scale in n / (2n / 16) consecutive lanes: one block
  // (n = 8: AVX2) or two (n = 16: AVX-512).
  // With true elements the scales are true values too: the products are normal.
  static constexpr int kScaleExp = kTrueElements ? 0 : 64;
  static constexpr int kRawExp = kTrueElements ? 0 : -126 + kScaleExp;
  static constexpr std::size_t kVectors = 2;
  using Tag = BlockFloatTag;

  template <class DF>
  static HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> Load(DF df, const std::uint8_t* row,
                                                           std::size_t chunk, std::size_t) {
    return LoadNibbleBytes(df, row + chunk * hn::Lanes(df));
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t* row, std::size_t chunk,
                                    std::size_t head_dim) {
    static constexpr auto kScales = e4m3_value_table<kScaleExp>();
    const std::uint8_t* scale_codes =
        row + head_dim / 2 + chunk * 2 * hn::Lanes(df) / kNvfp4BlockSize;
    if constexpr (hn::MaxLanes(df) == 16) {
      const hn::Half<DF> dh;
      return hn::Combine(df, hn::Set(dh, kScales[scale_codes[1]]),
                         hn::Set(dh, kScales[scale_codes[0]]));
    } else {
      static_assert(hn::MaxLanes(df) <= 8);
      return hn::Set(df, kScales[scale_codes[0]]);
    }
  }
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR bytes32, hn::Vec<DF> scale) {
    // The raw nibble is an fp32 subnormal for e = 0 codes. Zen 3 multiplies a subnormal operand
    // through a slow microcoded path (3x slower decode measured) but fuses it at full speed in an
    // FMA, so the exact product is taken as x * scale + (-0), which is x * scale, signed zeros
    // included.
    if constexpr (kTrueElements) {
#if MJOLNIR_E2M1_LOOKUP
      return hn::Mul(E2M1Value<kJ>(df, bytes32), scale);
#else
      return hn::Mul(LiftToNormal<126>(df, E2M1Nibble<kJ>(df, bytes32)), scale);
#endif
    } else {
      return hn::MulAdd(E2M1Nibble<kJ>(df, bytes32), scale, hn::Set(df, -0.0f));
    }
  }
};
using DecodeNvfp4 = DecodeNvfp4Of<bool(MJOLNIR_E2M1_LOOKUP)>;

// --- fp6 -----------------------------------------------------------------------------------------
// Four codes in three bytes, the little-endian word c0 | c1<<6 | c2<<12 | c3<<18. A byte shuffle
// spreads the groups of a 128-bit block into 32-bit lanes (group j in lane j); code k of every
// lane is then shifted to the top (sign in bit 31), arithmetic-shifted down onto the fp32
// exponent and mantissa fields, and masked: three instructions per vector. A chunk (4n channels,
// 3n bytes) comes out as code 0 of its n groups, then code 1, code 2, code 3.
// Loads never read outside the row: every block but a chunk's last loads the 16 bytes at its
// 12; the last loads the 16 bytes that end where its 12 end and shuffles from 4 bytes further.

template <int kExponentBits>
struct DecodeFp6 {
  // e2m3: 2^(e-127) (1.m) for 2^(e-1) (1.m), subnormals likewise: 2^-126.
  // e3m2: 2^(e-127) (1.m) for 2^(e-3) (1.m): 2^-124.
  static constexpr int kMantissaBits = 5 - kExponentBits;
  static constexpr int kRawExp = kExponentBits == 2 ? -126 : -124;
  static constexpr std::size_t kVectors = 4;
  using Tag = BlockFloatTag;

  template <class DF>
  static HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> Load(DF df, const std::uint8_t* row,
                                                         std::size_t chunk, std::size_t head_dim) {
    const hn::RebindToSigned<DF> di;
    const hn::Repartition<std::uint8_t, DF> d8;
    constexpr std::size_t n = kBlockLanes;
    // Lane j of a block gets bytes 3j..3j+2 (from 4 further on in a shifted block); the fourth
    // byte is never used (shifted out), so it repeats an index to stay in range everywhere.
    alignas(16) static constexpr std::uint8_t kGroups[16] = {0, 1, 2, 2, 3, 4,  5,  5,
                                                             6, 7, 8, 8, 9, 10, 11, 11};
    alignas(16) static constexpr std::uint8_t kGroupsShifted[16] = {4,  5,  6,  6,  7,  8,  9,  9,
                                                                    10, 11, 12, 12, 13, 14, 15, 15};
    const std::uint8_t* p = row + chunk * 3 * n;
    hn::Vec<decltype(d8)> bytes, index;
    if constexpr (n == 8) {
      const hn::Half<decltype(d8)> d8h;
      bytes = hn::Combine(d8, hn::LoadU(d8h, p + 8), hn::LoadU(d8h, p));
      index = hn::Combine(d8, hn::Load(d8h, kGroupsShifted), hn::Load(d8h, kGroups));
    } else {  // n == 4: one block per chunk; D >= 32 channels = 2 chunks at least
      const bool last = (chunk + 1) * 4 * n == head_dim;
      bytes = hn::LoadU(d8, last ? p - 4 : p);
      index = hn::Load(d8, last ? kGroupsShifted : kGroups);
    }
    (void)df;
    return hn::BitCast(di, hn::TableLookupBytes(bytes, index));
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR words, hn::Vec<DF>) {
    const hn::RebindToSigned<DF> di;
    constexpr int kUp = 26 - 6 * int(kJ);     // code kJ's sign to bit 31
    constexpr int kDown = 3 + kMantissaBits;  // its 5 magnitude bits onto fp32 bits 20/21..
    const auto mask = hn::Set(di, static_cast<std::int32_t>(0x80000000u | (0x1Fu << (26 - kDown))));
    return hn::BitCast(df, hn::And(hn::ShiftRight<kDown>(hn::ShiftLeft<kUp>(words)), mask));
  }
};

// AVX-512: a chunk is 8 groups (32 channels, 24 bytes) in two 16-lane vectors. One masked load
// (it never reads past the 24 bytes, so never outside the row), a dword permute that puts groups
// 0-3 into 128-bit blocks 0 and 2 and groups 4-7 into blocks 1 and 3, and the byte shuffle above
// give lane l group l % 8; vector j then takes code 2j in lanes 0-7 and code 2j + 1 in lanes
// 8-15 with one variable shift; its magnitude is then looked up (see Get).
#undef MJOLNIR_FP6_HALF
#if MJOLNIR_WIDE_FP6
template <int kExponentBits>
struct DecodeFp6Wide {
  // True values: the magnitude is looked up (below), so no code is an fp32 subnormal.
  static constexpr int kRawExp = 0;
  static constexpr std::size_t kVectors = 2;
  using Tag = WideFloatTag;

  // Channel (within its chunk) of lane `lane` of vector j.
  static constexpr std::size_t Channel(std::size_t j, std::size_t lane, std::size_t /* n */) {
    return 4 * (lane % 8) + 2 * j + lane / 8;
  }

  template <class DF>
  static HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> Load(DF, const std::uint8_t* row,
                                                         std::size_t chunk, std::size_t) {
    const hn::RebindToSigned<DF> di;
    const hn::Repartition<std::uint8_t, DF> d8;
    static_assert(hn::MaxLanes(di) == 16);
    alignas(64) static constexpr std::int32_t kBlocks[16] = {0, 1, 2, 2, 3, 4, 5, 5,
                                                             0, 1, 2, 2, 3, 4, 5, 5};
    alignas(64) static constexpr std::uint8_t kGroups[64] = {
        0, 1,  2,  2,  3, 4, 5, 5,  6,  7,  8, 8, 9, 10, 11, 11, 0, 1,  2,  2, 3, 4,
        5, 5,  6,  7,  8, 8, 9, 10, 11, 11, 0, 1, 2, 2,  3,  4,  5, 5,  6,  7, 8, 8,
        9, 10, 11, 11, 0, 1, 2, 2,  3,  4,  5, 5, 6, 7,  8,  8,  9, 10, 11, 11};
    const auto bytes = hn::MaskedLoad(hn::FirstN(d8, 24), d8, row + chunk * 24);
    const auto blocks =
        hn::TableLookupLanes(hn::BitCast(di, bytes), hn::SetTableIndices(di, kBlocks));
    return hn::BitCast(di, hn::TableLookupBytes(hn::BitCast(d8, blocks), hn::Load(d8, kGroups)));
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR words, hn::Vec<DF>) {
    const hn::RebindToSigned<DF> di;
    // Code c's sign to bit 31: shift 26 - 6c, for c = 2 kJ (lanes 0-7) and 2 kJ + 1 (8-15).
    constexpr std::int32_t kLow = 26 - 12 * std::int32_t(kJ), kHigh = kLow - 6;
    alignas(64) static constexpr std::int32_t kUp[16] = {kLow,  kLow,  kLow,  kLow,  kLow,  kLow,
                                                         kLow,  kLow,  kHigh, kHigh, kHigh, kHigh,
                                                         kHigh, kHigh, kHigh, kHigh};
    const auto top = hn::Shl(words, hn::Load(di, kUp));
    // The code's 5 magnitude bits index the 32 true magnitudes (vpermi2ps reads the low 5 bits of
    // each index, so the sign at bit 5 is ignored); the sign bit is then ORed in from `top`:
    // 4 ops where placing bits takes 3, but the subnormal codes are normal fp32 values, which
    // Intel cores multiply without a microcode assist (see E2M1Value).
    static constexpr Fp6Magnitudes kMagnitudes;
    const hn::RebindToUnsigned<DF> du;
    const auto index = hn::ShiftRight<26>(hn::BitCast(du, top));
    const __m512 magnitude = _mm512_permutex2var_ps(hn::Load(df, kMagnitudes.values).raw, index.raw,
                                                    hn::Load(df, kMagnitudes.values + 16).raw);
    // magnitude | (top & sign bit): truth table 0xF8 over (magnitude, top, sign mask).
    return hn::BitCast(
        df, hn::Vec<decltype(du)>{_mm512_ternarylogic_epi32(_mm512_castps_si512(magnitude), top.raw,
                                                            hn::Set(du, 0x80000000u).raw, 0xF8)});
  }
  // The true value of every magnitude code (sign clear) of the format.
  struct Fp6Magnitudes {
    alignas(64) float values[32]{};
    constexpr Fp6Magnitudes() {
      constexpr MinifloatSpec kSpec = kExponentBits == 2 ? kE2M3Spec : kE3M2Spec;
      for (std::uint32_t code = 0; code < 32; ++code) values[code] = decode_minifloat<kSpec>(code);
    }
  };
};

#define MJOLNIR_FP6_HALF 0
using DecodeE2M3 = DecodeFp6Wide<2>;
using DecodeE3M2 = DecodeFp6Wide<3>;
#elif HWY_TARGET == HWY_AVX2
#define MJOLNIR_FP6_HALF 1
// AVX2: DecodeFp6's groups and shifts, but each code placed into the low half of its 32-bit lane
// as fp16 bits (s | exponent at fp16 bits 10.. | mantissa below), two vectors' lanes packed into
// 16 halves and converted by F16C, which turns fp16 subnormals into normal fp32 values: no FMA
// meets an fp32 subnormal (an Intel microcode assist each, see E2M1Value). 5 ops a vector where
// DecodeFp6's placement takes 3, which on a Zen 5 made fp6 steps 30% slower (kernel_rates
// --target=AVX2, g 4: 34 -> 45 ns per token-head), so the kernel takes it only on CPUs whose
// subnormal FMAs are slow (VisitKernelDecoder, cpu/subnormals.h); DecodeE2M3 / DecodeE3M2 stay
// the placement.
template <int kExponentBits>
struct DecodeFp6Half {
  // e2m3: 2^(e-15) (1.m) for 2^(e-1) (1.m), the subnormal m 2^-3 the fp16 subnormal m 2^-17:
  // 2^-14. e3m2: 2^(e-15) (1.m) for 2^(e-3) (1.m), m 2^-4 as m 2^-16: 2^-12.
  static constexpr int kRawExp = kExponentBits == 2 ? -14 : -12;
  static constexpr std::size_t kVectors = 4;
  using Tag = BlockFloatTag;
  struct Vectors {
    hn::Vec<BlockFloatTag> v[4];
  };

  // Vector 2p + q, lane i: code 2p + i / 4 of group 4q + i % 4 (the 128-bit halves of a pack).
  static constexpr std::size_t Channel(std::size_t j, std::size_t lane, std::size_t /* n */) {
    return 4 * (4 * (j % 2) + lane % 4) + 2 * (j / 2) + lane / 4;
  }

  template <class DF>
  static HWY_INLINE Vectors Load(DF df, const std::uint8_t* row, std::size_t chunk,
                                 std::size_t head_dim) {
    static_assert(hn::MaxLanes(DF()) == 8);
    const auto words = DecodeFp6<kExponentBits>::Load(df, row, chunk, head_dim);
    const __m256i h0 = Place<0>(words), h1 = Place<1>(words), h2 = Place<2>(words),
                  h3 = Place<3>(words);
    // Each lane holds at most 0xFFFF, so the unsigned-saturating pack keeps every half as it is.
    const __m256i p01 = _mm256_packus_epi32(h0, h1), p23 = _mm256_packus_epi32(h2, h3);
    return {{hn::Vec<DF>{_mm256_cvtph_ps(_mm256_castsi256_si128(p01))},
             hn::Vec<DF>{_mm256_cvtph_ps(_mm256_extracti128_si256(p01, 1))},
             hn::Vec<DF>{_mm256_cvtph_ps(_mm256_castsi256_si128(p23))},
             hn::Vec<DF>{_mm256_cvtph_ps(_mm256_extracti128_si256(p23, 1))}}};
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF>
  static HWY_INLINE hn::Vec<DF> Get(DF, const Vectors& vectors, hn::Vec<DF>) {
    return vectors.v[kJ];
  }

 private:
  // Code kC of every lane's group as fp16 bits in the lane's low half: its sign to bit 31, then
  // an arithmetic shift that brings the magnitude's top bit to fp16 bit 11 (e2m3) or 12 (e3m2)
  // and copies the sign down over bit 15, and a mask.
  template <int kC, class V>
  static HWY_INLINE __m256i Place(V words) {
    constexpr int kUp = 26 - 6 * kC;
    constexpr int kDown = 16 + 5 - kExponentBits;  // e2m3: bit 30 -> 11; e3m2: 30 -> 12
    const __m256i top = _mm256_slli_epi32(words.raw, kUp);
    return _mm256_and_si256(_mm256_srai_epi32(top, kDown),
                            _mm256_set1_epi32(0x8000 | (0x1F << (26 - kDown))));
  }
};

using DecodeE2M3 = DecodeFp6<2>;
using DecodeE3M2 = DecodeFp6<3>;
#else
#define MJOLNIR_FP6_HALF 0
using DecodeE2M3 = DecodeFp6<2>;
using DecodeE3M2 = DecodeFp6<3>;
#endif

// --- SSE4 on CPUs with slow subnormals ----------------------------------------------------------
// SSE4 has neither F16C nor the AVX2 / AVX-512 permutes the decoders above use to stay out of the
// subnormal range, so there every placed value goes through LiftToNormal: 8 ops more a vector,
// against an Intel microcode assist for every FMA that meets a subnormal (fp4 and fp6 steps 100-250
// times slower). The kernel takes these with KernelConfig::avoid_fp32_subnormals
// (VisitKernelDecoder).
#if HWY_TARGET == HWY_SSE4
#define MJOLNIR_LIFTED_DECODERS 1
// Dec's codes and channel order, as true values (kRawExp 0).
template <class Dec>
struct DecodeLifted : Dec {
  static_assert(Dec::kRawExp < 0);
  static constexpr int kRawExp = 0;
  template <std::size_t kJ, class DF, class VR>
  static HWY_INLINE hn::Vec<DF> Get(DF df, VR raw, hn::Vec<DF> aux) {
    return LiftToNormal<-Dec::kRawExp>(df, Dec::template Get<kJ>(df, raw, aux));
  }
};
using DecodeNvfp4Lifted = DecodeNvfp4Of<true>;
#else
#define MJOLNIR_LIFTED_DECODERS 0
#endif

// --- whole rows --------------------------------------------------------------------------------

// Vectors of a decoder's tag per row, and channels per chunk.
template <class Dec>
HWY_INLINE std::size_t ChunkChannels() {
  return Dec::kVectors * hn::Lanes(typename Dec::Tag());
}

// out[i] = channel ChannelOrder()[i] of the row, times 2^kRawExp.
template <class Dec>
HWY_INLINE void DecodeRow(const std::uint8_t* row, std::size_t head_dim, float* HWY_RESTRICT out) {
  const typename Dec::Tag df;
  const std::size_t n = hn::Lanes(df);
  for (std::size_t c = 0; c < head_dim / ChunkChannels<Dec>(); ++c) {
    const auto raw = Dec::Load(df, row, c, head_dim);
    const auto aux = Dec::Aux(df, row, c, head_dim);
    float* o = out + c * Dec::kVectors * n;
    hn::StoreU(Dec::template Get<0>(df, raw, aux), df, o);
    if constexpr (Dec::kVectors > 1) hn::StoreU(Dec::template Get<1>(df, raw, aux), df, o + n);
    if constexpr (Dec::kVectors > 2) {
      hn::StoreU(Dec::template Get<2>(df, raw, aux), df, o + 2 * n);
      hn::StoreU(Dec::template Get<3>(df, raw, aux), df, o + 3 * n);
    }
  }
}

// Rows that DecodeRow<Dec> wrote (fp32, 64-byte aligned: Dec's channel order and 2^kRawExp scale),
// read back through Dec's interface: a kernel that reads each V row once per block of query rows
// decodes it once per tile instead (fma_values-inl.h), and its blocks load the vectors.
template <class Dec>
struct DecodedRows {
  static constexpr int kRawExp = Dec::kRawExp;
  static constexpr std::size_t kVectors = Dec::kVectors;
  using Tag = typename Dec::Tag;
  template <class DF>
  static HWY_INLINE const float* Load(DF df, const std::uint8_t* row, std::size_t chunk,
                                      std::size_t) {
    return reinterpret_cast<const float*>(row) + chunk * kVectors * hn::Lanes(df);
  }
  template <class DF>
  static HWY_INLINE hn::Vec<DF> Aux(DF df, const std::uint8_t*, std::size_t, std::size_t) {
    return hn::Zero(df);
  }
  template <std::size_t kJ, class DF>
  static HWY_INLINE hn::Vec<DF> Get(DF df, const float* chunk, hn::Vec<DF>) {
    return hn::Load(df, chunk + kJ * hn::Lanes(df));
  }
};

// channel_of[i]: the channel DecodeRow writes to out[i]. Within a chunk of kVectors * n
// channels, vector j lane l holds channel Dec::Channel(j, l, n), or kVectors * l + j for
// decoders without that function.
template <class Dec>
void ChannelOrder(std::size_t head_dim, std::int32_t* channel_of) {
  const std::size_t n = hn::Lanes(typename Dec::Tag());
  constexpr std::size_t v = Dec::kVectors;
  for (std::size_t i = 0; i < head_dim; ++i) {
    const std::size_t chunk = i / (v * n), j = (i % (v * n)) / n, lane = i % n;
    std::size_t in_chunk = v * lane + j;
    if constexpr (requires { Dec::Channel(j, lane, n); }) in_chunk = Dec::Channel(j, lane, n);
    channel_of[i] = static_cast<std::int32_t>(chunk * v * n + in_chunk);
  }
}

// This target's decoder of each format (whose facts are core/format_table.h's).
template <Format kFormat>
struct FormatDecoder;
template <>
struct FormatDecoder<Format::bf16> : std::type_identity<DecodeBf16> {};
template <>
struct FormatDecoder<Format::fp16> : std::type_identity<DecodeFp16> {};
template <>
struct FormatDecoder<Format::fp8_e4m3> : std::type_identity<DecodeE4M3> {};
template <>
struct FormatDecoder<Format::fp8_e5m2> : std::type_identity<DecodeE5M2> {};
template <>
struct FormatDecoder<Format::fp6_e2m3> : std::type_identity<DecodeE2M3> {};
template <>
struct FormatDecoder<Format::fp6_e3m2> : std::type_identity<DecodeE3M2> {};
template <>
struct FormatDecoder<Format::fp4_e2m1> : std::type_identity<DecodeE2M1> {};
template <>
struct FormatDecoder<Format::nvfp4> : std::type_identity<DecodeNvfp4> {};
template <Format kFormat>
using KvDecoder = typename FormatDecoder<kFormat>::type;

// Calls visit.template operator()<Decoder>() with the decoder of `format`.
template <class Visitor>
HWY_INLINE decltype(auto) VisitDecoder(Format format, Visitor&& visit) {
  return visit_format(format, [&]<Format kFormat>() -> decltype(auto) {
    return visit.template operator()<KvDecoder<kFormat>>();
  });
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_KV_DECODE_INL_H_

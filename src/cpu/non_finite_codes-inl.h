// NaN and Inf codes in the cache, for the decoders that read them as finite values (the non-finite
// policy, core/non_finite.h). Per-target header, see kv_decode-inl.h.
//
// write_kv never stores a NaN or Inf code, but a cache written by other means can hold one. The
// table decoders (AVX3_DL's fp8 words), bf16's placement and the hardware fp16 conversions read
// such codes as NaN and Inf, so the scores and O carry them to the row. The bit placements into
// fp16 or fp32 fields do not: e4m3's NaN (S.1111.111) reads as +-480, and on SSE4 and Arm
// fp16's and e5m2's top binade as large finite values. For those the kernel scans each tile's
// rows for such codes (two vector ops per vector of codes, one reduction per tile) and poisons the
// rows that see a token that holds one.

#if defined(MJOLNIR_CPU_NON_FINITE_CODES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_NON_FINITE_CODES_INL_H_
#undef MJOLNIR_CPU_NON_FINITE_CODES_INL_H_
#else
#define MJOLNIR_CPU_NON_FINITE_CODES_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu/kv_decode-inl.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"
#include "mjolnir/format.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// Whether the kernel must scan rows of `format` read through Decoder for NaN and Inf codes.
template <class Decoder>
constexpr bool ScansForNonFiniteCodes(Format format) {
  if (format != Format::fp16 && format != Format::fp8_e4m3 && format != Format::fp8_e5m2) {
    return false;  // bf16's placement keeps them; fp6, fp4 have none; nvfp4's scale table keeps NaN
  }
#if MJOLNIR_BF16_WORDS
  if (format != Format::fp16) return false;  // fp8 through the word tables
#endif
  if constexpr (std::is_same_v<Decoder, DecodeFp16>) {
    return HWY_TARGET == HWY_SSE4;  // F16C / FCVTL convert them; SSE4's emulation does not
  }
#if MJOLNIR_FP8_HALF
  if constexpr (std::is_same_v<Decoder, DecodeE5M2>) return false;  // fp16 bits and F16C
#endif
  return format != Format::fp16;
}

// Whether any of the rows at bases[t] + offsets[h] (t < tokens, h < heads), of `row_bytes` bytes
// each, holds a NaN or Inf code of `format` (fp16, fp8_e4m3 or fp8_e5m2): the largest of
// (code & mask) over them reaches the mask exactly when some code's exponent field is all ones
// (e5m2, fp16), or its exponent and mantissa are (e4m3's NaN). Vectors of at most 32 bytes, which
// divide every row (D is a multiple of 32); one reduction for all the rows: a tile's rows almost
// never hold such a code, and a reduction per row cost as much as the scan itself.
HWY_INLINE bool RowsHaveNonFiniteCode(Format format, const std::uint8_t* const* bases, int tokens,
                                      const std::int64_t* offsets, int heads,
                                      std::size_t row_bytes) {
  const auto scan = [&](auto d, auto mask_value) {
    const hn::Repartition<std::uint8_t, decltype(d)> d8;
    const auto mask = hn::Set(d, mask_value);
    auto top = hn::Zero(d);
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        const std::uint8_t* HWY_RESTRICT row = bases[t] + offsets[h];
        for (std::size_t i = 0; i < row_bytes; i += hn::Lanes(d8)) {
          top = hn::Max(top, hn::And(hn::BitCast(d, hn::LoadU(d8, row + i)), mask));
        }
      }
    }
    return !hn::AllFalse(d, hn::Eq(top, mask));
  };
  if (format == Format::fp16)
    return scan(hn::CappedTag<std::uint16_t, 16>(), std::uint16_t{0x7C00});
  return scan(hn::CappedTag<std::uint8_t, 32>(),
              std::uint8_t(format == Format::fp8_e4m3 ? 0x7F : 0x7C));
}

// Whether the row holds a NaN or Inf code of `format`.
HWY_INLINE bool RowHasNonFiniteCode(Format format, const std::uint8_t* row, std::size_t row_bytes) {
  const std::int64_t offset = 0;
  return RowsHaveNonFiniteCode(format, &row, 1, &offset, 1, row_bytes);
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_NON_FINITE_CODES_INL_H_

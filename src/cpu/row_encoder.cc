// The fast row encoder (see row_encoder.h), compiled per Highway target and dispatched at run
// time; the fallback target divides and calls the scalar encode_row.
#include "cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/row_encoder.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "cpu/minifloat_simd-inl.h"
#include "hwy/highway.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/format_table.h"
#include "core/minifloat.h"
#include "cpu/row_encoder.h"
#include "mjolnir/cache.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Channels encoded per step: a multiple of every packing unit (fp6 groups of 4, fp4 pairs,
// nvfp4 blocks of 16) and of every vector width.
constexpr std::size_t kGroup = 32;

#if MJOLNIR_PORTABLE_TARGET

void EncodeScaledRow(Format format, std::span<const float> values, std::span<const float> scales,
                     std::span<std::byte> row) {
  std::vector<float> scaled(values.size());
  for (std::size_t c = 0; c < values.size(); ++c) {
    scaled[c] = values[c] / scales[scales.size() == 1 ? 0 : c];
  }
  encode_row(format, scaled, row);
}

bool AllFinite(std::span<const float> values) {
  return std::all_of(values.begin(), values.end(), [](float x) { return std::isfinite(x); });
}

#else

bool AllFinite(std::span<const float> values) { return FiniteValues(values.data(), values.size()); }

using FloatTag = hn::CappedTag<float, 16>;

// values[c] / scale into out[0..kGroup). A single scale of 1 (bf16 and fp16 caches, and
// vLLM's default scales) is not divided by: x / 1 is x.
void ScaleGroup(const float* values, std::span<const float> scales, std::size_t first, float* out) {
  const FloatTag df;
  const std::size_t n = hn::Lanes(df);
  if (scales.size() == 1 && scales[0] == 1.0f) {
    for (std::size_t i = 0; i < kGroup; i += n) {
      hn::Store(hn::LoadU(df, values + first + i), df, out + i);
    }
    return;
  }
  for (std::size_t i = 0; i < kGroup; i += n) {
    const auto s = scales.size() == 1 ? hn::Set(df, scales[0]) : hn::LoadU(df, &scales[first + i]);
    hn::Store(hn::Div(hn::LoadU(df, values + first + i), s), df, out + i);
  }
}

template <MinifloatSpec kSpec>
void EncodeGroup(const float* scaled, std::uint32_t* codes) {
  const FloatTag df;
  const hn::RebindToUnsigned<decltype(df)> du;
  for (std::size_t i = 0; i < kGroup; i += hn::Lanes(df)) {
    hn::Store(EncodeMinifloat<kSpec>(df, hn::Load(df, scaled + i)), du, codes + i);
  }
}

// Codes of 16 or 8 bits stored as they are encoded, a vector at a time (16-bit codes
// little-endian, as the cache holds them: every target here is little-endian).
template <MinifloatSpec kSpec>
void EncodeWholeBytes(const float* scaled, std::byte* out) {
  const FloatTag df;
  const hn::RebindToUnsigned<decltype(df)> du;
  using Code = std::conditional_t<kSpec.total_bits() == 16, std::uint16_t, std::uint8_t>;
  const hn::RebindToSigned<decltype(du)> di;
  const hn::Rebind<Code, decltype(du)> dc;
  for (std::size_t i = 0; i < kGroup; i += hn::Lanes(df)) {
    // Saturating DemoteTo from int32 is the identity on codes of 0..255 or 0..65535. (Not
    // TruncateTo: Highway 1.0.3's u32 -> u8 TruncateTo on AVX3_DL permutes 32-bit lanes where it
    // means bytes, and returns the wrong bytes.)
    const auto codes =
        hn::DemoteTo(dc, hn::BitCast(di, EncodeMinifloat<kSpec>(df, hn::Load(df, scaled + i))));
    hn::StoreU(codes, dc, reinterpret_cast<Code*>(out + i * sizeof(Code)));
  }
}

// Codes of 6 or 4 bits packed into the row (format.h's bit order).
template <Format kFormat>
void PackCodes(const std::uint32_t* codes, std::size_t first, std::byte* row) {
  constexpr std::size_t kChannels = kFormatFacts<kFormat>.channels_per_group();
  for (std::size_t i = 0; i < kGroup; i += kChannels) {
    write_packed_group<kFormatFacts<kFormat>.packing>(codes + i, (first + i) / kChannels, row);
  }
}

template <Format kFormat>
void EncodePlain(std::span<const float> values, std::span<const float> scales, std::byte* row) {
  constexpr MinifloatSpec kSpec = kFormatFacts<kFormat>.element;
  constexpr CodePacking kPacking = kFormatFacts<kFormat>.packing;
  alignas(64) float scaled[kGroup];
  alignas(64) std::uint32_t codes[kGroup];
  for (std::size_t first = 0; first < values.size(); first += kGroup) {
    ScaleGroup(values.data(), scales, first, scaled);
    if constexpr (kPacking == CodePacking::u16_le || kPacking == CodePacking::byte) {
      EncodeWholeBytes<kSpec>(scaled, row + first * (kSpec.total_bits() / 8));
    } else {
      EncodeGroup<kSpec>(scaled, codes);
      PackCodes<kFormat>(codes, first, row);
    }
  }
}

// nvfp4: per block of 16, scale = e4m3(amax / 6) (at least the smallest code when the block is
// not zero) and codes e2m1(value / decoded scale), as format.cc defines it. Every block's scale
// comes first, a vector of blocks at a time: one block at a time, each scale's scalar encode
// and decode sat on the path to the block's division and codes.
void EncodeNvfp4(std::span<const float> values, std::span<const float> scales, std::byte* row) {
  const FloatTag df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const std::size_t n = hn::Lanes(df);
  const std::size_t head_dim = values.size();
  const std::size_t blocks = head_dim / kNvfp4BlockSize;
  std::byte* block_scales = row + head_dim / 2;
  // Whole vectors of blocks (a multiple of every vector width; blocks past the row stay 0).
  constexpr std::size_t kMaxBlocks = kMaxHeadDim / kNvfp4BlockSize;
  alignas(64) float scaled[kMaxHeadDim];
  alignas(64) float amax[kMaxBlocks] = {};
  alignas(64) std::uint32_t scale_codes[kMaxBlocks];
  alignas(64) float divisors[kMaxBlocks];
  alignas(64) std::uint32_t codes[kGroup];
  for (std::size_t first = 0; first < head_dim; first += kGroup) {
    ScaleGroup(values.data(), scales, first, scaled + first);
  }
  // Block maxima (finite values: write_kv checked them, so Max is std::max here).
  for (std::size_t b = 0; b < blocks; ++b) {
    auto block_max = hn::Zero(df);
    for (std::size_t i = 0; i < kNvfp4BlockSize; i += n) {
      block_max = hn::Max(block_max, hn::Abs(hn::Load(df, scaled + b * kNvfp4BlockSize + i)));
    }
    amax[b] = hn::GetLane(hn::MaxOfLanes(df, block_max));
  }
  // Scale codes: e4m3(amax / 6); 0 for an all-zero block, the smallest code for a block whose
  // scale would round to zero.
  const auto six = hn::Set(df, 6.0f);
  for (std::size_t b = 0; b < blocks; b += n) {
    const auto m = hn::Load(df, amax + b);
    const auto code = EncodeMinifloat<kE4M3Spec>(df, hn::Div(m, six));
    const auto nonzero = hn::RebindMask(du, hn::Gt(m, hn::Zero(df)));
    hn::Store(hn::IfThenElse(hn::And(nonzero, hn::Eq(code, hn::Zero(du))), hn::Set(du, 1u), code),
              du, scale_codes + b);
  }
  for (std::size_t b = 0; b < blocks; ++b) {
    block_scales[b] = std::byte(scale_codes[b]);
    divisors[b] = decode_minifloat<kE4M3Spec>(scale_codes[b]);
  }
  for (std::size_t first = 0; first < head_dim; first += kGroup) {
    for (std::size_t b = 0; b < kGroup; b += kNvfp4BlockSize) {
      const std::size_t block = (first + b) / kNvfp4BlockSize;
      if (scale_codes[block] == 0) {
        std::fill_n(codes + b, kNvfp4BlockSize, 0u);
        continue;
      }
      const auto divisor = hn::Set(df, divisors[block]);
      for (std::size_t i = 0; i < kNvfp4BlockSize; i += n) {
        const auto x = hn::Div(hn::Load(df, scaled + first + b + i), divisor);
        hn::StoreU(EncodeMinifloat<kE2M1Spec>(df, x), du, codes + b + i);
      }
    }
    for (std::size_t i = 0; i < kGroup; i += 2) {
      row[(first + i) / 2] = std::byte(codes[i] | codes[i + 1] << 4);
    }
  }
}

void EncodeScaledRow(Format format, std::span<const float> values, std::span<const float> scales,
                     std::span<std::byte> row) {
  std::byte* out = row.data();
  visit_format(format, [&]<Format kFormat>() {
    if constexpr (kFormatFacts<kFormat>.has_block_scales()) {
      EncodeNvfp4(values, scales, out);
    } else {
      EncodePlain<kFormat>(values, scales, out);
    }
  });
}

#endif  // MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

namespace mjolnir::cpu {

HWY_EXPORT(EncodeScaledRow);
HWY_EXPORT(AllFinite);

bool all_finite(std::span<const float> values) { return HWY_DYNAMIC_DISPATCH(AllFinite)(values); }

void encode_scaled_row(Format format, std::span<const float> values, std::span<const float> scales,
                       std::span<std::byte> row) {
  HWY_DYNAMIC_DISPATCH(EncodeScaledRow)(format, values, scales, row);
}

}  // namespace mjolnir::cpu

#endif  // HWY_ONCE

// Every fact about a KV cache format in one constexpr table (docs/design.md section 3): its name,
// its element code, how a row packs the codes, its block scales. The scalar codecs (format.cc),
// the CPU's row encoder and decoders, the error bounds and the CUDA codecs and launches all read
// their format's facts here, and visit_format() is the one switch from a runtime Format to a
// compile-time one. Adding a format is a row here, then a decoder per backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/minifloat.h"
#include "mjolnir/error.h"
#include "mjolnir/format.h"

namespace mjolnir {

// How a row lays out its channels' codes (the packing format.h's row_bytes() describes).
enum class CodePacking : std::uint8_t {
  u16_le,  // one little-endian 16-bit code a channel
  byte,    // one code a byte
  // Four 6-bit codes in three bytes: the little-endian word c0 | c1<<6 | c2<<12 | c3<<18.
  fp6_groups,
  nibble_pairs  // two 4-bit codes a byte, the even channel in the low nibble
};

struct FormatFacts {
  Format format;
  std::string_view name;  // what to_string() gives and parse_format() takes
  MinifloatSpec element;  // the code of one channel
  CodePacking packing;
  int block_channels;         // 0, or the channels that share one block scale (nvfp4: 16)
  MinifloatSpec block_scale;  // the block scales' code where block_channels > 0; they follow
                              // the row's codes, one byte each
  bool quantized;             // stored divided by an outer (tensor / head / channel) scale

  MJOLNIR_HOST_DEVICE constexpr int element_bits() const { return element.total_bits(); }
  MJOLNIR_HOST_DEVICE constexpr bool has_block_scales() const { return block_channels > 0; }
  // Channels and bytes of the smallest piece of a row that packs on its own.
  MJOLNIR_HOST_DEVICE constexpr int channels_per_group() const {
    return packing == CodePacking::fp6_groups ? 4 : packing == CodePacking::nibble_pairs ? 2 : 1;
  }
  MJOLNIR_HOST_DEVICE constexpr int bytes_per_group() const {
    return channels_per_group() * element_bits() / 8;
  }
  // Bytes of a row of `head_dim` channels: the codes, then the block scales.
  MJOLNIR_HOST_DEVICE constexpr std::size_t row_bytes(std::size_t head_dim) const {
    const std::size_t code_bytes = head_dim * static_cast<std::size_t>(element_bits()) / 8;
    return has_block_scales() ? code_bytes + head_dim / static_cast<std::size_t>(block_channels)
                              : code_bytes;
  }
  // The element's unit roundoff, 2^-(mantissa bits + 1): the relative error of rounding one
  // value in its normal range (docs/numerics.md's error bounds start from it).
  constexpr double unit_roundoff() const {
    return 1.0 / static_cast<double>(std::uint64_t{1} << (element.mantissa_bits + 1));
  }
};

// nvfp4's block scales are e4m3 codes, one per kNvfp4BlockSize channels (format.h).
inline constexpr FormatFacts kFormatTable[] = {
    {Format::bf16, "bf16", kBf16Spec, CodePacking::u16_le, 0, {}, false},
    {Format::fp16, "fp16", kFp16Spec, CodePacking::u16_le, 0, {}, false},
    {Format::fp8_e4m3, "fp8_e4m3", kE4M3Spec, CodePacking::byte, 0, {}, true},
    {Format::fp8_e5m2, "fp8_e5m2", kE5M2Spec, CodePacking::byte, 0, {}, true},
    {Format::fp6_e2m3, "fp6_e2m3", kE2M3Spec, CodePacking::fp6_groups, 0, {}, true},
    {Format::fp6_e3m2, "fp6_e3m2", kE3M2Spec, CodePacking::fp6_groups, 0, {}, true},
    {Format::fp4_e2m1, "fp4_e2m1", kE2M1Spec, CodePacking::nibble_pairs, 0, {}, true},
    {Format::nvfp4, "nvfp4", kE2M1Spec, CodePacking::nibble_pairs, kNvfp4BlockSize, kE4M3Spec,
     true},
};

namespace format_table_detail {
// The table is indexed by the enum's value: one row per enumerator, in order, and each row's
// packing agrees with its element's width.
constexpr bool table_is_consistent() {
  if (std::size(kFormatTable) != std::size(kAllFormats)) return false;
  for (std::size_t i = 0; i < std::size(kFormatTable); ++i) {
    const FormatFacts& facts = kFormatTable[i];
    if (static_cast<std::size_t>(facts.format) != i) return false;
    const int bits = facts.element_bits();
    const bool packing_fits = facts.packing == CodePacking::u16_le       ? bits == 16
                              : facts.packing == CodePacking::byte       ? bits == 8
                              : facts.packing == CodePacking::fp6_groups ? bits == 6
                                                                         : bits == 4;
    if (!packing_fits) return false;
    if (facts.has_block_scales() && facts.block_scale.total_bits() != 8) return false;
  }
  return true;
}
static_assert(table_is_consistent());
}  // namespace format_table_detail

// The scalar packing of codes into a row's bytes, host and device: the code of channel
// `channel` (>= 0) of a row, and a group of codes into its bytes. Byte is std::byte or
// std::uint8_t; Index is the caller's integer type (int in device code, where 64-bit arithmetic
// costs twice as much).
template <CodePacking kPacking, typename Byte, typename Index>
MJOLNIR_HOST_DEVICE constexpr std::uint32_t read_packed_code(const Byte* row, Index channel) {
  if constexpr (kPacking == CodePacking::u16_le) {
    return static_cast<std::uint32_t>(row[2 * channel]) |
           static_cast<std::uint32_t>(row[2 * channel + 1]) << 8;
  } else if constexpr (kPacking == CodePacking::byte) {
    return static_cast<std::uint32_t>(row[channel]);
  } else if constexpr (kPacking == CodePacking::fp6_groups) {
    const Byte* group = row + (channel >> 2) * 3;
    const std::uint32_t word = static_cast<std::uint32_t>(group[0]) |
                               static_cast<std::uint32_t>(group[1]) << 8 |
                               static_cast<std::uint32_t>(group[2]) << 16;
    return word >> (6 * (channel & 3)) & 0x3Fu;
  } else {
    static_assert(kPacking == CodePacking::nibble_pairs);
    return static_cast<std::uint32_t>(row[channel >> 1]) >> (4 * (channel & 1)) & 0xFu;
  }
}

// Writes the codes of group `group` (channels_per_group() of them, each within the element's
// bits) into its bytes of the row.
template <CodePacking kPacking, typename Byte, typename Index>
MJOLNIR_HOST_DEVICE constexpr void write_packed_group(const std::uint32_t* codes, Index group,
                                                      Byte* row) {
  // The casts keep the low byte: the masks are implied.
  if constexpr (kPacking == CodePacking::u16_le) {
    row[2 * group] = static_cast<Byte>(codes[0]);
    row[2 * group + 1] = static_cast<Byte>(codes[0] >> 8);
  } else if constexpr (kPacking == CodePacking::byte) {
    row[group] = static_cast<Byte>(codes[0]);
  } else if constexpr (kPacking == CodePacking::fp6_groups) {
    const std::uint32_t word = codes[0] | codes[1] << 6 | codes[2] << 12 | codes[3] << 18;
    row[3 * group] = static_cast<Byte>(word);
    row[3 * group + 1] = static_cast<Byte>(word >> 8);
    row[3 * group + 2] = static_cast<Byte>(word >> 16);
  } else {
    static_assert(kPacking == CodePacking::nibble_pairs);
    row[group] = static_cast<Byte>(codes[0] | codes[1] << 4);
  }
}

// The facts of a format known at compile time (usable in device code in constant expressions).
template <Format kFormat>
inline constexpr FormatFacts kFormatFacts = kFormatTable[static_cast<std::size_t>(kFormat)];

// Largest value of one channel of a format before the outer scale: the element's largest finite
// value, times the largest block scale where there are block scales (format_max()).
template <Format kFormat>
inline constexpr float kFormatMax = [] {
  constexpr const FormatFacts& facts = kFormatFacts<kFormat>;
  const float element_max = decode_minifloat<facts.element>(facts.element.max_finite_code());
  if constexpr (facts.has_block_scales()) {
    return element_max * decode_minifloat<facts.block_scale>(facts.block_scale.max_finite_code());
  }
  return element_max;
}();

// The facts of a runtime format; throws Error naming `arg_name` for a value outside the enum.
inline const FormatFacts& format_facts(Format format, std::string_view arg_name = "format") {
  const auto index = static_cast<std::size_t>(format);
  MJOLNIR_REQUIRE(index < std::size(kFormatTable), arg_name, ": unknown Format value ", index);
  return kFormatTable[index];
}

// The one switch from a runtime Format to a template constant: calls
// visit.template operator()<kFormat>() for `format`'s enumerator and returns what it returns. A
// value outside the enum throws Error naming `arg_name`. Host code.
template <typename Visitor>
decltype(auto) visit_format(Format format, Visitor&& visit, std::string_view arg_name = "format") {
  switch (format) {
    case Format::bf16:
      return visit.template operator()<Format::bf16>();
    case Format::fp16:
      return visit.template operator()<Format::fp16>();
    case Format::fp8_e4m3:
      return visit.template operator()<Format::fp8_e4m3>();
    case Format::fp8_e5m2:
      return visit.template operator()<Format::fp8_e5m2>();
    case Format::fp6_e2m3:
      return visit.template operator()<Format::fp6_e2m3>();
    case Format::fp6_e3m2:
      return visit.template operator()<Format::fp6_e3m2>();
    case Format::fp4_e2m1:
      return visit.template operator()<Format::fp4_e2m1>();
    case Format::nvfp4:
      return visit.template operator()<Format::nvfp4>();
  }
  detail::throw_error(arg_name, ": unknown Format value ", static_cast<int>(format));
}

}  // namespace mjolnir

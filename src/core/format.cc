// KV cache element formats: names, sizes, the scalar codecs and the packing of one token row
// (docs/design.md section 3). The bit-level conversions live in core/minifloat.h.
#include "mjolnir/format.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/code_values.h"
#include "core/format_table.h"
#include "core/minifloat.h"
#include "mjolnir/error.h"

namespace mjolnir {
namespace {

// A row is a whole number of 32-channel groups: that keeps fp6 groups of 4 codes, fp4 byte pairs
// and nvfp4 16-channel blocks aligned, and is what the kernels tile by.
constexpr int kHeadDimMultiple = 32;

// The largest e2m1 value, 6: an nvfp4 block scale maps the block's amax onto it.
constexpr float kE2M1Max = decode_minifloat<kE2M1Spec>(kE2M1Spec.max_finite_code());
// Smallest positive e4m3 code (subnormal, 2^-9): the block scale of a non-zero block whose
// amax / 6 rounds to zero, so its largest values still survive as small e2m1 codes instead
// of the whole block silently becoming zero.
constexpr std::uint32_t kE4M3SmallestPositiveCode = 0x01;

void require_head_dim(std::size_t head_dim, const char* arg_name) {
  MJOLNIR_REQUIRE(head_dim > 0 && head_dim % kHeadDimMultiple == 0, arg_name, ": ", head_dim,
                  " channels is not a positive multiple of ", kHeadDimMultiple, " (head_dim)");
}

void require_row_size(Format format, std::size_t head_dim, std::size_t row_size,
                      const char* arg_name) {
  const std::size_t expected = format_facts(format).row_bytes(head_dim);
  MJOLNIR_REQUIRE(row_size == expected, arg_name, ": ", row_size, " bytes, but a ",
                  to_string(format), " row of head_dim ", head_dim, " is ", expected, " bytes");
}

// --- nvfp4 ---------------------------------------------------------------------------------------

// e4m3 code of the scale of one block: e4m3(amax / 6), kept > 0 for a non-zero block.
// NaN values are ignored by the amax (write_kv rejects them before this), +-Inf saturates the
// scale to 448.
std::uint32_t nvfp4_block_scale_code(std::span<const float> block) {
  float amax = 0.0f;
  for (const float value : block) amax = std::max(amax, std::fabs(value));
  if (amax == 0.0f) return 0;
  const std::uint32_t code = encode_minifloat<kE4M3Spec>(amax / kE2M1Max);
  return code == 0 ? kE4M3SmallestPositiveCode : code;
}

void encode_nvfp4_row(std::span<const float> values, std::span<std::byte> row) {
  const std::size_t head_dim = values.size();
  std::byte* codes = row.data();                  // (head_dim / 2) bytes of e2m1 pairs
  std::byte* scales = row.data() + head_dim / 2;  // (head_dim / 16) e4m3 block scales
  for (std::size_t block = 0; block < head_dim / kNvfp4BlockSize; ++block) {
    const std::span<const float> block_values =
        values.subspan(block * kNvfp4BlockSize, kNvfp4BlockSize);
    const std::uint32_t scale_code = nvfp4_block_scale_code(block_values);
    scales[block] = static_cast<std::byte>(scale_code);
    std::byte* block_codes = codes + block * kNvfp4BlockSize / 2;
    if (scale_code == 0) {  // all-zero block (-0 included): scale 0, codes 0
      std::fill_n(block_codes, kNvfp4BlockSize / 2, std::byte{0});
      continue;
    }
    const float scale = decode_minifloat<kE4M3Spec>(scale_code);
    for (int pair = 0; pair < kNvfp4BlockSize / 2; ++pair) {
      const std::uint32_t codes[] = {
          encode_minifloat<kE2M1Spec>(block_values[2 * pair] / scale),
          encode_minifloat<kE2M1Spec>(block_values[2 * pair + 1] / scale)};
      write_packed_group<CodePacking::nibble_pairs>(codes, pair, block_codes);
    }
  }
}

// The element formats of at most 8 bits look their codes up in a table of every code's value
// instead of decoding each one: the emulator and the exact reference decode every row they read.
template <MinifloatSpec kSpec>
constexpr auto kCodeValues = minifloat_values<kSpec>();

template <MinifloatSpec kSpec>
float decode_code(std::uint32_t code) {
  if constexpr (kSpec.total_bits() <= 8) {
    return kCodeValues<kSpec>[code];
  } else {
    return decode_minifloat<kSpec>(code);
  }
}

void decode_nvfp4_row(std::span<const std::byte> row, std::span<float> out) {
  const std::size_t head_dim = out.size();
  const std::byte* codes = row.data();
  const std::byte* scales = row.data() + head_dim / 2;
  for (std::size_t block = 0; block < head_dim / kNvfp4BlockSize; ++block) {
    const float scale = decode_code<kE4M3Spec>(std::to_integer<std::uint32_t>(scales[block]));
    for (std::size_t channel = block * kNvfp4BlockSize; channel < (block + 1) * kNvfp4BlockSize;
         ++channel) {
      out[channel] =
          decode_code<kE2M1Spec>(read_packed_code<CodePacking::nibble_pairs>(codes, channel)) *
          scale;
    }
  }
}

// --- generic rows ----------------------------------------------------------------------------

template <Format kFormat>
void encode_plain_row(std::span<const float> values, std::span<std::byte> row) {
  constexpr const FormatFacts& kFacts = kFormatFacts<kFormat>;
  constexpr std::size_t kGroup = kFacts.channels_per_group();
  for (std::size_t group = 0; group < values.size() / kGroup; ++group) {
    std::uint32_t codes[kGroup];
    for (std::size_t i = 0; i < kGroup; ++i) {
      codes[i] = encode_minifloat<kFacts.element>(values[group * kGroup + i]);
    }
    write_packed_group<kFacts.packing>(codes, group, row.data());
  }
}

template <Format kFormat>
void decode_plain_row(std::span<const std::byte> row, std::span<float> out) {
  constexpr const FormatFacts& kFacts = kFormatFacts<kFormat>;
  for (std::size_t c = 0; c < out.size(); ++c) {
    out[c] = decode_code<kFacts.element>(read_packed_code<kFacts.packing>(row.data(), c));
  }
}

}  // namespace

std::string_view to_string(Format format) { return format_facts(format).name; }

Format parse_format(std::string_view name, std::string_view arg_name) {
  for (const FormatFacts& facts : kFormatTable) {
    if (facts.name == name) return facts.format;
  }
  std::string valid;
  for (const FormatFacts& facts : kFormatTable) {
    if (!valid.empty()) valid += ", ";
    valid += facts.name;
  }
  detail::throw_error(arg_name, ": '", name, "' is not one of ", valid);
}

int element_bits(Format format) { return format_facts(format).element_bits(); }

float format_max(Format format) {
  return visit_format(format, []<Format kFormat>() { return kFormatMax<kFormat>; });
}

bool is_quantized(Format format) { return format_facts(format).quantized; }

std::size_t row_bytes(Format format, int head_dim) {
  const FormatFacts& facts = format_facts(format);
  MJOLNIR_REQUIRE(head_dim > 0 && head_dim % kHeadDimMultiple == 0, "head_dim: ", head_dim,
                  " is not a positive multiple of ", kHeadDimMultiple);
  return facts.row_bytes(static_cast<std::size_t>(head_dim));
}

std::uint32_t encode_element(Format format, float value) {
  return visit_format(format, [value]<Format kFormat>() {
    return encode_minifloat<kFormatFacts<kFormat>.element>(value);
  });
}

float decode_element(Format format, std::uint32_t code) {
  return visit_format(format, [code]<Format kFormat>() {
    constexpr MinifloatSpec kSpec = kFormatFacts<kFormat>.element;
    MJOLNIR_REQUIRE(code >> kSpec.total_bits() == 0, "code: 0x", std::hex, code,
                    " has bits above the ", std::dec, kSpec.total_bits(), "-bit ",
                    kFormatFacts<kFormat>.name, " code");
    return decode_minifloat<kSpec>(code);
  });
}

void encode_row(Format format, std::span<const float> values, std::span<std::byte> row) {
  format_facts(format);  // a value outside the enum is named before the sizes
  require_head_dim(values.size(), "values");
  require_row_size(format, values.size(), row.size(), "row");
  visit_format(format, [&]<Format kFormat>() {
    if constexpr (kFormatFacts<kFormat>.has_block_scales()) {
      encode_nvfp4_row(values, row);
    } else {
      encode_plain_row<kFormat>(values, row);
    }
  });
}

void decode_row(Format format, std::span<const std::byte> row, std::span<float> out) {
  format_facts(format);
  require_head_dim(out.size(), "out");
  require_row_size(format, out.size(), row.size(), "row");
  visit_format(format, [&]<Format kFormat>() {
    if constexpr (kFormatFacts<kFormat>.has_block_scales()) {
      decode_nvfp4_row(row, out);
    } else {
      decode_plain_row<kFormat>(row, out);
    }
  });
}

}  // namespace mjolnir

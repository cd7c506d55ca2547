// KV cache element formats: names, sizes, the scalar codecs and the packing of one token row
// (docs/design.md section 3). The bit-level conversions live in core/minifloat.h.
#include "mjolnir/format.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "core/minifloat.h"
#include "mjolnir/error.h"

namespace mjolnir {
namespace {

struct FormatName {
  Format format;
  std::string_view name;
};

constexpr std::array<FormatName, 8> kFormatNames{{
    {Format::bf16, "bf16"},
    {Format::fp16, "fp16"},
    {Format::fp8_e4m3, "fp8_e4m3"},
    {Format::fp8_e5m2, "fp8_e5m2"},
    {Format::fp6_e2m3, "fp6_e2m3"},
    {Format::fp6_e3m2, "fp6_e3m2"},
    {Format::fp4_e2m1, "fp4_e2m1"},
    {Format::nvfp4, "nvfp4"},
}};

// to_string indexes the table by the enum's value.
constexpr bool names_in_enum_order() {
  for (std::size_t i = 0; i < kFormatNames.size(); ++i) {
    if (static_cast<std::size_t>(kFormatNames[i].format) != i) return false;
  }
  return kFormatNames.size() == std::size(kAllFormats);
}
static_assert(names_in_enum_order());

// A row is a whole number of 32-channel groups: that keeps fp6 groups of 4 codes, fp4 byte pairs
// and nvfp4 16-channel blocks aligned, and is what the kernels tile by.
constexpr int kHeadDimMultiple = 32;

// Channels per fp6 group: 4 codes of 6 bits fill 3 bytes.
constexpr int kFp6GroupChannels = 4;
constexpr int kFp6GroupBytes = 3;
constexpr std::uint32_t kFp6CodeMask = 0x3F;
constexpr std::uint32_t kFp4CodeMask = 0xF;

// The largest e2m1 value, 6: an nvfp4 block scale maps the block's amax onto it.
constexpr float kE2M1Max = decode_minifloat<kE2M1Spec>(kE2M1Spec.max_finite_code());
// Smallest positive e4m3 code (subnormal, 2^-9): the block scale of a non-zero block whose
// amax / 6 rounds to zero, so its largest values still survive as small e2m1 codes instead
// of the whole block silently becoming zero.
constexpr std::uint32_t kE4M3SmallestPositiveCode = 0x01;

void require_known(Format format) {
  const auto index = static_cast<std::size_t>(format);
  MJOLNIR_REQUIRE(index < kFormatNames.size(), "format: unknown Format value ", index);
}

void require_head_dim(std::size_t head_dim, const char* arg_name) {
  MJOLNIR_REQUIRE(head_dim > 0 && head_dim % kHeadDimMultiple == 0, arg_name, ": ", head_dim,
                  " channels is not a positive multiple of ", kHeadDimMultiple, " (head_dim)");
}

// Bytes of a row of `head_dim` channels, head_dim already validated.
std::size_t packed_row_bytes(Format format, std::size_t head_dim) {
  const std::size_t code_bytes = head_dim * static_cast<std::size_t>(element_bits(format)) / 8;
  if (format == Format::nvfp4) return code_bytes + head_dim / kNvfp4BlockSize;
  return code_bytes;
}

void require_row_size(Format format, std::size_t head_dim, std::size_t row_size,
                      const char* arg_name) {
  const std::size_t expected = packed_row_bytes(format, head_dim);
  MJOLNIR_REQUIRE(row_size == expected, arg_name, ": ", row_size, " bytes, but a ",
                  to_string(format), " row of head_dim ", head_dim, " is ", expected, " bytes");
}

// --- code <-> bytes ----------------------------------------------------------------------------

std::uint32_t read_u16_le(const std::byte* bytes) {
  return std::to_integer<std::uint32_t>(bytes[0]) | std::to_integer<std::uint32_t>(bytes[1]) << 8;
}
void write_u16_le(std::uint32_t value, std::byte* bytes) {
  bytes[0] = static_cast<std::byte>(value & 0xFF);
  bytes[1] = static_cast<std::byte>((value >> 8) & 0xFF);
}

// fp6: channels 4g..4g+3 are the little-endian 24-bit word c0 | c1<<6 | c2<<12 | c3<<18 in
// bytes 3g..3g+2.
std::uint32_t read_fp6_code(const std::byte* row, std::size_t channel) {
  const std::byte* group = row + channel / kFp6GroupChannels * kFp6GroupBytes;
  const std::uint32_t word = std::to_integer<std::uint32_t>(group[0]) |
                             std::to_integer<std::uint32_t>(group[1]) << 8 |
                             std::to_integer<std::uint32_t>(group[2]) << 16;
  return word >> (6 * (channel % kFp6GroupChannels)) & kFp6CodeMask;
}
// Writes the four codes of one group; codes[i] must fit 6 bits.
void write_fp6_group(const std::uint32_t* codes, std::byte* group) {
  const std::uint32_t word = codes[0] | codes[1] << 6 | codes[2] << 12 | codes[3] << 18;
  group[0] = static_cast<std::byte>(word & 0xFF);
  group[1] = static_cast<std::byte>((word >> 8) & 0xFF);
  group[2] = static_cast<std::byte>((word >> 16) & 0xFF);
}

// fp4: channel 2i in the low nibble of byte i, channel 2i+1 in the high nibble.
std::uint32_t read_fp4_code(const std::byte* codes, std::size_t channel) {
  return std::to_integer<std::uint32_t>(codes[channel / 2]) >> (4 * (channel % 2)) & kFp4CodeMask;
}
std::byte pack_fp4_pair(std::uint32_t even_code, std::uint32_t odd_code) {
  return static_cast<std::byte>(even_code | odd_code << 4);
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
      block_codes[pair] =
          pack_fp4_pair(encode_minifloat<kE2M1Spec>(block_values[2 * pair] / scale),
                        encode_minifloat<kE2M1Spec>(block_values[2 * pair + 1] / scale));
    }
  }
}

void decode_nvfp4_row(std::span<const std::byte> row, std::span<float> out) {
  const std::size_t head_dim = out.size();
  const std::byte* codes = row.data();
  const std::byte* scales = row.data() + head_dim / 2;
  for (std::size_t channel = 0; channel < head_dim; ++channel) {
    const float scale = decode_minifloat<kE4M3Spec>(
        std::to_integer<std::uint32_t>(scales[channel / kNvfp4BlockSize]));
    out[channel] = decode_minifloat<kE2M1Spec>(read_fp4_code(codes, channel)) * scale;
  }
}

// --- generic rows ----------------------------------------------------------------------------

template <MinifloatSpec kSpec>
void encode_plain_row(std::span<const float> values, std::span<std::byte> row) {
  const std::size_t head_dim = values.size();
  if constexpr (kSpec.total_bits() == 16) {
    for (std::size_t c = 0; c < head_dim; ++c) {
      write_u16_le(encode_minifloat<kSpec>(values[c]), row.data() + 2 * c);
    }
  } else if constexpr (kSpec.total_bits() == 8) {
    for (std::size_t c = 0; c < head_dim; ++c) {
      row[c] = static_cast<std::byte>(encode_minifloat<kSpec>(values[c]));
    }
  } else if constexpr (kSpec.total_bits() == 6) {
    for (std::size_t group = 0; group < head_dim / kFp6GroupChannels; ++group) {
      std::uint32_t codes[kFp6GroupChannels];
      for (int i = 0; i < kFp6GroupChannels; ++i) {
        codes[i] = encode_minifloat<kSpec>(values[group * kFp6GroupChannels + i]);
      }
      write_fp6_group(codes, row.data() + group * kFp6GroupBytes);
    }
  } else {
    static_assert(kSpec.total_bits() == 4);
    for (std::size_t pair = 0; pair < head_dim / 2; ++pair) {
      row[pair] = pack_fp4_pair(encode_minifloat<kSpec>(values[2 * pair]),
                                encode_minifloat<kSpec>(values[2 * pair + 1]));
    }
  }
}

template <MinifloatSpec kSpec>
void decode_plain_row(std::span<const std::byte> row, std::span<float> out) {
  const std::size_t head_dim = out.size();
  for (std::size_t c = 0; c < head_dim; ++c) {
    std::uint32_t code;
    if constexpr (kSpec.total_bits() == 16) {
      code = read_u16_le(row.data() + 2 * c);
    } else if constexpr (kSpec.total_bits() == 8) {
      code = std::to_integer<std::uint32_t>(row[c]);
    } else if constexpr (kSpec.total_bits() == 6) {
      code = read_fp6_code(row.data(), c);
    } else {
      static_assert(kSpec.total_bits() == 4);
      code = read_fp4_code(row.data(), c);
    }
    out[c] = decode_minifloat<kSpec>(code);
  }
}

// Calls visit.template operator()<spec>() with the element spec of `format` (nvfp4: e2m1).
template <typename Visitor>
decltype(auto) visit_element_spec(Format format, Visitor&& visit) {
  switch (format) {
    case Format::bf16:
      return visit.template operator()<kBf16Spec>();
    case Format::fp16:
      return visit.template operator()<kFp16Spec>();
    case Format::fp8_e4m3:
      return visit.template operator()<kE4M3Spec>();
    case Format::fp8_e5m2:
      return visit.template operator()<kE5M2Spec>();
    case Format::fp6_e2m3:
      return visit.template operator()<kE2M3Spec>();
    case Format::fp6_e3m2:
      return visit.template operator()<kE3M2Spec>();
    case Format::fp4_e2m1:
    case Format::nvfp4:
      return visit.template operator()<kE2M1Spec>();
  }
  detail::throw_error("format: unknown Format value ", static_cast<int>(format));
}

}  // namespace

std::string_view to_string(Format format) {
  require_known(format);
  return kFormatNames[static_cast<std::size_t>(format)].name;
}

Format parse_format(std::string_view name, std::string_view arg_name) {
  for (const FormatName& entry : kFormatNames) {
    if (entry.name == name) return entry.format;
  }
  std::string valid;
  for (const FormatName& entry : kFormatNames) {
    if (!valid.empty()) valid += ", ";
    valid += entry.name;
  }
  detail::throw_error(arg_name, ": '", name, "' is not one of ", valid);
}

int element_bits(Format format) {
  return visit_element_spec(format, []<MinifloatSpec kSpec>() { return kSpec.total_bits(); });
}

float format_max(Format format) {
  const float element_max = visit_element_spec(format, []<MinifloatSpec kSpec>() {
    return decode_minifloat<kSpec>(kSpec.max_finite_code());
  });
  if (format == Format::nvfp4) {
    return element_max * decode_minifloat<kE4M3Spec>(kE4M3Spec.max_finite_code());
  }
  return element_max;
}

bool is_quantized(Format format) {
  require_known(format);
  return format != Format::bf16 && format != Format::fp16;
}

std::size_t row_bytes(Format format, int head_dim) {
  require_known(format);
  MJOLNIR_REQUIRE(head_dim > 0 && head_dim % kHeadDimMultiple == 0, "head_dim: ", head_dim,
                  " is not a positive multiple of ", kHeadDimMultiple);
  return packed_row_bytes(format, static_cast<std::size_t>(head_dim));
}

std::uint32_t encode_element(Format format, float value) {
  return visit_element_spec(
      format, [value]<MinifloatSpec kSpec>() { return encode_minifloat<kSpec>(value); });
}

float decode_element(Format format, std::uint32_t code) {
  return visit_element_spec(format, [format, code]<MinifloatSpec kSpec>() {
    MJOLNIR_REQUIRE(code >> kSpec.total_bits() == 0, "code: 0x", std::hex, code,
                    " has bits above the ", std::dec, kSpec.total_bits(), "-bit ",
                    to_string(format), " code");
    return decode_minifloat<kSpec>(code);
  });
}

void encode_row(Format format, std::span<const float> values, std::span<std::byte> row) {
  require_known(format);
  require_head_dim(values.size(), "values");
  require_row_size(format, values.size(), row.size(), "row");
  if (format == Format::nvfp4) {
    encode_nvfp4_row(values, row);
    return;
  }
  visit_element_spec(format, [&]<MinifloatSpec kSpec>() { encode_plain_row<kSpec>(values, row); });
}

void decode_row(Format format, std::span<const std::byte> row, std::span<float> out) {
  require_known(format);
  require_head_dim(out.size(), "out");
  require_row_size(format, out.size(), row.size(), "row");
  if (format == Format::nvfp4) {
    decode_nvfp4_row(row, out);
    return;
  }
  visit_element_spec(format, [&]<MinifloatSpec kSpec>() { decode_plain_row<kSpec>(row, out); });
}

}  // namespace mjolnir

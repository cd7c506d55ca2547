// KV cache element formats (docs/design.md section 3): codes, packing of one token row,
// conversions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace mjolnir {

// Storage format of the KV cache. Conversions from float round to nearest, ties to even, and
// saturate to the largest finite value (Inf included); NaN inputs are rejected before encoding
// by write_kv, and the scalar codecs map them as CUDA's __NV_SATFINITE conversions do.
enum class Format : std::uint8_t {
  bf16,
  fp16,
  fp8_e4m3,  // OCP E4M3FN: no Inf, NaN = S.1111.111, max 448
  fp8_e5m2,  // OCP E5M2, max 57344
  fp6_e2m3,  // OCP MX element, no Inf/NaN, max 7.5
  fp6_e3m2,  // OCP MX element, no Inf/NaN, max 28
  fp4_e2m1,  // values 0, .5, 1, 1.5, 2, 3, 4, 6
  nvfp4,     // e2m1 codes + one e4m3 scale per 16 channels of a token (+ the outer scale)
};

inline constexpr Format kAllFormats[] = {Format::bf16,     Format::fp16,     Format::fp8_e4m3,
                                         Format::fp8_e5m2, Format::fp6_e2m3, Format::fp6_e3m2,
                                         Format::fp4_e2m1, Format::nvfp4};

std::string_view to_string(Format format);
// Parses "fp8_e4m3" etc.; throws Error naming `arg_name` and listing the valid names.
Format parse_format(std::string_view name, std::string_view arg_name = "format");

// Bits per stored element code (nvfp4: 4, its block scales counted by row_bytes()).
int element_bits(Format format);
// Largest value one token's channel can represent before the outer scale: the element maximum,
// for nvfp4 6 * 448 (largest code times largest block scale), and for bf16 / fp16 their largest
// finite values. Calibration divides amax by it.
float format_max(Format format);
// True for formats that are stored quantized with a scale (everything but bf16 and fp16).
bool is_quantized(Format format);

// nvfp4 stores one e4m3 scale per this many channels of a token.
inline constexpr int kNvfp4BlockSize = 16;

// Bytes of one packed token row of `head_dim` channels (head_dim a multiple of 32):
//   fp8: D, fp16/bf16: 2D, fp6: 3D/4 (4 codes in 3 bytes, little-endian c0|c1<<6|c2<<12|c3<<18),
//   fp4: D/2 (channel 2i in the low nibble), nvfp4: D/2 codes followed by D/16 e4m3 block scales.
std::size_t row_bytes(Format format, int head_dim);

// Scalar element codecs, the definition every fast path is tested against. `code` holds the
// element's bits in its low bits (16 for bf16/fp16, 8, 6 or 4); decode_element throws Error for
// bits above the element's width. nvfp4 elements are fp4_e2m1. Every NaN input encodes to the
// positive all-ones magnitude (NaN where the format has one, its maximum where it has none), as
// CUDA's conversions do.
std::uint32_t encode_element(Format format, float value);
float decode_element(Format format, std::uint32_t code);

// Quantizes one token row: row[c] = encode(values[c]) packed as above. `values` are already
// divided by the outer (tensor / head / channel) scale. For nvfp4 each block of 16 gets the
// scale e4m3(amax_block / 6) (kept > 0 when the block is not all zero) and codes
// e2m1(value / decode(block_scale)): fast paths must divide by the decoded block scale, not
// multiply by its reciprocal, to match bit for bit. An all-zero block has scale 0 and decodes
// to +0.
void encode_row(Format format, std::span<const float> values, std::span<std::byte> row);
// Inverse of encode_row: out[c] = decoded value (times the nvfp4 block scale), before the outer
// scale is applied.
void decode_row(Format format, std::span<const std::byte> row, std::span<float> out);

}  // namespace mjolnir

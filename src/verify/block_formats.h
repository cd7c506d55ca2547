// llama.cpp's block formats q8_0 and q4_0, as reference lines for the accuracy table
// (docs/accuracy.md): what a ggml user stores for the same K/V at about the same bytes. Written
// from the formats' definitions (blocks of 32 values along the channels, one fp16 scale each);
// only quantize-then-dequantize is needed, so no packed layout is produced.
#pragma once

#include <span>
#include <string_view>

namespace mjolnir::verify {

enum class BlockFormat {
  q8_0,  // d = amax / 127, q = round(x / d) in [-127, 127]: 8.5 bits per value
  q4_0,  // d = -(the value of largest magnitude) / 8, q in [0, 15], x = (q - 8) d: 4.5 bits
};

inline constexpr int kBlockFormatValues = 32;  // values per block, each block with its own scale

std::string_view to_string(BlockFormat format);
// Bits per value, the fp16 block scale included.
double block_format_bits(BlockFormat format);

// out = dequantize(quantize(in)), block by block; in.size() must be a multiple of 32 and
// out.size() == in.size(). The scale is stored in fp16, as ggml stores it, and the values
// are rebuilt from that stored scale.
void round_trip(BlockFormat format, std::span<const float> in, std::span<float> out);

}  // namespace mjolnir::verify

// Fast quantization of token rows for write_kv: the division by the outer scale and the element
// encoding vectorized, bit for bit equal to encode_row(format, values / scale); and the finiteness
// check write_kv makes on every value before it writes any.
#pragma once

#include <cstddef>
#include <span>

#include "mjolnir/format.h"

namespace mjolnir::cpu {

// row = encode_row(format, v) with v[c] = values[c] / scales[c] (scales.size() == D), or
// values[c] / scales[0] (scales.size() == 1). D = values.size(), a multiple of 32;
// row.size() == row_bytes(format, D). No argument checks: write_kv validates first. Values are
// finite (write_kv rejects NaN and Inf before encoding); for them the result equals encode_row's.
void encode_scaled_row(Format format, std::span<const float> values, std::span<const float> scales,
                       std::span<std::byte> row);

// Whether no value is NaN or +-Inf.
bool all_finite(std::span<const float> values);

}  // namespace mjolnir::cpu

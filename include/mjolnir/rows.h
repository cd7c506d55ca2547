// The element types of the float rows the library reads and writes: Q and O of a decode step,
// K and V of a cache write.
#pragma once

#include <cstddef>

namespace mjolnir {

// float32, or bf16 (a bf16 model's own tensors, read and written as they are). A bf16 input row
// is its float32 widening, exactly; a bf16 output row is the float32 result rounded to nearest
// even (NaN stored as 0x7FC0), as PyTorch's conversion does. Nothing else about a step changes.
enum class RowType { f32, bf16 };

constexpr std::size_t element_bytes(RowType type) { return type == RowType::bf16 ? 2 : 4; }

}  // namespace mjolnir

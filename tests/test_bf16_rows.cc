// bf16 Q and O rows (mjolnir/rows.h): the rounding against hand-worked values, and the reference
// backend given a bf16 model's tensors as they are (the CPU kernel's targets: test_cpu_kernels).
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "bf16_rows_check.h"
#include "core/bf16_rows.h"
#include "mjolnir/decode.h"
#include "test_seed.h"
#include "verify/problem.h"

namespace mjolnir {
namespace {

std::uint16_t round_bits(std::uint32_t float_bits) {
  return bf16_from_float(std::bit_cast<float>(float_bits));
}

// Hand-worked: the 16 bits dropped are compared with half a unit of the 16 kept.
TEST(Bf16Rows, FloatRoundsToNearestEvenAsPyTorchDoes) {
  EXPECT_EQ(round_bits(0x3F800000u), 0x3F80u);  // 1.0, exact
  EXPECT_EQ(round_bits(0x3F807FFFu), 0x3F80u);  // below half a unit: down
  EXPECT_EQ(round_bits(0x3F808000u), 0x3F80u);  // a tie, 0x3F80 is even: down
  EXPECT_EQ(round_bits(0x3F818000u), 0x3F82u);  // a tie, 0x3F81 is odd: up to even
  EXPECT_EQ(round_bits(0x3F808001u), 0x3F81u);  // above half: up
  EXPECT_EQ(round_bits(0xBF80C000u), 0xBF81u);  // -1.0078125 - a bit: magnitude rounds up
  EXPECT_EQ(round_bits(0x80000000u), 0x8000u);  // -0 keeps its sign
  EXPECT_EQ(round_bits(0x00008000u), 0x0000u);  // subnormal tie to even: 0
  EXPECT_EQ(round_bits(0x00018000u), 0x0002u);  // subnormal tie to even: up
  EXPECT_EQ(round_bits(0x7F7FFFFFu), 0x7F80u);  // FLT_MAX rounds up to +Inf, as c10's does
  EXPECT_EQ(round_bits(0xFF800000u), 0xFF80u);  // -Inf stays
  EXPECT_EQ(round_bits(0x7F800001u), 0x7FC0u);  // a signalling NaN: the canonical quiet NaN
  EXPECT_EQ(round_bits(0xFFFFFFFFu), 0x7FC0u);  // a negative NaN too
  EXPECT_EQ(std::bit_cast<std::uint32_t>(bf16_to_float(0xC0A1u)), 0xC0A10000u);
}

// Each value of a random row round-trips: widening is exact, and a float32 that is a bf16 value
// narrows back to its own bits.
TEST(Bf16Rows, RowsWidenExactlyAndNarrowBack) {
  std::mt19937_64 rng(testing::test_seed());
  std::vector<std::uint16_t> bits(1000), back(1000);
  for (auto& b : bits) {
    do {
      b = std::uint16_t(rng());
    } while ((b & 0x7F80u) == 0x7F80u);  // finite values
  }
  std::vector<float> wide(1000);
  widen_row(bits.data(), RowType::bf16, wide.data(), bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(wide[i]), std::uint32_t(bits[i]) << 16) << i;
  }
  narrow_row(wide.data(), RowType::bf16, back.data(), wide.size());
  EXPECT_EQ(back, bits);
}

// The reference backend (the emulator) with bf16 Q and O: the float32 step's O rounded, through
// its direct writes and its merges of split partials, with a NaN query row.
TEST(Bf16Rows, ReferenceBackendWritesTheFloat32StepRounded) {
  const auto backend = make_backend("reference");
  std::mt19937_64 rng(testing::test_seed() + 1);
  int index = 0;
  for (Format format : {Format::bf16, Format::fp8_e4m3, Format::fp6_e2m3, Format::nvfp4}) {
    for (int splits : {1, 3}) {
      verify::ProblemSpec s;
      s.format = format;
      s.head_dim = 64;
      s.num_kv_heads = 2;
      s.group = 2 + index % 2;
      s.granularity = ScaleGranularity(index % 3);
      s.params.q_len = 1 + index % 3;
      s.params.q_mode = QMode(index % 4);
      s.params.p_mode = PMode(index % 3);
      s.seq_lens = {500, 0, 70};
      s.seed = rng();
      ++index;
      testing::check_bf16_rows(*backend, s, PlanOptions{.fixed_splits = splits},
                               std::string(to_string(format)) + " splits " + std::to_string(splits),
                               /*nan_row=*/3);
    }
  }
}

}  // namespace
}  // namespace mjolnir

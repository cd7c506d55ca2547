// llama.cpp's q8_0 and q4_0 (the accuracy table's reference lines) against hand-worked blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "mjolnir/error.h"
#include "test_seed.h"
#include "verify/block_formats.h"

namespace mjolnir::verify {
namespace {

using mjolnir::testing::test_seed;

// 0.02 in fp16: 1.28 * 2^-6 with a 10-bit mantissa, 1311 / 1024 * 2^-6.
constexpr double kScale002 = 1311.0 / 1024.0 / 64.0;

TEST(BlockFormats, Q8_0RoundsToTheBlocksScaleStoredInFp16) {
  std::vector<float> in(64, 0.0f), out(64);
  // Block 0: amax 127, d = 1 (exact in fp16): plain rounding, halves away from zero.
  in[0] = 127.0f;
  in[1] = -25.5f;  // -26
  in[2] = 0.49f;   // 0
  in[3] = 50.3f;   // 50
  // Block 1: amax 2.54, d = 0.02, stored as fp16 0.020004...: 1.0 is 50 stored steps.
  in[32] = 2.54f;
  in[33] = 1.0f;
  round_trip(BlockFormat::q8_0, in, out);
  EXPECT_EQ(out[0], 127.0f);
  EXPECT_EQ(out[1], -26.0f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_EQ(out[3], 50.0f);
  EXPECT_EQ(out[31], 0.0f);
  EXPECT_FLOAT_EQ(out[32], float(127 * kScale002));
  EXPECT_FLOAT_EQ(out[33], float(50 * kScale002));
  EXPECT_EQ(out[63], 0.0f);
}

TEST(BlockFormats, Q4_0MapsTheLargestMagnitudeToMinus8) {
  std::vector<float> in(32, 0.0f), out(32);
  // Largest magnitude negative: d = 0.5, q = min(15, trunc(x / 0.5 + 8.5)), x = (q - 8) * 0.5.
  in[0] = -4.0f;  // q 0: -4
  in[1] = 1.3f;   // 11.1 -> 11: 1.5
  in[2] = 3.9f;   // 16.3 -> 15 (clamped): 3.5
  in[3] = -0.3f;  // 7.9 -> 7: -0.5
  in[4] = 0.1f;   // 8.7 -> 8: 0
  round_trip(BlockFormat::q4_0, in, out);
  EXPECT_EQ(out[0], -4.0f);
  EXPECT_EQ(out[1], 1.5f);
  EXPECT_EQ(out[2], 3.5f);
  EXPECT_EQ(out[3], -0.5f);
  EXPECT_EQ(out[4], 0.0f);
  // Largest magnitude positive: d = -0.5, so +4 is q 0 and the clamp falls on the negative side.
  in[0] = 4.0f;
  in[2] = -3.9f;  // -3.9 / -0.5 + 8.5 = 16.3 -> 15: (15 - 8) * -0.5 = -3.5
  round_trip(BlockFormat::q4_0, in, out);
  EXPECT_EQ(out[0], 4.0f);
  EXPECT_EQ(out[2], -3.5f);
}

// Every value of a random block lands within half a step of where it was (a step of clamp at
// q4_0's positive end), and each block has a scale of its own.
TEST(BlockFormats, ErrorsStayWithinHalfAStepPerBlock) {
  const auto seed = test_seed();
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> in(256), out(256);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = normal(rng) * (i < 32 ? 100.0f : 1.0f);
  for (const BlockFormat format : {BlockFormat::q8_0, BlockFormat::q4_0}) {
    round_trip(format, in, out);
    for (std::size_t first = 0; first < in.size(); first += 32) {
      float amax = 0;
      for (std::size_t i = first; i < first + 32; ++i) amax = std::max(amax, std::fabs(in[i]));
      const float step = format == BlockFormat::q8_0 ? amax / 127 : amax / 8;
      // Half a step (a whole one at q4_0's clamped end), plus the fp16 rounding of the scale
      // over up to 127 steps (8 for q4_0). q4_0's clamp alone reaches a whole step for a value of
      // magnitude amax opposite in sign to the block's extreme; its scale's rounding then adds
      // up to 7 relative 2^-11 of a step, which the bound once left out (a seed in thousands
      // failed).
      const float bound = (format == BlockFormat::q8_0 ? 0.5f * step : step) + amax * 1e-3f;
      for (std::size_t i = first; i < first + 32; ++i) {
        EXPECT_LE(std::fabs(out[i] - in[i]), bound)
            << to_string(format) << " value " << i << " " << in[i] << " -> " << out[i];
      }
    }
  }
}

TEST(BlockFormats, BitsCountTheBlockScale) {
  EXPECT_EQ(block_format_bits(BlockFormat::q8_0), 8.5);
  EXPECT_EQ(block_format_bits(BlockFormat::q4_0), 4.5);
}

TEST(BlockFormats, RejectsAPartialBlock) {
  std::vector<float> in(40, 1.0f), out(40);
  EXPECT_THROW(round_trip(BlockFormat::q8_0, in, out), Error);
}

}  // namespace
}  // namespace mjolnir::verify

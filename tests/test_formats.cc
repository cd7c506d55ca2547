// Tests of the KV element formats (include/mjolnir/format.h, src/core/minifloat.h).
//
// The codecs are checked bit for bit against CUDA's host-side conversions in cuda_fp8.h,
// cuda_fp6.h, cuda_fp4.h, cuda_bf16.h and cuda_fp16.h, an implementation written independently
// of ours. Those tests are skipped, saying why, when the headers were not found at configure time.
// Row packing is checked against a bit-stream reader written here from the packing formulas of
// docs/design.md section 3, and against hand-worked bytes.
//
// Random inputs are fresh each run; the seed is printed and recorded as a test property, and
// MJOLNIR_TEST_SEED=<seed> replays a run.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "core/format_table.h"
#include "mjolnir/error.h"
#include "mjolnir/format.h"

#if defined(MJOLNIR_HAVE_CUDA_HEADERS) && MJOLNIR_HAVE_CUDA_HEADERS
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp6.h>
#include <cuda_fp8.h>
#define MJOLNIR_TEST_HAS_CUDA_REFERENCE 1
#else
#define MJOLNIR_TEST_HAS_CUDA_REFERENCE 0
#endif

namespace mjolnir {

// Prints test parameters by name ("fp8_e4m3") instead of as bytes.
static void PrintTo(Format format, std::ostream* os) { *os << to_string(format); }

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// --- seeds and printing ------------------------------------------------------------------------

std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* text = std::getenv("MJOLNIR_TEST_SEED")) {
      return static_cast<std::uint64_t>(std::stoull(text));
    }
    std::random_device device;
    return (static_cast<std::uint64_t>(device()) << 32) | device();
  }();
  return seed;
}

// A generator for the current test: the run's seed mixed with the test's name, so tests draw
// different streams; the seed is printed and stored in the XML report.
std::mt19937_64 seeded_rng() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  ::testing::Test::RecordProperty("seed", std::to_string(test_seed()));
  std::cout << "[   SEED   ] " << name << ": MJOLNIR_TEST_SEED=" << test_seed() << "\n";
  std::seed_seq sequence{static_cast<std::uint32_t>(test_seed()),
                         static_cast<std::uint32_t>(test_seed() >> 32),
                         static_cast<std::uint32_t>(std::hash<std::string>{}(name))};
  return std::mt19937_64(sequence);
}

std::string describe(float value) {
  std::ostringstream os;
  os << value << " (0x" << std::hex << std::bit_cast<std::uint32_t>(value) << ")";
  return os.str();
}

std::string hex(std::uint32_t value) {
  std::ostringstream os;
  os << "0x" << std::hex << value;
  return os.str();
}

bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);  // -0 != +0
}

std::string format_name(const ::testing::TestParamInfo<Format>& info) {
  return std::string(to_string(info.param));
}

// --- the CUDA reference ------------------------------------------------------------------------

#if MJOLNIR_TEST_HAS_CUDA_REFERENCE
float half_bits_to_float(__half_raw raw) { return __half2float(__half(raw)); }

// CUDA's code for `value`. bf16/fp16 use CUDA's round-to-nearest conversion with our one
// documented difference applied: an Inf result (from a finite overflow or an Inf input) becomes
// the largest finite value of the same sign, since every mjolnir conversion saturates.
std::uint32_t cuda_encode(Format format, float value) {
  switch (format) {
    case Format::bf16: {
      const std::uint32_t code = __nv_bfloat16_raw(__float2bfloat16_rn(value)).x;
      return (code & 0x7FFF) == 0x7F80 ? (code & 0x8000) | 0x7F7F : code;
    }
    case Format::fp16: {
      const std::uint32_t code = __half_raw(__float2half_rn(value)).x;
      return (code & 0x7FFF) == 0x7C00 ? (code & 0x8000) | 0x7BFF : code;
    }
    case Format::fp8_e4m3:
      return __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3);
    case Format::fp8_e5m2:
      return __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E5M2);
    case Format::fp6_e2m3:
      return __nv_cvt_float_to_fp6(value, __NV_E2M3, cudaRoundNearest);
    case Format::fp6_e3m2:
      return __nv_cvt_float_to_fp6(value, __NV_E3M2, cudaRoundNearest);
    case Format::fp4_e2m1:
    case Format::nvfp4:
      return __nv_cvt_float_to_fp4(value, __NV_E2M1, cudaRoundNearest);
  }
  ADD_FAILURE() << "no CUDA reference for format " << static_cast<int>(format);
  return 0;
}

float cuda_decode(Format format, std::uint32_t code) {
  switch (format) {
    case Format::bf16: {
      __nv_bfloat16_raw raw;
      raw.x = static_cast<unsigned short>(code);
      return __bfloat162float(__nv_bfloat16(raw));
    }
    case Format::fp16: {
      __half_raw raw;
      raw.x = static_cast<unsigned short>(code);
      return half_bits_to_float(raw);
    }
    case Format::fp8_e4m3:
      return half_bits_to_float(
          __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3));
    case Format::fp8_e5m2:
      return half_bits_to_float(
          __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E5M2));
    case Format::fp6_e2m3:
      return half_bits_to_float(
          __nv_cvt_fp6_to_halfraw(static_cast<__nv_fp6_storage_t>(code), __NV_E2M3));
    case Format::fp6_e3m2:
      return half_bits_to_float(
          __nv_cvt_fp6_to_halfraw(static_cast<__nv_fp6_storage_t>(code), __NV_E3M2));
    case Format::fp4_e2m1:
    case Format::nvfp4:
      return half_bits_to_float(
          __nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(code), __NV_E2M1));
  }
  ADD_FAILURE() << "no CUDA reference for format " << static_cast<int>(format);
  return 0;
}
#define MJOLNIR_SKIP_WITHOUT_CUDA_REFERENCE() (void)0
#else
#define MJOLNIR_SKIP_WITHOUT_CUDA_REFERENCE()                                                  \
  GTEST_SKIP() << "CUDA's host-side conversion headers (cuda_fp8.h, cuda_fp6.h, cuda_fp4.h, "  \
                  "cuda_bf16.h, cuda_fp16.h) were not found, so MJOLNIR_HAVE_CUDA_HEADERS is " \
                  "not defined and there is no independent reference to compare against"
#endif

// The element codec used to build expected rows: CUDA's when available (so the packing tests
// are independent too), else ours, which the other tests then check against CUDA elsewhere.
std::uint32_t reference_encode(Format format, float value) {
#if MJOLNIR_TEST_HAS_CUDA_REFERENCE
  return cuda_encode(format, value);
#else
  return encode_element(format, value);
#endif
}
float reference_decode(Format format, std::uint32_t code) {
#if MJOLNIR_TEST_HAS_CUDA_REFERENCE
  return cuda_decode(format, code);
#else
  return decode_element(format, code);
#endif
}

#if MJOLNIR_TEST_HAS_CUDA_REFERENCE
// --- inputs for the encoding sweep -------------------------------------------------------------

// Every finite non-negative value of the format, ascending, decoded by the reference.
std::vector<double> positive_values(Format format) {
  std::vector<double> values;
  const std::uint32_t sign_bit = 1u << (element_bits(format) - 1);
  for (std::uint32_t code = 0; code < sign_bit; ++code) {
    const float value = reference_decode(format, code);
    if (std::isfinite(value)) values.push_back(value);
  }
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  return values;
}

// Values where rounding decides: every code value, every midpoint between consecutive values
// (the ties), the midpoint between the largest value and the next binade step (the saturation
// threshold), each with its nextafter neighbours, all of it with both signs; plus zeros,
// infinities, NaNs with either sign and odd payloads, float extremes and far overflow.
std::vector<float> boundary_inputs(Format format) {
  const std::vector<double> values = positive_values(format);
  std::vector<double> points(values.begin(), values.end());
  for (std::size_t i = 0; i + 1 < values.size(); ++i) {
    points.push_back((values[i] + values[i + 1]) / 2);
  }
  const double top_step = values.back() - values[values.size() - 2];
  points.push_back(values.back() + top_step / 2);
  points.push_back(values.back() + top_step);
  points.push_back(values.back() * 2);

  std::vector<float> inputs;
  for (const double point : points) {
    if (point > std::numeric_limits<float>::max()) continue;  // bf16 beyond max: Inf, below
    const auto value = static_cast<float>(point);
    EXPECT_EQ(static_cast<double>(value), point) << "boundary point not exact in float";
    for (const float sign : {1.0f, -1.0f}) {
      inputs.push_back(sign * value);
      inputs.push_back(sign * std::nextafter(value, 0.0f));
      inputs.push_back(sign * std::nextafter(value, kInf));
    }
  }
  for (const std::uint32_t bits :
       {0x0000'0000u, 0x8000'0000u, 0x7F80'0000u, 0xFF80'0000u, 0x7FC0'0000u, 0xFFC0'0000u,
        0x7F80'0001u, 0xFF80'0001u, 0x7FC1'2345u, 0x7FFF'FFFFu, 0xFFFF'FFFFu, 0x0000'0001u,
        0x8000'0001u, 0x0080'0000u, 0x807F'FFFFu, 0x7F7F'FFFFu, 0xFF7F'FFFFu, 0x7149'F2CAu}) {
    inputs.push_back(std::bit_cast<float>(bits));
  }
  return inputs;
}

// Random inputs: uniform bit patterns (every binade, NaNs included), uniform values over
// +-1.25 * max, and log-uniform magnitudes from far below the smallest subnormal to far above
// the maximum.
std::vector<float> random_inputs(Format format, std::mt19937_64& rng, std::size_t count) {
  const std::vector<double> values = positive_values(format);
  const double smallest = values[1];
  const double largest = values.back();
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_real_distribution<double> uniform(-1.25 * largest, 1.25 * largest);
  std::uniform_real_distribution<double> log2_magnitude(std::log2(smallest) - 4,
                                                        std::log2(largest) + 4);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> inputs;
  inputs.reserve(3 * count);
  for (std::size_t i = 0; i < count; ++i) {
    inputs.push_back(std::bit_cast<float>(any_bits(rng)));
    inputs.push_back(static_cast<float>(uniform(rng)));
    const auto magnitude = static_cast<float>(std::exp2(log2_magnitude(rng)));
    inputs.push_back(negative(rng) ? -magnitude : magnitude);
  }
  return inputs;
}

// Compares encode_element with CUDA for each input; reports the first few mismatches.
void expect_encoding_matches_cuda(Format format, const std::vector<float>& inputs,
                                  const char* what) {
  std::size_t mismatches = 0;
  for (const float value : inputs) {
    const std::uint32_t ours = encode_element(format, value);
    const std::uint32_t expected = cuda_encode(format, value);
    if (ours != expected && ++mismatches <= 8) {
      ADD_FAILURE() << to_string(format) << " " << what << ": encode(" << describe(value)
                    << ") = " << hex(ours) << ", CUDA gives " << hex(expected);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << inputs.size() << " " << what << " inputs";
}
#endif

// --- codec tests, one per format ---------------------------------------------------------------

class ElementCodec : public ::testing::TestWithParam<Format> {};
INSTANTIATE_TEST_SUITE_P(AllFormats, ElementCodec, ::testing::ValuesIn(kAllFormats), format_name);

TEST_P(ElementCodec, EveryCodeDecodesAsCuda) {
  MJOLNIR_SKIP_WITHOUT_CUDA_REFERENCE();
#if MJOLNIR_TEST_HAS_CUDA_REFERENCE
  const Format format = GetParam();
  std::size_t nan_codes = 0;
  for (std::uint32_t code = 0; code < (1u << element_bits(format)); ++code) {
    const float ours = decode_element(format, code);
    const float expected = cuda_decode(format, code);
    nan_codes += std::isnan(expected);
    ASSERT_TRUE(same_float(ours, expected))
        << to_string(format) << " code " << hex(code) << ": ours " << describe(ours) << ", CUDA "
        << describe(expected);
  }
  // The NaN encodings of docs/design.md section 3: none for fp6/fp4, S.1111.111 for e4m3, IEEE
  // otherwise.
  const std::size_t expected_nan_codes[] = {2 * 127, 2 * 1023, 2, 2 * 3, 0, 0, 0, 0};
  EXPECT_EQ(nan_codes, expected_nan_codes[static_cast<int>(format)]);
#endif
}

TEST_P(ElementCodec, EncodingMatchesCudaAtEveryBoundary) {
  MJOLNIR_SKIP_WITHOUT_CUDA_REFERENCE();
#if MJOLNIR_TEST_HAS_CUDA_REFERENCE
  expect_encoding_matches_cuda(GetParam(), boundary_inputs(GetParam()), "boundary");
#endif
}

TEST_P(ElementCodec, EncodingMatchesCudaOnRandomFloats) {
  MJOLNIR_SKIP_WITHOUT_CUDA_REFERENCE();
#if MJOLNIR_TEST_HAS_CUDA_REFERENCE
  std::mt19937_64 rng = seeded_rng();
  expect_encoding_matches_cuda(GetParam(), random_inputs(GetParam(), rng, 1 << 18), "random");
#endif
}

// Every 251st float bit pattern from a random start: 17 million inputs spread over every
// binade, sign, subnormal and NaN payload.
TEST_P(ElementCodec, EncodingMatchesCudaOnStrideSweepOfAllFloats) {
  MJOLNIR_SKIP_WITHOUT_CUDA_REFERENCE();
#if MJOLNIR_TEST_HAS_CUDA_REFERENCE
  constexpr std::uint64_t kStride = 251;
  const Format format = GetParam();
  std::mt19937_64 rng = seeded_rng();
  const std::uint64_t start = std::uniform_int_distribution<std::uint64_t>(0, kStride - 1)(rng);
  std::size_t mismatches = 0;
  std::size_t inputs = 0;
  for (std::uint64_t bits = start; bits <= 0xFFFF'FFFFu; bits += kStride, ++inputs) {
    const float value = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    const std::uint32_t ours = encode_element(format, value);
    const std::uint32_t expected = cuda_encode(format, value);
    if (ours != expected && ++mismatches <= 8) {
      ADD_FAILURE() << to_string(format) << ": encode(" << describe(value) << ") = " << hex(ours)
                    << ", CUDA gives " << hex(expected);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << inputs << " stride-sweep inputs from " << start;
#endif
}

// Independent of CUDA: every non-NaN code survives decode then encode (so encoding is exact on
// representable values and the two directions agree), and NaN maps to the all-ones positive
// code as CUDA's satfinite conversions do.
TEST_P(ElementCodec, DecodeThenEncodeIsIdentity) {
  const Format format = GetParam();
  const int bits = element_bits(format);
  for (std::uint32_t code = 0; code < (1u << bits); ++code) {
    const float value = decode_element(format, code);
    if (std::isnan(value)) continue;
    if (std::isinf(value)) {  // saturates to the largest finite value of that sign
      EXPECT_EQ(decode_element(format, encode_element(format, value)),
                std::copysign(format_max(format), value));  // IEEE formats: not nvfp4
      continue;
    }
    EXPECT_EQ(encode_element(format, value), code)
        << to_string(format) << " code " << hex(code) << " = " << describe(value);
  }
  const std::uint32_t all_ones_positive = (1u << (bits - 1)) - 1;
  EXPECT_EQ(encode_element(format, kNaN), all_ones_positive);
  EXPECT_EQ(encode_element(format, -kNaN), all_ones_positive);
  const float element_max = format == Format::nvfp4 ? 6.0f : format_max(format);
  const float float_max = std::numeric_limits<float>::max();
  EXPECT_EQ(decode_element(format, encode_element(format, kInf)), element_max);
  EXPECT_EQ(decode_element(format, encode_element(format, -float_max)), -element_max);
}

// --- hand-checked values -------------------------------------------------------------------------

TEST(FormatValues, HandCheckedCodes) {
  // fp4 e2m1: bias 1, one mantissa bit; code 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6 (docs/design.md
  // section 3).
  const float e2m1_values[] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (std::uint32_t code = 0; code < 8; ++code) {
    EXPECT_EQ(decode_element(Format::fp4_e2m1, code), e2m1_values[code]);
    EXPECT_EQ(decode_element(Format::fp4_e2m1, code | 8), -e2m1_values[code]);
  }
  EXPECT_TRUE(std::signbit(decode_element(Format::fp4_e2m1, 0x8)));
  // Ties to even: 2.5 -> 2 (0b0100), 5 -> 4 (0b0110), 0.25 -> 0, 0.75 -> 1 (0b0010).
  EXPECT_EQ(encode_element(Format::fp4_e2m1, 2.5f), 0x4u);
  EXPECT_EQ(encode_element(Format::fp4_e2m1, 5.0f), 0x6u);
  EXPECT_EQ(encode_element(Format::fp4_e2m1, 0.25f), 0x0u);
  EXPECT_EQ(encode_element(Format::fp4_e2m1, -0.25f), 0x8u);
  EXPECT_EQ(encode_element(Format::fp4_e2m1, 0.75f), 0x2u);
  // e4m3: 448 = 0x7E, 0x7F is NaN, smallest subnormal 2^-9 = 0x01; 464 (= 448 + half ulp)
  // is a tie that rounds to even 448, and everything above saturates.
  EXPECT_EQ(decode_element(Format::fp8_e4m3, 0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(decode_element(Format::fp8_e4m3, 0x7F)));
  EXPECT_TRUE(std::isnan(decode_element(Format::fp8_e4m3, 0xFF)));
  EXPECT_EQ(decode_element(Format::fp8_e4m3, 0x01), 0.001953125f);
  EXPECT_EQ(encode_element(Format::fp8_e4m3, 464.0f), 0x7Eu);
  EXPECT_EQ(encode_element(Format::fp8_e4m3, 1e9f), 0x7Eu);
  EXPECT_EQ(encode_element(Format::fp8_e4m3, -kInf), 0xFEu);
  // e5m2 keeps IEEE Inf codes for decoding, but encoding saturates at 57344 = 0x7B.
  EXPECT_EQ(decode_element(Format::fp8_e5m2, 0x7C), kInf);
  EXPECT_EQ(encode_element(Format::fp8_e5m2, 61440.0f), 0x7Bu);
  EXPECT_EQ(encode_element(Format::fp8_e5m2, kInf), 0x7Bu);
  // fp16 / bf16 saturate instead of returning Inf; NaN stays a quiet NaN (0x7FFF).
  EXPECT_EQ(encode_element(Format::fp16, 65520.0f), 0x7BFFu);
  EXPECT_EQ(encode_element(Format::fp16, -kInf), 0xFBFFu);
  EXPECT_EQ(encode_element(Format::fp16, kNaN), 0x7FFFu);
  EXPECT_EQ(encode_element(Format::bf16, kInf), 0x7F7Fu);
  EXPECT_EQ(encode_element(Format::bf16, 1.0f), 0x3F80u);
  EXPECT_EQ(encode_element(Format::bf16, std::bit_cast<float>(0x3F80'8000u)), 0x3F80u);  // tie
  EXPECT_EQ(encode_element(Format::bf16, std::bit_cast<float>(0x3F81'8000u)), 0x3F82u);  // tie
  EXPECT_EQ(encode_element(Format::bf16, -kNaN), 0x7FFFu);
  // fp6 / fp4 have no NaN: NaN becomes +max, as CUDA does.
  EXPECT_EQ(encode_element(Format::fp6_e2m3, -kNaN), 0x1Fu);
  EXPECT_EQ(encode_element(Format::fp6_e3m2, kNaN), 0x1Fu);
  EXPECT_EQ(encode_element(Format::fp4_e2m1, -kNaN), 0x7u);
}

TEST(FormatValues, Properties) {
  // Order of kAllFormats: bf16 fp16 e4m3 e5m2 e2m3 e3m2 e2m1 nvfp4.
  const int bits[] = {16, 16, 8, 8, 6, 6, 4, 4};
  const float maxima[] = {
      std::bit_cast<float>(0x7F7F'0000u), 65504, 448, 57344, 7.5f, 28, 6, 6 * 448};
  const bool quantized[] = {false, false, true, true, true, true, true, true};
  const std::size_t bytes_for_128[] = {256, 256, 128, 128, 96, 96, 64, 64 + 8};
  // Half an ulp of 1 relative: 2^-(mantissa bits + 1), the error bounds' unit roundoff.
  const int roundoff_exponents[] = {-8, -11, -4, -3, -4, -3, -2, -2};
  for (const Format format : kAllFormats) {
    const auto i = static_cast<std::size_t>(format);
    SCOPED_TRACE(std::string(to_string(format)));
    EXPECT_EQ(format_facts(format).unit_roundoff(), std::ldexp(1.0, roundoff_exponents[i]));
    EXPECT_EQ(element_bits(format), bits[i]);
    EXPECT_EQ(format_max(format), maxima[i]);
    EXPECT_EQ(is_quantized(format), quantized[i]);
    EXPECT_EQ(row_bytes(format, 128), bytes_for_128[i]);
    EXPECT_EQ(row_bytes(format, 32) * 4, bytes_for_128[i]);
  }
}

// --- names -------------------------------------------------------------------------------------

TEST(FormatNames, ParseAndPrintRoundTrip) {
  for (const Format format : kAllFormats) {
    EXPECT_EQ(parse_format(to_string(format)), format);
  }
  EXPECT_EQ(to_string(Format::fp8_e4m3), "fp8_e4m3");
  EXPECT_EQ(to_string(Format::nvfp4), "nvfp4");
}

TEST(FormatNames, BadNameNamesTheArgumentAndListsValidNames) {
  for (const std::string_view bad : {"fp7", "FP8_E4M3", "", "fp8_e4m3 ", "e4m3"}) {
    try {
      parse_format(bad, "--kv-format");
      ADD_FAILURE() << "parse_format accepted '" << bad << "'";
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_EQ(message.rfind("--kv-format", 0), 0u) << message;
      EXPECT_NE(message.find("'" + std::string(bad) + "'"), std::string::npos) << message;
      for (const Format format : kAllFormats) {
        EXPECT_NE(message.find(to_string(format)), std::string::npos) << message;
      }
    }
  }
  EXPECT_THROW(
      {
        try {
          parse_format("int4");
        } catch (const Error& error) {
          EXPECT_EQ(std::string(error.what()).rfind("format:", 0), 0u) << error.what();
          throw;
        }
      },
      Error);
}

// --- packing -----------------------------------------------------------------------------------

// Reads `width` bits at bit `offset` of a little-endian bit stream (bit k of the row is bit k % 8
// of byte k / 8). The packings of docs/design.md section 3 are all this stream: fp6 c0 | c1<<6 |
// c2<<12 | c3<<18 over three little-endian bytes, fp4 channel 2i in the low nibble, 16-bit codes
// little-endian.
std::uint32_t read_bits(std::span<const std::byte> row, std::size_t offset, int width) {
  std::uint32_t value = 0;
  for (int bit = 0; bit < width; ++bit) {
    const std::size_t position = offset + static_cast<std::size_t>(bit);
    const auto byte = std::to_integer<std::uint32_t>(row[position / 8]);
    value |= ((byte >> (position % 8)) & 1u) << bit;
  }
  return value;
}

// A span in the middle of a buffer whose guard regions hold a sentinel, to catch writes outside.
template <typename T>
class Guarded {
 public:
  Guarded(std::size_t size, T sentinel)
      : sentinel_(sentinel), size_(size), storage_(size + 2 * kGuard, sentinel) {}
  std::span<T> span() { return {storage_.data() + kGuard, size_}; }
  bool guards_intact() const {
    for (std::size_t i = 0; i < kGuard; ++i) {
      if (!same(storage_[i]) || !same(storage_[kGuard + size_ + i])) return false;
    }
    return true;
  }

 private:
  static constexpr std::size_t kGuard = 37;
  bool same(T value) const {
    if constexpr (std::is_same_v<T, float>) return same_float(value, sentinel_);
    return value == sentinel_;
  }
  T sentinel_;
  std::size_t size_;
  std::vector<T> storage_;
};

constexpr std::byte kByteSentinel{0xA5};
const float kFloatSentinel = std::bit_cast<float>(0x7FA5'A5A5u);  // a NaN nothing writes

// Random row values for `format`: mostly within +-1.1 * max, a few far beyond (saturation) and
// a few tiny; for nvfp4 each 16-channel block gets its own magnitude from 2^-14 to 2^12 so block
// scales vary from subnormal to saturated. Never all zero.
std::vector<float> random_row(Format format, int head_dim, std::mt19937_64& rng) {
  const double largest = format == Format::nvfp4 ? 6.0 : format_max(format);
  std::uniform_real_distribution<double> unit(-1.1, 1.1);
  std::uniform_real_distribution<double> block_log2(-14, 12);
  std::uniform_int_distribution<int> kind(0, 19);
  std::vector<float> values(static_cast<std::size_t>(head_dim));
  double block_magnitude = largest;
  for (std::size_t c = 0; c < values.size(); ++c) {
    if (format == Format::nvfp4 && c % kNvfp4BlockSize == 0) {
      block_magnitude = std::exp2(block_log2(rng));
    }
    const int k = kind(rng);
    double value = unit(rng) * block_magnitude;
    if (k == 0) value *= 1e3;   // beyond the range: saturates
    if (k == 1) value *= 1e-4;  // tiny: subnormal or flushed
    values[c] = static_cast<float>(value);
  }
  values[0] = static_cast<float>(block_magnitude * 0.75);  // at least one non-zero
  return values;
}

struct PackingCase {
  Format format;
  int head_dim;
};

void PrintTo(const PackingCase& packing_case, std::ostream* os) {
  *os << to_string(packing_case.format) << " head_dim " << packing_case.head_dim;
}

std::string packing_case_name(const ::testing::TestParamInfo<PackingCase>& info) {
  return std::string(to_string(info.param.format)) + "_d" + std::to_string(info.param.head_dim);
}

std::vector<PackingCase> all_packing_cases() {
  std::vector<PackingCase> cases;
  for (const Format format : kAllFormats) {
    for (const int head_dim : {32, 64, 96, 128, 256}) cases.push_back({format, head_dim});
  }
  return cases;
}

class RowPacking : public ::testing::TestWithParam<PackingCase> {};
INSTANTIATE_TEST_SUITE_P(AllFormatsAndHeadDims, RowPacking,
                         ::testing::ValuesIn(all_packing_cases()), packing_case_name);

// encode_row writes exactly the codes the reference codec gives, where docs/design.md section 3
// says, and decode_row reads them back; nothing outside the spans is touched.
TEST_P(RowPacking, RoundTripMatchesElementCodec) {
  const auto [format, head_dim] = GetParam();
  std::mt19937_64 rng = seeded_rng();
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> values = random_row(format, head_dim, rng);
    const std::size_t bytes = row_bytes(format, head_dim);
    Guarded<std::byte> row(bytes, kByteSentinel);
    encode_row(format, values, row.span());
    ASSERT_TRUE(row.guards_intact()) << "encode_row wrote outside its row";

    Guarded<float> out(values.size(), kFloatSentinel);
    decode_row(format, row.span(), out.span());
    ASSERT_TRUE(out.guards_intact()) << "decode_row wrote outside its output";

    const int bits = element_bits(format);
    for (std::size_t c = 0; c < values.size(); ++c) {
      float scale = 1.0f;
      float scaled_value = values[c];
      if (format == Format::nvfp4) {
        // Block scale from docs/design.md section 3: e4m3(amax / 6), the smallest subnormal if that
        // is 0.
        const std::size_t block = c / kNvfp4BlockSize;
        float amax = 0;
        for (std::size_t i = 0; i < static_cast<std::size_t>(kNvfp4BlockSize); ++i) {
          amax = std::max(amax, std::fabs(values[block * kNvfp4BlockSize + i]));
        }
        std::uint32_t expected_scale = reference_encode(Format::fp8_e4m3, amax / 6.0f);
        if (expected_scale == 0 && amax > 0) expected_scale = 1;
        const std::size_t scale_offset = bytes - values.size() / kNvfp4BlockSize + block;
        ASSERT_EQ(read_bits(row.span(), 8 * scale_offset, 8), expected_scale)
            << "block " << block << " amax " << amax;
        scale = reference_decode(Format::fp8_e4m3, expected_scale);
        scaled_value = expected_scale == 0 ? 0.0f : values[c] / scale;
      }
      const std::uint32_t code = read_bits(row.span(), c * static_cast<std::size_t>(bits), bits);
      const std::uint32_t expected_code = scale == 0 ? 0 : reference_encode(format, scaled_value);
      ASSERT_EQ(code, expected_code) << "channel " << c << " value " << describe(values[c]);
      const float expected_out = reference_decode(format, code) * scale;
      ASSERT_TRUE(same_float(out.span()[c], expected_out))
          << "channel " << c << ": " << describe(out.span()[c]) << " vs " << describe(expected_out);
    }
  }
}

std::vector<std::byte> to_bytes(std::initializer_list<int> values) {
  std::vector<std::byte> bytes;
  for (const int value : values) bytes.push_back(static_cast<std::byte>(value));
  return bytes;
}

TEST(RowPackingByHand, Fp6E2M3) {
  // e2m3: bias 1, 3 mantissa bits, subnormal step 1/8.
  //   1.0   = exponent field 1, mantissa 0        = 0b0'01'000 = 0x08
  //  -0.5   = subnormal 4/8                       = 0b1'00'100 = 0x24
  //   7.5   = max: exponent 3 (2^2) * 1.875       = 0b0'11'111 = 0x1F
  //   0.125 = subnormal 1/8                       = 0b0'00'001 = 0x01
  //   word = 0x08 | 0x24<<6 | 0x1F<<12 | 0x01<<18 = 0x08 + 0x900 + 0x1F000 + 0x40000 = 0x05F908
  //   bytes (little-endian) 08 F9 05
  //  -7.5   = -max                                = 0x3F
  //   3.0   = 2^1 * 1.5: field 2, mantissa 4      = 0b0'10'100 = 0x14
  //   0.0625= half of 1/8: a tie, even is 0       = 0x00
  //   100   = saturates to 7.5                    = 0x1F
  //   word = 0x3F | 0x14<<6 | 0x00<<12 | 0x1F<<18 = 0x3F + 0x500 + 0x7C0000 = 0x7C053F
  //   bytes 3F 05 7C
  const float group_a[] = {1.0f, -0.5f, 7.5f, 0.125f};
  const float group_b[] = {-7.5f, 3.0f, 0.0625f, 100.0f};
  std::vector<float> values;
  std::vector<std::byte> expected;
  for (int repeat = 0; repeat < 4; ++repeat) {
    values.insert(values.end(), std::begin(group_a), std::end(group_a));
    values.insert(values.end(), std::begin(group_b), std::end(group_b));
    for (const std::byte b : to_bytes({0x08, 0xF9, 0x05, 0x3F, 0x05, 0x7C})) expected.push_back(b);
  }
  std::vector<std::byte> row(row_bytes(Format::fp6_e2m3, 32));
  ASSERT_EQ(row.size(), 24u);
  encode_row(Format::fp6_e2m3, values, row);
  EXPECT_EQ(row, expected);

  std::vector<float> out(32);
  decode_row(Format::fp6_e2m3, row, out);
  const float decoded[] = {1.0f, -0.5f, 7.5f, 0.125f, -7.5f, 3.0f, 0.0f, 7.5f};
  for (std::size_t c = 0; c < out.size(); ++c) EXPECT_EQ(out[c], decoded[c % 8]) << c;
}

TEST(RowPackingByHand, Fp4E2M1) {
  // e2m1 codes: 0 .5 1 1.5 2 3 4 6 = 0..7, sign 0x8.
  //   1.5 -> 3,  -3.0 -> 0xD            byte 0 = 0x3 | 0xD<<4 = 0xD3
  //   0.5 -> 1,   6.0 -> 7              byte 1 = 0x1 | 0x7<<4 = 0x71
  //   2.5 -> tie 2|3, even 2 = 4; 5.0 -> tie 4|6, even 4 = 6
  //                                     byte 2 = 0x4 | 0x6<<4 = 0x64
  //  -0.25 -> tie 0|0.5, even 0 = -0 = 8; 100 -> saturates to 6 = 7
  //                                     byte 3 = 0x8 | 0x7<<4 = 0x78
  const float pattern[] = {1.5f, -3.0f, 0.5f, 6.0f, 2.5f, 5.0f, -0.25f, 100.0f};
  std::vector<float> values;
  std::vector<std::byte> expected;
  for (int repeat = 0; repeat < 4; ++repeat) {
    values.insert(values.end(), std::begin(pattern), std::end(pattern));
    for (const std::byte b : to_bytes({0xD3, 0x71, 0x64, 0x78})) expected.push_back(b);
  }
  std::vector<std::byte> row(row_bytes(Format::fp4_e2m1, 32));
  ASSERT_EQ(row.size(), 16u);
  encode_row(Format::fp4_e2m1, values, row);
  EXPECT_EQ(row, expected);

  std::vector<float> out(32);
  decode_row(Format::fp4_e2m1, row, out);
  const float decoded[] = {1.5f, -3.0f, 0.5f, 6.0f, 2.0f, 4.0f, -0.0f, 6.0f};
  for (std::size_t c = 0; c < out.size(); ++c) {
    EXPECT_TRUE(same_float(out[c], decoded[c % 8])) << c << ": " << describe(out[c]);
  }
}

// --- nvfp4 block scales ------------------------------------------------------------------------

TEST(Nvfp4, HandWorkedBlocks) {
  // Block 0: amax 10, 10/6 = 1.667 lies between the e4m3 values 1.625 and 1.75 (midpoint
  // 1.6875), so the scale is 1.625 = 2^0 * 1.101b = 0b0'0111'101 = 0x3D. Codes are
  // e2m1(x / 1.625); the amax itself, 6.15, saturates to 6:
  //   10 -> 6.15 -> 7     -10 -> F     1.625 -> 1 -> 2     3.25 -> 2 -> 4
  //   0.8125 -> .5 -> 1   -4.875 -> -3 -> D   0.40625 -> .25 (tie, even 0) -> 0   0.2 -> 0
  //   2.4375 -> 1.5 -> 3  1 -> .615 -> 1      2 -> 1.23 -> 2   3 -> 1.85 -> 4
  //   4 -> 2.46 -> 4      5 -> 3.08 -> 5      6 -> 3.69 -> 6   -0.1 -> -0.06 -> -0 = 8
  //   bytes (channel 2i low): F7 42 D1 00 13 42 54 86
  // Block 1: amax 12, scale e4m3(2) = 0b0'1000'000 = 0x40, codes e2m1(x / 2):
  //   12 -> 6 -> 7   -12 -> F   0.5 -> .25 (tie) -> 0   -0.75 -> -.375 -> -.5 -> 9
  //   5 -> 2.5 (tie) -> 2 = 4   7 -> 3.5 (tie) -> 4 = 6   -1 -> -.5 -> 9   3 -> 1.5 -> 3
  //   1.5 -> .75 (tie) -> 1 = 2   2 -> 1 -> 2   4 -> 2 -> 4   6 -> 3 -> 5
  //   8 -> 4 -> 6   -9 -> -4.5 -> -4 = E   10 -> 5 (tie) -> 4 = 6   11 -> 5.5 -> 6 = 7
  //   bytes: F7 90 64 39 22 54 E6 76
  // Then the two scale bytes 3D 40.
  const std::vector<float> values = {
      10, -10, 1.625f, 3.25f,  0.8125f, -4.875f, 0.40625f, 0.2f, 2.4375f, 1, 2, 3, 4, 5,  6,  -0.1f,
      12, -12, 0.5f,   -0.75f, 5,       7,       -1,       3,    1.5f,    2, 4, 6, 8, -9, 10, 11};
  const std::vector<std::byte> expected =
      to_bytes({0xF7, 0x42, 0xD1, 0x00, 0x13, 0x42, 0x54, 0x86, 0xF7, 0x90, 0x64, 0x39, 0x22, 0x54,
                0xE6, 0x76, 0x3D, 0x40});
  std::vector<std::byte> row(row_bytes(Format::nvfp4, 32));
  ASSERT_EQ(row.size(), 18u);
  encode_row(Format::nvfp4, values, row);
  EXPECT_EQ(row, expected);

  std::vector<float> out(32);
  decode_row(Format::nvfp4, row, out);
  const std::vector<float> decoded = {
      9.75f, -9.75f, 1.625f, 3.25f, 0.8125f, -4.875f, 0,   0,  2.4375f, 0.8125f, 1.625f,
      3.25f, 3.25f,  4.875f, 6.5f,  -0.0f,   12,      -12, 0,  -1,      4,       8,
      -1,    3,      2,      2,     4,       6,       8,   -8, 8,       12};
  for (std::size_t c = 0; c < out.size(); ++c) {
    EXPECT_TRUE(same_float(out[c], decoded[c])) << c << ": " << describe(out[c]);
  }
}

TEST(Nvfp4, AllZeroBlockHasZeroScaleAndCodes) {
  std::mt19937_64 rng = seeded_rng();
  std::uniform_real_distribution<float> nonzero(0.5f, 100.0f);
  std::vector<float> values(64);
  for (float& value : values) value = nonzero(rng);
  for (int c = 16; c < 32; ++c) values[c] = c % 2 ? -0.0f : 0.0f;  // block 1 is all zero
  std::vector<std::byte> row(row_bytes(Format::nvfp4, 64));
  encode_row(Format::nvfp4, values, row);
  EXPECT_EQ(row[32 + 1], std::byte{0}) << "block 1 scale";
  for (int i = 8; i < 16; ++i) EXPECT_EQ(row[i], std::byte{0}) << "block 1 code byte " << i;
  for (const int block : {0, 2, 3}) EXPECT_NE(row[32 + block], std::byte{0}) << block;
  std::vector<float> out(64);
  decode_row(Format::nvfp4, row, out);
  for (int c = 16; c < 32; ++c) EXPECT_TRUE(same_float(out[c], 0.0f)) << c;
}

TEST(Nvfp4, TinyBlockKeepsSmallestScaleInsteadOfFlushing) {
  // amax 0.002: 0.002 / 6 = 3.3e-4 is below half the smallest e4m3 subnormal (2^-10), so the
  // plain rule would give scale 0 and flush the block. The smallest subnormal 2^-9 is used:
  // 0.002 / 2^-9 = 1.024 -> e2m1 1.0, -0.001 / 2^-9 = -0.512 -> -0.5.
  ASSERT_EQ(encode_element(Format::fp8_e4m3, 0.002f / 6), 0u);
  std::vector<float> values(32, 0.0f);
  for (int c = 0; c < 16; ++c) values[c] = c % 2 ? -0.001f : 0.002f;
  for (int c = 16; c < 32; ++c) values[c] = 1.0f;
  std::vector<std::byte> row(row_bytes(Format::nvfp4, 32));
  encode_row(Format::nvfp4, values, row);
  EXPECT_EQ(row[16], std::byte{0x01});
  EXPECT_EQ(row[0], std::byte{0x92});  // channel 0: 1.0 = 2, channel 1: -0.5 = 9
  std::vector<float> out(32);
  decode_row(Format::nvfp4, row, out);
  EXPECT_EQ(out[0], 0.001953125f);
  EXPECT_EQ(out[1], -0.0009765625f);
}

TEST(Nvfp4, SaturatesAtSixTimes448) {
  // amax far above 6 * 448: the scale saturates to 448 (0x7E) and the codes to +-6.
  std::vector<float> values(32);
  for (int c = 0; c < 32; ++c) values[c] = static_cast<float>(c + 1) * 1000.0f;
  values[3] = kInf;
  values[5] = -3000.0f;  // / 448 = -6.7 -> -6
  values[20] = 2688.0f;  // block 1 amax 32000 -> scale 448; 2688 / 448 = 6 exactly
  std::vector<std::byte> row(row_bytes(Format::nvfp4, 32));
  encode_row(Format::nvfp4, values, row);
  EXPECT_EQ(row[16], std::byte{0x7E});
  EXPECT_EQ(row[17], std::byte{0x7E});
  std::vector<float> out(32);
  decode_row(Format::nvfp4, row, out);
  EXPECT_EQ(out[3], format_max(Format::nvfp4));
  EXPECT_EQ(out[5], -format_max(Format::nvfp4));
  EXPECT_EQ(out[20], 2688.0f);
  EXPECT_EQ(out[31], 2688.0f);
  // The element codec of nvfp4 is e2m1.
  EXPECT_EQ(encode_element(Format::nvfp4, 5.0f), encode_element(Format::fp4_e2m1, 5.0f));
  EXPECT_EQ(decode_element(Format::nvfp4, 0xF), -6.0f);
}

// --- argument checking -------------------------------------------------------------------------

// Runs `call`, expecting mjolnir::Error whose message starts with `argument`.
template <typename Call>
void expect_error_naming(const char* argument, Call&& call) {
  try {
    call();
    ADD_FAILURE() << "no mjolnir::Error thrown; expected one naming " << argument;
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()).rfind(argument, 0), 0u)
        << "message should start with '" << argument << "': " << error.what();
  }
}

TEST_P(ElementCodec, BadSpansThrowNamingTheArgument) {
  const Format format = GetParam();
  const std::vector<float> values64(64, 1.0f);
  const std::vector<float> values48(48, 1.0f);
  std::vector<float> out64(64);
  std::vector<float> out48(48);
  std::vector<std::byte> row64(row_bytes(format, 64));
  std::vector<std::byte> row_too_long(row64.size() + 1);
  expect_error_naming("values", [&] { encode_row(format, values48, row64); });
  expect_error_naming("values", [&] { encode_row(format, {}, row64); });
  expect_error_naming("row", [&] { encode_row(format, values64, row_too_long); });
  expect_error_naming(
      "row", [&] { encode_row(format, values64, std::span(row64).first(row64.size() - 1)); });
  expect_error_naming("out", [&] { decode_row(format, row64, out48); });
  expect_error_naming("row", [&] { decode_row(format, row_too_long, out64); });
  expect_error_naming("head_dim", [&] { row_bytes(format, 48); });
  expect_error_naming("head_dim", [&] { row_bytes(format, 0); });
  expect_error_naming("head_dim", [&] { row_bytes(format, -32); });
  expect_error_naming("code", [&] { decode_element(format, 1u << element_bits(format)); });
  EXPECT_NO_THROW(encode_row(format, values64, row64));
  EXPECT_NO_THROW(decode_row(format, row64, out64));
}

TEST(FormatArguments, UnknownFormatValueThrows) {
  const auto bogus = static_cast<Format>(200);
  expect_error_naming("format", [&] { to_string(bogus); });
  expect_error_naming("format", [&] { element_bits(bogus); });
  expect_error_naming("format", [&] { row_bytes(bogus, 32); });
  expect_error_naming("format", [&] { encode_element(bogus, 1.0f); });
  std::vector<float> values(32, 1.0f);
  std::vector<std::byte> row(64);
  expect_error_naming("format", [&] { encode_row(bogus, values, row); });
  expect_error_naming("format", [&] { format_max(bogus); });
  expect_error_naming("format", [&] { is_quantized(bogus); });
  expect_error_naming("cache.geometry.format", [&] {
    visit_format(
        bogus, []<Format>() {}, "cache.geometry.format");
  });
}

}  // namespace
}  // namespace mjolnir

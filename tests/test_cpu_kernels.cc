// The CPU kernels' building blocks on every compiled SIMD target (Highway's per-target test
// pattern): row decoders against the scalar decode_row, SIMD rounding and encoding against the
// scalar codecs, both exp2s, the fast row encoder, and whole decode steps against the emulator.
#include "cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
// Found through the src/ include directory (tests/ is not on the include path).
#define HWY_TARGET_INCLUDE "../tests/test_cpu_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "cpu/bf16_dot-inl.h"
#include "cpu/exp2-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/minifloat_simd-inl.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"
#include "hwy/tests/hwy_gtest.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "bf16_rows_check.h"
#include "core/minifloat.h"
#include "cpu/amx.h"
#include "cpu/attention_kernel.h"
#include "cpu/cpu_backend.h"
#include "cpu/row_encoder.h"
#include "cpu/work_units.h"
#include "expect_error.h"
#include "mjolnir/format.h"
#include "non_finite_cases.h"
#include "test_seed.h"
#include "verify/case_matrix.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if MJOLNIR_PORTABLE_TARGET

// The fallback target runs the scalar path; the case-matrix tests below cover it.
void TestDecoders() {}
void TestDotDecoders() {}
void TestNvfp4DotScales() {}
void TestRounding() {}
void TestExp2() {}

#else

std::uint32_t Bits(float x) { return std::bit_cast<std::uint32_t>(x); }

// Random packed rows of `format` whose codes are all finite (as write_kv stores them): encoded
// from random floats over the whole range, plus rows that walk every code.
std::vector<std::vector<std::byte>> TestRows(Format format, int head_dim, std::mt19937_64& rng) {
  std::vector<std::vector<std::byte>> rows;
  const std::size_t bytes = row_bytes(format, head_dim);
  std::uniform_real_distribution<float> exponent(-30.0f, 20.0f);
  std::vector<float> values(head_dim);
  for (int i = 0; i < 20; ++i) {
    for (float& v : values) v = std::exp2(exponent(rng)) * (rng() % 2 ? 1.0f : -1.0f);
    if (i % 3 == 0) values[rng() % head_dim] = 0.0f;
    rows.emplace_back(bytes);
    encode_row(format, values, rows.back());
  }
  // Every code of the element format, in every channel position over the rows.
  const int bits = element_bits(format);
  const std::uint32_t codes = 1u << bits;
  for (std::uint32_t start = 0; start < codes; start += head_dim) {
    std::vector<float> walk(head_dim);
    for (int c = 0; c < head_dim; ++c) {
      std::uint32_t code = (start + c) % codes;
      float v = decode_element(format, code);
      if (!std::isfinite(v)) v = 1.0f;  // Inf / NaN codes never reach a cache
      walk[c] = v;
    }
    rows.emplace_back(bytes);
    encode_row(format, walk, rows.back());
  }
  return rows;
}

// Every decoded channel against decode_row, bit for bit. no_subnormals: the decoder must also
// never produce an fp32 subnormal (the kernel decoders of AVX3_DL, word_decoders-inl.h).
template <class Decoder>
void CheckDecoder(Format format, std::initializer_list<int> head_dims, bool no_subnormals) {
  std::mt19937_64 rng(mjolnir::testing::test_seed() ^ static_cast<std::uint64_t>(format));
  for (int head_dim : head_dims) {
    std::vector<std::int32_t> channel_of(head_dim);
    ChannelOrder<Decoder>(head_dim, channel_of.data());
    std::vector<bool> seen(head_dim, false);
    for (int i = 0; i < head_dim; ++i) {
      ASSERT_TRUE(channel_of[i] >= 0 && channel_of[i] < head_dim);
      ASSERT_FALSE(seen[channel_of[i]]) << "channel order is not a permutation";
      seen[channel_of[i]] = true;
    }
    auto raw = hwy::AllocateAligned<float>(head_dim);
    std::vector<float> want(head_dim);
    const float unscale = std::ldexp(1.0f, -Decoder::kRawExp);
    for (const auto& row : TestRows(format, head_dim, rng)) {
      // Decode from a copy that ends exactly at the row's end, so a read past it is caught by
      // ASan, and from an odd address.
      std::vector<std::byte> padded(row.size() + 1);
      std::memcpy(padded.data() + 1, row.data(), row.size());
      std::vector<std::byte> exact_copy(row.begin(), row.end());
      decode_row(format, row, want);
      for (const std::byte* src : {exact_copy.data(), padded.data() + 1}) {
        DecodeRow<Decoder>(reinterpret_cast<const std::uint8_t*>(src), head_dim, raw.get());
        for (int i = 0; i < head_dim; ++i) {
          const float got = raw[i] * unscale;
          const float w = want[channel_of[i]];
          ASSERT_EQ(Bits(got), Bits(w)) << to_string(format) << " D" << head_dim << " channel "
                                        << channel_of[i] << ": " << got << " vs " << w;
          if (no_subnormals) {
            ASSERT_NE(std::fpclassify(raw[i]), FP_SUBNORMAL)
                << to_string(format) << " D" << head_dim << " channel " << channel_of[i] << ": "
                << raw[i] << " decodes to an fp32 subnormal";
          }
        }
      }
    }
  }
}

void TestDecoders() {
  for (Format format : kAllFormats) {
    // The decoders that never make an fp32 subnormal (Intel FMAs take an assist for each): on
    // x86 AVX2 and AVX-512, e2m1 looked up as true values and fp8 converted from fp16; on
    // AVX-512, fp6 magnitudes looked up; on AVX2, fp6 through fp16 (DecodeFp6Half, which the
    // kernel takes on CPUs with slow subnormals).
    const bool e2m1 = format == Format::fp4_e2m1 || format == Format::nvfp4;
    const bool fp8 = format == Format::fp8_e4m3 || format == Format::fp8_e5m2;
    const bool fp6 = format == Format::fp6_e2m3 || format == Format::fp6_e3m2;
    const bool normal_only =
        (MJOLNIR_E2M1_LOOKUP && e2m1) || (MJOLNIR_FP8_HALF && fp8) || (MJOLNIR_WIDE_FP6 && fp6);
    VisitDecoder(format, [&]<class Decoder>() {
      CheckDecoder<Decoder>(format, {32, 64, 96, 128, 160, 256}, normal_only);
    });
#if MJOLNIR_FP6_HALF
    if (format == Format::fp6_e2m3) CheckDecoder<DecodeFp6Half<2>>(format, {32, 64, 96, 256}, true);
    if (format == Format::fp6_e3m2) CheckDecoder<DecodeFp6Half<3>>(format, {32, 64, 96, 256}, true);
#endif
    // The kernel's own choice where rows have whole 64-channel chunks, for CPUs with fast and
    // with slow subnormals whatever this one is: on AVX3_DL the decoders through bf16 words for
    // the low-bit formats, which must never make an fp32 subnormal, nor, where subnormals are
    // slow, must AVX2's fp6 or SSE4's lifted decoders (where they are fast, x86's fp4_e2m1 and
    // nvfp4 take the bit placement, subnormals and all).
    const bool low_bit = format != Format::bf16 && format != Format::fp16;
    for (const bool slow : {false, true}) {
      VisitKernelDecoder(format, 64, slow, [&]<class Decoder>() {
        CheckDecoder<Decoder>(
            format, {64, 128, 192, 256},
            (MJOLNIR_BF16_WORDS && low_bit) ||
                (slow && ((MJOLNIR_FP6_HALF && fp6) || (MJOLNIR_LIFTED_DECODERS && low_bit))));
      });
    }
  }
}

#if MJOLNIR_BF16_DOT
HWY_PUSH_ATTRIBUTES("avx512bf16,avx512vbmi")

// DotNvfp4::DecodeScaled's words of chunk c of an nvfp4 row: the true values decode_row gave
// (want), bit for bit as bf16 words; NaN where the block's scale is.
void CheckNvfp4ScaledWords(const std::uint8_t* row, std::size_t c, int head_dim,
                           const std::vector<float>& want) {
  const WordTag dw;
  Words x0, x1;
  DotNvfp4::DecodeScaled(row, c, head_dim, x0, x1);
  alignas(64) std::uint16_t words[2][32];
  hn::Store(x0, dw, words[0]);
  hn::Store(x1, dw, words[1]);
  for (std::size_t j = 0; j < 2; ++j) {
    for (std::size_t w = 0; w < 32; ++w) {
      const std::size_t channel = c * kDotChunk + DotNvfp4::Channel(j, w);
      const float got = std::bit_cast<float>(std::uint32_t(words[j][w]) << 16);
      if (std::isnan(want[channel])) {
        ASSERT_TRUE(std::isnan(got)) << "nvfp4 D" << head_dim << " channel " << channel;
      } else {
        ASSERT_EQ(Bits(got), Bits(want[channel]))
            << "nvfp4 scaled words, D" << head_dim << " channel " << channel << ": " << got
            << " vs " << want[channel];
      }
    }
  }
}

// The bf16 words a dot decoder makes of every test row, against decode_row: bit for bit.
template <class Dot>
void CheckDotDecoder(Format format) {
  std::mt19937_64 rng(mjolnir::testing::test_seed() ^ (static_cast<std::uint64_t>(format) << 8));
  const WordTag dw;
  for (int head_dim : {64, 128, 192, 256}) {
    std::vector<bool> seen(kDotChunk, false);
    for (std::size_t j = 0; j < 2; ++j) {
      for (std::size_t w = 0; w < 32; ++w) {
        const std::size_t channel = Dot::Channel(j, w);
        ASSERT_LT(channel, kDotChunk);
        ASSERT_FALSE(seen[channel]) << "channel order is not a permutation";
        seen[channel] = true;
      }
    }
    const auto state = Dot::MakeState();
    std::vector<float> want(head_dim);
    alignas(64) std::uint16_t words[2][32];
    for (const auto& row : TestRows(format, head_dim, rng)) {
      // From a copy that ends exactly at the row's end, so a read past it is caught by ASan.
      std::vector<std::byte> exact_copy(row.begin(), row.end());
      const auto* src = reinterpret_cast<const std::uint8_t*>(exact_copy.data());
      decode_row(format, row, want);
      for (std::size_t c = 0; c < std::size_t(head_dim) / kDotChunk; ++c) {
        Words x0, x1;
        Dot::Decode(state, src, c, x0, x1);
        hn::Store(x0, dw, words[0]);
        hn::Store(x1, dw, words[1]);
        // nvfp4: the word times its lane's block scale (lane w / 2 sums words w and w + 1); the
        // product of the two is exact in fp32.
        alignas(64) float scales[16];
        std::fill_n(scales, 16, 1.0f);
        if constexpr (std::is_same_v<Dot, DotNvfp4>) {
          hn::Store(Dot::ChunkScales(Dot::GroupScales(src, c / 4, head_dim), c), WideFloatTag(),
                    scales);
        }
        for (std::size_t j = 0; j < 2; ++j) {
          for (std::size_t w = 0; w < 32; ++w) {
            const std::size_t channel = c * kDotChunk + Dot::Channel(j, w);
            const std::uint32_t got =
                Bits(std::bit_cast<float>(std::uint32_t(words[j][w]) << 16) * scales[w / 2]);
            ASSERT_EQ(got, Bits(want[channel]))
                << to_string(format) << " D" << head_dim << " channel " << channel << ": "
                << std::bit_cast<float>(got) << " vs " << want[channel];
          }
        }
        if constexpr (std::is_same_v<Dot, DotNvfp4>) {
          CheckNvfp4ScaledWords(src, c, head_dim, want);
        }
      }
    }
  }
}

// DotNvfp4's block scales for every e4m3 code, against the scalar decoder: 16 rows of D 256
// whose 16 scale bytes walk the 256 codes; and the words DecodeScaled makes of those rows.
void CheckNvfp4DotScales() {
  constexpr int kHeadDim = 256;
  std::vector<std::uint8_t> row(row_bytes(Format::nvfp4, kHeadDim));
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 29);
  for (auto& byte : row) byte = static_cast<std::uint8_t>(rng());
  alignas(64) float got[16];
  std::vector<float> values(kHeadDim);
  for (std::uint32_t first = 0; first < 256; first += 16) {
    for (std::uint32_t b = 0; b < 16; ++b) row[kHeadDim / 2 + b] = std::uint8_t(first + b);
    // The scaled words too, with every scale code under random e2m1 codes.
    decode_row(Format::nvfp4, std::as_bytes(std::span(row)), values);
    for (std::size_t c = 0; c < kHeadDim / kDotChunk; ++c) {
      CheckNvfp4ScaledWords(row.data(), c, kHeadDim, values);
    }
    hn::Store(DotNvfp4::GroupScales(row.data(), 0, kHeadDim), WideFloatTag(), got);
    for (std::uint32_t b = 0; b < 16; ++b) {
      const float want = decode_minifloat<kE4M3Spec>(first + b);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got[b])) << "e4m3 code " << first + b;
      } else {
        EXPECT_EQ(Bits(got[b]), Bits(want)) << "e4m3 code " << first + b;
      }
    }
  }
}

HWY_POP_ATTRIBUTES

void TestDotDecoders() {
  if (!CpuHasBf16Dot()) {
    GTEST_SKIP() << "this CPU has no AVX512_BF16 / AVX512_VBMI: the bf16 dot decoders cannot run";
  }
  int checked = 0;
  for (Format format : kAllFormats) {
    VisitKernelDecoder(format, 128, false, [&]<class Decoder>() {
      using Dot = typename DotDecoderOf<Decoder>::type;
      if constexpr (!std::is_void_v<Dot>) {
        CheckDotDecoder<Dot>(format);
        ++checked;
      }
    });
  }
  EXPECT_EQ(checked, 7);  // bf16, fp8 x 2, fp6 x 2, fp4_e2m1, nvfp4
}

void TestNvfp4DotScales() {
  if (!CpuHasBf16Dot()) {
    GTEST_SKIP() << "this CPU has no AVX512_BF16 / AVX512_VBMI: the bf16 dot decoders cannot run";
  }
  CheckNvfp4DotScales();
}

#else
// Targets other than AVX3_DL compile no dot decoders (bf16_dot-inl.h).
void TestDotDecoders() {}
void TestNvfp4DotScales() {}
#endif

// Floats to check roundings on: every float of a few binades around the format's edges, a
// stride through all the others, and specials.
std::vector<float> RoundingInputs(std::mt19937_64& rng) {
  std::vector<float> x;
  for (std::uint32_t bits = 0; bits < 0x7F800000u; bits += 4099)
    x.push_back(std::bit_cast<float>(bits));
  for (int e :
       {-150, -134, -133, -127, -126, -125, -25, -24, -17, -16, -15, -14, -10, -9, -8, -7, -6,
        -5,   -4,   -3,   -2,   -1,   0,    1,   2,   3,   4,   5,   6,   8,   15, 16, 127}) {
    const std::uint32_t base = e < -126 ? 0 : std::uint32_t(e + 127) << 23;
    for (std::uint32_t m = 0; m < (1u << 23); m += (e < -126 ? 1 : 97)) {
      x.push_back(std::bit_cast<float>(base | m));
    }
  }
  for (int i = 0; i < 100000; ++i)
    x.push_back(std::bit_cast<float>(std::uint32_t(rng()) & 0x7FFFFFFFu));
  x.push_back(std::numeric_limits<float>::infinity());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  x.push_back(std::bit_cast<float>(0x7FFFFFFFu));
  const std::size_t positive = x.size();
  for (std::size_t i = 0; i < positive; ++i) x.push_back(-x[i]);
  while (x.size() % 64 != 0) x.push_back(0.0f);
  return x;
}

template <MinifloatSpec kSpec>
void CheckRounding(const std::vector<float>& inputs) {
  const hn::CappedTag<float, 16> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const std::size_t n = hn::Lanes(df);
  alignas(64) float rounded[16];
  alignas(64) std::uint32_t codes[16];
  for (std::size_t i = 0; i < inputs.size(); i += n) {
    const auto x = hn::LoadU(df, &inputs[i]);
    hn::Store(RoundToMinifloat<kSpec>(df, x), df, rounded);
    hn::Store(EncodeMinifloat<kSpec>(df, x), du, codes);
    for (std::size_t j = 0; j < n; ++j) {
      const std::uint32_t want_code = encode_minifloat<kSpec>(inputs[i + j]);
      const float want = decode_minifloat<kSpec>(want_code);
      ASSERT_EQ(codes[j], want_code)
          << "encode " << inputs[i + j] << " (0x" << std::hex << Bits(inputs[i + j]) << ")";
      ASSERT_TRUE(Bits(rounded[j]) == Bits(want) || (std::isnan(want) && std::isnan(rounded[j])))
          << "round " << inputs[i + j] << " (0x" << std::hex << Bits(inputs[i + j])
          << "): " << rounded[j] << " vs " << want;
    }
  }
}

void TestRounding() {
  std::mt19937_64 rng(mjolnir::testing::test_seed());
  const std::vector<float> inputs = RoundingInputs(rng);
  CheckRounding<kBf16Spec>(inputs);
  CheckRounding<kFp16Spec>(inputs);
  CheckRounding<kE4M3Spec>(inputs);
  CheckRounding<kE5M2Spec>(inputs);
  CheckRounding<kE2M3Spec>(inputs);
  CheckRounding<kE3M2Spec>(inputs);
  CheckRounding<kE2M1Spec>(inputs);
}

void TestExp2() {
  const hn::CappedTag<float, 16> df;
  const std::size_t n = hn::Lanes(df);
  // Every float in [-160, 0] is checked for the libm replica: a stride of 1 would be 1.1e9
  // floats; a coprime stride covers every binade and mantissa pattern in a second. With
  // MJOLNIR_TEST_QUICK=1 (the sanitizer suite, and the Arm check, where qemu took 166 s a target
  // for the 18.5M points) an 8x coarser odd stride, still every binade.
  const char* quick = std::getenv("MJOLNIR_TEST_QUICK");
  const std::uint32_t stride = quick != nullptr && std::string_view(quick) == "1" ? 487 : 61;
  std::vector<float> x;
  for (std::uint32_t bits = 0x80000000u; bits <= 0xC3200000u; bits += stride)
    x.push_back(std::bit_cast<float>(bits));
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(-150.0f);
  x.push_back(-149.5f);
  while (x.size() % n != 0) x.push_back(0.0f);
  alignas(64) float libm[16], fast[16];
  std::size_t mismatches = 0;
  double worst_fast_ulps = 0;
  for (std::size_t i = 0; i < x.size(); i += n) {
    const auto v = hn::LoadU(df, &x[i]);
    hn::Store(Exp2Exact(df, v), df, libm);
    hn::Store(Exp2Fast(df, v, 0), df, fast);
    for (std::size_t j = 0; j < n; ++j) {
      const float want = std::exp2(x[i + j]);
      if (Bits(libm[j]) != Bits(want)) ++mismatches;
      if (want >= std::ldexp(1.0f, -126)) {
        const double ulps =
            std::abs(double(fast[j]) - want) / std::ldexp(1.0, std::ilogb(want) - 23);
        worst_fast_ulps = std::max(worst_fast_ulps, ulps);
      } else if (x[i + j] < -126.0f) {
        ASSERT_EQ(fast[j], 0.0f) << x[i + j];
      }
    }
  }
  // The FMA and non-FMA variants of glibc's exp2f round differently only where the double
  // result sits within ~1e-16 of a float rounding boundary.
  EXPECT_LE(mismatches, x.size() / 10000000 + 2) << "Exp2Exact differs from std::exp2";
  EXPECT_LE(worst_fast_ulps, 2.0) << "Exp2Fast";
  // Folding a power of two into Exp2Fast is exact.
  alignas(64) float folded[16];
  for (std::size_t i = 0; i < x.size(); i += n) {
    const auto v = hn::LoadU(df, &x[i]);
    hn::Store(Exp2Fast(df, v, 0), df, fast);
    hn::Store(Exp2Fast(df, v, 100), df, folded);
    for (std::size_t j = 0; j < n; ++j) {
      ASSERT_EQ(Bits(std::ldexp(fast[j], 100)), Bits(folded[j])) << x[i + j];
    }
  }
}

#endif  // MJOLNIR_PORTABLE_TARGET

// The fast row encoder against encode_row.
void TestRowEncoder() {
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Format format : kAllFormats) {
    for (int head_dim : {32, 64, 96, 128, 256}) {
      std::vector<float> values(head_dim), scales(head_dim);
      std::vector<std::byte> want(row_bytes(format, head_dim)), got(want.size());
      for (int trial = 0; trial < 200; ++trial) {
        const float spread = std::exp2(float(int(rng() % 60) - 30));
        for (int c = 0; c < head_dim; ++c) {
          values[c] = normal(rng) * spread;
          if (rng() % 17 == 0) values[c] = 0.0f;
          if (rng() % 97 == 0) values[c] = spread * 1e6f;  // saturates
          scales[c] = std::exp2(float(int(rng() % 8) - 4)) * (1.0f + float(rng() % 5) / 7);
        }
        if (trial % 5 == 0) std::fill(values.begin(), values.begin() + 16, 0.0f);  // zero block
        const bool per_channel = trial % 2 == 0;
        std::vector<float> scaled(head_dim);
        for (int c = 0; c < head_dim; ++c)
          scaled[c] = values[c] / (per_channel ? scales[c] : scales[0]);
        encode_row(format, scaled, want);
        std::fill(got.begin(), got.end(), std::byte{0xA5});
        encode_scaled_row(
            format, values,
            per_channel ? std::span<const float>(scales) : std::span<const float>(scales.data(), 1),
            got);
        ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0)
            << to_string(format) << " D" << head_dim << " trial " << trial;
      }
    }
  }
}

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

namespace mjolnir_cpu_kernel_tests {
namespace cpu = mjolnir::cpu;
namespace verify = mjolnir::verify;
using mjolnir::Backend;
using mjolnir::BackendOptions;
using mjolnir::CpuKernelOptions;
using mjolnir::Format;
using mjolnir::kAllFormats;
using mjolnir::kAllLayouts;
using mjolnir::make_backend;
using mjolnir::PMode;
using mjolnir::QMode;
using mjolnir::ScaleGranularity;
using namespace mjolnir::cpu;  // the per-target functions HWY_EXPORT names

HWY_BEFORE_TEST(CpuKernelTest);
HWY_EXPORT_AND_TEST_P(CpuKernelTest, TestDecoders);
HWY_EXPORT_AND_TEST_P(CpuKernelTest, TestDotDecoders);
HWY_EXPORT_AND_TEST_P(CpuKernelTest, TestNvfp4DotScales);
HWY_EXPORT_AND_TEST_P(CpuKernelTest, TestRounding);
HWY_EXPORT_AND_TEST_P(CpuKernelTest, TestExp2);
HWY_EXPORT_AND_TEST_P(CpuKernelTest, TestRowEncoder);

// Whole decode steps through the backend, once per target: the quick case matrix (every
// format, layout, page size, D, g, q_len, mode) against the emulator and the exact reference,
// plus odd shapes that straddle vector widths and tiles.
class CpuKernelMatrix : public hwy::TestWithParamTarget {
 protected:
  // MJOLNIR_TEST_CASE_EVERY=N (default 1): this target runs the matrix cases i with
  // (i + its target bit's index) % N == 0, so N targets with consecutive bits share the matrix
  // between them, every case on one of them. scripts/arm-check.sh sets 3 for NEON, SVE and SVE2
  // under qemu, which runs the SVE targets over ten times slower than NEON.
  bool runs_case(std::size_t index) const {
    const char* every = std::getenv("MJOLNIR_TEST_CASE_EVERY");
    const int n = every != nullptr ? std::max(1, std::atoi(every)) : 1;
    const int offset = std::countr_zero(static_cast<std::uint64_t>(GetParam()));
    return (index + std::size_t(offset)) % std::size_t(n) == 0;
  }
};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(CpuKernelMatrix);

TEST_P(CpuKernelMatrix, QuickMatrixMatchesEmulator) {
  EXPECT_EQ(cpu::kernel_target(), hwy::TargetName(GetParam()));
  const auto backend = make_backend("cpu", BackendOptions{.threads = 2});
  const std::vector<verify::Case> cases = verify::case_matrix(true, mjolnir::testing::test_seed());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    if (!runs_case(i)) continue;
    const verify::Case& c = cases[i];
    const verify::CaseResult r = verify::run_case(c, *backend);
    EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
  }
}

// The non-finite policy on this target's kernel: every format (each NaN and Inf code), mode and
// plan (non_finite_cases.h).
TEST_P(CpuKernelMatrix, NonFiniteInputsPoisonExactlyTheRowsThatMeetThem) {
  const auto backend = make_backend("cpu", BackendOptions{.threads = 2});
  const auto configs = mjolnir::testing::non_finite_configs();
  for (std::size_t i = 0; i < configs.size(); ++i) {
    if (runs_case(i)) {
      mjolnir::testing::check_non_finite_policy(*backend, configs[i],
                                                mjolnir::testing::test_seed() + 23);
    }
  }
}

// A Q . K test case: `format`, D, g and q_len as given, P in fp32 and Q in fp32 until the caller
// sets them, and the rest varied by `index` (layout, pages of 8 to 64 tokens, KV heads, causal,
// scale granularity, tiles of 16 to 64 keys, splits), with sequences that end inside a block.
verify::Case QkCase(Format format, int d, int g, int q_len, int index, std::uint64_t seed) {
  verify::Case c;
  verify::ProblemSpec& s = c.spec;
  s.format = format;
  s.layout = kAllLayouts[index % 6];
  s.page_size = 8 << (index % 4);
  s.head_dim = d;
  s.group = g;
  s.num_kv_heads = 1 + index % 3;
  s.params.q_len = q_len;
  s.params.causal = index % 2 == 0;
  s.granularity = ScaleGranularity(index % 3);
  s.seed = seed;
  c.tile_tokens = 16 << (index % 3);
  c.splits = 1 + index % 2;
  s.seq_lens = {q_len, 113, 301, s.page_size + 1};
  return c;
}

// Q . K in integers (Q mode int8 against fp4_e2m1, fp6_e2m3 and nvfp4 codes with AVX-512 VNNI,
// AVX2 and Arm's sdot) against the emulator on every target that has them, and the rest on the
// other paths:
// group sizes and q_len that exercise the 4-row blocks, leftover rows and key groups of fewer than
// 4, D of 1 and 2 chunks of 128 channels (and 64 and 192, which stay on the other paths), every
// scale granularity and layout, split or not, P in fp32 and bf16 (rounded from the kernel's own
// scores and exp2, so within bf16 P's tolerance of the emulator). A wrong bias, channel order or
// scale moves O by far more than the tolerances (a start of -11 instead of -12 times sum(q)
// failed 28 cases).
TEST_P(CpuKernelMatrix, Int8DotMatchesEmulator) {
  if (!cpu::cpu_has_int8_dot()) {
    GTEST_SKIP() << "the dispatched target (" << cpu::kernel_target()
                 << ") or this CPU has no integer dot products (AVX512_VNNI, AVX2, Arm sdot)";
  }
  // From 8 query rows the AMX tiles take Q . K where the CPU has them; not here.
  const auto backend =
      make_backend("cpu", BackendOptions{.threads = 2, .cpu_kernels = {.amx = false}});
  // fp4_e2m1, fp6_e2m3 and nvfp4 on every target with integer dot products (fp6_e3m2's codes do
  // not fit a byte).
  const auto in_integers = [](Format format) {
    return format == Format::fp4_e2m1 || format == Format::fp6_e2m3 || format == Format::nvfp4;
  };
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 37);
  const int shapes[][2] = {{1, 1}, {4, 1}, {8, 1}, {3, 2}, {4, 4}, {5, 3}, {16, 2}};
  int index = 0;
  for (const Format format :
       {Format::fp4_e2m1, Format::fp6_e2m3, Format::nvfp4, Format::fp6_e3m2}) {
    for (const PMode p_mode : {PMode::fp32, PMode::bf16}) {
      for (const int d : {64, 128, 192, 256}) {
        for (const auto [g, q_len] : shapes) {
          verify::Case c = QkCase(format, d, g, q_len, index, rng());
          // The formats without integer decoders on this target are controls that must not run
          // in integers: D 128 is enough of them. The Arm check shares the rest among its
          // targets (runs_case): under qemu the SVE targets took over 17 minutes for all.
          const bool control = !in_integers(format);
          if (!runs_case(index++) || (control && d != 128)) continue;
          c.spec.params.q_mode = QMode::int8;
          c.spec.params.p_mode = p_mode;
          const std::uint64_t before = cpu::kernel_path_counts(*backend).int8_dot;
          const verify::CaseResult r = verify::run_case(c, *backend);
          EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
          if (d % 128 == 0 && in_integers(format)) {
            EXPECT_GT(cpu::kernel_path_counts(*backend).int8_dot, before)
                << c.name() << " did not run in integers";
          } else {
            EXPECT_EQ(cpu::kernel_path_counts(*backend).int8_dot, before)
                << c.name() << " ran in integers";
          }
        }
      }
    }
  }
}

// Units of many query rows decode each K and V row once per tile (kernel_paths-inl.h,
// kDecodeOnceRows) and their blocks of rows load the decoded vectors: the scores and O must be
// what decoding in registers gives, so the emulator's within the modes' tolerances, at 4 rows (in
// registers), 16 and 32 (decoded once; g 16 x q_len 2 has leftover keys in its 4-key groups), for
// Q in int8 (the keys, on x86), bf16 (the keys as the dot products' words, AVX512_BF16) and fp32,
// with each format's decoder. decoded_once() says which
// rows this target decodes once; the path counts check the kernel took that path.
TEST_P(CpuKernelMatrix, DecodeOnceMatchesEmulator) {
  const auto backend =
      make_backend("cpu", BackendOptions{.threads = 2, .cpu_kernels = {.amx = false}});
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 41);
  const int shapes[][2] = {{4, 1}, {4, 4}, {16, 2}};
  int index = 0;
  for (const Format format : kAllFormats) {
    for (const QMode q_mode : {QMode::fp32, QMode::int8, QMode::bf16}) {
      for (const auto [g, q_len] : shapes) {
        verify::Case c = QkCase(format, 128, g, q_len, index, rng());
        if (!runs_case(index++)) continue;
        c.spec.params.q_mode = q_mode;
        const cpu::DecodedOnce once = cpu::decoded_once(format, q_mode, g * q_len, 128);
        const cpu::KernelPathCounts before = cpu::kernel_path_counts(*backend);
        const verify::CaseResult r = verify::run_case(c, *backend);
        EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
        const cpu::KernelPathCounts after = cpu::kernel_path_counts(*backend);
        EXPECT_EQ(after.decoded_keys > before.decoded_keys, once.keys) << c.name();
        EXPECT_EQ(after.decoded_values > before.decoded_values, once.values) << c.name();
        if (g * q_len < 16) EXPECT_FALSE(once.keys || once.values) << c.name();
      }
    }
  }
  // fp6_e2m3's V is decoded once from 16 rows on every SIMD target (the portable ones have no
  // tiles of rows).
  const std::string target = cpu::kernel_target();
  if (target != "EMU128" && target != "SCALAR") {
    EXPECT_TRUE(cpu::decoded_once(Format::fp6_e2m3, QMode::fp32, 16, 128).values);
  }
}

TEST_P(CpuKernelMatrix, OddShapesMatchEmulator) {
  const auto backend = make_backend("cpu", BackendOptions{.threads = 2});
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 11);
  int index = 0;
  for (Format format : kAllFormats) {
    for (int g : {1, 2, 3, 5, 8}) {
      for (PMode p_mode : {PMode::fp32, PMode::bf16, PMode::fp8}) {
        verify::Case c;
        verify::ProblemSpec& s = c.spec;
        s.format = format;
        s.layout = kAllLayouts[index % 6];
        s.page_size = 8 << (index % 3);
        s.head_dim = 32 * (1 + index % 8);
        s.group = g;
        s.num_kv_heads = 1 + index % 2;
        s.params.q_len = 1 + index % 3;
        s.params.causal = index % 2 == 0;
        s.params.q_mode = QMode(index % 4);  // every Q mode, int8 too
        s.params.p_mode = p_mode;
        s.granularity = ScaleGranularity(index % 3);
        s.seed = rng();
        c.tile_tokens = (index % 4 == 0) ? 24 : 16 << (index % 3);  // 24: a tile not a power of 2
        c.splits = 1 + index % 3;
        s.seq_lens = {1 + int(rng() % 3) * 0 + s.params.q_len, 113, c.tile_tokens * c.splits + 1,
                      s.page_size + 1, s.page_size - 1 + s.params.q_len};
        ++index;
        const verify::CaseResult r = verify::run_case(c, *backend);
        EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
      }
    }
  }
}

// The decoders the kernel takes on CPUs whose subnormal FMAs are slow (on AVX2, fp6 through fp16;
// on SSE4, every placed format lifted) and on CPUs whose FMAs take subnormals at full speed (on
// x86, e2m1 nibbles placed into fp32 fields rather than looked up), run
// here whatever this CPU is: the low-bit cases of the quick matrix against the emulator, under
// each policy.
TEST_P(CpuKernelMatrix, EachSubnormalPolicyMatchesEmulator) {
  for (const bool avoid : {true, false}) {
    SCOPED_TRACE(avoid ? "avoiding fp32 subnormals" : "making fp32 subnormals");
    const auto backend = make_backend(
        "cpu", BackendOptions{.threads = 2, .cpu_kernels = {.avoid_fp32_subnormals = avoid}});
    ASSERT_EQ(cpu::kernel_config(*backend).avoid_fp32_subnormals, avoid);
    int cases = 0;
    const std::vector<verify::Case> matrix =
        verify::case_matrix(true, mjolnir::testing::test_seed() + 5);
    for (std::size_t i = 0; i < matrix.size(); ++i) {
      const verify::Case& c = matrix[i];
      if (c.spec.format == Format::bf16 || c.spec.format == Format::fp16 || !runs_case(i)) continue;
      // Making subnormals changes only e2m1's decoders (the rest are the quick matrix's own).
      const bool e2m1 = c.spec.format == Format::fp4_e2m1 || c.spec.format == Format::nvfp4;
      if (!avoid && !e2m1) continue;
      const verify::CaseResult r = verify::run_case(c, *backend);
      EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
      ++cases;
    }
    EXPECT_GT(cases, 0);
  }
}

// The cases of the Q . K tests below: every format whose codes are bf16 values, in each Q mode
// (mode 0 bf16, 1 fp8, 2 fp32 with bf16 queries, 3 plain fp32), for each (g, q_len), P in fp32,
// with layouts, pages of 8 to 64 tokens, D 64 to 256, scale granularities, tiles of 16 to 64 keys
// and splits varied case by case, and sequences that end inside a block. run(c, mode, g, q_len)
// checks each one.
template <class Run>
void ForEachQkCase(std::uint64_t seed, std::initializer_list<std::pair<int, int>> shapes, Run run) {
  std::mt19937_64 rng(seed);
  int index = 0;
  for (Format format : {Format::bf16, Format::fp8_e4m3, Format::fp8_e5m2, Format::fp6_e2m3,
                        Format::fp6_e3m2, Format::fp4_e2m1, Format::nvfp4}) {
    for (int mode = 0; mode < 4; ++mode) {
      for (const auto [g, q_len] : shapes) {
        verify::Case c = QkCase(format, 64 * (1 + index % 4), g, q_len, index, rng());
        verify::ProblemSpec& s = c.spec;
        s.params.q_mode = mode == 0 ? QMode::bf16 : mode == 1 ? QMode::fp8 : QMode::fp32;
        s.bf16_queries = mode == 2;
        // Per-channel K scales fold into Q before it is used, so fp32 queries stay bf16 values
        // only with per-tensor or per-head scales.
        s.granularity = ScaleGranularity(index % (mode >= 2 ? 2 : 3));
        ++index;
        run(c, mode, g, q_len);
      }
    }
  }
}

// Q . K on bf16 dot products (Q in bf16 or fp8 mode, or in fp32 mode with bf16 values; P in
// fp32; every format whose codes are bf16 values) against the emulator, over group sizes, q_len
// and D that exercise its 4-row blocks, leftover rows and key groups of fewer than 4, and from
// 16 rows its 16 x 16 blocks (ScoresDotPairs: a whole group of rows, one and a part, two); each
// case must have run on it, and fp32 queries that are not bf16 values must not. The 16 x 16
// blocks run where K's rows are words: a bf16 cache's, or the others' decoded once per tile
// (queries in bf16 or fp8 mode; not nvfp4), on the dot products themselves or on fp32 FMAs
// over K widened once per tile (ScoresFmaPairs, CpuKernelOptions::fma_pair_scores): both.
TEST(CpuBf16Dot, MatchesEmulator) {
  if (!cpu::cpu_has_bf16_dot()) {
    GTEST_SKIP() << "the dispatched target (" << cpu::kernel_target()
                 << ") or this CPU has no AVX512_BF16 / AVX512_VBMI dot products";
  }
  for (const bool fma_pairs : {false, true}) {
    SCOPED_TRACE(fma_pairs ? "16 x 16 blocks on fp32 FMAs" : "16 x 16 blocks on the dot products");
    // On CPUs with AMX, Q . K would go on its tiles instead (CpuAmx below).
    const auto backend = make_backend(
        "cpu",
        BackendOptions{.threads = 2, .cpu_kernels = {.amx = false, .fma_pair_scores = fma_pairs}});
    ASSERT_TRUE(cpu::kernel_config(*backend).bf16_dot);
    ASSERT_EQ(cpu::kernel_config(*backend).fma_pair_scores, fma_pairs);
    ForEachQkCase(
        mjolnir::testing::test_seed() + 23,
        {{1, 1}, {4, 1}, {8, 1}, {3, 2}, {4, 4}, {5, 3}, {5, 4}, {16, 2}},
        [&](const verify::Case& c, int mode, int g, int q_len) {
          const cpu::KernelPathCounts before = cpu::kernel_path_counts(*backend);
          const verify::CaseResult r = verify::run_case(c, *backend);
          EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
          const cpu::KernelPathCounts after = cpu::kernel_path_counts(*backend);
          const Format format = c.spec.format;
          const bool pairs = mode < 3 && g * q_len >= 16 &&
                             (format == Format::bf16 || (mode < 2 && format != Format::nvfp4));
          EXPECT_EQ(after.pair_scores > before.pair_scores, pairs)
              << c.name() << (pairs ? " did not run" : " ran") << " in 16 x 16 blocks";
          EXPECT_EQ(after.fma_pair_scores > before.fma_pair_scores, pairs && fma_pairs)
              << c.name() << " on the FMAs' 16 x 16 blocks";
          if (mode < 3) {
            EXPECT_GT(after.bf16_dot, before.bf16_dot) << c.name() << " did not run on them";
          } else {
            EXPECT_EQ(after.bf16_dot, before.bf16_dot) << c.name() << " ran on them";
          }
        });
  }
}

// Turned off in the backend's options, the dot products and the tiles run no work item, and the
// steps they would have taken match the emulator on the FMAs; on, each runs where the CPU has it.
TEST(CpuKernelOptions, TurnTheirPathsOff) {
  const auto off = make_backend(
      "cpu", BackendOptions{.threads = 2, .cpu_kernels = {.bf16_dot = false, .amx = false}});
  const auto on = make_backend("cpu", BackendOptions{.threads = 2});
  EXPECT_FALSE(cpu::kernel_config(*off).bf16_dot);
  EXPECT_FALSE(cpu::kernel_config(*off).amx);
  EXPECT_EQ(cpu::kernel_config(*on).bf16_dot, cpu::cpu_has_bf16_dot());
  EXPECT_EQ(cpu::kernel_config(*on).amx, cpu::cpu_has_bf16_dot() && cpu::cpu_has_amx());
  if (!cpu::cpu_has_bf16_dot()) {
    GTEST_SKIP() << "the dispatched target (" << cpu::kernel_target()
                 << ") or this CPU has no bf16 dot products to turn off";
  }
  ForEachQkCase(mjolnir::testing::test_seed() + 41, {{4, 1}, {8, 2}},
                [&](const verify::Case& c, int mode, int, int) {
                  if (mode == 3) return;  // fp32 queries that are not bf16 values: FMAs anyway
                  for (const Backend* backend : {off.get(), on.get()}) {
                    const verify::CaseResult r = verify::run_case(c, *backend);
                    EXPECT_NE(r.status, verify::CaseResult::Status::failed)
                        << c.name() << ": " << r.message;
                  }
                });
  const cpu::KernelPathCounts counts = cpu::kernel_path_counts(*off);
  EXPECT_EQ(counts.bf16_dot + counts.amx_scores + counts.amx_values + counts.dot_values, 0u);
  const cpu::KernelPathCounts taken = cpu::kernel_path_counts(*on);
  // Where the tiles run, Q . K takes them from 8 rows and fp32 FMAs below (faster there than
  // the dot products); elsewhere the dot products take every row count.
  EXPECT_EQ(taken.bf16_dot > 0, !cpu::kernel_config(*on).amx);
  EXPECT_EQ(cpu::kernel_config(*on).bf16_dot_below_tiles, !cpu::kernel_config(*on).amx);
  EXPECT_EQ(taken.amx_scores > 0, cpu::kernel_config(*on).amx);
}

TEST(CpuKernelOptions, CountsBelongToACpuBackend) {
  mjolnir::testing::expect_error([&] { cpu::kernel_path_counts(*make_backend("reference")); },
                                 "backend: 'reference' is not the cpu backend");
}

// The CLI's and the Python package's switches: 0 and 1, unset or empty for the default, and an
// error naming the variable for anything else.
TEST(CpuKernelOptions, FromTheEnvironment) {
  const char* names[] = {"MJOLNIR_CPU_BF16_DOT", "MJOLNIR_CPU_AMX", "MJOLNIR_CPU_AVOID_SUBNORMALS",
                         "MJOLNIR_CPU_BF16_DOT_VALUES", "MJOLNIR_CPU_FMA_PAIR_SCORES"};
  for (const char* name : names) unsetenv(name);
  CpuKernelOptions options = mjolnir::cpu_kernel_options_from_environment();
  EXPECT_TRUE(options.bf16_dot);
  EXPECT_TRUE(options.amx);
  EXPECT_FALSE(options.avoid_fp32_subnormals.has_value());
  EXPECT_FALSE(options.bf16_dot_values.has_value());
  EXPECT_FALSE(options.fma_pair_scores.has_value());
  setenv("MJOLNIR_CPU_BF16_DOT", "0", 1);
  setenv("MJOLNIR_CPU_AMX", "", 1);
  setenv("MJOLNIR_CPU_AVOID_SUBNORMALS", "1", 1);
  setenv("MJOLNIR_CPU_BF16_DOT_VALUES", "0", 1);
  setenv("MJOLNIR_CPU_FMA_PAIR_SCORES", "1", 1);
  options = mjolnir::cpu_kernel_options_from_environment();
  EXPECT_EQ(options.fma_pair_scores, std::optional<bool>(true));
  EXPECT_FALSE(options.bf16_dot);
  EXPECT_TRUE(options.amx);
  EXPECT_EQ(options.avoid_fp32_subnormals, std::optional<bool>(true));
  EXPECT_EQ(options.bf16_dot_values, std::optional<bool>(false));
  setenv("MJOLNIR_CPU_AMX", "off", 1);
  mjolnir::testing::expect_error([] { mjolnir::cpu_kernel_options_from_environment(); },
                                 "MJOLNIR_CPU_AMX: 'off' is neither 0 nor 1");
  for (const char* name : names) unsetenv(name);
}

// auto_modes picks Q int8 exactly where Q . K then runs in integers (below the AMX tiles' rows),
// and keeps bf16 for a bf16 model's queries elsewhere.
TEST(CpuInt8Dot, AutoModesPickInt8WhereItRuns) {
  // This CPU's target with integer dot products decodes fp4_e2m1 at least.
  EXPECT_EQ(cpu::int8_dot_applies(Format::fp4_e2m1, 128), cpu::cpu_has_int8_dot());
  const auto backend = make_backend("cpu", BackendOptions{.threads = 1});
  const bool tiles = cpu::cpu_has_amx() && cpu::cpu_has_bf16_dot();
  for (const Format format : kAllFormats) {
    for (const int d : {64, 128, 256}) {
      for (const int rows : {1, 4, 8, 32}) {
        const mjolnir::CacheGeometry geometry{format, 4, 16, 8, d};
        const mjolnir::NumericsModes modes = backend->auto_modes(geometry, rows, true);
        const bool amx_scores =
            rows >= 8 && tiles && format != Format::fp16 && d % 64 == 0;  // bf16_dot_applies
        // fp4_e2m1, fp6_e2m3 and nvfp4 on every target with integer dot products.
        const bool int8 =
            cpu::cpu_has_int8_dot() && d % 128 == 0 && !amx_scores &&
            (format == Format::fp4_e2m1 || format == Format::fp6_e2m3 || format == Format::nvfp4);
        EXPECT_EQ(modes.q_mode, int8 ? QMode::int8 : QMode::bf16)
            << to_string(format) << " D " << d << " rows " << rows;
      }
    }
  }
}

// P in fp16 where P . V runs on fp16 FMAs (every step of the formats P fp16 takes) that the AMX
// tiles do not take; fp32 everywhere else (but P in bf16 on the tiles, or on the dot products
// where they pay: CpuBf16Dot.AutoModesPutPInBf16WhereTheDotProductsPay).
TEST(CpuHalfValues, AutoModesPickFp16WhereItRunsAndPays) {
  const auto backend = make_backend("cpu", BackendOptions{.threads = 1});
  const bool tiles = cpu::cpu_has_amx() && cpu::cpu_has_bf16_dot();
  const bool dot_values = cpu::kernel_config(*backend).bf16_dot_values;
  for (const Format format : kAllFormats) {
    for (const int d : {64, 128, 256}) {
      for (const int rows : {1, 4, 8, 16, 32, 128}) {
        const mjolnir::CacheGeometry geometry{format, 4, 16, 8, d};
        const mjolnir::NumericsModes modes = backend->auto_modes(geometry, rows, true);
        const bool words = format != Format::fp16 && d % 64 == 0;  // bf16_dot_applies
        if (tiles && rows >= 8 && words) continue;                 // P bf16 on the tiles
        if (dot_values && words && rows >= 16) continue;           // P bf16 on the dot products
        const bool half = cpu::half_values_apply(format, d);
        EXPECT_EQ(modes.p_mode, half ? PMode::fp16 : PMode::fp32)
            << to_string(format) << " D " << d << " rows " << rows;
      }
    }
  }
#if defined(__x86_64__)
  // The CPUs with AVX512-FP16 run it for nvfp4 at D 128 on the AVX3_DL target.
  if (cpu::kernel_target() == "AVX3_DL" && __builtin_cpu_supports("avx512fp16")) {
    EXPECT_TRUE(cpu::half_values_apply(Format::nvfp4, 128));
    EXPECT_FALSE(cpu::half_values_apply(Format::nvfp4, 64));
  }
#endif
}

// Q . K on AMX tiles (where the dot products apply, from 8 query rows) against the emulator, over
// query rows that fill part of a column group, all of it and more than one (up to 32), D of 1 to
// 4 pairs of 32-channel steps, tiles of 16 to 64 keys (one or two 16-key blocks per pass), pages
// of 8 keys (bf16 through the buffer) and of 16 to 64 (bf16 straight from the cache), and
// sequences that end inside a block; each case must have run on the tiles, and the rest not.
TEST(CpuAmx, MatchesEmulator) {
  if (!cpu::cpu_has_amx() || !cpu::cpu_has_bf16_dot()) {
    GTEST_SKIP() << "this CPU (or the dispatched target, " << cpu::kernel_target()
                 << ") has no AMX-BF16 tiles, or Linux did not grant them";
  }
  const auto backend = make_backend("cpu", BackendOptions{.threads = 2});
  ASSERT_TRUE(cpu::kernel_config(*backend).amx);
  ForEachQkCase(
      mjolnir::testing::test_seed() + 29, {{1, 1}, {4, 1}, {4, 4}, {8, 2}, {8, 3}, {16, 2}},
      [&](const verify::Case& c, int mode, int g, int q_len) {
        const std::uint64_t before = cpu::kernel_path_counts(*backend).amx_scores;
        const verify::CaseResult r = verify::run_case(c, *backend);
        EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
        if (mode < 3 && g * q_len >= 8) {  // kAmxMinRows
          EXPECT_GT(cpu::kernel_path_counts(*backend).amx_scores, before)
              << c.name() << " did not run on the tiles";
        } else {
          EXPECT_EQ(cpu::kernel_path_counts(*backend).amx_scores, before)
              << c.name() << " ran on the tiles";
        }
      });
}

// A ragged step of `format` (a prompt, a chunk, a decode and a chunk in one batch; query tiles
// of up to 32 tokens, 128 rows at g 4), D 128, tiles of 64 keys, in the given modes.
verify::Case RaggedCase(Format format, QMode q_mode, PMode p_mode, std::mt19937_64& rng) {
  verify::Case c;
  verify::ProblemSpec& s = c.spec;
  s.format = format;
  s.layout = kAllLayouts[rng() % 6];
  s.page_size = 16;
  s.head_dim = 128;
  s.group = 4;
  s.num_kv_heads = 2;
  s.params.q_len = 0;
  s.params.q_mode = q_mode;
  s.params.p_mode = p_mode;
  s.seed = rng();
  s.seq_lens = {200, 77, 9, 130};
  s.query_lens = {200, 13, 1, 31};
  c.tile_tokens = 64;
  return c;
}

// P . V with P in bf16 on the path `path_count` counts, against the emulator within the
// tolerance of P rounded from the kernel's own scores (docs/numerics.md), and against the exact
// reference within P bf16's bound: the Q . K cases above with P in bf16, and ragged steps
// (prefill, chunked prefill and decodes in one batch, query tiles of 32 tokens). Every case whose
// values are bf16 values must have run on the path (nvfp4 from 8 query rows), and the rest not.
void ExpectValuesOnPathMatchEmulator(const Backend& backend,
                                     std::uint64_t cpu::KernelPathCounts::*path_count,
                                     std::uint64_t seed) {
  std::vector<double> path_errors;
  const auto check = [&](const verify::Case& c, bool on_path) {
    const std::uint64_t before = cpu::kernel_path_counts(backend).*path_count;
    const verify::CaseResult r = verify::run_case(c, backend);
    EXPECT_NE(r.status, verify::CaseResult::Status::failed) << c.name() << ": " << r.message;
    if (on_path) {
      EXPECT_GT(cpu::kernel_path_counts(backend).*path_count, before)
          << c.name() << " did not run on the path";
      path_errors.push_back(r.error_vs_emulator);
    } else {
      EXPECT_EQ(cpu::kernel_path_counts(backend).*path_count, before)
          << c.name() << " ran on the path";
    }
  };
  ForEachQkCase(seed, {{1, 1}, {4, 1}, {4, 2}, {3, 1}, {8, 1}, {4, 4}, {8, 3}, {16, 2}},
                [&](const verify::Case& qk, int, int g, int q_len) {
                  verify::Case c = qk;
                  c.spec.params.p_mode = PMode::bf16;
                  // nvfp4 keeps P . V on the FMAs below 8 rows (kernel_paths-inl.h).
                  check(c, c.spec.format != Format::nvfp4 || g * q_len >= 8);
                });
  // Ragged steps: every sequence's query tokens in tiles of up to 8 (32 rows at g 4).
  std::mt19937_64 rng(seed + 6);
  for (Format format : {Format::bf16, Format::fp8_e4m3, Format::fp6_e3m2, Format::fp4_e2m1,
                        Format::nvfp4, Format::fp16}) {
    const QMode q_mode = rng() % 2 ? QMode::bf16 : QMode::fp32;
    verify::Case c = RaggedCase(format, q_mode, PMode::bf16, rng);
    c.spec.bf16_queries = true;
    // fp16 values are not bf16 values: its P . V stays on the FMAs.
    check(c, format != Format::fp16);
  }
  // A P code that rounds the other way is rare: the typical case matches the emulator to fp32
  // rounding. A bias in the rounding (truncating instead of rounding to nearest) would move every
  // case by about 2^-9, within each case's tolerance but not in the median.
  ASSERT_FALSE(path_errors.empty());
  std::nth_element(path_errors.begin(), path_errors.begin() + path_errors.size() / 2,
                   path_errors.end());
  EXPECT_LT(path_errors[path_errors.size() / 2], 1e-4) << "median error against the emulator";
}

// P . V on AMX tiles (P mode bf16): from 16 query rows in whole tiles, below that in tiles of the
// unit's rows (a decode step's 4 rows, 1 to 15 here), over every case above.
TEST(CpuAmx, ValuesMatchEmulator) {
  if (!cpu::cpu_has_amx() || !cpu::cpu_has_bf16_dot()) {
    GTEST_SKIP() << "this CPU (or the dispatched target, " << cpu::kernel_target()
                 << ") has no AMX-BF16 tiles, or Linux did not grant them";
  }
  const auto backend = make_backend("cpu", BackendOptions{.threads = 2});
  ASSERT_TRUE(cpu::kernel_config(*backend).amx);
  ExpectValuesOnPathMatchEmulator(*backend, &cpu::KernelPathCounts::amx_values,
                                  mjolnir::testing::test_seed() + 31);
}

// P . V on the bf16 dot products (P mode bf16 where the tiles do not take it: here they are
// turned off), over the same cases; none of them runs on the tiles.
TEST(CpuBf16Dot, ValuesMatchEmulator) {
  if (!cpu::cpu_has_bf16_dot()) {
    GTEST_SKIP() << "the dispatched target (" << cpu::kernel_target()
                 << ") or this CPU has no AVX512_BF16 / AVX512_VBMI dot products";
  }
  const auto backend =
      make_backend("cpu", BackendOptions{.threads = 2, .cpu_kernels = {.amx = false}});
  ExpectValuesOnPathMatchEmulator(*backend, &cpu::KernelPathCounts::dot_values,
                                  mjolnir::testing::test_seed() + 43);
  EXPECT_EQ(cpu::kernel_path_counts(*backend).amx_values, 0u);
}

// The auto modes put P in bf16 from 16 query rows where P . V then runs on the dot products (no
// tiles) on CPUs that issue them at an FMA's rate (AMD's), or when the options ask for it;
// CpuBf16Dot.ValuesMatchEmulator checks those steps' results.
TEST(CpuBf16Dot, AutoModesPutPInBf16WhereTheDotProductsPay) {
  const auto by_default = make_backend("cpu", BackendOptions{.threads = 1});
  const auto asked = make_backend(
      "cpu", BackendOptions{.threads = 1, .cpu_kernels = {.amx = false, .bf16_dot_values = true}});
  const auto refused = make_backend(
      "cpu", BackendOptions{.threads = 1, .cpu_kernels = {.amx = false, .bf16_dot_values = false}});
  const bool dots = cpu::cpu_has_bf16_dot();
  EXPECT_EQ(cpu::kernel_config(*by_default).bf16_dot_values,
            dots && !cpu::kernel_config(*by_default).amx && cpu::bf16_dot_at_fma_rate());
  EXPECT_EQ(cpu::kernel_config(*asked).bf16_dot_values, dots);
  EXPECT_FALSE(cpu::kernel_config(*refused).bf16_dot_values);
  // The FMAs' 16 x 16 score blocks by default where the dot products do not run at their rate.
  EXPECT_EQ(cpu::kernel_config(*by_default).fma_pair_scores,
            dots && !cpu::kernel_config(*by_default).amx && !cpu::bf16_dot_at_fma_rate());
  for (const Format format : kAllFormats) {
    for (const int d : {64, 96, 128}) {
      for (const int rows : {1, 4, 8, 15, 16, 128}) {
        const mjolnir::CacheGeometry geometry{format, 4, 16, 8, d};
        const bool pays = dots && format != Format::fp16 && d % 64 == 0 && rows >= 16;
        const std::string where = std::string(to_string(format)) + " D " + std::to_string(d) +
                                  " rows " + std::to_string(rows);
        EXPECT_EQ(asked->auto_modes(geometry, rows, true).p_mode == PMode::bf16, pays) << where;
        EXPECT_NE(refused->auto_modes(geometry, rows, true).p_mode, PMode::bf16) << where;
      }
    }
  }
}

// Every item's token range is covered exactly once by the units, and token parts merge back.
// P mode fp16 (docs/numerics.md): where the CPU has AVX512-FP16, fp4_e2m1, nvfp4, fp6 and fp8
// with D a multiple of 128 run P . V on fp16 FMAs (cpu/half_values-inl.h) and sum each group of 32
// keys in fp16 as the emulator does, so they match it up to P codes that round the other way (rare:
// the median case within 1e-4, where summing the same fp16 P in fp32, as D 64 does, differs by 5e-4
// to 1e-3). Every case within P fp16's tolerance of the emulator and its bound against the exact
// reference; Q in int8, bf16 and fp32; decode shapes of 1 to 32 rows (leftover rows past the 4-row
// blocks) and ragged steps (prefill and decodes in one batch).
TEST(CpuHalfValues, MatchEmulator) {
  if (!cpu::half_values_apply(Format::fp4_e2m1, 128)) {
    GTEST_SKIP() << "the dispatched target (" << cpu::kernel_target()
                 << ") or this CPU has no AVX512-FP16 (P mode fp16 then sums on fp32 FMAs, "
                    "which the case matrix checks)";
  }
  const auto backend =
      make_backend("cpu", BackendOptions{.threads = 2, .cpu_kernels = {.amx = false}});
  std::vector<double> path_errors;
  const auto check = [&](const verify::Case& c) {
    const bool on_path = cpu::half_values_apply(c.spec.format, c.spec.head_dim);
    const std::uint64_t before = cpu::kernel_path_counts(*backend).half_values;
    const verify::CaseResult r = verify::run_case(c, *backend);
    EXPECT_EQ(r.status, verify::CaseResult::Status::passed) << c.name() << ": " << r.message;
    if (on_path) {
      EXPECT_GT(cpu::kernel_path_counts(*backend).half_values, before)
          << c.name() << " did not run on fp16 FMAs";
      path_errors.push_back(r.error_vs_emulator);
    } else {
      EXPECT_EQ(cpu::kernel_path_counts(*backend).half_values, before)
          << c.name() << " ran on fp16 FMAs";
    }
  };
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 47);
  const int shapes[][2] = {{1, 1}, {4, 1}, {3, 2}, {8, 1}, {4, 4}, {5, 3}, {8, 4}};
  int index = 0;
  for (const Format format : {Format::fp4_e2m1, Format::nvfp4, Format::fp6_e2m3, Format::fp6_e3m2,
                              Format::fp8_e4m3, Format::fp8_e5m2}) {
    for (const int d : {64, 128, 256}) {
      for (const auto [g, q_len] : shapes) {
        verify::Case c = QkCase(format, d, g, q_len, index, rng());
        const QMode modes[] = {QMode::int8, QMode::bf16, QMode::fp32};
        c.spec.params.q_mode = modes[index % 3];
        c.spec.params.p_mode = PMode::fp16;
        ++index;
        check(c);  // D 64: off the path, a control (the fp16 P summed on fp32 FMAs)
      }
    }
  }
  for (const Format format : {Format::fp4_e2m1, Format::nvfp4}) {
    check(RaggedCase(format, QMode::int8, PMode::fp16, rng));
  }
  check(RaggedCase(Format::fp8_e4m3, QMode::bf16, PMode::fp16, rng));
  check(RaggedCase(Format::fp8_e5m2, QMode::fp32, PMode::fp16, rng));
  ASSERT_FALSE(path_errors.empty());
  std::nth_element(path_errors.begin(), path_errors.begin() + path_errors.size() / 2,
                   path_errors.end());
  EXPECT_LT(path_errors[path_errors.size() / 2], 1e-4) << "median error against the emulator";
}

TEST(CpuWorkUnits, CoverEveryItemOnce) {
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 17);
  for (int trial = 0; trial < 300; ++trial) {
    const int num_seqs = 1 + int(rng() % 4), hk = 1 + int(rng() % 8);
    std::vector<std::int32_t> lens(num_seqs);
    for (auto& len : lens) len = rng() % 5 == 0 ? 0 : 1 + int(rng() % 2000);
    mjolnir::PlanOptions options;
    options.workers = 1 + int(rng() % 4);
    options.tile_tokens = 16 << (rng() % 3);
    options.fixed_splits = rng() % 2 ? int(rng() % 4) : 0;
    mjolnir::Plan plan(mjolnir::PlanCapacity{num_seqs, hk, 16});
    mjolnir::make_plan(plan, lens, 1, hk, options);
    for (int threads = 1; threads <= 5; ++threads) {
      for (bool cut_tokens : {false, true}) {
        cpu::UnitSchedule schedule;
        cpu::make_units(plan, threads, cut_tokens, schedule);
        ASSERT_LE(schedule.part_slots, cpu::max_part_slots(threads));
        std::vector<std::vector<std::pair<int, int>>> covered(plan.num_items);
        for (const cpu::WorkUnit& u : schedule.units) {
          ASSERT_GT(u.heads, 0);
          for (int i = u.first_item; i < u.first_item + u.heads; ++i) {
            ASSERT_LT(i, plan.num_items);
            covered[i].emplace_back(u.kv_begin, u.kv_end);
          }
          if (u.part_slot >= 0) {
            bool merged = false;
            for (const cpu::PartMerge& m : schedule.merges) {
              merged |= m.first_item <= u.first_item && u.first_item < m.first_item + m.heads &&
                        m.first_slot <= u.part_slot && u.part_slot < m.first_slot + m.parts;
            }
            ASSERT_TRUE(merged) << "part slot " << u.part_slot << " is never merged";
          }
        }
        for (int i = 0; i < plan.num_items; ++i) {
          auto& ranges = covered[i];
          std::sort(ranges.begin(), ranges.end());
          int at = plan.items[i].kv_begin;
          for (const auto& [b, e] : ranges) {
            ASSERT_EQ(b, at) << "item " << i << " threads " << threads;
            at = e;
          }
          ASSERT_EQ(at, plan.items[i].kv_end) << "item " << i << " threads " << threads;
        }
        // One merge task per (merge, KV head of it), in order.
        std::vector<std::pair<int, int>> tasks;
        for (int m = 0; m < int(schedule.merges.size()); ++m) {
          for (int h = 0; h < schedule.merges[m].heads; ++h) tasks.emplace_back(m, h);
        }
        ASSERT_EQ(schedule.merge_tasks, tasks) << "threads " << threads;
      }
      // What plan() prepares: both kinds of units, and a merge per KV head of each split tile.
      cpu::CpuPlan prepared;
      cpu::prepare_cpu_plan(plan, options.workers, prepared);
      ASSERT_EQ(prepared.threads, options.workers);
      ASSERT_EQ(&prepared.units_for(PMode::fp32), &prepared.token_parts);
      ASSERT_EQ(&prepared.units_for(PMode::bf16), &prepared.plan_tiles);
      ASSERT_EQ(&prepared.units_for(PMode::fp8), &prepared.plan_tiles);
      ASSERT_TRUE(prepared.plan_tiles.merges.empty()) << "P codes of the plan's tiles were cut";
      int split_tiles = 0;
      for (int i = 0; i < plan.num_query_tiles; ++i) split_tiles += plan.num_splits[i] > 1;
      ASSERT_EQ(prepared.tile_merges.size(), std::size_t(split_tiles * hk));
      for (const auto& [tile, head] : prepared.tile_merges) {
        ASSERT_GT(plan.num_splits[tile], 1);
        ASSERT_LT(head, hk);
      }
    }
  }
}

// One sequence on two threads, P in fp32: a chunk shorter than a tile stays one unit, a short
// one goes to two groups of heads (no merges), a long one to two token parts of whole tiles that
// merge back into every head.
TEST(CpuWorkUnits, ShortChunksGoToHeadGroupsLongOnesToTokenParts) {
  for (const int len :
       {1, 63, 64, 128, cpu::kHeadGroupMaxTokens, cpu::kHeadGroupMaxTokens + 1, 8192}) {
    mjolnir::PlanOptions options;
    options.workers = 2;
    options.max_splits = 1;
    mjolnir::Plan plan(mjolnir::PlanCapacity{1, 8, 16});
    const std::vector<std::int32_t> lens{len};
    mjolnir::make_plan(plan, lens, 1, 8, options);
    cpu::UnitSchedule schedule;
    cpu::make_units(plan, 2, /*may_cut_tokens=*/true, schedule);
    ASSERT_EQ(plan.tile_tokens, 64);
    if (len < plan.tile_tokens) {
      ASSERT_EQ(schedule.units.size(), 1u) << len << " tokens";
      EXPECT_EQ(schedule.units[0].heads, 8);
      EXPECT_TRUE(schedule.merges.empty());
      continue;
    }
    ASSERT_EQ(schedule.units.size(), 2u) << len << " tokens";
    if (len <= cpu::kHeadGroupMaxTokens) {
      EXPECT_TRUE(schedule.merges.empty()) << len << " tokens";
      for (const cpu::WorkUnit& u : schedule.units) {
        EXPECT_EQ(u.heads, 4) << len << " tokens";
        EXPECT_EQ(u.kv_end - u.kv_begin, len) << len << " tokens";
        EXPECT_EQ(u.part_slot, -1) << len << " tokens";
      }
    } else {
      ASSERT_EQ(schedule.merges.size(), 1u) << len << " tokens";
      EXPECT_EQ(schedule.merges[0].heads, 8);
      EXPECT_EQ(schedule.merges[0].parts, 2);
      EXPECT_EQ(schedule.merge_tasks.size(), 8u);
      for (const cpu::WorkUnit& u : schedule.units) {
        EXPECT_EQ(u.heads, 8) << len << " tokens";
        EXPECT_GE(u.part_slot, 0) << len << " tokens";
        EXPECT_EQ(u.kv_begin % plan.tile_tokens, 0) << len << " tokens";
      }
    }
  }
}

// One long sequence on two threads, planned as the backend plans it: every P mode gives each
// thread a chunk of its own, all 8 KV heads over half the tokens (the plan's split), so P codes
// rounded from the kernel's own scores do not fall back to groups of heads, whose rows lie apart
// in B2NHD; a short one stays one chunk and its heads are shared out.
TEST(CpuWorkUnits, OneLongSequenceGivesEachThreadAChunkInEveryPMode) {
  const auto backend = make_backend("cpu", BackendOptions{.threads = 2});
  for (const int len : {cpu::kHeadGroupMaxTokens, 32768}) {
    const std::vector<std::int32_t> lens{len};
    const mjolnir::StepShape step{.seq_lens = lens, .q_len = 1, .num_kv_heads = 8};
    const mjolnir::PlanOptions options = backend->plan_options();
    EXPECT_EQ(options.heads_together_min_tokens, cpu::kHeadGroupMaxTokens);
    mjolnir::BackendPlan plan(mjolnir::capacity_for(step, options));
    backend->plan(plan, step, options);
    const auto* prepared = dynamic_cast<const cpu::CpuPlan*>(plan.prepared());
    ASSERT_NE(prepared, nullptr);
    for (const PMode p_mode : {PMode::fp32, PMode::bf16, PMode::fp16, PMode::fp8}) {
      const cpu::UnitSchedule& schedule = prepared->units_for(p_mode);
      ASSERT_EQ(schedule.units.size(), 2u) << len << " tokens, P " << to_string(p_mode);
      EXPECT_TRUE(schedule.merges.empty()) << len << " tokens, P " << to_string(p_mode);
      for (const cpu::WorkUnit& u : schedule.units) {
        EXPECT_EQ(u.heads, len > cpu::kHeadGroupMaxTokens ? 8 : 4) << len << " tokens";
        EXPECT_EQ(u.kv_end - u.kv_begin, len > cpu::kHeadGroupMaxTokens ? len / 2 : len);
      }
    }
    EXPECT_EQ(plan.plan().num_splits[0], len > cpu::kHeadGroupMaxTokens ? 2 : 1);
  }
}

// Steps with fewer chunks than threads: the backend cuts chunks into token parts (P fp32) or
// groups of heads (P rounded) so every thread works; results must not depend on it.
TEST_P(CpuKernelMatrix, FewChunksCutForThreadsMatchEmulator) {
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 13);
  int index = 0;
  for (int threads : {2, 3, 4}) {
    const auto backend = make_backend("cpu", BackendOptions{.threads = threads});
    for (Format format : {Format::fp8_e4m3, Format::bf16, Format::nvfp4, Format::fp6_e3m2}) {
      for (PMode p_mode : {PMode::fp32, PMode::bf16, PMode::fp8}) {
        for (int len : {1, 17, 2 * 32 + 5, 300}) {
          verify::Case c;
          verify::ProblemSpec& s = c.spec;
          s.format = format;
          s.layout = kAllLayouts[index % 6];
          s.page_size = 16;
          s.head_dim = 64 + 64 * (index % 2);
          s.group = 1 + index % 4;
          s.num_kv_heads = 1 + index % 3;
          s.params.q_len = std::min(len, 1 + index % 3);
          s.params.causal = index % 2 == 1;
          s.params.p_mode = p_mode;
          s.params.q_mode = QMode(index % 4);  // every Q mode, int8 too
          s.granularity = ScaleGranularity(index % 3);
          s.seed = rng();
          s.seq_lens = {len};
          c.tile_tokens = 32;
          c.splits = 1;
          ++index;
          const verify::CaseResult r = verify::run_case(c, *backend);
          EXPECT_NE(r.status, verify::CaseResult::Status::failed)
              << "threads " << threads << " " << c.name() << ": " << r.message;
        }
      }
    }
  }
}

// A bf16 model's Q and O as bf16 rows (bf16_rows_check.h): O is exactly the float32 step's O
// rounded, on this target's kernel, through every way a row is written: by the kernel itself
// (unsplit items), from split partials and from token parts (the backend's merges), in a ragged
// step, from 8 query rows (AMX where the CPU has it), and for a NaN query row.
TEST_P(CpuKernelMatrix, Bf16QueryAndOutputRowsAreTheFloat32StepRounded) {
  const auto backend = make_backend("cpu", BackendOptions{.threads = 2});
  std::mt19937_64 rng(mjolnir::testing::test_seed() + 41);
  int index = 0;
  for (Format format : kAllFormats) {
    for (int variant = 0; variant < 4; ++variant, ++index) {
      if (!runs_case(std::size_t(index))) continue;
      verify::ProblemSpec s;
      s.format = format;
      s.layout = kAllLayouts[index % 6];
      s.head_dim = 64 + 64 * (index % 2);
      s.num_kv_heads = 2;
      s.group = 1 + index % 4;
      s.granularity = ScaleGranularity(index % 3);
      s.params.q_mode = QMode(index % 4);
      s.params.p_mode = PMode(index % 3);
      s.seed = rng();
      mjolnir::PlanOptions options;
      switch (variant) {
        case 0:  // unsplit items write O themselves; a padding sequence
          s.params.q_len = 2;
          s.seq_lens = {37, 0, 130};
          options.max_splits = 1;
          break;
        case 1:  // split query tiles, merged from their partials
          s.seq_lens = {700, 300};
          options.fixed_splits = 3;
          break;
        case 2:  // one long chunk for two threads: token parts, merged (P in fp32)
          s.params.p_mode = PMode::fp32;
          s.seq_lens = {cpu::kHeadGroupMaxTokens + 300};
          options.max_splits = 1;
          break;
        default:  // a ragged step (a prompt and a decode token) with 8 query rows per item
          s.params.q_len = 0;
          s.group = 8;
          s.seq_lens = {40, 90};
          s.query_lens = {40, 1};
          break;
      }
      const std::string name =
          std::string(to_string(format)) + " variant " + std::to_string(variant) + " q " +
          std::string(to_string(s.params.q_mode)) + " p " + std::string(to_string(s.params.p_mode));
      mjolnir::testing::check_bf16_rows(*backend, s, options, name, variant == 0 ? 1 : -1);
    }
  }
}

}  // namespace mjolnir_cpu_kernel_tests

#endif  // HWY_ONCE

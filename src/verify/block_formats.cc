#include "verify/block_formats.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/minifloat.h"
#include "mjolnir/error.h"

namespace mjolnir::verify {

namespace {

float to_fp16(float x) { return decode_minifloat<kFp16Spec>(encode_minifloat<kFp16Spec>(x)); }

// One block of q8_0: the quantizer divides by the exact scale (multiplying by its reciprocal)
// and rounds half away from zero; the values come back from the fp16-rounded scale.
void q8_0_block(std::span<const float> in, std::span<float> out) {
  float amax = 0;
  for (const float x : in) amax = std::max(amax, std::fabs(x));
  const float d = amax / 127.0f;
  const float inverse = d != 0 ? 1.0f / d : 0.0f;
  const float stored = to_fp16(d);
  for (std::size_t i = 0; i < in.size(); ++i) {
    out[i] = std::round(in[i] * inverse) * stored;
  }
}

// One block of q4_0: the scale maps the value of largest magnitude to -8 (so its sign picks
// which end of [-8, 7] is reached), q = min(15, trunc(x / d + 8.5)).
void q4_0_block(std::span<const float> in, std::span<float> out) {
  float amax = 0, extreme = 0;
  for (const float x : in) {
    if (std::fabs(x) > amax) {
      amax = std::fabs(x);
      extreme = x;
    }
  }
  const float d = extreme / -8.0f;
  const float inverse = d != 0 ? 1.0f / d : 0.0f;
  const float stored = to_fp16(d);
  for (std::size_t i = 0; i < in.size(); ++i) {
    const int q = std::min(15, static_cast<int>(static_cast<std::int8_t>(in[i] * inverse + 8.5f)));
    out[i] = static_cast<float>(q - 8) * stored;
  }
}

}  // namespace

std::string_view to_string(BlockFormat format) {
  return format == BlockFormat::q8_0 ? "q8_0" : "q4_0";
}

double block_format_bits(BlockFormat format) {
  const int code_bits = format == BlockFormat::q8_0 ? 8 : 4;
  return code_bits + 16.0 / kBlockFormatValues;
}

void round_trip(BlockFormat format, std::span<const float> in, std::span<float> out) {
  MJOLNIR_REQUIRE(in.size() % kBlockFormatValues == 0, "in: ", in.size(),
                  " values, not a multiple of the block of ", kBlockFormatValues);
  MJOLNIR_REQUIRE(out.size() == in.size(), "out: ", out.size(), " values for ", in.size());
  for (std::size_t first = 0; first < in.size(); first += kBlockFormatValues) {
    const auto block_in = in.subspan(first, kBlockFormatValues);
    const auto block_out = out.subspan(first, kBlockFormatValues);
    if (format == BlockFormat::q8_0) {
      q8_0_block(block_in, block_out);
    } else {
      q4_0_block(block_in, block_out);
    }
  }
}

}  // namespace mjolnir::verify

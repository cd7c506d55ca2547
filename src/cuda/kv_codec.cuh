// Device-side codecs of the KV formats and the numerics contract's rounding steps, on top of the
// scalar codecs of core/minifloat.h (the same definitions the host uses, so codes match bit for
// bit). Packing of one token row as in format.h: 16-bit little-endian, fp8 one byte, fp6 four
// codes in three bytes (c0 | c1<<6 | c2<<12 | c3<<18), fp4 two a byte (even channel low),
// nvfp4 fp4 codes then one e4m3 scale per 16 channels.
#pragma once

#include <cstdint>

#include "core/format_table.h"
#include "core/minifloat.h"
#include "mjolnir/decode.h"
#include "mjolnir/format.h"

namespace mjolnir::cuda {

// A format's element spec and packing: core/format_table.h's kFormatFacts<kFormat>.
template <Format kFormat>
inline constexpr MinifloatSpec kElementSpec = kFormatFacts<kFormat>.element;

// Code of channel c of a packed row (shared or global memory, byte addressed).
template <Format kFormat>
__device__ __forceinline__ std::uint32_t read_code(const std::uint8_t* row, int c) {
  return read_packed_code<kFormatFacts<kFormat>.packing>(row, c);
}

// Decoded value of channel c of a packed row of `head_dim` channels, before the outer scale
// (nvfp4: times its block scale, an exact product as on the host).
template <Format kFormat>
__device__ __forceinline__ float decode_channel(const std::uint8_t* row, int c, int head_dim) {
  const float value = decode_minifloat<kElementSpec<kFormat>>(read_code<kFormat>(row, c));
  if constexpr (kFormatFacts<kFormat>.has_block_scales()) {
    const float block_scale = decode_minifloat<kE4M3Spec>(row[head_dim / 2 + c / kNvfp4BlockSize]);
    return __fmul_rn(value, block_scale);
  } else {
    return value;
  }
}

// --- encoding a row (write_kv) ------------------------------------------------------------------

// A row is encoded in independent units: one channel (16- and 8-bit), a group of 4 (fp6, three
// bytes), a pair (fp4, one byte), or a block of 16 with its scale (nvfp4).
template <Format kFormat>
inline constexpr int kChannelsPerUnit = kFormatFacts<kFormat>.has_block_scales()
                                            ? kFormatFacts<kFormat>.block_channels
                                            : kFormatFacts<kFormat>.channels_per_group();

// Writes unit `u` of a packed row of `head_dim` channels; value(c) is channel c already divided
// by its outer scale. Bit for bit what encode_row() writes (format.cc): the same scalar encoder,
// and for nvfp4 the block scale e4m3(amax / 6) (at least the smallest positive code for a
// non-zero block) and codes e2m1(value / decoded scale), true divisions.
template <Format kFormat, typename Value>
__device__ void encode_unit(std::uint8_t* row, int u, int head_dim, const Value& value) {
  constexpr MinifloatSpec kSpec = kElementSpec<kFormat>;
  if constexpr (kFormatFacts<kFormat>.has_block_scales()) {
    const int first = u * kNvfp4BlockSize;
    float amax = 0.0f;
    for (int i = 0; i < kNvfp4BlockSize; ++i)
      amax = amax < fabsf(value(first + i)) ? fabsf(value(first + i)) : amax;
    std::uint32_t scale_code = 0;
    if (amax != 0.0f) {
      constexpr float kE2M1Max = 6.0f;
      scale_code = encode_minifloat<kE4M3Spec>(__fdiv_rn(amax, kE2M1Max));
      if (scale_code == 0) scale_code = 1;  // the smallest positive e4m3 code
    }
    std::uint8_t* codes = row + first / 2;
    if (scale_code == 0) {
      for (int pair = 0; pair < kNvfp4BlockSize / 2; ++pair) codes[pair] = 0;
    } else {
      const float scale = decode_minifloat<kE4M3Spec>(scale_code);
      for (int pair = 0; pair < kNvfp4BlockSize / 2; ++pair) {
        const std::uint32_t even =
            encode_minifloat<kSpec>(__fdiv_rn(value(first + 2 * pair), scale));
        const std::uint32_t odd =
            encode_minifloat<kSpec>(__fdiv_rn(value(first + 2 * pair + 1), scale));
        codes[pair] = static_cast<std::uint8_t>(even | odd << 4);
      }
    }
    row[head_dim / 2 + u] = static_cast<std::uint8_t>(scale_code);
  } else {
    constexpr int kGroup = kChannelsPerUnit<kFormat>;
    std::uint32_t codes[kGroup];
    for (int i = 0; i < kGroup; ++i) codes[i] = encode_minifloat<kSpec>(value(kGroup * u + i));
    write_packed_group<kFormatFacts<kFormat>.packing>(codes, u, row);
  }
}

// --- the contract's rounding steps (docs/numerics.md) -------------------------------------------

inline constexpr float kFp8Max = 448.0f;     // e4m3 largest finite: Q codes use the full range
inline constexpr float kInt8Max = 127.0f;    // int8 Q codes: -127..127
inline constexpr float kFp8PScale = 256.0f;  // fp8 P = e4m3(p * 256)
// std::numbers::log2e_v<float> and ln2_v<float>, as the emulator rounds them.
inline constexpr float kLog2e = 1.44269504088896340736f;
inline constexpr float kLn2 = 0.693147180559945309417f;

template <MinifloatSpec kSpec>
__device__ __forceinline__ float round_through(float x) {
  return decode_minifloat<kSpec>(encode_minifloat<kSpec>(x));
}

// Q as the QK product consumes it, given the prepared (channel-scale folded) value and sq.
__device__ __forceinline__ float round_query(float x, int q_mode, float sq) {
  switch (static_cast<QMode>(q_mode)) {
    case QMode::fp32:
      return x;
    case QMode::bf16:
      return round_through<kBf16Spec>(x);
    case QMode::fp8:
      return round_through<kE4M3Spec>(__fdiv_rn(x, sq));
    case QMode::int8:  // the nearest integer, ties to even (rintf), within +-127
      return fminf(fmaxf(rintf(__fdiv_rn(x, sq)), -kInt8Max), kInt8Max);
  }
  return x;
}

// P as the PV product consumes it.
__device__ __forceinline__ float round_probability(float p, int p_mode) {
  switch (static_cast<PMode>(p_mode)) {
    case PMode::fp32:
      return p;
    case PMode::bf16:
      return round_through<kBf16Spec>(p);
    case PMode::fp8:
      return round_through<kE4M3Spec>(__fmul_rn(p, kFp8PScale));
    case PMode::fp16:  // not run here: unsupported_reason refuses it
      return p;
  }
  return p;
}

// Transcendentals of the contract, evaluated in double and rounded once to float: that is the
// correctly rounded result except within a double ulp of a float rounding midpoint. The host's
// glibc exp2f / expf / logf / log2f, which the emulator calls, are within 0.502 ulp and differ
// from it for about 0.07% of arguments; a 1-ulp change of p flips a bf16 P code with probability
// ~2^-16, so codes match in practice. Plain exp2f (MUFU.EX2, up to 2 ulp) plus a reordered QK sum
// would flip bf16 P codes often enough to break the 2e-6 tolerance of the fp32 / bf16 modes
// (docs/cuda.md, "Numerics").
__device__ __forceinline__ float exp2_rn(float x) {
  return static_cast<float>(exp2(static_cast<double>(x)));
}
__device__ __forceinline__ float exp_rn(float x) {
  return static_cast<float>(exp(static_cast<double>(x)));
}
__device__ __forceinline__ float log_rn(float x) {
  return static_cast<float>(log(static_cast<double>(x)));
}
__device__ __forceinline__ float log2_rn(float x) {
  return static_cast<float>(log2(static_cast<double>(x)));
}

// std::max(a, b) as the host evaluates it ((a < b) ? b : a): a NaN b leaves a.
__device__ __forceinline__ float host_max(float a, float b) { return a < b ? b : a; }

}  // namespace mjolnir::cuda

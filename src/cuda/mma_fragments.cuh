// The warp-level tensor-core pieces of the fast decode path (decode_mma_kernel.cuh): packing
// floats into f16x2 / bf16x2 registers (and splitting an fp32 value into several such terms that
// sum back to it), converting packed fp8 codes to f16x2 in registers, byte permutes, and
// mma.sync m16n8k16 with fp32 accumulators.
//
// Fragment layout of m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4 * gid +
// tid: A (16 x 16, row) a0 = A[gid][2tid, 2tid+1], a1 = A[gid+8][2tid, 2tid+1], a2 = A[gid][2tid+8,
// 2tid+9], a3 = A[gid+8][2tid+8, 2tid+9]; B (16 x 8, col) b0 = B[2tid, 2tid+1][gid], b1 =
// B[2tid+8, 2tid+9][gid]; C (16 x 8) c0, c1 = C[gid][2tid, 2tid+1], c2, c3 = C[gid+8][2tid,
// 2tid+1]. The lower k index sits in the low half of a register.
//
// Under MJOLNIR_CUDA_EMULATION (tests on CPU threads) every piece has a plain implementation:
// the conversions through core/minifloat.h, the MMA gathering the warp's operands in one exchange
// and summing exact products in k order.
#pragma once

#if defined(MJOLNIR_CUDA_EMULATION)
#include "cuda/cpu_emulation.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#endif

#include <cmath>
#include <cstdint>

#include "core/minifloat.h"
#include "mjolnir/format.h"

namespace mjolnir::cuda {

// The 16-bit operand type of the MMA: f16 (every fp8 code and fp16 is exact in it) or bf16.
enum class MmaType { f16, bf16 };

// Two floats rounded to nearest even and packed, `lo` in the low half.
template <MmaType kType>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
#if defined(MJOLNIR_CUDA_EMULATION)
  constexpr MinifloatSpec kSpec = kType == MmaType::f16 ? kFp16Spec : kBf16Spec;
  // The hardware conversion keeps an infinity, which encode_minifloat saturates (a K or V
  // value of Inf must stay one: the non-finite policy, docs/numerics.md).
  const auto code = [&](float x) {
    if (!std::isinf(x)) return encode_minifloat<kSpec>(x);
    return (x < 0 ? kSpec.sign_mask() : 0u) | kSpec.max_exponent_field() << kSpec.mantissa_bits;
  };
  return code(lo) | code(hi) << 16;
#else
  if constexpr (kType == MmaType::f16) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
#endif
}

// The two values of a packed register, low half first.
template <MmaType kType>
__device__ __forceinline__ void unpack2(std::uint32_t bits, float& lo, float& hi) {
#if defined(MJOLNIR_CUDA_EMULATION)
  constexpr MinifloatSpec kSpec = kType == MmaType::f16 ? kFp16Spec : kBf16Spec;
  lo = decode_minifloat<kSpec>(bits & 0xFFFFu);
  hi = decode_minifloat<kSpec>(bits >> 16);
#else
  if constexpr (kType == MmaType::f16) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&bits));
    lo = f.x;
    hi = f.y;
  } else {
    lo = __uint_as_float(bits << 16);
    hi = __uint_as_float(bits & 0xFFFF0000u);
  }
#endif
}

// (lo, hi) as kTerms packed registers whose values sum to (lo, hi) up to the last term's
// rounding: term t holds the rounding of what terms 0..t-1 left (each remainder is exact in
// fp32). Two f16 terms carry 22 significant bits, three bf16 terms 24.
template <MmaType kType, int kTerms>
__device__ __forceinline__ void split2(float lo, float hi, std::uint32_t (&out)[kTerms]) {
#pragma unroll
  for (int t = 0; t < kTerms; ++t) {
    out[t] = pack2<kType>(lo, hi);
    if (t + 1 < kTerms) {
      float lo_part, hi_part;
      unpack2<kType>(out[t], lo_part, hi_part);
      lo = __fsub_rn(lo, lo_part);
      hi = __fsub_rn(hi, hi_part);
    }
  }
}

// Two fp8 codes (the low 16 bits of `codes`, the lower channel in the low byte) as f16x2; exact.
template <Format kFormat>
__device__ __forceinline__ std::uint32_t fp8x2_to_f16x2(std::uint32_t codes) {
  static_assert(kFormat == Format::fp8_e4m3 || kFormat == Format::fp8_e5m2);
#if defined(MJOLNIR_CUDA_EMULATION)
  constexpr MinifloatSpec kSpec = kFormat == Format::fp8_e4m3 ? kE4M3Spec : kE5M2Spec;
  return pack2<MmaType::f16>(decode_minifloat<kSpec>(codes & 0xFFu),
                             decode_minifloat<kSpec>((codes >> 8) & 0xFFu));
#else
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xFFFFu),
                                 kFormat == Format::fp8_e4m3 ? __NV_E4M3 : __NV_E5M2);
  return std::uint32_t(h.x) | std::uint32_t(h.y) << 16;
#endif
}

// Two fp8 codes in the high 16 bits of `codes`, as f16x2; exact. On sm_89+ the conversion reads
// the register's upper half itself (F2FP ... R.H1 in the SASS), where the shift that
// fp8x2_to_f16x2(codes >> 16) needs would be one more instruction per two values.
template <Format kFormat>
__device__ __forceinline__ std::uint32_t fp8x2_high_to_f16x2(std::uint32_t codes) {
#if !defined(MJOLNIR_CUDA_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  std::uint32_t pair;
  if constexpr (kFormat == Format::fp8_e4m3) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}"
        : "=r"(pair)
        : "r"(codes));
  } else {
    static_assert(kFormat == Format::fp8_e5m2);
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e5m2x2 %0, hi;\n}"
        : "=r"(pair)
        : "r"(codes));
  }
  return pair;
#else
  return fp8x2_to_f16x2<kFormat>(codes >> 16);
#endif
}

// 2^x by the hardware's approximation (MUFU.EX2, about 2 ulp, as exp2f), flushing results below
// 2^-126 to zero: exp2f adds about a dozen instructions per call to keep those subnormal
// results, which in the online softmax are probabilities under 2^-126 of the row's largest.
// exp2(0) is exactly 1, so an unchanged maximum still gives alpha == 1. The emulation (and the
// host pass) use std::exp2, which keeps them; the difference is far below the tolerance.
__device__ __forceinline__ float exp2_flush(float x) {
#if !defined(MJOLNIR_CUDA_EMULATION) && defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// e2m1 codes become f16 by placing their bits (sign at bit 15, exponent and mantissa at bits
// 9-11), which is the code's value times 2^-14 exactly, subnormal codes included. In two steps,
// so that most of the work is shared by four codes:
//   - e2m1_bytes: the four codes of one parity of a word of eight (code i at bits 4i; `odd`:
//     codes 1, 3, 5, 7, else 0, 2, 4, 6), code 2b + odd placed in byte b: sign at bit 7,
//     exponent and mantissa at bits 1-3 (the other bits are left as they fall). Two shifts at
//     most and one logic operation for four codes.
//   - e2m1x2_from_bytes: bytes 1 and 3 of such a word (or of a byte permute of two) as f16x2,
//     one logic operation.
__device__ __forceinline__ std::uint32_t e2m1_bytes(std::uint32_t word, bool odd) {
  const std::uint32_t sign = odd ? word : word << 4;
  const std::uint32_t magnitude = odd ? word >> 3 : word << 1;
  return (sign & 0x80808080u) | (magnitude & 0x7F7F7F7Fu);  // a bit select: one LOP3
}

__device__ __forceinline__ std::uint32_t e2m1x2_from_bytes(std::uint32_t bytes) {
  return bytes & 0x8E008E00u;
}

// Two fp6 codes, each at bit t (at most 10) of a 16-bit half of `halves` (the other bits
// ignored), as f16x2: each code's bits placed into an f16 (sign to bit 15; exponent and mantissa
// so that the mantissas align, at bits 7-11 for e2m3 and 8-12 for e3m2), which is the code's value
// times 2^-14 (e2m3) or 2^-12 (e3m2) exactly, subnormal codes included. Two shifts (one where
// they coincide) and two logic operations for the pair.
template <Format kFormat>
__device__ __forceinline__ std::uint32_t fp6x2_to_f16x2(std::uint32_t halves, int t) {
  static_assert(kFormat == Format::fp6_e2m3 || kFormat == Format::fp6_e3m2);
  constexpr int kShift = kFormat == Format::fp6_e2m3 ? 7 : 8;  // 3 or 2 mantissa bits
  constexpr std::uint32_t kMagnitude = 0x1Fu << kShift | 0x1Fu << (16 + kShift);
  const std::uint32_t sign = halves << (10 - t);
  const std::uint32_t magnitude = t <= kShift ? halves << (kShift - t) : halves >> (t - kShift);
  return (sign & 0x80008000u) | (magnitude & kMagnitude);
}

// The 32 bits from bit `shift` of the 64-bit pair (hi:lo).
__device__ __forceinline__ std::uint32_t funnel_right(std::uint32_t lo, std::uint32_t hi,
                                                      int shift) {
#if defined(MJOLNIR_CUDA_EMULATION)
  return static_cast<std::uint32_t>((std::uint64_t(hi) << 32 | lo) >> shift);
#else
  return __funnelshift_r(lo, hi, shift);
#endif
}

// The byte_perm selector that puts byte k of x in bytes 0 and 1 and byte k of y in bytes 2 and 3.
__device__ __forceinline__ std::uint32_t byte_pair_selector(int k) {
  return std::uint32_t(k) * 0x11u | std::uint32_t(4 + k) * 0x1100u;
}

// a * b for f16x2 values, rounded to nearest (exact for nvfp4's code times block scale).
__device__ __forceinline__ std::uint32_t hmul2(std::uint32_t a, std::uint32_t b) {
#if defined(MJOLNIR_CUDA_EMULATION)
  float a_lo, a_hi, b_lo, b_hi;
  unpack2<MmaType::f16>(a, a_lo, a_hi);
  unpack2<MmaType::f16>(b, b_lo, b_hi);
  return pack2<MmaType::f16>(a_lo * b_lo, a_hi * b_hi);
#else
  const __half2 product =
      __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const std::uint32_t*>(&product);
#endif
}

// Byte i of the result is byte (selector >> 4i) & 7 of the pair (x = bytes 0-3, y = 4-7).
__device__ __forceinline__ std::uint32_t byte_perm(std::uint32_t x, std::uint32_t y,
                                                   std::uint32_t selector) {
#if defined(MJOLNIR_CUDA_EMULATION)
  const std::uint64_t both = std::uint64_t(y) << 32 | x;
  std::uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned from = (selector >> (4 * i)) & 7u;
    out |= std::uint32_t((both >> (8 * from)) & 0xFFu) << (8 * i);
  }
  return out;
#else
  return __byte_perm(x, y, selector);
#endif
}

// c += a * b for one m16n8k16 tile, fp32 accumulators.
template <MmaType kType>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1) {
#if defined(MJOLNIR_CUDA_EMULATION)
  const int lane = threadIdx.x & 31, gid = lane >> 2, tid = lane & 3;
  const auto all = emulation::warp_gather({a[0], a[1], a[2], a[3], b0, b1, 0, 0});
  float a_rows[2][16], b_cols[16][2];  // A rows gid, gid + 8; B columns 2tid, 2tid + 1
  for (int t = 0; t < 4; ++t) {
    const auto& from = all[gid * 4 + t];
    unpack2<kType>(from[0], a_rows[0][2 * t], a_rows[0][2 * t + 1]);
    unpack2<kType>(from[1], a_rows[1][2 * t], a_rows[1][2 * t + 1]);
    unpack2<kType>(from[2], a_rows[0][2 * t + 8], a_rows[0][2 * t + 9]);
    unpack2<kType>(from[3], a_rows[1][2 * t + 8], a_rows[1][2 * t + 9]);
    for (int j = 0; j < 2; ++j) {
      const auto& column = all[(2 * tid + j) * 4 + t];
      unpack2<kType>(column[4], b_cols[2 * t][j], b_cols[2 * t + 1][j]);
      unpack2<kType>(column[5], b_cols[2 * t + 8][j], b_cols[2 * t + 9][j]);
    }
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      float sum = c[2 * i + j];
      for (int k = 0; k < 16; ++k) sum += a_rows[i][k] * b_cols[k][j];  // exact products
      c[2 * i + j] = sum;
    }
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kType == MmaType::f16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  // Every architecture this project builds for is sm_80 or newer (CMakeLists.txt); the host
  // pass of nvcc never runs device code.
  (void)c, (void)a, (void)b0, (void)b1;
#endif
}

}  // namespace mjolnir::cuda

// Q . K in integers for the CPU kernel (attention_kernel.cc), Q mode int8 (docs/numerics.md
// step 1): Q holds the integers -127..127, and fp4 e2m1's codes are the integers -12..12 after a
// factor 2 (0, 0.5, 1, 1.5, 2, 3, 4, 6), so each score is an integer sum, exact in any order.
// AVX-512 VNNI's vpdpbusd does 64 multiply-adds of unsigned x signed bytes into 16 int32 lanes:
// the K codes go in as unsigned bytes k + 12 (a 16-entry vpshufb table per nibble), Q as signed
// bytes, and each row's sum starts at -12 * sum(q), which takes the 12 back out. On the Intel
// Xeon this was written on, 32 vpdpbusd (a 4 x 4 block of 128 channels) took 6.5 ns where 32
// vdpbf16ps (64 channels) took 18.7 (bench/micro/vector_op_costs, docs/cpu-performance.md).
//
// The sums are converted to fp32 (exact: |sum| < 2^24) and reduced like the other blocks' sums,
// then times the kernel's scale (the score scale / 2): the scores are the emulator's bit for bit.
// Only the AVX3_DL target compiles it, and it runs on CPUs with AVX512_VNNI (Ice Lake and later,
// Zen 4 and later); it applies from 128 channels a chunk (D a multiple of 128). Per-target header,
// see kv_decode-inl.h.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(MJOLNIR_CPU_INT8_DOT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_INT8_DOT_INL_H_
#undef MJOLNIR_CPU_INT8_DOT_INL_H_
#else
#define MJOLNIR_CPU_INT8_DOT_INL_H_
#endif

#include <array>
#include <cstddef>
#include <cstdint>

#include "core/minifloat.h"
#include "cpu/kernel_blocks-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/tile_prefetcher.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef MJOLNIR_INT8_DOT
#if HWY_TARGET == HWY_AVX3_DL
#define MJOLNIR_INT8_DOT 1

// True when this CPU executes vpdpbusd (Highway 1.0.3's AVX3_DL does not require it).
inline bool CpuHasInt8Dot() {
  static const bool has = __builtin_cpu_supports("avx512vnni") != 0;
  return has;
}

// Channels per chunk: one 64-byte row of e2m1 codes, decoded into two vectors of 64 bytes, the
// even channels (low nibbles) and the odd ones (high nibbles).
inline constexpr std::size_t kInt8Chunk = 128;
// e2m1 codes times 2 are -12..12; plus 12 they are unsigned bytes 0..24.
inline constexpr int kE2M1IntBias = 12;
inline constexpr float kE2M1IntFactor = 2.0f;

// The unsigned byte 2 * value + 12 of every e2m1 code, repeated in each 128-bit block for
// vpshufb.
struct E2M1IntTable {
  alignas(64) std::array<std::uint8_t, 64> bytes{};
  constexpr E2M1IntTable() {
    for (std::uint32_t i = 0; i < 64; ++i) {
      const float value = decode_minifloat<kE2M1Spec>(i % 16) * kE2M1IntFactor;
      bytes[i] = static_cast<std::uint8_t>(static_cast<int>(value) + kE2M1IntBias);
    }
  }
};

// Chunk c of an e2m1 row (64 code bytes) as unsigned bytes: even channels 0, 2, .., 126 of the
// chunk in `even`, odd ones in `odd`.
HWY_INLINE void DecodeE2M1Int(__m512i table, const std::uint8_t* row, std::size_t chunk,
                              __m512i& even, __m512i& odd) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i codes = _mm512_loadu_si512(row + chunk * (kInt8Chunk / 2));
  even = _mm512_shuffle_epi8(table, _mm512_and_si512(codes, nibble));
  odd = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble));
}

// q_bytes [R][d] (signed int8, per chunk of 128 channels the 64 even channels then the 64 odd
// ones) and start [R] (-12 times the row's sum) from qn [R][D]: the int8 codes of Q mode int8,
// as floats in natural order.
inline void PrepareInt8Query(const float* HWY_RESTRICT qn, int rows, std::size_t d,
                             std::int8_t* HWY_RESTRICT q_bytes, std::int32_t* HWY_RESTRICT start) {
  for (int r = 0; r < rows; ++r) {
    const float* src = qn + std::size_t(r) * d;
    std::int8_t* dst = q_bytes + std::size_t(r) * d;
    std::int32_t sum = 0;
    for (std::size_t c0 = 0; c0 < d; c0 += kInt8Chunk) {
      for (std::size_t i = 0; i < kInt8Chunk / 2; ++i) {
        const auto even = static_cast<std::int32_t>(src[c0 + 2 * i]);
        const auto odd = static_cast<std::int32_t>(src[c0 + 2 * i + 1]);
        dst[c0 + i] = static_cast<std::int8_t>(even);
        dst[c0 + kInt8Chunk / 2 + i] = static_cast<std::int8_t>(odd);
        sum += even + odd;
      }
    }
    start[r] = -kE2M1IntBias * sum;
  }
}

HWY_PUSH_ATTRIBUTES("avx512vnni")

// Scores of kRows query rows (q_bytes d apart) against the 4 K rows k[0..3]: kRows x 4 int32
// accumulators, each K chunk decoded once for all rows. Writes scale times row r's sum for key i
// to out[r * stride + i].
template <int kRows>
HWY_INLINE void Int8Block(const std::int8_t* HWY_RESTRICT q, std::size_t d,
                          const std::int32_t* start, const std::uint8_t* const* k, __m512i table,
                          float scale, float* out, std::size_t stride) {
  const WideFloatTag df;
  __m512i a[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    const __m512i first = _mm512_maskz_set1_epi32(__mmask16{1}, start[r]);
    for (auto& acc : a[r]) acc = first;
  }
  for (std::size_t c = 0; c < d / kInt8Chunk; ++c) {
    __m512i even[4], odd[4];
    for (int i = 0; i < 4; ++i) DecodeE2M1Int(table, k[i], c, even[i], odd[i]);
    for (int r = 0; r < kRows; ++r) {
      const std::int8_t* qr = q + r * d + c * kInt8Chunk;
      const __m512i q0 = _mm512_loadu_si512(qr);
      for (int i = 0; i < 4; ++i) a[r][i] = _mm512_dpbusd_epi32(a[r][i], even[i], q0);
      const __m512i q1 = _mm512_loadu_si512(qr + kInt8Chunk / 2);
      for (int i = 0; i < 4; ++i) a[r][i] = _mm512_dpbusd_epi32(a[r][i], odd[i], q1);
    }
  }
  hn::Vec<WideFloatTag> sums[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < 4; ++i) sums[r][i].raw = _mm512_cvtepi32_ps(a[r][i]);
  }
  if constexpr (kRows == 4) {
    StoreSums4x4(df, sums, scale, out, stride);
  } else {
    const Float4 s = Reduce4(df, sums[0][0], sums[0][1], sums[0][2], sums[0][3]);
    hn::StoreU(hn::Mul(s, hn::Set(Float4Tag(), scale)), Float4Tag(), out);
  }
}

// scores[r][t] = scale * q_r . k_t for the count e2m1 K rows at bases[t] + offset, as ScoresDot
// does it with bf16 dot products (bf16_dot-inl.h), keys in groups of 4 (a group of fewer repeats
// its last key and writes up to 3 scores past `count`, inside each scores row's padding);
// q_bytes and start from PrepareInt8Query, scale the score scale / kE2M1IntFactor.
HWY_NOINLINE void ScoresInt8(const std::int8_t* HWY_RESTRICT q_bytes,
                             const std::int32_t* HWY_RESTRICT start, int rows, std::size_t d,
                             const std::uint8_t* const* bases, std::int64_t offset, int count,
                             float scale, float* HWY_RESTRICT scores, std::size_t stride,
                             TilePrefetcher& prefetch, int prefetch_per_key) {
  static constexpr E2M1IntTable kTable;
  const __m512i table = _mm512_load_si512(kTable.bytes.data());
  for (int t = 0; t < count; t += 4) {
    const int keys = count - t < 4 ? count - t : 4;
    prefetch.Issue(keys * prefetch_per_key);
    const std::uint8_t* k[4];
    for (int i = 0; i < 4; ++i) k[i] = bases[t + (i < keys ? i : keys - 1)] + offset;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      Int8Block<4>(q_bytes + r * d, d, start + r, k, table, scale, scores + r * stride + t, stride);
    }
    for (; r < rows; ++r) {
      Int8Block<1>(q_bytes + r * d, d, start + r, k, table, scale, scores + r * stride + t, stride);
    }
  }
}

HWY_POP_ATTRIBUTES

#else
#define MJOLNIR_INT8_DOT 0
#endif  // HWY_AVX3_DL

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_INT8_DOT_INL_H_

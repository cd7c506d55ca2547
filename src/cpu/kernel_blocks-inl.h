// The register blocks of the CPU kernel's fast path (attention_kernel.cc): Q . K for 8 query rows
// x 1 key (steps with 8 rows or more) and 4 rows x 2 keys, P . V for 4 rows x 2 vectors, and on
// targets with 32 vector registers 4 x 4 blocks of both and P . V for 8 rows x 2 vectors, each K/V
// vector decoded in registers (kv_decode-inl.h) once for all rows of the block. Per-target header,
// see kv_decode-inl.h.
//
// Sizes are set by AVX2's 16 vector registers: 8 accumulators (8 independent FMA chains, which
// two FMA pipes with 4-cycle latency need), 2 decoded vectors, 1 query vector and a constant or
// two. Zen 3 sustains only about 32 bytes of vector loads per cycle beside two FMAs, so a step
// loads 4 query vectors (128 bytes) per 8 FMAs and reads K and V as codes, never as fp32.

#if defined(MJOLNIR_CPU_KERNEL_BLOCKS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_KERNEL_BLOCKS_INL_H_
#undef MJOLNIR_CPU_KERNEL_BLOCKS_INL_H_
#else
#define MJOLNIR_CPU_KERNEL_BLOCKS_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <utility>

#include "cpu/kv_decode-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// Keeps a loaded vector in a register. Compilers otherwise fold every use of it into the FMAs as
// a memory operand, loading it again per use, and the register blocks below become load-bound.
template <class V>
HWY_INLINE V InRegister(V v) {
#if HWY_ARCH_X86
  asm("" : "+x"(v.raw));
#endif
  return v;
}

// Targets with 32 vector registers (AVX-512, NEON) run 4 x 4 blocks: 16 accumulators, 4
// decoded vectors and a query or probability vector fit, and each query load or probability
// broadcast then serves 4 FMAs instead of 2. AVX2 and SSE4 have 16 registers. SVE has 32 too, but
// its sizeless vectors cannot form the arrays the 4 x 4 blocks are written with.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_NEON
inline constexpr bool kWideRegisterFile = true;
#else
inline constexpr bool kWideRegisterFile = false;
#endif

using Float4Tag = hn::CappedTag<float, 4>;
using Float4 = hn::Vec<Float4Tag>;

// Lane-wise combinations for Reduce4By: sums and maxima.
struct SumLanesOp {
  template <class V>
  HWY_INLINE V operator()(V a, V b) const {
    return hn::Add(a, b);
  }
  template <class D, class V>
  HWY_INLINE float All(D d, V v) const {
    return hn::GetLane(hn::SumOfLanes(d, v));
  }
};
struct MaxLanesOp {
  template <class V>
  HWY_INLINE V operator()(V a, V b) const {
    return hn::Max(a, b);
  }
  template <class D, class V>
  HWY_INLINE float All(D d, V v) const {
    return hn::GetLane(hn::MaxOfLanes(d, v));
  }
};

// [op over the lanes of a0, of a1, of a2, of a3].
template <class DF, class Op>  // a template, so only the branch for DF's lane count is instantiated
HWY_INLINE Float4 Reduce4By(DF df, Op op, hn::Vec<DF> a0, hn::Vec<DF> a1, hn::Vec<DF> a2,
                            hn::Vec<DF> a3) {
#if HWY_TARGET == HWY_SVE || HWY_TARGET == HWY_SVE2 || HWY_TARGET == HWY_SVE_256 || \
    HWY_TARGET == HWY_SVE2_128
  const Float4Tag d4;
  alignas(16) float all[4] = {op.All(df, a0), op.All(df, a1), op.All(df, a2), op.All(df, a3)};
  return hn::Load(d4, all);
#else
  // Within each 128-bit block: transpose-and-combine the four vectors into one holding four
  // partial results, then combine the blocks.
  const hn::Repartition<std::uint64_t, decltype(df)> d64;
  const auto t0 = op(hn::InterleaveLower(df, a0, a1), hn::InterleaveUpper(df, a0, a1));
  const auto t1 = op(hn::InterleaveLower(df, a2, a3), hn::InterleaveUpper(df, a2, a3));
  const auto lo = hn::InterleaveLower(d64, hn::BitCast(d64, t0), hn::BitCast(d64, t1));
  const auto hi = hn::InterleaveUpper(d64, hn::BitCast(d64, t0), hn::BitCast(d64, t1));
  const auto u = op(hn::BitCast(df, lo), hn::BitCast(df, hi));
  constexpr std::size_t kLanes = hn::MaxLanes(df);
  if constexpr (kLanes == 4) {
    return u;
  } else if constexpr (kLanes == 8) {
    const hn::Half<decltype(df)> dh;
    return op(hn::LowerHalf(dh, u), hn::UpperHalf(dh, u));
  } else {  // 16 lanes
    const hn::Half<decltype(df)> dh;
    const hn::Half<decltype(dh)> dq;
    const auto h = op(hn::LowerHalf(dh, u), hn::UpperHalf(dh, u));
    return op(hn::LowerHalf(dq, h), hn::UpperHalf(dq, h));
  }
#endif
}

// [sum(a0), sum(a1), sum(a2), sum(a3)].
template <class DF>
HWY_INLINE Float4 Reduce4(DF df, hn::Vec<DF> a0, hn::Vec<DF> a1, hn::Vec<DF> a2, hn::Vec<DF> a3) {
  return Reduce4By(df, SumLanesOp(), a0, a1, a2, a3);
}

template <class Step, std::size_t... kJ>
HWY_INLINE void CallWithEach(Step& step, std::index_sequence<kJ...>) {
  (step(std::integral_constant<std::size_t, kJ>()), ...);
}

// Calls step(std::integral_constant<std::size_t, j>()) for the vectors j = 0 .. kVectors - 1 of a
// decoder's chunk, in order: j must be a constant, since Dec::Get<j> is a template.
template <class Dec, class Step>
HWY_INLINE void ForEachVector(Step&& step) {
  CallWithEach(step, std::make_index_sequence<Dec::kVectors>());
}

// Fast path, one step of a 4-row x 2-key score block: vector kJ of a chunk of both keys,
// decoded in registers, against the matching vector of 4 query rows (q, D floats apart).
template <class Dec, std::size_t kJ, class DF, class VR, class V = hn::Vec<DF>>
HWY_INLINE void ScoreStep4x2(DF df, const float* HWY_RESTRICT q, std::size_t qs, VR w0, VR w1, V u0,
                             V u1, V& a00, V& a01, V& a10, V& a11, V& a20, V& a21, V& a30, V& a31) {
  const auto x0 = InRegister(Dec::template Get<kJ>(df, w0, u0));
  const auto x1 = InRegister(Dec::template Get<kJ>(df, w1, u1));
  const auto q0 = InRegister(hn::Load(df, q));
  a00 = hn::MulAdd(q0, x0, a00);
  a01 = hn::MulAdd(q0, x1, a01);
  const auto q1 = InRegister(hn::Load(df, q + qs));
  a10 = hn::MulAdd(q1, x0, a10);
  a11 = hn::MulAdd(q1, x1, a11);
  const auto q2 = InRegister(hn::Load(df, q + 2 * qs));
  a20 = hn::MulAdd(q2, x0, a20);
  a21 = hn::MulAdd(q2, x1, a21);
  const auto q3 = InRegister(hn::Load(df, q + 3 * qs));
  a30 = hn::MulAdd(q3, x0, a30);
  a31 = hn::MulAdd(q3, x1, a31);
}

// Orders the steps of a multi-vector chunk: the next step's decode (which reads w0, w1) cannot be
// hoisted above the previous step's FMAs (which produce the accumulators). Left to itself, GCC
// decodes every vector of the chunk up front, runs out of the 16 AVX2 registers and spills
// accumulators to the stack inside the hottest loop.
template <class VR, class V>
HWY_INLINE void StepBarrier(VR& w0, VR& w1, V& a00, V& a01, V& a10, V& a11, V& a20, V& a21, V& a30,
                            V& a31) {
#if HWY_ARCH_X86
  if constexpr (requires { w0.raw; }) {
    asm volatile(""
                 : "+x"(w0.raw), "+x"(w1.raw), "+x"(a00.raw), "+x"(a01.raw), "+x"(a10.raw),
                   "+x"(a11.raw), "+x"(a20.raw), "+x"(a21.raw), "+x"(a30.raw), "+x"(a31.raw));
  } else {  // decoded in Load already (word_decoders-inl.h): only the FMAs to order
    asm volatile(""
                 : "+x"(a00.raw), "+x"(a01.raw), "+x"(a10.raw), "+x"(a11.raw), "+x"(a20.raw),
                   "+x"(a21.raw), "+x"(a30.raw), "+x"(a31.raw));
  }
#else
  (void)w0, (void)w1, (void)a00, (void)a01, (void)a10, (void)a11, (void)a20, (void)a21, (void)a30,
      (void)a31;
#endif
}

// Scores of 4 query rows (qs floats apart) against the K rows k0 and k1 over chunks [c0, c1): 8
// independent FMA
// chains keep both FMA pipes busy; each K byte is loaded and decoded once for the 4 rows, and
// only Q (4 vectors per 8 FMAs) comes from L1. Returns the sums for k0 (rows 0..3) and k1.
template <class Dec>
HWY_INLINE void ScoreBlock4x2(const float* HWY_RESTRICT q, std::size_t qs, std::size_t d,
                              const std::uint8_t* k0, const std::uint8_t* k1, std::size_t c0,
                              std::size_t c1, Float4& sum0, Float4& sum1) {
  using DF = typename Dec::Tag;
  const DF df;
  const std::size_t n = hn::Lanes(df);
  auto a00 = hn::Zero(df), a01 = hn::Zero(df), a10 = hn::Zero(df), a11 = hn::Zero(df);
  auto a20 = hn::Zero(df), a21 = hn::Zero(df), a30 = hn::Zero(df), a31 = hn::Zero(df);
  for (std::size_t c = c0; c < c1; ++c) {
    auto w0 = Dec::Load(df, k0, c, d);
    auto w1 = Dec::Load(df, k1, c, d);
    const auto u0 = Dec::Aux(df, k0, c, d);
    const auto u1 = Dec::Aux(df, k1, c, d);
    const float* qc = q + c * Dec::kVectors * n;
    ScoreStep4x2<Dec, 0>(df, qc, qs, w0, w1, u0, u1, a00, a01, a10, a11, a20, a21, a30, a31);
    if constexpr (Dec::kVectors > 1) {
      StepBarrier(w0, w1, a00, a01, a10, a11, a20, a21, a30, a31);
      ScoreStep4x2<Dec, 1>(df, qc + n, qs, w0, w1, u0, u1, a00, a01, a10, a11, a20, a21, a30, a31);
    }
    if constexpr (Dec::kVectors > 2) {
      StepBarrier(w0, w1, a00, a01, a10, a11, a20, a21, a30, a31);
      ScoreStep4x2<Dec, 2>(df, qc + 2 * n, qs, w0, w1, u0, u1, a00, a01, a10, a11, a20, a21, a30,
                           a31);
      StepBarrier(w0, w1, a00, a01, a10, a11, a20, a21, a30, a31);
      ScoreStep4x2<Dec, 3>(df, qc + 3 * n, qs, w0, w1, u0, u1, a00, a01, a10, a11, a20, a21, a30,
                           a31);
    }
  }
  sum0 = Reduce4(df, a00, a10, a20, a30);
  sum1 = Reduce4(df, a01, a11, a21, a31);
}

// Vector v0 + kJ of a K or V row, v0 a multiple of 4: vectors of one decoder chunk share its
// loads (the compiler merges them), since every decoder has 1, 2 or 4 vectors per chunk.
template <class Dec, std::size_t kJ, class DF>
HWY_INLINE hn::Vec<DF> RowVector(DF df, const std::uint8_t* row, std::size_t v0, std::size_t d) {
  static_assert(4 % Dec::kVectors == 0);
  const std::size_t c = v0 / Dec::kVectors + kJ / Dec::kVectors;
  return Dec::template Get<kJ % Dec::kVectors>(df, Dec::Load(df, row, c, d),
                                               Dec::Aux(df, row, c, d));
}

// Stores key i's scores for rows 0..3 (s0 .. s3, times scale) at out[row * stride + i]: a 4 x 4
// transpose, then one 16-byte store per row.
HWY_INLINE void StoreRowQuads(Float4 s0, Float4 s1, Float4 s2, Float4 s3, Float4 scale, float* out,
                              std::size_t stride) {
  const Float4Tag d4;
  const hn::Repartition<std::uint64_t, Float4Tag> d64;
  s0 = hn::Mul(s0, scale);
  s1 = hn::Mul(s1, scale);
  s2 = hn::Mul(s2, scale);
  s3 = hn::Mul(s3, scale);
  const auto rows01_keys01 = hn::BitCast(d64, hn::InterleaveLower(d4, s0, s1));
  const auto rows01_keys23 = hn::BitCast(d64, hn::InterleaveLower(d4, s2, s3));
  const auto rows23_keys01 = hn::BitCast(d64, hn::InterleaveUpper(d4, s0, s1));
  const auto rows23_keys23 = hn::BitCast(d64, hn::InterleaveUpper(d4, s2, s3));
  hn::StoreU(hn::BitCast(d4, hn::InterleaveLower(d64, rows01_keys01, rows01_keys23)), d4, out);
  hn::StoreU(hn::BitCast(d4, hn::InterleaveUpper(d64, rows01_keys01, rows01_keys23)), d4,
             out + stride);
  hn::StoreU(hn::BitCast(d4, hn::InterleaveLower(d64, rows23_keys01, rows23_keys23)), d4,
             out + 2 * stride);
  hn::StoreU(hn::BitCast(d4, hn::InterleaveUpper(d64, rows23_keys01, rows23_keys23)), d4,
             out + 3 * stride);
}

// Writes scale * sum(a[r][i]) to out[r * stride + i] for 4 rows x 4 keys of accumulators.
// With 16 lanes (AVX-512), one transpose-and-add tree: each row's 4 keys to 4 partial sums per
// 128-bit block (as Reduce4 does), then the blocks of the 4 rows against one another, ending in
// one vector with row r's 4 sums in block r: 30 shuffles and 15 adds, then one multiply and 4
// stores, where 4 Reduce4 and a 4 x 4 transpose took 40 shuffles, 20 adds and 4 multiplies.
template <class DF, class V = hn::Vec<DF>>
HWY_INLINE void StoreSums4x4(DF df, const V (&a)[4][4], float scale, float* out,
                             std::size_t stride) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (hn::MaxLanes(df) == 16) {
    const hn::Repartition<std::uint64_t, DF> d64;
    V rows[4];
    for (int r = 0; r < 4; ++r) {
      const V t0 = hn::Add(hn::InterleaveLower(df, a[r][0], a[r][1]),
                           hn::InterleaveUpper(df, a[r][0], a[r][1]));
      const V t1 = hn::Add(hn::InterleaveLower(df, a[r][2], a[r][3]),
                           hn::InterleaveUpper(df, a[r][2], a[r][3]));
      const auto t0q = hn::BitCast(d64, t0), t1q = hn::BitCast(d64, t1);
      rows[r] = hn::Add(hn::BitCast(df, hn::InterleaveLower(d64, t0q, t1q)),
                        hn::BitCast(df, hn::InterleaveUpper(d64, t0q, t1q)));
    }
    // Blocks (b0 + b2, b1 + b3) of rows 0, 1 and of rows 2, 3; then their two blocks of each row
    // added. (_mm512_shuffle_f32x4 would do the second step too, but GCC 12 warns on it.)
    V halves[2];
    for (int p = 0; p < 2; ++p) {
      halves[p] = hn::Add(hn::ConcatLowerLower(df, rows[2 * p + 1], rows[2 * p]),
                          hn::ConcatUpperUpper(df, rows[2 * p + 1], rows[2 * p]));
    }
    alignas(64) static constexpr std::int32_t kFirst[16] = {0,  1,  2,  3,  8,  9,  10, 11,
                                                            16, 17, 18, 19, 24, 25, 26, 27};
    alignas(64) static constexpr std::int32_t kSecond[16] = {4,  5,  6,  7,  12, 13, 14, 15,
                                                             20, 21, 22, 23, 28, 29, 30, 31};
    const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
    const V sums = hn::Mul(hn::Add(V{_mm512_permutex2var_ps(halves[0].raw, first, halves[1].raw)},
                                   V{_mm512_permutex2var_ps(halves[0].raw, second, halves[1].raw)}),
                           hn::Set(df, scale));
    const hn::Half<DF> dh;
    const hn::Half<decltype(dh)> dq;
    const auto rows01 = hn::LowerHalf(dh, sums), rows23 = hn::UpperHalf(dh, sums);
    hn::StoreU(hn::LowerHalf(dq, rows01), dq, out);
    hn::StoreU(hn::UpperHalf(dq, rows01), dq, out + stride);
    hn::StoreU(hn::LowerHalf(dq, rows23), dq, out + 2 * stride);
    hn::StoreU(hn::UpperHalf(dq, rows23), dq, out + 3 * stride);
    return;
  }
#endif
  StoreRowQuads(Reduce4(df, a[0][0], a[1][0], a[2][0], a[3][0]),
                Reduce4(df, a[0][1], a[1][1], a[2][1], a[3][1]),
                Reduce4(df, a[0][2], a[1][2], a[2][2], a[3][2]),
                Reduce4(df, a[0][3], a[1][3], a[2][3], a[3][3]), hn::Set(Float4Tag(), scale), out,
                stride);
}

// Scores of 4 query rows (qs floats apart) against the K rows k[0..3], for targets with 32
// registers: 16 FMA chains, each query vector loaded once for 4 FMAs and each K vector decoded
// once for 4; d must be a multiple of 4 vectors. Writes scale times row r's sum for key i to
// out[r * stride + i].
template <class Dec>
HWY_INLINE void ScoreBlock4x4(const float* HWY_RESTRICT q, std::size_t qs, std::size_t d,
                              const std::uint8_t* const* k, float scale, float* out,
                              std::size_t stride) {
  using DF = typename Dec::Tag;
  const DF df;
  const std::size_t n = hn::Lanes(df);
  hn::Vec<DF> a[4][4];
  for (auto& row : a) {
    for (auto& acc : row) acc = hn::Zero(df);
  }
  for (std::size_t v0 = 0; v0 < d / n; v0 += 4) {
    const auto step = [&](auto j) HWY_ATTR {
      constexpr std::size_t kJ = decltype(j)::value;
      hn::Vec<DF> x[4];
      for (int i = 0; i < 4; ++i) x[i] = RowVector<Dec, kJ>(df, k[i], v0, d);
      for (int r = 0; r < 4; ++r) {
        const auto qv = hn::Load(df, q + r * qs + (v0 + kJ) * n);
        for (int i = 0; i < 4; ++i) a[r][i] = hn::MulAdd(qv, x[i], a[r][i]);
      }
    };
    CallWithEach(step, std::make_index_sequence<4>());
  }
  StoreSums4x4(df, a, scale, out, stride);
}

// Scores of 8 query rows (qs floats apart) against one K row, for steps with 8 rows or more
// (GQA groups of 8, speculative q_len): each K vector is decoded once for 8 FMAs rather than 4,
// and the 8 query vectors come from L1 as the FMAs' memory operands. Measured in isolation on
// Zen 3 (fp8): 4.7 cycles per 8 FMAs against 5.5 for ScoreBlock4x2. Writes the 8 sums to
// out[j * stride].
template <class Dec>
HWY_INLINE void ScoreBlock8x1(const float* HWY_RESTRICT q, std::size_t qs, std::size_t d,
                              const std::uint8_t* k, float scale, float* out, std::size_t stride) {
  using DF = typename Dec::Tag;
  const DF df;
  const std::size_t n = hn::Lanes(df);
  auto a0 = hn::Zero(df), a1 = hn::Zero(df), a2 = hn::Zero(df), a3 = hn::Zero(df);
  auto a4 = hn::Zero(df), a5 = hn::Zero(df), a6 = hn::Zero(df), a7 = hn::Zero(df);
  for (std::size_t c = 0; c < d / (Dec::kVectors * n); ++c) {
    const auto w = Dec::Load(df, k, c, d);
    const auto u = Dec::Aux(df, k, c, d);
    const float* qc = q + c * Dec::kVectors * n;
    const auto step = [&](auto j) HWY_ATTR {
      const auto x = InRegister(Dec::template Get<decltype(j)::value>(df, w, u));
      const float* qj = qc + decltype(j)::value * n;
      a0 = hn::MulAdd(hn::Load(df, qj), x, a0);
      a1 = hn::MulAdd(hn::Load(df, qj + qs), x, a1);
      a2 = hn::MulAdd(hn::Load(df, qj + 2 * qs), x, a2);
      a3 = hn::MulAdd(hn::Load(df, qj + 3 * qs), x, a3);
      a4 = hn::MulAdd(hn::Load(df, qj + 4 * qs), x, a4);
      a5 = hn::MulAdd(hn::Load(df, qj + 5 * qs), x, a5);
      a6 = hn::MulAdd(hn::Load(df, qj + 6 * qs), x, a6);
      a7 = hn::MulAdd(hn::Load(df, qj + 7 * qs), x, a7);
    };
    ForEachVector<Dec>(step);
  }
  const Float4Tag d4;
  const auto scale4 = hn::Set(d4, scale);
  alignas(16) float s[8];
  hn::Store(hn::Mul(Reduce4(df, a0, a1, a2, a3), scale4), d4, s);
  hn::Store(hn::Mul(Reduce4(df, a4, a5, a6, a7), scale4), d4, s + 4);
  for (int j = 0; j < 8; ++j) out[j * stride] = s[j];
}

// One query row against 2 K rows (rows left over from blocks of 4).
template <class Dec>
HWY_INLINE void ScoreBlock1x2(const float* HWY_RESTRICT q, std::size_t d, const std::uint8_t* k0,
                              const std::uint8_t* k1, float* sum0, float* sum1) {
  using DF = typename Dec::Tag;
  const DF df;
  const std::size_t n = hn::Lanes(df);
  auto a0 = hn::Zero(df), a1 = hn::Zero(df);
  for (std::size_t c = 0; c < d / (Dec::kVectors * n); ++c) {
    const auto w0 = Dec::Load(df, k0, c, d), w1 = Dec::Load(df, k1, c, d);
    const auto u0 = Dec::Aux(df, k0, c, d), u1 = Dec::Aux(df, k1, c, d);
    const float* qc = q + c * Dec::kVectors * n;
    const auto step = [&](auto j) HWY_ATTR {
      const auto qv = hn::Load(df, qc + decltype(j)::value * n);
      a0 = hn::MulAdd(qv, Dec::template Get<decltype(j)::value>(df, w0, u0), a0);
      a1 = hn::MulAdd(qv, Dec::template Get<decltype(j)::value>(df, w1, u1), a1);
    };
    ForEachVector<Dec>(step);
  }
  alignas(16) float s[4];
  hn::Store(Reduce4(df, a0, a1, a0, a0), Float4Tag(), s);
  *sum0 = s[0];
  *sum1 = s[1];
}

// --- P . V ---------------------------------------------------------------------------------------

// acc + *p * x with *p broadcast to every lane. On AVX-512 the broadcast is the FMA's own memory
// operand ({1to16}), done by the load unit: a separate vbroadcastss zmm costs Zen 4 a slot on the
// vector pipes its decoders' shuffles use (bench/micro/vector_op_costs, ValueBlock4x4's step of
// one fp8 decode of 64 channels and 16 FMAs: 5.5 ns with 4 broadcasts, 4.7 with 16 embedded
// ones, 4.4 for the FMAs alone). GCC keeps a broadcast that several FMAs use in a register, so
// the instruction is written out. kernel_rates on Zen 4, Q bf16, 7 interleaved rounds, medians:
// steps of 8 rows (g 8, q_len 1) fp8 57 -> 49 ns per token-head, fp4 48 -> 43, bf16 unchanged;
// g 4 at q_len 4 fp8 103 -> 96, fp4 90 -> 83; g 4 at q_len 1 within the noise or faster.
template <class DF, class V = hn::Vec<DF>>
HWY_INLINE V MulAddBroadcast(DF df, const float* p, V x, V acc) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (hn::MaxLanes(df) == 16) {
    asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc.raw) : "v"(x.raw), "m"(*p));
    return acc;
  }
#endif
  return hn::MulAdd(hn::Set(df, *p), x, acc);
}

// Vectors kJ and kJ + 1 of V row `row` for the value blocks: the two halves of one chunk, or,
// for one-vector chunks, chunks c and c + 1.
template <class Dec, std::size_t kJ, class DF>
HWY_INLINE void ValuePair(DF df, const std::uint8_t* row, std::size_t c, std::size_t d,
                          hn::Vec<DF>& x0, hn::Vec<DF>& x1) {
  if constexpr (Dec::kVectors == 1) {
    x0 = Dec::template Get<0>(df, Dec::Load(df, row, c, d), Dec::Aux(df, row, c, d));
    x1 = Dec::template Get<0>(df, Dec::Load(df, row, c + 1, d), Dec::Aux(df, row, c + 1, d));
  } else {
    const auto w = Dec::Load(df, row, c, d);
    const auto u = Dec::Aux(df, row, c, d);
    x0 = Dec::template Get<kJ>(df, w, u);
    x1 = Dec::template Get<kJ + 1>(df, w, u);
  }
}

// acc[4 rows, `as` floats apart][vectors v, v + 1] = alpha * acc + sum_t p[row][t] * v_t over the
// count V rows at
// bases[t] + offset, decoded in registers: 8 FMA chains, each V vector decoded once for the 4
// rows. (c, kJ) locate vector v: chunk c, vector kJ within it (chunks c, c + 1 for one-vector
// chunks).
template <class Dec, std::size_t kJ>
HWY_INLINE void ValueBlock4x2(const float* HWY_RESTRICT p, std::size_t p_stride,
                              const std::uint8_t* const* bases, std::int64_t offset, int count,
                              std::size_t d, float* HWY_RESTRICT acc, std::size_t as,
                              const float* alpha, std::size_t v, std::size_t c) {
  using DF = typename Dec::Tag;
  const DF df;
  const std::size_t n = hn::Lanes(df);
  float* a0p = acc + v * n;
  float* a1p = a0p + as;
  float* a2p = a0p + 2 * as;
  float* a3p = a0p + 3 * as;
  auto a00 = hn::Load(df, a0p), a01 = hn::Load(df, a0p + n);
  auto a10 = hn::Load(df, a1p), a11 = hn::Load(df, a1p + n);
  auto a20 = hn::Load(df, a2p), a21 = hn::Load(df, a2p + n);
  auto a30 = hn::Load(df, a3p), a31 = hn::Load(df, a3p + n);
  if (alpha != nullptr) {
    const auto s0 = hn::Set(df, alpha[0]), s1 = hn::Set(df, alpha[1]);
    const auto s2 = hn::Set(df, alpha[2]), s3 = hn::Set(df, alpha[3]);
    a00 = hn::Mul(a00, s0), a01 = hn::Mul(a01, s0), a10 = hn::Mul(a10, s1), a11 = hn::Mul(a11, s1);
    a20 = hn::Mul(a20, s2), a21 = hn::Mul(a21, s2), a30 = hn::Mul(a30, s3), a31 = hn::Mul(a31, s3);
  }
  for (int t = 0; t < count; ++t) {
    hn::Vec<DF> x0, x1;
    ValuePair<Dec, kJ>(df, bases[t] + offset, c, d, x0, x1);
    x0 = InRegister(x0);
    x1 = InRegister(x1);
    const auto p0 = hn::Set(df, p[t]);
    a00 = hn::MulAdd(p0, x0, a00);
    a01 = hn::MulAdd(p0, x1, a01);
    const auto p1 = hn::Set(df, p[p_stride + t]);
    a10 = hn::MulAdd(p1, x0, a10);
    a11 = hn::MulAdd(p1, x1, a11);
    const auto p2 = hn::Set(df, p[2 * p_stride + t]);
    a20 = hn::MulAdd(p2, x0, a20);
    a21 = hn::MulAdd(p2, x1, a21);
    const auto p3 = hn::Set(df, p[3 * p_stride + t]);
    a30 = hn::MulAdd(p3, x0, a30);
    a31 = hn::MulAdd(p3, x1, a31);
  }
  hn::Store(a00, df, a0p), hn::Store(a01, df, a0p + n);
  hn::Store(a10, df, a1p), hn::Store(a11, df, a1p + n);
  hn::Store(a20, df, a2p), hn::Store(a21, df, a2p + n);
  hn::Store(a30, df, a3p), hn::Store(a31, df, a3p + n);
}

// The accumulators of a value block: rows r, vectors v0 .. v0 + kVectors - 1 of acc (rows `as`
// floats apart), times alpha[r] unless alpha is null; and back.
template <int kRows, int kVectors, class DF>
HWY_INLINE void LoadAccumulators(DF df, const float* HWY_RESTRICT acc, std::size_t as,
                                 std::size_t v0, const float* alpha,
                                 hn::Vec<DF> (&a)[kRows][kVectors]) {
  const std::size_t n = hn::Lanes(df);
  for (int r = 0; r < kRows; ++r) {
    const auto s = hn::Set(df, alpha != nullptr ? alpha[r] : 1.0f);
    for (int i = 0; i < kVectors; ++i) {
      a[r][i] = hn::Load(df, acc + r * as + (v0 + i) * n);
      if (alpha != nullptr) a[r][i] = hn::Mul(a[r][i], s);
    }
  }
}
template <int kRows, int kVectors, class DF>
HWY_INLINE void StoreAccumulators(DF df, const hn::Vec<DF> (&a)[kRows][kVectors],
                                  float* HWY_RESTRICT acc, std::size_t as, std::size_t v0) {
  const std::size_t n = hn::Lanes(df);
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kVectors; ++i) hn::Store(a[r][i], df, acc + r * as + (v0 + i) * n);
  }
}

// As ValueBlock4x2 for the 4 vectors v0 .. v0 + 3 (v0 a multiple of 4), on targets with 32
// registers: 16 FMA chains, each probability broadcast serving 4 FMAs.
template <class Dec>
HWY_INLINE void ValueBlock4x4(const float* HWY_RESTRICT p, std::size_t p_stride,
                              const std::uint8_t* const* bases, std::int64_t offset, int count,
                              std::size_t d, float* HWY_RESTRICT acc, std::size_t as,
                              const float* alpha, std::size_t v0) {
  using DF = typename Dec::Tag;
  const DF df;
  hn::Vec<DF> a[4][4];
  LoadAccumulators(df, acc, as, v0, alpha, a);
  for (int t = 0; t < count; ++t) {
    const std::uint8_t* row = bases[t] + offset;
    hn::Vec<DF> x[4];
    const auto decode = [&](auto j) HWY_ATTR {
      x[decltype(j)::value] = RowVector<Dec, decltype(j)::value>(df, row, v0, d);
    };
    CallWithEach(decode, std::make_index_sequence<4>());
    for (int r = 0; r < 4; ++r) {
      for (int i = 0; i < 4; ++i)
        a[r][i] = MulAddBroadcast(df, &p[r * p_stride + t], x[i], a[r][i]);
    }
  }
  StoreAccumulators(df, a, acc, as, v0);
}

// As ValueBlock4x2 for 8 rows, on targets with 32 registers: 16 FMA chains, each V vector
// decoded once for 8 rows instead of 4 (steps of 8 rows or more: GQA groups of 8, speculative
// q_len), so the decode costs half as much per FMA as in ValueBlock4x4, for one more broadcast per
// 2 FMAs.
template <class Dec, std::size_t kJ>
HWY_INLINE void ValueBlock8x2(const float* HWY_RESTRICT p, std::size_t p_stride,
                              const std::uint8_t* const* bases, std::int64_t offset, int count,
                              std::size_t d, float* HWY_RESTRICT acc, std::size_t as,
                              const float* alpha, std::size_t v, std::size_t c) {
  using DF = typename Dec::Tag;
  const DF df;
  hn::Vec<DF> a[8][2];
  LoadAccumulators(df, acc, as, v, alpha, a);
  for (int t = 0; t < count; ++t) {
    hn::Vec<DF> x0, x1;
    ValuePair<Dec, kJ>(df, bases[t] + offset, c, d, x0, x1);
    x0 = InRegister(x0);
    x1 = InRegister(x1);
    for (int r = 0; r < 8; ++r) {
      a[r][0] = MulAddBroadcast(df, &p[r * p_stride + t], x0, a[r][0]);
      a[r][1] = MulAddBroadcast(df, &p[r * p_stride + t], x1, a[r][1]);
    }
  }
  StoreAccumulators(df, a, acc, as, v);
}

// One row's share (rows left over from blocks of 4).
template <class Dec, std::size_t kJ>
HWY_INLINE void ValueBlock1x2(const float* HWY_RESTRICT p, const std::uint8_t* const* bases,
                              std::int64_t offset, int count, std::size_t d,
                              float* HWY_RESTRICT acc, const float* alpha, std::size_t v,
                              std::size_t c) {
  using DF = typename Dec::Tag;
  const DF df;
  const std::size_t n = hn::Lanes(df);
  auto a0 = hn::Load(df, acc + v * n), a1 = hn::Load(df, acc + (v + 1) * n);
  if (alpha != nullptr) {
    a0 = hn::Mul(a0, hn::Set(df, alpha[0]));
    a1 = hn::Mul(a1, hn::Set(df, alpha[0]));
  }
  for (int t = 0; t < count; ++t) {
    hn::Vec<DF> x0, x1;
    ValuePair<Dec, kJ>(df, bases[t] + offset, c, d, x0, x1);
    const auto pt = hn::Set(df, p[t]);
    a0 = hn::MulAdd(pt, x0, a0);
    a1 = hn::MulAdd(pt, x1, a1);
  }
  hn::Store(a0, df, acc + v * n);
  hn::Store(a1, df, acc + (v + 1) * n);
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_KERNEL_BLOCKS_INL_H_

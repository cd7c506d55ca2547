// Scores in the emulator's exact order, for P modes that round P (bf16, fp8): there a score one
// ulp away from the emulator's could round p to a different code, so the dot products repeat the
// emulator's summation exactly (attention_kernel.cc). Per-target header, see kv_decode-inl.h.

#if defined(MJOLNIR_CPU_EXACT_SCORES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_EXACT_SCORES_INL_H_
#undef MJOLNIR_CPU_EXACT_SCORES_INL_H_
#else
#define MJOLNIR_CPU_EXACT_SCORES_INL_H_
#endif

#include <algorithm>
#include <cstddef>

#include "cpu/item_context.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// The product as its own rounded value: an empty asm the compiler cannot see through, so GCC
// (which contracts C++ expressions into FMAs by default where the target has them) cannot fuse
// it with the following add.
template <class V>
HWY_INLINE V RoundedProduct(V a, V b) {
  V product = hn::Mul(a, b);
#if HWY_ARCH_X86
  asm("" : "+x"(product.raw));
#elif HWY_ARCH_ARM_A64 && (HWY_TARGET == HWY_NEON)
  asm("" : "+w"(product.raw));
#elif HWY_ARCH_ARM_A64
  asm("" : "+w"(product));
#endif
  return product;
}

template <bool kFused, class V>
HWY_INLINE V AccumulateProduct(V sum, V a, V b) {
  if constexpr (kFused) {
    return hn::MulAdd(a, b, sum);
  } else {
    return hn::Add(sum, RoundedProduct(a, b));
  }
}

// Exact path: the emulator's dot product, dot = ((0 + q0 k0) + q1 k1) + ..., in channel order and
// fused or not as the emulator's build does it, for every row at once: lanes are query rows
// (qt [D][rows_padded], the transpose of Q), four keys at a time for four independent add
// chains. Keys are true decoded values in natural channel order.
template <bool kFused, class DE>
void ScoresExactT(DE de, const ItemContext& it, const float* HWY_RESTRICT qt,
                  std::size_t rows_padded, const float* HWY_RESTRICT keys, int count, float scale,
                  float* HWY_RESTRICT scores, std::size_t stride, int first) {
  const std::size_t ne = hn::Lanes(de);
  const int d = it.d;
  alignas(64) float lanes[4][16];
  for (std::size_t rv = 0; rv < rows_padded; rv += ne) {
    for (int t = 0; t < count; t += 4) {
      const float* k0 = keys + std::size_t(t) * d;
      const float* k1 = keys + std::size_t(std::min(t + 1, count - 1)) * d;
      const float* k2 = keys + std::size_t(std::min(t + 2, count - 1)) * d;
      const float* k3 = keys + std::size_t(std::min(t + 3, count - 1)) * d;
      auto a0 = hn::Zero(de), a1 = hn::Zero(de), a2 = hn::Zero(de), a3 = hn::Zero(de);
      for (int c = 0; c < d; ++c) {
        const auto qv = hn::Load(de, qt + std::size_t(c) * rows_padded + rv);
        a0 = AccumulateProduct<kFused>(a0, qv, hn::Set(de, k0[c]));
        a1 = AccumulateProduct<kFused>(a1, qv, hn::Set(de, k1[c]));
        a2 = AccumulateProduct<kFused>(a2, qv, hn::Set(de, k2[c]));
        a3 = AccumulateProduct<kFused>(a3, qv, hn::Set(de, k3[c]));
      }
      const auto sv = hn::Set(de, scale);
      hn::Store(hn::Mul(a0, sv), de, lanes[0]);
      hn::Store(hn::Mul(a1, sv), de, lanes[1]);
      hn::Store(hn::Mul(a2, sv), de, lanes[2]);
      hn::Store(hn::Mul(a3, sv), de, lanes[3]);
      for (int j = 0; j < 4 && t + j < count; ++j) {
        for (std::size_t lane = 0; lane < ne && rv + lane < std::size_t(it.rows); ++lane) {
          scores[(rv + lane) * stride + first + t + j] = lanes[j][lane];
        }
      }
    }
  }
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_EXACT_SCORES_INL_H_

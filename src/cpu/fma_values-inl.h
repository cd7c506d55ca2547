// P . V on fp32 FMAs over V decoded in registers (kernel_blocks-inl.h), for every format and P
// mode where the AMX tiles do not take it (amx_values-inl.h). Per-target header, see
// kv_decode-inl.h.

#if defined(MJOLNIR_CPU_FMA_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_FMA_VALUES_INL_H_
#undef MJOLNIR_CPU_FMA_VALUES_INL_H_
#else
#define MJOLNIR_CPU_FMA_VALUES_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu/item_context.h"
#include "cpu/kernel_blocks-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/tile_prefetcher.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// The rows of the next tile are prefetched along the way, prefetch_rows per pass over the tokens.
// acc [R][ld] (decoder channel order) = alpha * acc + P [R][0, count) . the count V rows at
// bases[t] + offset; alpha null: no rescale.
template <class Dec>
void AccumulateValues(const ItemContext& it, const float* HWY_RESTRICT probs, std::size_t stride,
                      const std::uint8_t* const* bases, std::int64_t offset, int count,
                      float* HWY_RESTRICT acc, const float* alpha, TilePrefetcher& prefetch,
                      int prefetch_rows) {
  const std::size_t d = std::size_t(it.d);
  const std::size_t vectors = d / hn::Lanes(typename Dec::Tag());
  // Vector pairs (v, v + 1): within one chunk (kJ = v mod kVectors) or two one-vector chunks.
  const auto each_pair = [&](auto&& block) {
    for (std::size_t v = 0; v < vectors; v += 2) {
      prefetch.Issue(prefetch_rows);
      const std::size_t c = v / Dec::kVectors;
      if constexpr (Dec::kVectors == 4) {
        if (v % 4 == 2) {
          block(v, c, std::integral_constant<std::size_t, 2>());
          continue;
        }
      }
      block(v, c, std::integral_constant<std::size_t, 0>());
    }
  };
  int r = 0;
  if constexpr (kWideRegisterFile) {
    for (; r + 8 <= it.rows; r += 8) {
      const float* p = probs + std::size_t(r) * stride;
      float* a = acc + r * it.ld;
      const float* al = alpha != nullptr ? alpha + r : nullptr;
      each_pair([&](std::size_t v, std::size_t c, auto j) HWY_ATTR {
        prefetch.Issue(prefetch_rows);  // 8 rows do the work of two passes of 4
        ValueBlock8x2<Dec, decltype(j)::value>(p, stride, bases, offset, count, d, a, it.ld, al, v,
                                               c);
      });
    }
  }
  for (; r + 4 <= it.rows; r += 4) {
    const float* p = probs + std::size_t(r) * stride;
    float* a = acc + r * it.ld;
    const float* al = alpha != nullptr ? alpha + r : nullptr;
    if constexpr (kWideRegisterFile) {
      if (vectors % 4 == 0) {
        for (std::size_t v = 0; v < vectors; v += 4) {
          prefetch.Issue(2 * prefetch_rows);  // a pass of 4 vectors does the work of 2 pairs
          ValueBlock4x4<Dec>(p, stride, bases, offset, count, d, a, it.ld, al, v);
        }
        continue;
      }
    }
    each_pair([&](std::size_t v, std::size_t c, auto j) HWY_ATTR {
      ValueBlock4x2<Dec, decltype(j)::value>(p, stride, bases, offset, count, d, a, it.ld, al, v,
                                             c);
    });
  }
  for (; r < it.rows; ++r) {
    const float* p = probs + std::size_t(r) * stride;
    float* a = acc + r * it.ld;
    const float* al = alpha != nullptr ? alpha + r : nullptr;
    each_pair([&](std::size_t v, std::size_t c, auto j) HWY_ATTR {
      ValueBlock1x2<Dec, decltype(j)::value>(p, bases, offset, count, d, a, al, v, c);
    });
  }
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_FMA_VALUES_INL_H_

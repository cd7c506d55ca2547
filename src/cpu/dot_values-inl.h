// P . V on AVX-512 BF16 dot products for the CPU kernel (attention_kernel.cc), with P rounded to
// bf16 (P mode bf16) where the AMX tiles do not take it: below kAmxMinRows query rows (a decode
// step's g x q_len, 4 for most GQA models) or on CPUs without AMX (Zen 4 and 5). On the fp32 FMAs
// P . V costs one multiply-add per query row, channel and key; vdpbf16ps does two (two keys), so
// the same 4-row x 64-channel block takes 16 instructions a key pair instead of 32.
//
// vdpbf16ps multiplies word pairs: lane i of the accumulator adds a[2i] b[2i] + a[2i+1] b[2i+1].
// Here a pair is two keys: V's words of keys t and t + 1 for one channel (the dot decoders of
// word_decoders-inl.h give a chunk's words, vpunpcklwd / vpunpckhwd interleave two keys' words
// within 128-bit blocks, as the AMX tiles' B rows are built: amx_values-inl.h), and P's words of
// the same keys for one query row, broadcast to every lane. The accumulator therefore holds the
// channels in the AMX value tiles' order (AmxValueChannel), and the kernel writes O through it
// as it does for the tiles; a row's accumulator is [ld] floats in memory between tiles, four
// vectors of 16 channels in registers within one.
//
// Numerics are the tiles': V's words are true values (exact in bf16 for every format but fp16;
// nvfp4's codes times their block scales), P's are the rounded P (a bf16 value: taking the float's
// high half is exact), each product is exact in fp32 and the sums are fp32 in this order. An odd
// last key pairs with zero words. Only the AVX3_DL target compiles it. Per-target header, see
// kv_decode-inl.h.

#if defined(MJOLNIR_CPU_DOT_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_DOT_VALUES_INL_H_
#undef MJOLNIR_CPU_DOT_VALUES_INL_H_
#else
#define MJOLNIR_CPU_DOT_VALUES_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu/amx_values-inl.h"
#include "cpu/bf16_dot-inl.h"
#include "cpu/tile_prefetcher.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if MJOLNIR_AMX  // the AVX3_DL target: the word decoders and the value tiles' channel order

// The amx-tile attributes only so that ValuePairs inlines: nothing here uses the tiles.
HWY_PUSH_ATTRIBUTES("amx-tile,amx-bf16,avx512bf16")

// kRows rows' accumulators of chunk c (acc + r * ld, groups 4c .. 4c + 3) = alpha * acc + P . V
// over the count keys; row r's P pairs are the dwords of p_words + r * 32 in each 32-key block
// of block_words words.
template <class Dot, int kRows>
HWY_INLINE void ValueDotBlock(const typename Dot::State& state, const std::uint16_t* p_words,
                              std::size_t block_words, const std::uint8_t* const* bases,
                              std::int64_t offset, int count, std::size_t c, std::size_t d,
                              float* HWY_RESTRICT acc, std::size_t ld, const float* alpha) {
  const WideFloatTag df;
  hn::Vec<WideFloatTag> a[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    float* row = acc + std::size_t(r) * ld + 4 * c * kAmxChannels;
    const auto scale = hn::Set(df, alpha[r]);
    for (int q = 0; q < 4; ++q) a[r][q] = hn::Mul(hn::Load(df, row + q * kAmxChannels), scale);
  }
  for (int t = 0; t < count; t += 2) {
    Words v[4];
    ValuePairs<Dot>(state, bases, offset, t, count, c, d, v);
    const auto* pairs = reinterpret_cast<const std::int32_t*>(
        p_words + std::size_t(t / kAmxKeys) * block_words + (t % kAmxKeys));
    for (int r = 0; r < kRows; ++r) {
      const Words p{_mm512_set1_epi32(pairs[r * kAmxRowWords / 2])};
      for (int q = 0; q < 4; ++q) a[r][q] = DotPairs(a[r][q], v[q], p);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float* row = acc + std::size_t(r) * ld + 4 * c * kAmxChannels;
    for (int q = 0; q < 4; ++q) hn::Store(a[r][q], df, row + q * kAmxChannels);
  }
}

// acc [rows][ld] (AmxValueChannel order) = alpha * acc + P [rows][0, count) . the count V rows at
// bases[t] + offset; p_words: AmxProbWords(count, rows) words of scratch, 64-byte aligned.
// prefetch_per_pass rows are prefetched per pass over the keys (a chunk of 64 channels for up to 4
// rows).
template <class Dot>
HWY_NOINLINE void ValuesDot(const float* HWY_RESTRICT probs, std::size_t stride, int rows,
                            const std::uint8_t* const* bases, std::int64_t offset, int count,
                            std::size_t d, float* HWY_RESTRICT acc, std::size_t ld,
                            const float* HWY_RESTRICT alpha, std::uint16_t* HWY_RESTRICT p_words,
                            TilePrefetcher& prefetch, int prefetch_per_pass) {
  PrepareProbWords(probs, stride, rows, rows, count, p_words);
  const std::size_t block_words = std::size_t(rows) * kAmxRowWords;
  const auto state = Dot::MakeState();
  for (std::size_t c = 0; c < d / kDotChunk; ++c) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      prefetch.Issue(prefetch_per_pass);
      ValueDotBlock<Dot, 4>(state, p_words + r * kAmxRowWords, block_words, bases, offset, count, c,
                            d, acc + std::size_t(r) * ld, ld, alpha + r);
    }
    for (; r < rows; ++r) {
      prefetch.Issue(prefetch_per_pass);
      ValueDotBlock<Dot, 1>(state, p_words + r * kAmxRowWords, block_words, bases, offset, count, c,
                            d, acc + std::size_t(r) * ld, ld, alpha + r);
    }
  }
}

HWY_POP_ATTRIBUTES

#endif  // MJOLNIR_AMX

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_DOT_VALUES_INL_H_

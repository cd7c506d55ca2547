// P . V on AMX tiles for the CPU kernel (attention_kernel.cc), with P rounded to bf16 (P mode
// bf16) on Intel cores with AMX-BF16. On the fp32 FMAs, P . V costs D / 16 FMAs per query row and
// key: at the 128 rows of a prefill query tile (32 tokens x g 4) that is 1024 FMAs a key, most of a
// prefill step's time. One TDPBF16PS does 16 rows x 16 channels x 32 keys, 8192 multiply-adds, in
// about 16 cycles.
//
// The tiles compute O += P V: A is 16 query rows x 32 keys of bf16 P (the softmax's P, which P
// mode bf16 rounds to bf16 values: converting them to words is exact), B is 32 keys x 16
// channels of V in the pair-interleaved layout TDPBF16PS takes (row p holds keys 2p and 2p + 1
// of 16 channels, interleaved), C is 16 rows x 16 channels of the fp32 accumulator, which stays
// in memory ([rows][ld], rows padded to 16) and is loaded as tiles once per KV tile for 4
// channel groups at a time (C tiles 0-3, A 4, B 5-7). A unit of fewer than 16 rows whose Q . K
// is not on the tiles (a decode step's 4) configures A and C with just its rows (AmxValueRows)
// instead of padding them to 16.
//
// V goes through the dot decoders of word_decoders-inl.h (true values as bf16 words, exact for
// every format but fp16; nvfp4's codes times their block scales, exact in bf16 as for K), two
// keys at a time: unpacking the words of keys 2p and 2p + 1 (vpunpcklwd / vpunpckhwd, within
// 128-bit blocks) gives B's row p of four channel groups. The accumulator's channel order is
// therefore the decoder's, regrouped by the unpacks (AmxValueChannel); the kernel writes O
// through it.
//
// Numerics: bf16 P times bf16-exact V is exact in fp32, the sums fp32 in the tile's order. The
// P codes are rounded from the kernel's own scores (AMX or dot products, fp32 in another order
// than the emulator's), so a P code sitting on a bf16 rounding boundary can round to its
// neighbour: the contract's allowance for P rounded from a backend's own scores
// (docs/numerics.md). Only the AVX3_DL target compiles it. Per-target header, see
// kv_decode-inl.h.

#if defined(MJOLNIR_CPU_AMX_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_AMX_VALUES_INL_H_
#undef MJOLNIR_CPU_AMX_VALUES_INL_H_
#else
#define MJOLNIR_CPU_AMX_VALUES_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu/amx_scores-inl.h"
#include "cpu/bf16_dot-inl.h"
#include "cpu/exp2-inl.h"
#include "cpu/item_context.h"
#include "cpu/online_softmax-inl.h"
#include "cpu/tile_prefetcher.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if MJOLNIR_AMX

inline constexpr int kAmxChannels = 16;          // channels per C tile (a channel group)
inline constexpr int kAmxValueBatch = 4;         // channel groups whose C tiles are held at once
inline constexpr std::size_t kAmxRowWords = 32;  // keys per A row: bf16 P words

// Query rows padded to whole A tiles.
inline int AmxPaddedRows(int rows) { return (rows + kAmxRows - 1) / kAmxRows * kAmxRows; }

// The rows of P . V's A and C tiles for a unit of `rows` query rows: all of them in one tile
// below 16 where Q . K is not on the tiles (a decode step's 4 rows cost a quarter of a padded
// tile), else whole tiles of 16 (the layout of SoftmaxColumns' A rows).
inline int AmxValueRows(int rows, bool amx_scores) {
  return amx_scores || rows >= kAmxRows ? AmxPaddedRows(rows) : rows;
}

// Words of a KV tile's V B-tiles (tile_tokens rounded up to 32 keys, d channels) and of its P
// A-rows (padded rows x 32 words per 32 keys).
inline std::size_t AmxValueWords(int tile_tokens, std::size_t d) {
  return std::size_t((tile_tokens + kAmxKeys - 1) / kAmxKeys) * kAmxKeys * d;
}
inline std::size_t AmxProbWords(int tile_tokens, int value_rows) {
  return std::size_t((tile_tokens + kAmxKeys - 1) / kAmxKeys) * value_rows * kAmxRowWords;
}

// The natural channel of accumulator column i (channel group i / 16, column i % 16). Group
// 4 c + q comes from chunk c's vector q / 2, its low (q even) or high words of each 128-bit
// block: column n is word 8 (n / 4) + n % 4 of the block's pair (+ 4 for the high words).
template <class Dot>
constexpr std::size_t AmxValueChannel(std::size_t i) {
  const std::size_t group = i / kAmxChannels, n = i % kAmxChannels;
  const std::size_t chunk = group / 4, q = group % 4;
  const std::size_t word = 8 * (n / 4) + n % 4 + (q % 2 == 1 ? 4 : 0);
  return chunk * kDotChunk + Dot::Channel(q / 2, word);
}

HWY_PUSH_ATTRIBUTES("amx-tile,amx-bf16,avx512bf16")

// V's words of keys t < count and t + 1 (zero where past count) for chunk c, as four vectors of 16
// channel pairs: B's rows of channel groups 4c .. 4c + 3 (AmxValueChannel), and the dot products'
// operands (dot_values-inl.h).
template <class Dot>
HWY_INLINE void ValuePairs(const typename Dot::State& state, const std::uint8_t* const* bases,
                           std::int64_t offset, int t, int count, std::size_t c, std::size_t d,
                           Words pairs[4]) {
  const WordTag dw;
  Words a0, a1, b0 = hn::Zero(dw), b1 = hn::Zero(dw);
  DecodeTrueWords<Dot>(state, bases[t] + offset, c, d, a0, a1);
  if (t + 1 < count) DecodeTrueWords<Dot>(state, bases[t + 1] + offset, c, d, b0, b1);
  pairs[0].raw = _mm512_unpacklo_epi16(a0.raw, b0.raw);
  pairs[1].raw = _mm512_unpackhi_epi16(a0.raw, b0.raw);
  pairs[2].raw = _mm512_unpacklo_epi16(a1.raw, b1.raw);
  pairs[3].raw = _mm512_unpackhi_epi16(a1.raw, b1.raw);
}

// B tiles of the count V rows at bases[t] + offset: for each 32-key block b and channel group G,
// tile (b, G) at v_tiles + (b * groups + G) * 512 words, row p = keys 2p and 2p + 1 of the block,
// interleaved over the group's 16 channels. Keys past count are zero.
template <class Dot>
HWY_INLINE void PrepareValueTiles(const std::uint8_t* const* bases, std::int64_t offset, int count,
                                  std::size_t d, std::uint16_t* HWY_RESTRICT v_tiles,
                                  TilePrefetcher& prefetch, int prefetch_per_key) {
  const WordTag dw;
  const auto state = Dot::MakeState();
  const std::size_t groups = d / kAmxChannels;
  const int blocks = (count + kAmxKeys - 1) / kAmxKeys;
  for (int pair = 0; pair < blocks * kAmxKeys / 2; ++pair) {
    const int block = pair / 16, p = pair % 16;
    const int t = 2 * pair;
    prefetch.Issue(2 * prefetch_per_key);
    for (std::size_t c = 0; c < d / kDotChunk; ++c) {
      Words v[4] = {hn::Zero(dw), hn::Zero(dw), hn::Zero(dw), hn::Zero(dw)};
      if (t < count) ValuePairs<Dot>(state, bases, offset, t, count, c, d, v);
      std::uint16_t* tiles = v_tiles + (std::size_t(block) * groups + 4 * c) * 512 + 32 * p;
      for (int q = 0; q < 4; ++q) hn::Store(v[q], dw, tiles + q * 512);
    }
  }
}

// A rows of P: for each 32-key block b, row r (of `padded`, at least rows) at p_words + (b *
// padded + r) * 32: the bf16 words of probs[r][32 b .. 32 b + 32), zero past count and for rows
// past `rows`. probs holds bf16 values (P mode bf16, no power of two folded in), so taking their
// high halves is exact.
HWY_INLINE void PrepareProbWords(const float* HWY_RESTRICT probs, std::size_t stride, int rows,
                                 int padded, int count, std::uint16_t* HWY_RESTRICT p_words) {
  const int blocks = (count + kAmxKeys - 1) / kAmxKeys;
  for (int b = 0; b < blocks; ++b) {
    const int keys = std::min(kAmxKeys, count - b * kAmxKeys);
    const auto mask = static_cast<__mmask32>(keys >= 32 ? 0xFFFFFFFFu : (1u << keys) - 1);
    for (int r = 0; r < padded; ++r) {
      std::uint16_t* dst = p_words + (std::size_t(b) * padded + r) * kAmxRowWords;
      if (r >= rows) {
        _mm512_storeu_si512(dst, _mm512_setzero_si512());
        continue;
      }
      const float* src = probs + std::size_t(r) * stride + b * kAmxKeys;
      const __m256i lo = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_loadu_si512(src), 16));
      const __m256i hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_loadu_si512(src + 16), 16));
      const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_storeu_si512(dst, _mm512_maskz_mov_epi16(mask, words));
    }
  }
}

// 2^x for x <= 0 (finite), within 2 ulp: Exp2Fast's polynomial, with the power of two put in by
// vscalefps (which also takes very negative x to 0) instead of integer field arithmetic.
HWY_INLINE __m512 Exp2Scalef(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.546144469856913e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3400428177615838e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618056678524637e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550327226670302e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650922288757e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472067028326e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax of one tile in the tiles' layout (ScoresAmx<Dot, true>): scores [keys][stride]
// holds raw sums for the count keys (rounded up to 32) and every query row, so each vector is one
// key's 16 rows and the row maxima and sums are lane-wise, with no reduction across lanes. For
// each group of 16 rows: the rows' maxima over the keys they may see (live: LiveTokens), m, alpha
// and l as SoftmaxTile updates them, p = 2^(scale s - m) with the polynomial (P is rounded from
// the kernel's own scores: docs/numerics.md), l summing the fp32 p, and P rounded to bf16 (RNE)
// into the A tiles of ValuesAmx: p_words + (b * padded + r) * 32 holds row r's words of keys
// [32 b, 32 b + 32), zero where masked and past count. Rows past it.rows (the A tiles' padding)
// are left unmasked: their P only reaches accumulator rows nobody reads.
inline void SoftmaxColumns(const ItemContext& it, const float* HWY_RESTRICT scores,
                           std::size_t stride, int first, int count, float scale,
                           const RowState& state, std::uint16_t* HWY_RESTRICT p_words) {
  const WideFloatTag df;
  const int padded = AmxPaddedRows(it.rows);
  const int blocks = (count + kAmxKeys - 1) / kAmxKeys;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  // Word w of the pair vector: row w / 2's word of the even key (w even) or the odd one.
  alignas(64) static constexpr std::uint16_t kPairWords[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pair_words = _mm512_load_si512(kPairWords);
  for (int r0 = 0; r0 < padded; r0 += kAmxRows) {
    const int group_rows = std::min(kAmxRows, it.rows - r0);
    alignas(64) std::int32_t live_rows[16];
    alignas(64) float m_rows[16], l_rows[16];
    bool masked = false;  // some row of the group may not see some key of the tile (causal)
    for (int j = 0; j < 16; ++j) {
      live_rows[j] = j < group_rows ? LiveTokens(it, r0 + j, first, count) : count;
      masked |= live_rows[j] < count;
      m_rows[j] = j < group_rows ? state.m[r0 + j] : -std::numeric_limits<float>::infinity();
      l_rows[j] = j < group_rows ? state.l[r0 + j] : 0.0f;
    }
    const __m512i live = _mm512_load_si512(live_rows);
    // Lanes of the rows that see key k.
    const auto visible = [&](int k) { return _mm512_cmpgt_epi32_mask(live, _mm512_set1_epi32(k)); };
    const float* s = scores + r0;
    __m512 tile_max = neg_inf;
    // x - x summed over the keys a row sees: NaN where one of its scores is not finite, which
    // poisons the row (l = NaN, core/non_finite.h).
    __m512 non_finite = _mm512_setzero_ps();
    if (masked) {
      for (int k = 0; k < count; ++k) {
        const __m512 x = _mm512_load_ps(s + k * stride);
        tile_max = _mm512_mask_max_ps(tile_max, visible(k), tile_max, x);
        non_finite = _mm512_mask_add_ps(non_finite, visible(k), non_finite, _mm512_sub_ps(x, x));
      }
    } else {
      for (int k = 0; k < count; ++k) {
        const __m512 x = _mm512_load_ps(s + k * stride);
        tile_max = _mm512_max_ps(tile_max, x);
        non_finite = _mm512_add_ps(non_finite, _mm512_sub_ps(x, x));
      }
    }
    const auto m_old = hn::Load(df, m_rows);
    const auto m_new =
        hn::Max(m_old, hn::Mul(hn::Vec<WideFloatTag>{tile_max}, hn::Vec<WideFloatTag>{vscale}));
    // A row that has seen nothing (m still -inf) keeps alpha 1; on a row's first tile alpha is 0.
    const auto seen = hn::Ne(m_new, hn::Vec<WideFloatTag>{neg_inf});
    const auto alpha =
        hn::IfThenElse(seen, Exp2Fast(df, hn::Sub(m_old, m_new), 0), hn::Set(df, 1.0f));
    const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m_new.raw);
    __m512 sum = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b) {
      __m512i pairs[16];
      for (int j = 0; j < 16; ++j) {
        __m512 p[2];
        for (int i = 0; i < 2; ++i) {
          const int k = 32 * b + 2 * j + i;
          p[i] = Exp2Scalef(_mm512_fmadd_ps(_mm512_load_ps(s + k * stride), vscale, neg_m));
          if (masked || k >= count) p[i] = _mm512_maskz_mov_ps(visible(k), p[i]);
          sum = _mm512_add_ps(sum, p[i]);
        }
        // Words: even key's 16 rows, then the odd key's; paired per row: row r's dword.
        const __m512i words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0]));
        pairs[j] = _mm512_permutexvar_epi16(pair_words, words);
      }
      Transpose16x16(pairs);  // pairs[r]: row r's 16 key pairs, keys 32 b .. 32 b + 31
      std::uint16_t* out = p_words + (std::size_t(b) * padded + r0) * kAmxRowWords;
      for (int r = 0; r < 16; ++r) _mm512_store_si512(out + r * kAmxRowWords, pairs[r]);
    }
    alignas(64) float alpha_rows[16], m_out[16], l_out[16], non_finite_rows[16];
    hn::Store(alpha, df, alpha_rows);
    hn::Store(m_new, df, m_out);
    hn::Store(hn::MulAdd(hn::Load(df, l_rows), alpha, hn::Vec<WideFloatTag>{sum}), df, l_out);
    _mm512_store_ps(non_finite_rows, non_finite);
    for (int j = 0; j < group_rows; ++j) {
      state.alpha[r0 + j] = alpha_rows[j];
      state.m[r0 + j] = m_out[j];
      state.l[r0 + j] = std::isnan(non_finite_rows[j]) ? kPoisonedRow : l_out[j];
    }
  }
}

// acc [value_rows][ld] (AmxValueChannel order) = alpha * acc + P [rows][0, count) . the count V
// rows at bases[t] + offset; value_rows: AmxValueRows. v_tiles and p_words: AmxValueWords /
// AmxProbWords words of scratch, 64-byte aligned. probs null: p_words already holds P
// (SoftmaxColumns). The tiles must be configured for value_rows (AmxTiles).
template <class Dot>
HWY_NOINLINE void ValuesAmx(const float* HWY_RESTRICT probs, std::size_t stride, int rows,
                            int value_rows, const std::uint8_t* const* bases, std::int64_t offset,
                            int count, std::size_t d, float* HWY_RESTRICT acc, std::size_t ld,
                            const float* HWY_RESTRICT alpha, std::uint16_t* HWY_RESTRICT v_tiles,
                            std::uint16_t* HWY_RESTRICT p_words, TilePrefetcher& prefetch,
                            int prefetch_per_key) {
  const WideFloatTag df;
  for (int r = 0; r < rows; ++r) {
    if (alpha[r] == 1.0f) continue;
    const auto a = hn::Set(df, alpha[r]);
    float* row = acc + std::size_t(r) * ld;
    for (std::size_t c = 0; c < d; c += hn::Lanes(df)) {
      hn::Store(hn::Mul(hn::Load(df, row + c), a), df, row + c);
    }
  }
  PrepareValueTiles<Dot>(bases, offset, count, d, v_tiles, prefetch, prefetch_per_key);
  if (probs != nullptr) PrepareProbWords(probs, stride, rows, value_rows, count, p_words);

  const int padded = value_rows;
  const int blocks = (count + kAmxKeys - 1) / kAmxKeys;
  const std::size_t groups = d / kAmxChannels;
  const long acc_stride = long(ld * sizeof(float));
  for (int r0 = 0; r0 < padded; r0 += kAmxRows) {
    for (std::size_t g0 = 0; g0 < groups; g0 += kAmxValueBatch) {
      float* c = acc + std::size_t(r0) * ld + g0 * kAmxChannels;
      // d is a multiple of 64: the groups come in whole batches of 4.
      _tile_loadd(0, c, acc_stride);
      _tile_loadd(1, c + kAmxChannels, acc_stride);
      _tile_loadd(2, c + 2 * kAmxChannels, acc_stride);
      _tile_loadd(3, c + 3 * kAmxChannels, acc_stride);
      for (int b = 0; b < blocks; ++b) {
        const std::uint16_t* v = v_tiles + (std::size_t(b) * groups + g0) * 512;
        _tile_loadd(4, p_words + (std::size_t(b) * padded + r0) * kAmxRowWords, 64);
        // B tiles rotate through 5, 6 and 7, so a load need not wait for the product that read
        // the tile before it (tiles are not renamed).
        _tile_loadd(5, v, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, v + 2 * 512, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, v + 3 * 512, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, c, acc_stride);
      _tile_stored(1, c + kAmxChannels, acc_stride);
      _tile_stored(2, c + 2 * kAmxChannels, acc_stride);
      _tile_stored(3, c + 3 * kAmxChannels, acc_stride);
    }
  }
}

HWY_POP_ATTRIBUTES

#endif  // MJOLNIR_AMX

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_AMX_VALUES_INL_H_

// Q . K on AMX tiles for the CPU kernel (attention_kernel.cc), on Intel cores with AMX-BF16
// (Sapphire Rapids and later). One TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one
// into 16 x 16 fp32 sums, 8192 multiply-adds, in about 16 cycles, where the AVX-512 dot products
// issue at half the FMAs' rate on these cores (docs/cpu-experiments.md). What the tiles cost
// around that (K stored and loaded as a tile, the sums gathered back) makes them pay from 8 query
// rows on (kAmxMinRows).
//
// The tiles compute S^T = K Q^T, so that K's rows go in as they are: A is 16 keys x 32 channels
// of bf16 K words (decoded by the dot decoders of bf16_dot-inl.h into a small buffer, 32 keys at
// a time), B is 32 channels x 16 query rows of Q in the pair-interleaved layout TDPBF16PS takes
// (prepared once per work item), and C is 16 keys x 16 rows. Query rows beyond 16 take further
// column groups; rows short of 16 leave B's columns zero, at no cost in time (a tile's time does
// not depend on how many of its columns are used, so q_len 4 costs Q . K no more than q_len 1).
// C is stored and its columns gathered into the kernel's score rows.
//
// The same B layout of Q serves the AVX-512 dot products where no tiles run (ScoresDotPairs):
// from 16 rows, over K rows decoded into words once per tile, the vector form of that product.
//
// Numerics are those of the dot products (bf16_dot-inl.h): every product of two bf16 values is
// exact in fp32, the sums are fp32 in the tile's order, subnormal inputs and results are zero.
// nvfp4's K values go in as e2m1 x block scale, exact in bf16 (DotNvfp4::DecodeScaled).
//
// Only the AVX3_DL target compiles it (it uses the word decoders). Per-target header, see
// kv_decode-inl.h.

#if defined(MJOLNIR_CPU_AMX_SCORES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_AMX_SCORES_INL_H_
#undef MJOLNIR_CPU_AMX_SCORES_INL_H_
#else
#define MJOLNIR_CPU_AMX_SCORES_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu/bf16_dot-inl.h"
#include "cpu/tile_prefetcher.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef MJOLNIR_AMX
#if MJOLNIR_BF16_DOT
#define MJOLNIR_AMX 1

inline constexpr int kAmxRows = 16;          // query rows per column group (C's columns)
inline constexpr int kAmxKeys = 32;          // keys per block: two C tiles of 16
inline constexpr std::size_t kAmxStep = 32;  // channels per TDPBF16PS (A's columns)

// kAmxMinRows (cpu/attention_kernel.h): the query rows from which work goes on the tiles.

// Words of one head's B tiles: per column group and 32-channel step, 16 pairs x 16 rows x 2.
inline std::size_t AmxQueryWords(int rows, std::size_t d) {
  return std::size_t((rows + kAmxRows - 1) / kAmxRows) * (d / kAmxStep) * 16 * 32;
}
// Words of the key buffer (kAmxKeys rows of d words), then floats of the C buffer (2 x 16 x 16).
inline std::size_t AmxKeyWords(std::size_t d) { return kAmxKeys * d; }
inline constexpr std::size_t kAmxSumFloats = 2 * 16 * 16;

// Transposes 16 vectors of 16 32-bit lanes in place: v[i] lane j <- v[j] lane i.
HWY_INLINE void Transpose16x16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now v[4a + b] holds, in its 128-bit block k, lane 4k + b of vectors 4a .. 4a + 3: lane
  // 4k + b of the result takes block k of v[b], v[4 + b], v[8 + b] and v[12 + b], in order.
  for (int b = 0; b < 4; ++b) {
    const __m512i x = _mm512_shuffle_i32x4(v[b], v[4 + b], 0x88);  // blocks 0, 2 of each
    const __m512i y = _mm512_shuffle_i32x4(v[8 + b], v[12 + b], 0x88);
    const __m512i x2 = _mm512_shuffle_i32x4(v[b], v[4 + b], 0xDD);  // blocks 1, 3 of each
    const __m512i y2 = _mm512_shuffle_i32x4(v[8 + b], v[12 + b], 0xDD);
    t[b] = _mm512_shuffle_i32x4(x, y, 0x88);
    t[8 + b] = _mm512_shuffle_i32x4(x, y, 0xDD);
    t[4 + b] = _mm512_shuffle_i32x4(x2, y2, 0x88);
    t[12 + b] = _mm512_shuffle_i32x4(x2, y2, 0xDD);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

// q_tiles from PrepareDotQuery's q_words ([rows][qs] bf16 words in Dot's channel order):
// tile (group, step) word 32 p + 2 m + i = word 32 step + 2 p + i of query row 16 group + m,
// zero past the last row. In 32-bit pairs of words, each tile is the transpose of the group's
// 16 rows x 16 pairs of the step. ScoresDotPairs reads the same layout: per group, d / 2 vectors
// whose lanes are the rows.
inline void PrepareAmxQuery(const std::uint16_t* HWY_RESTRICT q_words, std::size_t qs, int rows,
                            std::size_t d, std::uint16_t* HWY_RESTRICT q_tiles) {
  const int groups = (rows + kAmxRows - 1) / kAmxRows;
  const std::size_t steps = d / kAmxStep;
  for (int group = 0; group < groups; ++group) {
    for (std::size_t step = 0; step < steps; ++step) {
      __m512i pairs[16];
      for (int m = 0; m < kAmxRows; ++m) {
        const int r = group * kAmxRows + m;
        pairs[m] = r < rows ? _mm512_loadu_si512(q_words + std::size_t(r) * qs + kAmxStep * step)
                            : _mm512_setzero_si512();
      }
      Transpose16x16(pairs);
      std::uint16_t* tile = q_tiles + (std::size_t(group) * steps + step) * 16 * 32;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + 32 * p, pairs[p]);
    }
  }
}

// acc + the dot products of q's 16 lanes (bf16 word pairs) with the word pair at k broadcast to
// every lane: vdpbf16ps with an embedded broadcast, so the pair is a memory operand and no
// register holds it.
HWY_INLINE __m512 DotPairBroadcast(__m512 acc, __m512i q, const std::uint32_t* k) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*k));
  return acc;
}

// The 16 x 16 blocks both pair kernels run: for each 16 keys from t0 (keys of them real;
// set_keys(t0, keys) points at their rows, repeating the last one past count) and each group of
// 16 rows of Q as PrepareAmxQuery lays it out (per group, its d / 2 word pairs, each a vector
// whose lanes are the rows), accumulate(q, acc) sums the block into one accumulator per key,
// lanes the rows; a 16 x 16 transpose then puts the block's scores into the rows, scaled. Keys
// past count land in each row's padding (stride holds the tile rounded up to 16), which the
// softmax ignores.
template <class SetKeys, class Accumulate>
HWY_INLINE void ScoresInPairBlocks(const std::uint16_t* HWY_RESTRICT q_tiles, int rows,
                                   std::size_t d, int count, float scale,
                                   float* HWY_RESTRICT scores, std::size_t stride,
                                   TilePrefetcher& prefetch, int prefetch_per_key,
                                   SetKeys&& set_keys, Accumulate&& accumulate) {
  const std::size_t pairs = d / 2;
  const int groups = (rows + kAmxRows - 1) / kAmxRows;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int t0 = 0; t0 < count; t0 += 16) {
    const int keys = count - t0 < 16 ? count - t0 : 16;
    prefetch.Issue(keys * prefetch_per_key);
    set_keys(t0, keys);
    for (int group = 0; group < groups; ++group) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      accumulate(q_tiles + std::size_t(group) * pairs * 32, acc);
      __m512i v[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) v[i] = _mm512_castps_si512(acc[i]);
      Transpose16x16(v);  // v[m]: row m's scores of the 16 keys
      const int group_rows =
          rows - group * kAmxRows < kAmxRows ? rows - group * kAmxRows : kAmxRows;
      float* out = scores + std::size_t(group) * kAmxRows * stride + t0;
      for (int m = 0; m < group_rows; ++m) {
        _mm512_storeu_ps(out + std::size_t(m) * stride,
                         _mm512_mul_ps(_mm512_castsi512_ps(v[m]), vscale));
      }
    }
  }
}

// scores[r][t] = scale * q_r . k_t for the count K rows of words at bases[t] + offset, in the
// order of Q's words (decoded once per tile by DecodeWordRows, or a bf16 cache's rows), in the
// 16 x 16 blocks of ScoresInPairBlocks: each Q pair vector is loaded once for the 16 keys, whose
// pairs the dot products take as broadcast memory operands, and no lane sums are left at the end
// (ScoresDot's 4 x 4 blocks sum 16 lanes per score, and reload Q for every 4 keys).
HWY_NOINLINE void ScoresDotPairs(const std::uint16_t* HWY_RESTRICT q_tiles, int rows, std::size_t d,
                                 const std::uint8_t* const* bases, std::int64_t offset, int count,
                                 float scale, float* HWY_RESTRICT scores, std::size_t stride,
                                 TilePrefetcher& prefetch, int prefetch_per_key) {
  const std::size_t pairs = d / 2;
  const std::uint32_t* k[16];
  ScoresInPairBlocks(
      q_tiles, rows, d, count, scale, scores, stride, prefetch, prefetch_per_key,
      [&](int t0, int keys) {
        for (int i = 0; i < 16; ++i) {
          k[i] = reinterpret_cast<const std::uint32_t*>(bases[t0 + (i < keys ? i : keys - 1)] +
                                                        offset);
        }
      },
      [&](const std::uint16_t* q, __m512(&acc)[16]) {
        for (std::size_t p = 0; p < pairs; ++p) {
          const __m512i qp = _mm512_loadu_si512(q + 32 * p);
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) acc[i] = DotPairBroadcast(acc[i], qp, k[i] + p);
        }
      });
}

// Stores 16 bf16 words as the fp32 values they are (each shifted up 16 bits), in order.
HWY_INLINE void StoreWidened(__m256i words, float* HWY_RESTRICT out) {
  _mm512_storeu_si512(out, _mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

// The count K rows at rows[t] + offset as fp32 rows of d floats at wide + t * d, in the order of
// Q's words, the last row repeated up to a multiple of 16 rows: ScoresFmaPairs' broadcast
// operands, 16 keys at a time. Dot void: the rows are bf16 words already (a bf16 cache's), only
// widened; else Dot's words as it decodes them (DecodeWordRows' words, never stored as words).
template <class Dot>
HWY_NOINLINE void DecodeWideRows(const std::uint8_t* const* rows, std::int64_t offset, int count,
                                 std::size_t d, float* HWY_RESTRICT wide) {
  const int padded = (count + 15) / 16 * 16;
  for (int t = 0; t < padded; ++t) {
    const std::uint8_t* row = rows[t < count ? t : count - 1] + offset;
    float* out = wide + std::size_t(t) * d;
    if constexpr (std::is_void_v<Dot>) {
      const auto* words = reinterpret_cast<const std::uint16_t*>(row);
      for (std::size_t c = 0; c < d; c += 16) {
        StoreWidened(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + c)), out + c);
      }
    } else {
      const auto state = Dot::MakeState();
      for (std::size_t c = 0; c < d / kDotChunk; ++c) {
        Words x[2];
        Dot::Decode(state, row, c, x[0], x[1]);
        for (int h = 0; h < 2; ++h) {  // words 64 c + 32 h ..., as DecodeWordRows stores them
          float* o = out + c * 64 + 32 * h;
          StoreWidened(_mm512_castsi512_si256(x[h].raw), o);
          StoreWidened(_mm512_extracti64x4_epi64(x[h].raw, 1), o + 16);
        }
      }
    }
  }
}

// ScoresDotPairs on fp32 FMAs, for cores where a vdpbf16ps costs more than the two FMAs it does
// the work of (Intel's: about four; KernelConfig::fma_pair_scores): each Q pair vector split into
// its two channels' fp32 vectors (the low word shifted up, the high one masked: exact), K as fp32
// rows of d floats at wide + t * d (DecodeWideRows, the words' channel order, padded to 16 rows),
// each key's channel broadcast from memory by its FMA. Products of bf16 values are exact in fp32,
// as on the dot products; the sums round in this order, channel by channel, where a vdpbf16ps adds
// a pair's two products first. kD: d where it is one of the common head sizes, so that the 16
// keys' rows sit at fixed offsets from one pointer (0 otherwise: the loop reloads pointers).
template <std::size_t kD>
HWY_NOINLINE void ScoresFmaPairsOf(const std::uint16_t* HWY_RESTRICT q_tiles, int rows,
                                   std::size_t d, const float* HWY_RESTRICT wide, int count,
                                   float scale, float* HWY_RESTRICT scores, std::size_t stride,
                                   TilePrefetcher& prefetch, int prefetch_per_key) {
  const std::size_t row = kD != 0 ? kD : d;
  const std::size_t pairs = row / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const float* keys = nullptr;
  ScoresInPairBlocks(
      q_tiles, rows, row, count, scale, scores, stride, prefetch, prefetch_per_key,
      [&](int t0, int) { keys = wide + std::size_t(t0) * row; },
      [&](const std::uint16_t* q, __m512(&acc)[16]) {
        for (std::size_t p = 0; p < pairs; ++p) {
          const __m512i qp = _mm512_loadu_si512(q + 32 * p);
          const __m512 q_even = _mm512_castsi512_ps(_mm512_slli_epi32(qp, 16));
          const __m512 q_odd = _mm512_castsi512_ps(_mm512_and_si512(qp, high));
          const float* k = keys + 2 * p;
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            acc[i] = _mm512_fmadd_ps(q_even, _mm512_set1_ps(k[std::size_t(i) * row]), acc[i]);
          }
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            acc[i] = _mm512_fmadd_ps(q_odd, _mm512_set1_ps(k[std::size_t(i) * row + 1]), acc[i]);
          }
        }
      });
}

inline void ScoresFmaPairs(const std::uint16_t* HWY_RESTRICT q_tiles, int rows, std::size_t d,
                           const float* HWY_RESTRICT wide, int count, float scale,
                           float* HWY_RESTRICT scores, std::size_t stride, TilePrefetcher& prefetch,
                           int prefetch_per_key) {
  switch (d) {
    case 64:
      return ScoresFmaPairsOf<64>(q_tiles, rows, d, wide, count, scale, scores, stride, prefetch,
                                  prefetch_per_key);
    case 128:
      return ScoresFmaPairsOf<128>(q_tiles, rows, d, wide, count, scale, scores, stride, prefetch,
                                   prefetch_per_key);
    case 256:
      return ScoresFmaPairsOf<256>(q_tiles, rows, d, wide, count, scale, scores, stride, prefetch,
                                   prefetch_per_key);
    default:
      return ScoresFmaPairsOf<0>(q_tiles, rows, d, wide, count, scale, scores, stride, prefetch,
                                 prefetch_per_key);
  }
}

HWY_PUSH_ATTRIBUTES("amx-tile,amx-bf16,avx512bf16")

// The palette-1 tile configuration: for Q . K tiles 0 and 1 hold C (16 keys x 16 fp32), 4 and 5 B,
// 2, 3, 6 and 7 A (16 keys x 32 bf16); for P . V tiles 0-3 hold C (query rows x 16 fp32), 4 A
// (query rows x 32 bf16) and 5-7 B (16 key pairs x 16 channel pairs). Every tile has rows of 64
// bytes; tiles 0-4 have value_rows rows (16 wherever Q . K is on the tiles), the others 16.
struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Loading the configuration costs about what a tile of scores does, so a work unit loads it once
// (AmxTiles) and releases the tile state at its end (a thread that holds it makes every context
// switch save 8 KiB more).
// The configurations are static: GCC does not see ldtilecfg read its operand, and drops the
// stores that would fill one on the stack.
struct AmxTileConfigs {
  AmxTileConfig by_value_rows[kAmxRows + 1];
  constexpr AmxTileConfigs() {
    for (int value_rows = 1; value_rows <= kAmxRows; ++value_rows) {
      for (int tile = 0; tile < 5; ++tile) {
        by_value_rows[value_rows].rows[tile] = static_cast<std::uint8_t>(value_rows);
      }
    }
  }
};
HWY_NOINLINE inline void ConfigureAmxTiles(int value_rows) {
  static constexpr AmxTileConfigs kConfigs{};
  _tile_loadconfig(&kConfigs.by_value_rows[value_rows]);
}
HWY_NOINLINE inline void ReleaseAmxTiles() { _tile_release(); }

// scores[r][t] = scale * q_r . k_t for the count K rows at bases[t] + offset, as ScoresDot does
// (bf16_dot-inl.h); q_tiles from PrepareAmxQuery, keys and sums: AmxKeyWords(d) words and
// kAmxSumFloats floats of scratch, 64-byte aligned. Writes up to 15 scores past `count`, inside
// each scores row's padding (the softmax overwrites them). The tiles must be configured
// (AmxTiles).
//
// kColumns: the tiles' own layout instead, unscaled: scores[t][r] = q_r . k_t for keys t in the
// count rounded up to 32 (zero keys past count) and rows r in `rows` rounded up to 16, rows
// `stride` floats apart, stored straight from the tiles (no gather): for the column softmax of
// P . V on the tiles (amx_values-inl.h). sums is unused then.
template <class Dot, bool kColumns = false>
HWY_NOINLINE void ScoresAmx(const std::uint16_t* HWY_RESTRICT q_tiles, int rows, std::size_t d,
                            const std::uint8_t* const* bases, std::int64_t offset, int count,
                            float scale, float* HWY_RESTRICT scores, std::size_t stride,
                            TilePrefetcher& prefetch, int prefetch_per_key,
                            std::uint16_t* HWY_RESTRICT keys, float* HWY_RESTRICT sums) {
  const WideFloatTag df;
  const WordTag dw;
  const hn::RebindToSigned<WideFloatTag> di;
  const auto column = hn::Mul(hn::Iota(di, 0), hn::Set(di, 16));  // C's column m, key by key
  const auto vscale = hn::Set(df, scale);
  const auto state = Dot::MakeState();
  const int groups = (rows + kAmxRows - 1) / kAmxRows;
  const std::size_t steps = d / kAmxStep;
  const long key_bytes = long(d * sizeof(std::uint16_t));
  for (int t0 = 0; t0 < count; t0 += kAmxKeys) {
    const int n = count - t0 < kAmxKeys ? count - t0 : kAmxKeys;
    // The A tiles' rows, per 16 keys: bf16 K rows straight from the cache where all 16 lie at one
    // stride (the 16 tokens of one page, or of pages one after the other), else the buffer.
    const std::uint16_t* a_rows[2] = {keys, keys + 16 * d};
    long a_stride[2] = {key_bytes, key_bytes};
    bool direct[2] = {false, false};
    if constexpr (std::is_same_v<Dot, DotBf16>) {
      for (int half = 0; half < 2 && n >= 16 * (half + 1); ++half) {
        const std::uint8_t* const* b = bases + t0 + 16 * half;
        const std::ptrdiff_t spacing = b[1] - b[0];
        bool uniform = spacing > 0;
        for (int i = 2; i < 16; ++i) uniform &= b[i] - b[0] == i * spacing;
        if (uniform) {
          direct[half] = true;
          a_rows[half] = reinterpret_cast<const std::uint16_t*>(b[0] + offset);
          a_stride[half] = long(spacing);
        }
      }
    }
    for (int t = 0; t < n; ++t) {
      // Spread over the keys: a block's prefetches at once would fill the line-fill buffers.
      prefetch.Issue(prefetch_per_key);
      if (direct[t / 16]) continue;
      const std::uint8_t* k = bases[t0 + t] + offset;
      std::uint16_t* dst = keys + std::size_t(t) * d;
      for (std::size_t c = 0; c < d / kDotChunk; ++c) {
        Words x0, x1;
        DecodeTrueWords<Dot>(state, k, c, d, x0, x1);
        hn::Store(x0, dw, dst + c * kDotChunk);
        hn::Store(x1, dw, dst + c * kDotChunk + 32);
      }
    }
    // Keys past n are zero (never direct: a direct half has all 16): their sums land in scores
    // past `count`, which the softmax overwrites.
    if (n < kAmxKeys) std::fill(keys + std::size_t(n) * d, keys + kAmxKeys * d, std::uint16_t{0});
    const bool second = n > 16;
    for (int group = 0; group < groups; ++group) {
      const std::uint16_t* q_group = q_tiles + std::size_t(group) * steps * 16 * 32;
      if constexpr (kColumns) {
        // Two column groups at once where there are: four chains of products into four C
        // tiles, where one group's two chains wait on each product's latency (about three times
        // its issue interval) before the next can start.
        if (second && group + 1 < groups) {
          const std::uint16_t* q_next = q_group + steps * 16 * 32;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (std::size_t step = 0; step < steps; ++step) {
            _tile_loadd(4, q_group + step * 16 * 32, 64);
            _tile_loadd(6, a_rows[0] + step * kAmxStep, a_stride[0]);
            _tile_dpbf16ps(0, 6, 4);
            _tile_loadd(7, a_rows[1] + step * kAmxStep, a_stride[1]);
            _tile_dpbf16ps(1, 7, 4);
            _tile_loadd(5, q_next + step * 16 * 32, 64);
            _tile_dpbf16ps(2, 6, 5);
            _tile_dpbf16ps(3, 7, 5);
          }
          float* out = scores + std::size_t(t0) * stride + group * kAmxRows;
          const long out_stride = long(stride * sizeof(float));
          _tile_stored(0, out, out_stride);
          _tile_stored(1, out + 16 * stride, out_stride);
          _tile_stored(2, out + kAmxRows, out_stride);
          _tile_stored(3, out + 16 * stride + kAmxRows, out_stride);
          ++group;
          continue;
        }
      }
      _tile_zero(0);
      if (second) _tile_zero(1);
      // Even and odd steps load into different tiles (A: 6 and 7, or 2 and 3; B: 4 or 5), so a
      // step's loads need not wait for the previous step's products to have read their tiles
      // (tiles are not renamed). d is a multiple of 64: steps come in pairs.
      for (std::size_t step = 0; step < steps; step += 2) {
        const std::uint16_t* k0 = a_rows[0] + step * kAmxStep;
        const std::uint16_t* k1 = a_rows[1] + step * kAmxStep;
        _tile_loadd(4, q_group + step * 16 * 32, 64);
        _tile_loadd(6, k0, a_stride[0]);
        _tile_dpbf16ps(0, 6, 4);
        if (second) {
          _tile_loadd(7, k1, a_stride[1]);
          _tile_dpbf16ps(1, 7, 4);
        }
        _tile_loadd(5, q_group + (step + 1) * 16 * 32, 64);
        _tile_loadd(2, k0 + kAmxStep, a_stride[0]);
        _tile_dpbf16ps(0, 2, 5);
        if (second) {
          _tile_loadd(3, k1 + kAmxStep, a_stride[1]);
          _tile_dpbf16ps(1, 3, 5);
        }
      }
      if constexpr (kColumns) {
        float* out = scores + std::size_t(t0) * stride + group * kAmxRows;
        const long out_stride = long(stride * sizeof(float));
        _tile_stored(0, out, out_stride);
        if (second) _tile_stored(1, out + 16 * stride, out_stride);
        continue;
      }
      _tile_stored(0, sums, 64);
      if (second) _tile_stored(1, sums + 256, 64);
      const int group_rows =
          rows - group * kAmxRows < kAmxRows ? rows - group * kAmxRows : kAmxRows;
      for (int m = 0; m < group_rows; ++m) {
        float* out = scores + std::size_t(group * kAmxRows + m) * stride + t0;
        hn::StoreU(hn::Mul(hn::GatherIndex(df, sums + m, column), vscale), df, out);
        if (second) {
          hn::StoreU(hn::Mul(hn::GatherIndex(df, sums + 256 + m, column), vscale), df, out + 16);
        }
      }
    }
  }
}

HWY_POP_ATTRIBUTES

// The tile configuration for the scope of a work unit, where `use`: P . V's A and C tiles hold
// value_rows query rows, 16 from 16 on (AmxTileConfig).
class AmxTiles {
 public:
  AmxTiles(bool use, int value_rows) : use_(use) {
    if (use_) ConfigureAmxTiles(value_rows < kAmxRows ? value_rows : kAmxRows);
  }
  ~AmxTiles() {
    if (use_) ReleaseAmxTiles();
  }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

 private:
  bool use_;
};

#else
#define MJOLNIR_AMX 0
#endif  // MJOLNIR_BF16_DOT

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_AMX_SCORES_INL_H_

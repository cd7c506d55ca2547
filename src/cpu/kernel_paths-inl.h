// The paths of the CPU kernel (attention_kernel.cc) and the one place that chooses among them.
// Q . K has five: fp32 FMAs in any order (fast_scores-inl.h), the emulator's exact order
// (exact_scores-inl.h), bf16 dot products (bf16_dot-inl.h), AMX tiles (amx_scores-inl.h) and
// integer dot products (int8_dot-inl.h); P . V four: fp32 FMAs (fma_values-inl.h), AMX tiles
// (amx_values-inl.h), bf16 dot products (dot_values-inl.h) and fp16 FMAs (half_values-inl.h). A
// unit's paths follow from its format, modes, head size and query rows and from what this CPU
// executes (ChooseUnitPaths); a head's score path also from its queries, since Q in fp32 mode takes
// the bf16 dot products exactly where its values are bf16 values (HeadScorePath). Per-target
// header, see kv_decode-inl.h.

#if defined(MJOLNIR_CPU_KERNEL_PATHS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_KERNEL_PATHS_INL_H_
#undef MJOLNIR_CPU_KERNEL_PATHS_INL_H_
#else
#define MJOLNIR_CPU_KERNEL_PATHS_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu/amx_scores-inl.h"
#include "cpu/amx_values-inl.h"
#include "cpu/attention_kernel.h"
#include "cpu/bf16_dot-inl.h"
#include "cpu/dot_values-inl.h"
#include "cpu/exact_scores-inl.h"
#include "cpu/fast_scores-inl.h"
#include "cpu/fma_values-inl.h"
#include "cpu/half_values-inl.h"
#include "cpu/int8_dot-inl.h"
#include "cpu/item_context.h"
#include "cpu/kernel_config.h"
#include "cpu/online_softmax-inl.h"
#include "cpu/prepare_query-inl.h"
#include "cpu/tile_prefetcher.h"
#include "hwy/highway.h"
#include "mjolnir/decode.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

// How one head's Q . K runs.
enum class ScorePath : std::uint8_t {
  fast,      // fp32 FMAs over raw decoded K, any order (P in fp32 or bf16)
  exact,     // the emulator's order over true values (P in fp8: its codes match the emulator's)
  bf16_dot,  // bf16 dot products over K decoded to bf16 words (Q's values are bf16 values)
  amx,       // the same products on AMX tiles, from kAmxMinRows query rows
  int8,      // integer dot products (Q mode int8 against e2m1 or e2m3 codes)
};

// The paths of one unit, the same for all its heads.
struct UnitPaths {
  bool exact = false;  // P in fp8: scores in the emulator's order
  // Heads whose queries are bf16 values take Q . K on the dot products (dot_scores_apply) ...
  bool dot_scores = false;
  bool amx_scores = false;   // ... and on AMX tiles
  bool amx_values = false;   // P . V on AMX tiles (scores then in the tiles' column layout)
  bool dot_values = false;   // P . V on the bf16 dot products, where the tiles do not take it
  bool half_values = false;  // P . V on fp16 FMAs (P mode fp16, AVX512-FP16)
  int value_rows = 0;        // amx_values: the query rows of its A and C tiles (AmxValueRows)
  bool int8 = false;         // every head's Q . K in integers
  // K / V rows decoded once per tile (SetDecodedOnce, kDecodeOnceRows), not once per block of rows
  bool decoded_keys = false, decoded_values = false;
  // Q . K on the dot products in blocks of 16 rows x 16 keys over Q's transposed word pairs
  // (ScoresDotPairs), from kDecodeOnceRows, where K's rows are words: decoded once per tile, or
  // a bf16 cache's rows as they are.
  bool pair_scores = false;
  // ... on fp32 FMAs over K widened once per tile instead (ScoresFmaPairs,
  // KernelConfig::fma_pair_scores).
  bool fma_pair_scores = false;
};

#if MJOLNIR_BF16_DOT
// The bf16 dot-product decoder of a kernel decoder's format, or void (bf16_dot-inl.h).
template <class Decoder>
using DotOf = typename DotDecoderOf<Decoder>::type;
#endif

// From this many query rows a unit decodes each K row (Q . K in integers, on x86) and each V row
// (P . V on FMAs, the formats whose decode costs more than a load: DecodeValuesOncePays) of a
// tile once, into L1 / L2, and its blocks of 4 or 8 rows load the decoded vectors, where each block
// decoded the row again in registers: a prompt's query tile (32 tokens x g rows) decoded every
// row 16 to 32 times. Below it the stores and loads cost more than the decodes they save.
inline constexpr int kDecodeOnceRows = 16;

// Whether P . V decodes V once per tile for this format (kDecodeOnceRows): not for the 16-bit
// formats (one op a vector), nor on AVX-512 for fp4_e2m1 (one vpermps a vector), where
// kernel_rates measured no gain or a loss (docs/cpu-experiments.md, "Decoding once per tile").
inline bool DecodeValuesOncePays(Format format) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if (format == Format::fp4_e2m1) return false;
#endif
  return format != Format::bf16 && format != Format::fp16;
}

// Whether Q . K on the bf16 dot products (off the AMX tiles) decodes K into words once per tile:
// the formats whose words take ops to make. Not bf16, whose rows are the words, nor nvfp4, whose
// block scales DotBlock applies key by key. The dot products and the decode's byte permutes
// compete for the same cores' ports (on the Emerald Rapids Xeon each vpermi2b added its own
// 0.65 ns to 16 vdpbf16ps' 12.6), so a prompt's K decoded per 4-row block cost it directly.
inline bool DecodeKeyWordsOncePays(Format format) {
  return format != Format::bf16 && format != Format::fp16 && format != Format::nvfp4;
}

// Sets paths.decoded_keys / decoded_values (and pair_scores) for a unit of `rows` query rows whose
// other paths are chosen: K where Q . K runs in integers on a target that reads decoded K
// (DecodedInt) or on the bf16 dot products off the tiles for queries whose values are all bf16
// values (Q mode bf16, fp8, or int8 where it does not run in integers) and the decode pays, V where
// P . V runs on FMAs (not as words, on the tiles or the dot products) and the decode pays, or on
// fp16 FMAs (into fp16 words there, ValuesHalf; every format it takes).
inline void SetDecodedOnce(Format format, QMode q_mode, int rows, UnitPaths& paths) {
  const bool many = rows >= kDecodeOnceRows;
  const bool dot_off_tiles =
      MJOLNIR_BF16_DOT && paths.dot_scores && !paths.amx_scores && !paths.int8;
  const bool dot_words = dot_off_tiles && q_mode != QMode::fp32 && DecodeKeyWordsOncePays(format);
  paths.decoded_keys = many && ((MJOLNIR_INT8_DECODED_KEYS && paths.int8) || dot_words);
  paths.pair_scores = many && (dot_words || (dot_off_tiles && format == Format::bf16));
  paths.decoded_values = many && (paths.half_values || (!paths.amx_values && !paths.dot_values &&
                                                        DecodeValuesOncePays(format)));
}

// Rows a unit decodes once per tile: row t at rows + t * stride, also listed in bases (what the
// score and value blocks take). rows null: the blocks decode in registers.
struct DecodedTile {
  std::uint8_t* rows = nullptr;
  std::size_t stride = 0;  // bytes
  const std::uint8_t** bases = nullptr;
  std::uint8_t* Row(int t) const { return rows + std::size_t(t) * stride; }
};

// Bytes between the K rows a unit decodes once per tile: DecodedInt<Int>::RowBytes at most for
// Q . K in integers, else the dot products' words (2 bytes a channel).
inline std::size_t DecodedKeyStride(std::size_t d, bool int8) { return int8 ? d + d / 2 : 2 * d; }

// The paths of a unit of `rows` query rows. P mode bf16 rounds P from the kernel's own scores
// (docs/numerics.md) and takes P . V onto the tiles where they exist, else onto the bf16 dot
// products (nvfp4 from kAmxMinRows rows); P mode fp8, whose codes
// are 16 times coarser, computes the scores in the emulator's order. Where the bf16 dot products
// apply, Q . K goes on AMX tiles on CPUs that have them; Q mode int8 against codes that are small
// integers goes on VNNI, vpmaddubsw or sdot, below the rows where the tiles take it.
template <class Decoder>
UnitPaths ChooseUnitPaths([[maybe_unused]] const KernelConfig& config, const DecodeArgs& args,
                          int rows) {
  const Format format = args.cache.geometry.format;
  const int d = args.cache.geometry.head_dim;
  UnitPaths paths;
  paths.exact = args.params.p_mode == PMode::fp8;
#if MJOLNIR_BF16_DOT
  if constexpr (!std::is_void_v<DotOf<Decoder>>) {
    // nvfp4's V words are looked up per block scale key by key (DotNvfp4::DecodeScaled), a cost
    // per key that only the FMAs' cost per row and key outweighs, from kAmxMinRows rows (at 4
    // rows the tiles take 1.15x the FMAs' time: docs/cpu-experiments.md, "P . V on bf16 words").
    const bool words_pay = format != Format::nvfp4 || rows >= kAmxMinRows;
    paths.amx_values = words_pay && amx_values_apply(config, format, args.params.p_mode, d);
    paths.dot_values =
        words_pay && !paths.amx_values && dot_values_apply(config, format, args.params.p_mode, d);
    paths.dot_scores = !paths.exact && dot_scores_apply(config, format, rows, d);
    paths.amx_scores = paths.dot_scores && amx_scores_apply(config, format, rows, d);
#if MJOLNIR_AMX
    if (paths.amx_values) paths.value_rows = AmxValueRows(rows, paths.amx_scores);
#endif
  }
#endif
#if MJOLNIR_INT8_DOT
  paths.int8 = args.params.q_mode == QMode::int8 && HasIntDecoder(format) &&
               d % int(kInt8Chunk) == 0 && !paths.exact && !paths.amx_scores && CpuHasInt8Dot();
#endif
#if MJOLNIR_HALF_VALUES
  paths.half_values = args.params.p_mode == PMode::fp16 && HasHalfDecoder(format) && d % 128 == 0 &&
                      CpuHasHalfFma();
#endif
  SetDecodedOnce(format, args.params.q_mode, rows, paths);
#if MJOLNIR_BF16_DOT
  paths.fma_pair_scores = paths.pair_scores && config.fma_pair_scores;
#endif
  return paths;
}

// The score path of a head whose rounded queries are qn [rows][d] (PrepareQuery).
inline ScorePath HeadScorePath(const UnitPaths& paths, QMode q_mode, const float* qn,
                               std::size_t count) {
  if (paths.int8) return ScorePath::int8;
  if (paths.dot_scores && (q_mode != QMode::fp32 || AllBf16Values(qn, count))) {
    return paths.amx_scores ? ScorePath::amx : ScorePath::bf16_dot;
  }
  return paths.exact ? ScorePath::exact : ScorePath::fast;
}

// Counts a head's work item by its score path (KernelScratch::counts, for tests).
inline void CountPath(ScorePath path, KernelPathCounts& counts) {
  switch (path) {
    case ScorePath::bf16_dot:
      ++counts.bf16_dot;
      return;
    case ScorePath::amx:
      ++counts.amx_scores;
      return;
    case ScorePath::int8:
      ++counts.int8_dot;
      return;
    case ScorePath::fast:
    case ScorePath::exact:
      return;
  }
}

// Where the int8 path keeps each row's starting sum: after Q's [R][D] bytes, 64-byte aligned,
// inside the [R][D + 16] floats of a head's Q buffer.
inline std::int32_t* Int8Starts(float* q, int rows, int d) {
  return reinterpret_cast<std::int32_t*>(q) + (std::size_t(rows) * d + 63) / 64 * 16;
}

// One KV head of a unit: its prepared Q and running softmax state.
struct HeadState {
  ItemContext it;
  ScorePath path;
  float* q;                         // kernel-ready Q, in the layout of its score path
  float kernel_scale;               // turns q . k as computed into log2-scaled scores
  std::uint16_t* q_tiles;           // Q's B tiles (path amx; bf16_dot with pair_scores)
  std::uint16_t* prob_words;        // P . V on AMX tiles: this head's P A-rows
  float* acc;                       // [R][ld] O accumulator, decoder (or value tiles') order
  RowState state;                   // m, l, alpha: [R] each
  float* q_poisoned;                // [R]: 1 where the row's q is not finite
  std::int64_t k_offset, v_offset;  // head's K and V rows from a token's base
};

// The decoder's channel order, shared by every head of the unit.
struct ChannelOrderOf {
  const std::int32_t* channel_of;  // channel_of[i]: the channel decoded into position i
  bool natural;                    // the identity
};

// Prepares hs.q (and hs.q_tiles) for the head's score path from its rounded queries qn [R][D],
// and sets hs.kernel_scale from the score scale PrepareQuery returned.
template <class Decoder>
void PrepareHeadQuery(HeadState& hs, const float* HWY_RESTRICT qn, float score_scale,
                      const ChannelOrderOf& order) {
  const ItemContext& it = hs.it;
  const std::size_t d = std::size_t(it.d);
  hs.kernel_scale = score_scale;
  switch (hs.path) {
    case ScorePath::int8:  // signed bytes in the decoder's channel order, and each row's start
#if MJOLNIR_INT8_DOT
      VisitIntDecoder(it.args->cache.geometry.format, [&]<class Int>() {
        PrepareInt8Query<Int>(qn, it.rows, d, reinterpret_cast<std::int8_t*>(hs.q),
                              Int8Starts(hs.q, it.rows, it.d));
        hs.kernel_scale = score_scale / Int::kFactor;
      });
#endif
      return;
    case ScorePath::bf16_dot:
    case ScorePath::amx:  // bf16 words in the dot decoder's channel order, true values
#if MJOLNIR_BF16_DOT
      if constexpr (!std::is_void_v<DotOf<Decoder>>) {
        auto* words = reinterpret_cast<std::uint16_t*>(hs.q);
        PrepareDotQuery<DotOf<Decoder>>(qn, it.rows, d, it.ld, words);
        if (hs.q_tiles != nullptr) {  // the tiles, or the pair dot products (ScoresDotPairs)
          PrepareAmxQuery(words, 2 * it.ld, it.rows, d, hs.q_tiles);
        }
      }
#endif
      return;
    case ScorePath::exact:  // true values, transposed: lanes are query rows
      PrepareExactQuery(qn, it.rows, d, hs.q);
      return;
    case ScorePath::fast:  // decoder channel order, times 2^q_exp to meet raw k
      hs.kernel_scale = PrepareFastQuery<Decoder>(qn, it.rows, d, it.ld, order.channel_of,
                                                  order.natural, score_scale, hs.q);
      return;
  }
}

// The K rows of one tile: token t's slot starts at bases[t]; a head's K row adds its k_offset.
struct TileRows {
  const std::uint8_t* const* bases;
  int first, count;
};

// What the score paths compute with, per unit.
struct ScoreScratch {
  float* scores;              // [R][stride] (or [keys][column_stride] on AMX values)
  std::size_t stride;         // floats between rows of scores and probs
  std::size_t column_stride;  // AMX values: floats between keys of the column layout
  ExactKeys exact;            // the exact path's decoded keys
  bool fused;                 // the emulator's build fuses multiply-adds (the exact path)
  float* amx_sums;            // AMX scores: C tiles
  std::uint16_t* amx_keys;    // AMX scores: K as B tiles
  DecodedTile decoded_keys;   // Q . K in integers or on the dot products over K decoded once a tile
  // fma_pair_scores: the tile's K rows as fp32 (decoded once a tile where decoded_keys), tile
  // rounded up to 16 x d; decoded_keys then holds no rows.
  float* wide_keys;
};

// Q . K and the online softmax of one tile for one head: P into probs [R][stride] (or the
// head's A rows, on AMX values), with 2^p_exp folded in; prefetch_per_key prefetched rows a key.
template <class Decoder>
void ScoreHeadTile([[maybe_unused]] const UnitPaths& paths, HeadState& hs, const TileRows& tile,
                   const ScoreScratch& s, int p_exp, float* HWY_RESTRICT probs,
                   TilePrefetcher& prefetcher, int prefetch_per_key) {
  const ItemContext& it = hs.it;
  const std::size_t d = std::size_t(it.d);
  switch (hs.path) {
    case ScorePath::amx:
#if MJOLNIR_AMX
      if constexpr (!std::is_void_v<DotOf<Decoder>>) {
        if (paths.amx_values) {  // scores, softmax and P in the tiles' layout: no gather
          ScoresAmx<DotOf<Decoder>, true>(hs.q_tiles, it.rows, d, tile.bases, hs.k_offset,
                                          tile.count, 1.0f, s.scores, s.column_stride, prefetcher,
                                          prefetch_per_key, s.amx_keys, s.amx_sums);
          SoftmaxColumns(it, s.scores, s.column_stride, tile.first, tile.count, hs.kernel_scale,
                         hs.state, hs.prob_words);
          return;
        }
        ScoresAmx<DotOf<Decoder>>(hs.q_tiles, it.rows, d, tile.bases, hs.k_offset, tile.count,
                                  hs.kernel_scale, s.scores, s.stride, prefetcher, prefetch_per_key,
                                  s.amx_keys, s.amx_sums);
      }
#endif
      break;
    case ScorePath::int8:
#if MJOLNIR_INT8_DOT
      VisitIntDecoder(it.args->cache.geometry.format, [&]<class Int>() {
        const auto* q_bytes = reinterpret_cast<const std::int8_t*>(hs.q);
#if MJOLNIR_INT8_DECODED_KEYS
        if (s.decoded_keys.rows != nullptr) {
          const auto state = Int::MakeState();
          for (int t = 0; t < tile.count; ++t) {
            DecodeKeyRow<Int>(state, tile.bases[t] + hs.k_offset, d, s.decoded_keys.Row(t));
          }
          ScoresInt8<DecodedInt<Int>>(q_bytes, Int8Starts(hs.q, it.rows, it.d), it.rows, d,
                                      s.decoded_keys.bases, 0, tile.count, hs.kernel_scale,
                                      s.scores, s.stride, prefetcher, prefetch_per_key);
          return;
        }
#endif
        ScoresInt8<Int>(q_bytes, Int8Starts(hs.q, it.rows, it.d), it.rows, d, tile.bases,
                        hs.k_offset, tile.count, hs.kernel_scale, s.scores, s.stride, prefetcher,
                        prefetch_per_key);
      });
#endif
      break;
    case ScorePath::bf16_dot:
#if MJOLNIR_BF16_DOT
      if constexpr (!std::is_void_v<DotOf<Decoder>>) {
        const auto* q_words = reinterpret_cast<const std::uint16_t*>(hs.q);
        if (hs.q_tiles != nullptr && s.wide_keys != nullptr) {  // paths.fma_pair_scores
          // Each head's K rows as fp32, once per tile: decoded straight into them, or a bf16
          // cache's rows widened.
          if (paths.decoded_keys) {
            DecodeWideRows<DotOf<Decoder>>(tile.bases, hs.k_offset, tile.count, d, s.wide_keys);
          } else {
            DecodeWideRows<void>(tile.bases, hs.k_offset, tile.count, d, s.wide_keys);
          }
          ScoresFmaPairs(hs.q_tiles, it.rows, d, s.wide_keys, tile.count, hs.kernel_scale, s.scores,
                         s.stride, prefetcher, prefetch_per_key);
          break;
        }
        if (hs.q_tiles != nullptr) {  // paths.pair_scores: K's rows as words
          const std::uint8_t* const* k_rows = tile.bases;
          std::int64_t k_offset = hs.k_offset;   // a bf16 cache's rows are the words already
          if (s.decoded_keys.rows != nullptr) {  // the others' once per tile
            DecodeWordRows<DotOf<Decoder>>(tile.bases, hs.k_offset, tile.count, d,
                                           s.decoded_keys.rows, s.decoded_keys.stride);
            k_rows = s.decoded_keys.bases;
            k_offset = 0;
          }
          ScoresDotPairs(hs.q_tiles, it.rows, d, k_rows, k_offset, tile.count, hs.kernel_scale,
                         s.scores, s.stride, prefetcher, prefetch_per_key);
          break;
        }
        ScoresDot<DotOf<Decoder>>(q_words, 2 * it.ld, it.rows, d, tile.bases, hs.k_offset,
                                  tile.count, hs.kernel_scale, s.scores, s.stride, prefetcher,
                                  prefetch_per_key);
      }
#endif
      break;
    case ScorePath::fast:
      ScoresFast<Decoder>(it, hs.q, tile.bases, hs.k_offset, tile.count, hs.kernel_scale, s.scores,
                          s.stride, prefetcher, prefetch_per_key);
      break;
    case ScorePath::exact:
      ScoresExact<Decoder>(it, hs.q, tile.bases, hs.k_offset, tile.count, hs.kernel_scale, s.exact,
                           s.fused, s.scores, s.stride, prefetcher, prefetch_per_key);
      break;
  }
  SoftmaxTile(it, s.scores, probs, s.stride, tile.first, tile.count, p_exp, hs.state);
}

// acc = alpha * acc + P . V over one tile for one head, on AMX tiles (value_scratch: scratch for
// the tile's V as B tiles), the bf16 dot products (value_scratch: scratch for the tile's P pairs),
// fp16 FMAs or fp32 FMAs (over V decoded once per tile into `decoded`'s rows where it has them:
// fp16 words or fp32); prefetch_rows prefetched rows a pass.
template <class Decoder>
void AccumulateHeadValues(const UnitPaths& paths, HeadState& hs, const TileRows& tile,
                          const float* HWY_RESTRICT probs, std::size_t stride,
                          [[maybe_unused]] std::uint16_t* value_scratch, const DecodedTile& decoded,
                          TilePrefetcher& prefetcher, int prefetch_rows) {
  const ItemContext& it = hs.it;
  if (paths.amx_values) {
#if MJOLNIR_AMX
    if constexpr (!std::is_void_v<DotOf<Decoder>>) {
      // P is in the A rows already where the scores ran on the tiles (SoftmaxColumns).
      ValuesAmx<DotOf<Decoder>>(hs.path == ScorePath::amx ? nullptr : probs, stride, it.rows,
                                paths.value_rows, tile.bases, hs.v_offset, tile.count,
                                std::size_t(it.d), hs.acc, it.ld, hs.state.alpha, value_scratch,
                                hs.prob_words, prefetcher, prefetch_rows);
    }
#endif
    return;
  }
  if (paths.dot_values) {
#if MJOLNIR_AMX
    if constexpr (!std::is_void_v<DotOf<Decoder>>) {
      ValuesDot<DotOf<Decoder>>(probs, stride, it.rows, tile.bases, hs.v_offset, tile.count,
                                std::size_t(it.d), hs.acc, it.ld, hs.state.alpha, value_scratch,
                                prefetcher, prefetch_rows);
    }
#endif
    return;
  }
  if (paths.half_values) {
#if MJOLNIR_HALF_VALUES
    VisitHalfDecoder(it.args->cache.geometry.format, [&]<class Half>() {
      ValuesHalf<Half>(probs, stride, it.rows, tile.bases, hs.v_offset, tile.count,
                       std::size_t(it.d), hs.acc, it.ld, hs.state.alpha, prefetcher, prefetch_rows,
                       decoded.rows, decoded.stride, decoded.bases);
    });
#endif
    return;
  }
  if (decoded.rows != nullptr) {
    const std::size_t d = std::size_t(it.d);
    for (int t = 0; t < tile.count; ++t) {
      DecodeRow<Decoder>(tile.bases[t] + hs.v_offset, d, reinterpret_cast<float*>(decoded.Row(t)));
    }
    AccumulateValues<DecodedRows<Decoder>>(it, probs, stride, decoded.bases, 0, tile.count, hs.acc,
                                           hs.state.alpha, prefetcher, prefetch_rows);
    return;
  }
  AccumulateValues<Decoder>(it, probs, stride, tile.bases, hs.v_offset, tile.count, hs.acc,
                            hs.state.alpha, prefetcher, prefetch_rows);
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_KERNEL_PATHS_INL_H_

// The CPU decode-attention kernel (see attention_kernel.h and docs/cpu-performance.md), compiled
// once per Highway target by foreach_target.h and dispatched at run time.
//
// A unit is the work items of one chunk for one or more KV heads (work_units.h): for each head,
// the R = q_len * g query rows against KV tokens [kv_begin, kv_end), in tiles of T tokens (the
// online-softmax tile: the plan's with P rounded, as the emulator runs it; with P in fp32 at most
// the plan's, sized to stay in L2, see FastPathTile). Per tile:
//   1. For each head, Q . K: K rows are decoded in registers (kv_decode-inl.h: the format's
//      channel order and a power-of-two scale, both folded into Q) and fed to register blocks
//      of fp32 FMAs (kernel_blocks-inl.h: 8 rows x 1 key, 4 x 2, or 4 x 4 with 32 registers):
//      each K byte is read once for all R rows. Then the online softmax of the tile
//      (online_softmax-inl.h).
//   2. For each head, P . V: V rows decoded the same way, accumulated by 4-row x 2-vector blocks
//      (4 x 4 with 32 registers).
// The tile's V rows are prefetched while its scores compute, and the next tile's K rows while
// its values accumulate (tile_prefetcher.h): pages are scattered through the block table, so no
// hardware prefetcher can follow a sequence from one page to the next.
// Which path each step takes (fp32 FMAs, the exact order, bf16 or int8 dot products, AMX tiles)
// is chosen once per unit and head by kernel_paths-inl.h; each path lives in its own -inl.h.
// This file holds the unit's set-up, the tile loop and step 5.
//
// Numerics. With P in fp32 scores use FMAs in any order and exp2 is a fast polynomial: they
// differ from the emulator by fp32 rounding only. With P in bf16 P is rounded from those same
// scores, as the contract allows (docs/numerics.md): a P code sitting on a bf16 tie can round
// to its neighbour; P . V then runs on bf16 words of V: on AMX tiles where the CPU has them
// (amx_values-inl.h), else on the bf16 dot products (dot_values-inl.h). With P in fp8, whose codes
// are 16 times coarser, the scores are computed in the emulator's exact order from true decoded
// values (exact_scores-inl.h) and exp2 is glibc's exp2f bit for bit (exp2-inl.h): the P codes match
// the emulator's exactly.
#include "cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention_kernel.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "cpu/kernel_paths-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/non_finite_codes-inl.h"
#include "cpu/online_softmax-inl.h"
#include "hwy/highway.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <type_traits>

#include "core/bf16_rows.h"
#include "core/fused_dot.h"
#include "core/minifloat.h"
#include "core/non_finite.h"
#include "core/query_codes.h"
#include "cpu/attention_kernel.h"
#include "cpu/item_context.h"
#include "cpu/tile_prefetcher.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if MJOLNIR_PORTABLE_TARGET

// Highway's fallback target: the scalar portable path item by item, then copy its rows out.
void RunWorkUnit(const KernelConfig&, const DecodeArgs& args, const Plan& plan,
                 const WorkItem* items, int heads, KernelScratch& scratch, const ItemOutput* outs) {
  const int d = args.cache.geometry.head_dim;
  const int rows = items[0].q_count * (args.params.num_q_heads / args.cache.geometry.num_kv_heads);
  for (int h = 0; h < heads; ++h) {
    run_attention_item(args, plan, items[h], scratch.portable);
    for (int r = 0; r < rows; ++r) {
      narrow_row(&scratch.portable.o[std::size_t(r) * d], outs[h].o_type, outs[h].o[r],
                 std::size_t(d));
      if (outs[h].lse[r] != nullptr) *outs[h].lse[r] = scratch.portable.lse[r];
      if (outs[h].stats != nullptr) {
        outs[h].stats[r][0] = scratch.portable.m[r];
        outs[h].stats[r][1] = scratch.portable.l[r];
      }
    }
  }
}

#else  // SIMD targets

using FloatTag = WideFloatTag;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum Slot : int {
  kQNatural,
  kQKernel,
  kKeys,
  kKeysNatural,
  kScores,
  kProbs,
  kAcc,
  kRowState,
  kRowOffsets,
  kQTiles,
  kAmxBuffers,
  kAmxValues,
  kDecodedValues,
  kDecodedKeys,
  kWideKeys
};
static_assert(kWideKeys + 1 == KernelScratch::kSlots, "a buffer for every slot");

// --- KV row addressing and prefetch ----------------------------------------------------------

// Start of token `pos`'s slot in its page (head 0, K): page * stride.page + in_page * stride.token,
// for the `count` tokens from `first`. A head's K or V row adds head * stride.head + kv *
// stride.kv.
void TokenBases(const ItemContext& it, const std::int32_t* pages, int first, int count,
                const std::uint8_t** bases) {
  const KvCacheView& cache = it.args->cache;
  const int page_size = cache.geometry.page_size;
  const auto* data = reinterpret_cast<const std::uint8_t*>(cache.data);
  for (int i = 0; i < count;) {
    const int pos = first + i;
    const int in_page = pos % page_size;
    const int run = std::min(count - i, page_size - in_page);
    const std::uint8_t* row = data + std::int64_t(pages[pos / page_size]) * cache.strides.page +
                              std::int64_t(in_page) * cache.strides.token;
    for (int j = 0; j < run; ++j) bases[i + j] = row + std::int64_t(j) * cache.strides.token;
    i += run;
  }
}

// --- the unit ---------------------------------------------------------------------------------

// K and V bytes of one tile (all the unit's heads) on the fast path. With the V rows and the next
// tile's K rows prefetched while it computes, an eighth of Zen 3's 512 KiB L2 keeps every row in
// L2 until it is used (Arm server cores have 1-2 MiB); 128 KiB was measurably slower for bf16.
inline constexpr std::size_t kFastTileBytes = std::size_t(64) << 10;

// Tokens per tile of the fast path (P in fp32): the largest power of two up to the plan's tile
// whose K and V rows fit kFastTileBytes, at least 8. With P rounded, P codes depend on each
// tile's running max, so the exact path runs the plan's tile as the emulator does; with P in
// fp32 the tile only moves where the running sums are rescaled, an fp32 rounding difference.
// Measured with `mjolnir bench` (2026-11-30, Zen 3, 2 threads, Hq 32, Hk 8, D 128, 32k tokens,
// median of 3 runs interleaved with the plan's 64-token tile): bf16 11.1 ms against 15.1 at
// batch 1 and 95 ms against 123 at batch 8, fp16 97 ms against 136; the formats whose tile
// stays at 32-64 tokens within the noise (±10%).
int FastPathTile(int plan_tile, int heads, std::size_t row_bytes) {
  const std::size_t token_bytes = 2 * std::size_t(heads) * row_bytes;
  int tile = 8;
  while (tile * 2 <= plan_tile && std::size_t(tile) * 2 * token_bytes <= kFastTileBytes) tile *= 2;
  return std::min(tile, plan_tile);
}

// y rounded to bf16 as core/bf16_rows.h does (nearest even, NaN as 0x7FC0), stored at out.
template <class DF, class V>
HWY_INLINE void StoreBf16([[maybe_unused]] DF df, V y, std::uint16_t* HWY_RESTRICT out) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<std::uint16_t, DF> d16;
  const auto u = hn::BitCast(du, y);
  const auto odd = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(hn::Add(u, hn::Set(du, 0x7FFFu)), odd));
  const auto bits = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(y)), hn::Set(du, 0x7FC0u), rounded);
  // A saturating demotion of values below 2^16: the identity (see row_encoder.cc on TruncateTo).
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, bits)), d16, out);
}

// Step 5 for every head of the unit: o = acc * v_scale / l, undoing the fold 2^(p_exp +
// v_raw_exp) and the channel order of the accumulators (channel c of O is gathered from column
// source_of[c]; nullptr: the natural order), and lse and the stats from m and l. One gather per
// vector: a scalar scatter of the channels cost a short decode step (8 sequences of 16 tokens)
// about 5% of its time. A bf16 O (a bf16 model's output tensor) is rounded as it is stored.
void WriteOutputs(const DecodeArgs& args, const WorkItem* items, int heads,
                  const HeadState* head_state, const ItemOutput* outs,
                  const std::int32_t* source_of, int fold_exp) {
  const KvCacheView& cache = args.cache;
  const FloatTag df;
  const hn::RebindToSigned<FloatTag> di;
  const int d = cache.geometry.head_dim;
  const bool channel_scales = cache.granularity == ScaleGranularity::channel;
  const float p_mode_scale = args.params.p_mode == PMode::fp8 ? 256.0f : 1.0f;
  const float unfold = std::ldexp(1.0f, -fold_exp);
  for (int h = 0; h < heads; ++h) {
    const HeadState& hs = head_state[h];
    const int kv_head = items[h].kv_head;
    const float* vs = channel_scales ? &cache.v_scale[std::size_t(kv_head) * d] : nullptr;
    const bool bf16 = outs[h].o_type == RowType::bf16;
    for (int r = 0; r < hs.it.rows; ++r) {
      void* o = outs[h].o[r];
      float* lse = outs[h].lse[r];
      const float l = hs.state.l[r];
      if (outs[h].stats != nullptr) {
        outs[h].stats[r][0] = hs.state.m[r];
        outs[h].stats[r][1] = l;
      }
      if (l == 0.0f) {  // the empty row: +0 in either type
        std::memset(o, 0, std::size_t(d) * element_bytes(outs[h].o_type));
        if (lse != nullptr) *lse = kNegInf;
        continue;
      }
      const float inv_l = 1.0f / (l * p_mode_scale);
      const float* a = hs.acc + r * hs.it.ld;
      const auto f = hn::Set(df, (vs ? 1.0f : cache.v_scale_at(kv_head, 0)) * inv_l * unfold);
      auto non_finite = hn::Zero(df);  // y - y: NaN where y is not finite
      for (int c = 0; c < d; c += int(hn::Lanes(df))) {
        const auto v = source_of != nullptr ? hn::GatherIndex(df, a, hn::LoadU(di, source_of + c))
                                            : hn::Load(df, a + c);
        const auto y = hn::Mul(v, vs ? hn::Mul(hn::LoadU(df, vs + c), f) : f);
        non_finite = hn::Add(non_finite, hn::Sub(y, y));
        if (bf16) {
          StoreBf16(df, y, static_cast<std::uint16_t*>(o) + c);
        } else {
          hn::StoreU(y, df, static_cast<float*>(o) + c);
        }
      }
      if (lse != nullptr) *lse = (hs.state.m[r] + std::log2(l)) * std::numbers::ln2_v<float>;
      // The non-finite policy (core/non_finite.h): a non-finite q (flagged), score (l = NaN,
      // hence O) or V value (O) poisons the row. Its l says so to a merge of token parts.
      if (hs.q_poisoned[r] != 0.0f || !hn::AllFalse(df, hn::IsNaN(non_finite))) {
        if (bf16) {
          std::fill_n(static_cast<std::uint16_t*>(o), d, bf16_from_float(kPoisonedRow));
          if (lse != nullptr) *lse = kPoisonedRow;
        } else {
          poison_row(static_cast<float*>(o), std::size_t(d), lse);
        }
        if (outs[h].stats != nullptr) outs[h].stats[r][1] = kPoisonedRow;
      }
    }
  }
}

// The work items of one chunk (same sequence and token range) for `heads` KV heads, tile by
// tile: every tile reads the rows of all the unit's heads, so a page's K and V (for all heads
// in the unit) are read at once, as contiguous memory in every layout. The paths each step
// takes are chosen once, by kernel_paths-inl.h.
template <class Decoder>
void RunUnit(const KernelConfig& config, const DecodeArgs& args, const Plan& plan,
             const WorkItem* items, int heads, KernelScratch& scratch, const ItemOutput* outs) {
  const KvCacheView& cache = args.cache;
  const CacheGeometry& geo = cache.geometry;
  const int d = geo.head_dim;
  const int g = args.params.num_q_heads / geo.num_kv_heads;
  const int rows = items[0].q_count * g;  // the unit's items share their query tile
  const UnitPaths paths = ChooseUnitPaths<Decoder>(config, args, rows);
  // With P rounded, P codes depend on each tile's running max: the plan's tile, as the emulator.
  const int tile = args.params.p_mode != PMode::fp32
                       ? plan.tile_tokens
                       : FastPathTile(plan.tile_tokens, heads, geo.row_bytes());
  const std::size_t stride = (std::size_t(tile) + 15) / 16 * 16 + 16;  // scores / probs rows
  const std::size_t ld = std::size_t(d) + 16;
  const std::int32_t* pages =
      args.batch.block_table.data() + std::size_t(items[0].seq) * args.batch.max_pages_per_seq;

  // Channel order of the decoded rows, and whether it is the natural one.
  std::int32_t* channel_of = scratch.ints(std::size_t(d));
  ChannelOrder<Decoder>(std::size_t(d), channel_of);
  bool natural = true;
  for (int i = 0; i < d; ++i) natural &= channel_of[i] == i;

  const std::size_t q_floats = paths.exact ? ExactPaddedRows(rows) * d : std::size_t(rows) * ld;
  // P . V folds 2^p_exp into P: p * 2^p_exp . raw v (= v 2^kRawExp). On the tiles and the dot
  // products V is decoded to true values (bf16 words) and P stays as rounded.
  const bool values_as_words = paths.amx_values || paths.dot_values;
  const int p_exp = values_as_words ? 0 : std::min(-Decoder::kRawExp, kMaxFoldExp);
  const int v_raw_exp = values_as_words ? 0 : Decoder::kRawExp;
  // The accumulator's rows: padded to whole A tiles on the tiles.
#if MJOLNIR_AMX
  const int acc_rows = paths.amx_values ? paths.value_rows : rows;
  // Q's transposed pairs: the tiles' B operand, and the dot products' in 16 x 16 blocks
  // (paths.pair_scores).
  const bool q_pairs = paths.amx_scores || paths.pair_scores;
  const std::size_t q_tile_words = q_pairs ? AmxQueryWords(rows, std::size_t(d)) : 0;
  std::uint16_t* q_tiles_all =
      q_pairs ? reinterpret_cast<std::uint16_t*>(scratch.floats(kQTiles, q_tile_words / 2 * heads))
              : nullptr;
#else
  const int acc_rows = rows;
#endif

  float* qn = scratch.floats(kQNatural, std::size_t(rows) * d);
  float* q_all = scratch.floats(kQKernel, q_floats * heads);
  float* acc_all = scratch.floats(kAcc, std::size_t(acc_rows) * ld * heads);
  float* state_all = scratch.floats(kRowState, 4 * std::size_t(rows) * heads);
  static_assert(std::is_trivially_destructible_v<HeadState>);
  HeadState* head_state = static_cast<HeadState*>(scratch.bytes(sizeof(HeadState) * heads));
  std::uninitialized_default_construct_n(head_state, heads);
  const ChannelOrderOf order{channel_of, natural};
  for (int h = 0; h < heads; ++h) {
    HeadState& hs = head_state[h];
    const WorkItem& item = items[h];
    hs.it = ItemContext{&args,
                        &item,
                        d,
                        g,
                        rows,
                        item.q_count,
                        tile,
                        plan.query_tiles[item.tile].kv_len,
                        args.params.causal,
                        args.params.p_mode,
                        geo.row_bytes(),
                        ld};
    hs.k_offset = std::int64_t(item.kv_head) * cache.strides.head;
    hs.v_offset = hs.k_offset + cache.strides.kv;
    hs.q = q_all + q_floats * h;
    hs.acc = acc_all + std::size_t(acc_rows) * ld * h;
    float* st = state_all + 4 * std::size_t(rows) * h;
    hs.state = RowState{st, st + rows, st + 2 * rows};
    hs.q_poisoned = st + 3 * rows;
    std::fill(hs.state.m, hs.state.m + rows, kNegInf);
    std::fill(hs.state.l, hs.state.l + rows, 0.0f);
    std::fill(hs.acc, hs.acc + std::size_t(acc_rows) * ld, 0.0f);

    const float score_scale = PrepareQuery(hs.it, qn, hs.q_poisoned);
    hs.path = HeadScorePath(paths, args.params.q_mode, qn, std::size_t(rows) * d);
    hs.q_tiles = nullptr;
#if MJOLNIR_AMX
    if (hs.path == ScorePath::amx || (hs.path == ScorePath::bf16_dot && paths.pair_scores)) {
      hs.q_tiles = q_tiles_all + q_tile_words * h;
      if (hs.path == ScorePath::bf16_dot) {
        ++scratch.counts.pair_scores;
        if (paths.fma_pair_scores) ++scratch.counts.fma_pair_scores;
      }
    }
#endif
    hs.prob_words = nullptr;
    PrepareHeadQuery<Decoder>(hs, qn, score_scale, order);
    CountPath(hs.path, scratch.counts);
  }

  ScoreScratch score_scratch{};
  score_scratch.stride = stride;
  static const bool fused = host_fuses_dot_products();  // the emulator's order
  score_scratch.fused = fused;
  if (paths.exact) {
    score_scratch.exact =
        ExactKeys{scratch.floats(kKeys, std::size_t(d)),
                  scratch.floats(kKeysNatural, std::size_t(kSubTokens) * d), channel_of, natural};
  }
  std::size_t column_floats = 0;
  std::uint16_t* value_scratch = nullptr;
#if MJOLNIR_AMX
  // On the tiles, scores are kept in the tiles' layout, [keys][padded rows] (amx_values-inl.h).
  if (paths.amx_values) {
    score_scratch.column_stride = std::size_t(AmxPaddedRows(rows));
    column_floats =
        std::size_t((tile + kAmxKeys - 1) / kAmxKeys) * kAmxKeys * score_scratch.column_stride;
  }
  if (paths.amx_scores) {
    score_scratch.amx_sums =
        scratch.floats(kAmxBuffers, kAmxSumFloats + AmxKeyWords(std::size_t(d)) / 2);
    score_scratch.amx_keys =
        reinterpret_cast<std::uint16_t*>(score_scratch.amx_sums + kAmxSumFloats);
  }
  if (paths.half_values) scratch.counts.half_values += std::uint64_t(heads);
  // P . V's scratch. On the dot products: the P pairs of one head's tile (A rows, unpadded).
  if (paths.dot_values) {
    value_scratch =
        reinterpret_cast<std::uint16_t*>(scratch.floats(kAmxValues, AmxProbWords(tile, rows) / 2));
    scratch.counts.dot_values += std::uint64_t(heads);
  }
  // V's B tiles of the tile (one head at a time), then each head's P A-rows.
  if (paths.amx_values) {
    const std::size_t value_words = AmxValueWords(tile, std::size_t(d));
    const std::size_t prob_words = AmxProbWords(tile, paths.value_rows);
    value_scratch = reinterpret_cast<std::uint16_t*>(
        scratch.floats(kAmxValues, (value_words + prob_words * heads) / 2));
    for (int h = 0; h < heads; ++h) {
      head_state[h].prob_words = value_scratch + value_words + prob_words * h;
      ++scratch.counts.amx_values;
    }
  }
  const AmxTiles amx_tiles(paths.amx_scores || paths.amx_values,
                           paths.amx_values ? paths.value_rows : kAmxRows);
#endif
  score_scratch.scores =
      scratch.floats(kScores, std::max(std::size_t(rows) * stride, column_floats));
  float* probs_all = scratch.floats(kProbs, std::size_t(rows) * stride * heads);
  // Token bases of this tile and the next, which is prefetched while this one computes; then
  // those of the V and K rows the unit decodes once per tile (paths.decoded_values / _keys).
  const std::uint8_t** bases = scratch.row_pointers(4 * std::size_t(tile));
  const std::uint8_t** next_bases = bases + tile;
  const auto decoded_tile = [&](int slot, std::size_t stride, const std::uint8_t** row_bases) {
    const DecodedTile decoded{reinterpret_cast<std::uint8_t*>(
                                  scratch.floats(slot, std::size_t(tile) * stride / sizeof(float))),
                              stride, row_bases};
    for (int t = 0; t < tile; ++t) row_bases[t] = decoded.Row(t);
    return decoded;
  };
  DecodedTile decoded_values;
  if (paths.decoded_values) {
    decoded_values = decoded_tile(kDecodedValues, std::size_t(d) * sizeof(float), bases + 2 * tile);
    scratch.counts.decoded_values += std::uint64_t(heads);
  }
  if (paths.decoded_keys) {
    if (!paths.fma_pair_scores) {  // which decodes into wide_keys instead
      score_scratch.decoded_keys = decoded_tile(
          kDecodedKeys, DecodedKeyStride(std::size_t(d), paths.int8), bases + 3 * tile);
    }
    scratch.counts.decoded_keys += std::uint64_t(heads);
  }
  score_scratch.wide_keys = paths.fma_pair_scores
                                ? scratch.floats(kWideKeys, std::size_t(tile + 15) / 16 * 16 * d)
                                : nullptr;

  // K and V row offsets of every head of the unit, for the prefetcher.
  std::int64_t* k_offsets = reinterpret_cast<std::int64_t*>(scratch.floats(kRowOffsets, 4 * heads));
  std::int64_t* v_offsets = k_offsets + heads;
  for (int h = 0; h < heads; ++h) {
    k_offsets[h] = head_state[h].k_offset;
    v_offsets[h] = head_state[h].v_offset;
  }
  TilePrefetcher prefetcher;
  const bool scan_codes = ScansForNonFiniteCodes<Decoder>(geo.format);
  const std::size_t row_bytes = geo.row_bytes();

  const int begin = items[0].kv_begin, end = items[0].kv_end;
  const auto tile_bases = [&](int first, const std::uint8_t** out) {
    const int n = first < end ? std::min(tile, end - first) : 0;
    if (n > 0) TokenBases(head_state[0].it, pages, first, n, out);
    return n;
  };
  tile_bases(begin, bases);
  // The first tile's K rows, before anything else is in flight.
  prefetcher.Reset(bases, std::min(tile, end - begin), k_offsets, heads, row_bytes);
  prefetcher.Issue(prefetcher.rows());
  for (int first = begin; first < end; first += tile) {
    const TileRows rows_of_tile{bases, first, std::min(tile, end - first)};
    const int count = rows_of_tile.count;
    const int next_count = tile_bases(first + tile, next_bases);
    // While the scores of this tile compute, its V rows are prefetched; while its values
    // accumulate, the next tile's K rows are. Each phase's prefetch is one phase ahead, and its
    // rows (all heads of a tile) fit in L2 beside the rows being used.
    prefetcher.Reset(bases, count, v_offsets, heads, row_bytes);
    const int per_key = (prefetcher.rows() + heads * count - 1) / (heads * count);

    // 1 and 2: scores and softmax, head by head; each head's P stays for step 3.
    for (int h = 0; h < heads; ++h) {
      ScoreHeadTile<Decoder>(paths, head_state[h], rows_of_tile, score_scratch, p_exp,
                             probs_all + std::size_t(h) * rows * stride, prefetcher, per_key);
    }

    // NaN and Inf codes this decoder would read as finite values poison the rows that see their
    // token (non_finite_codes-inl.h); a NaN l stays NaN through the softmax updates and P . V.
    // Scanned here, not before the scores: the tile's V rows have been prefetched by now, and a
    // scan ahead of them stalled on memory (fp8_e4m3 steps of 4 and 8 rows took 0.75-0.76x the
    // time on an AVX2 Zen 3, docs/cpu-experiments.md).
    if (scan_codes &&
        (RowsHaveNonFiniteCode(geo.format, bases, count, k_offsets, heads, row_bytes) ||
         RowsHaveNonFiniteCode(geo.format, bases, count, v_offsets, heads, row_bytes))) {
      for (int h = 0; h < heads; ++h) {
        HeadState& hs = head_state[h];
        for (int t = 0; t < count; ++t) {
          if (!RowHasNonFiniteCode(geo.format, bases[t] + hs.k_offset, row_bytes) &&
              !RowHasNonFiniteCode(geo.format, bases[t] + hs.v_offset, row_bytes)) {
            continue;
          }
          for (int r = 0; r < rows; ++r) {
            if (LiveTokens(hs.it, r, first, count) > t) hs.state.l[r] = kPoisonedRow;
          }
        }
      }
    }

    // 3. P . V, head by head, prefetching the next tile's K rows.
    prefetcher.Reset(next_bases, next_count, k_offsets, heads, row_bytes);
    int per_pass;
    if (paths.amx_values) {
      per_pass = (prefetcher.rows() + heads * count - 1) / std::max(heads * count, 1);
    } else if (paths.dot_values) {  // a pass: 64 channels of up to 4 rows
      const int passes = heads * (d / 64) * (rows / 4 + rows % 4);
      per_pass = (prefetcher.rows() + passes - 1) / passes;
    } else {
      const int passes = heads * int(d / hn::Lanes(typename Decoder::Tag()) / 2) * ((rows + 3) / 4);
      per_pass = (prefetcher.rows() + passes - 1) / passes;
    }
    for (int h = 0; h < heads; ++h) {
      AccumulateHeadValues<Decoder>(paths, head_state[h], rows_of_tile,
                                    probs_all + std::size_t(h) * rows * stride, stride,
                                    value_scratch, decoded_values, prefetcher, per_pass);
    }
    std::swap(bases, next_bases);
  }

  // Where each output channel's accumulator is: the decoder's order inverted, or the AMX
  // value tiles' order.
  std::int32_t inverse[kMaxHeadDim];
  const std::int32_t* source_of = nullptr;
  if (!natural) {
    for (int i = 0; i < d; ++i) inverse[channel_of[i]] = i;
    source_of = inverse;
  }
#if MJOLNIR_AMX
  if constexpr (!std::is_void_v<DotOf<Decoder> >) {
    if (values_as_words) {
      for (int i = 0; i < d; ++i) inverse[AmxValueChannel<DotOf<Decoder> >(i)] = i;
      source_of = inverse;
    }
  }
#endif
  WriteOutputs(args, items, heads, head_state, outs, source_of, p_exp + v_raw_exp);
}

void RunWorkUnit(const KernelConfig& config, const DecodeArgs& args, const Plan& plan,
                 const WorkItem* items, int heads, KernelScratch& scratch, const ItemOutput* outs) {
  VisitKernelDecoder(args.cache.geometry.format, std::size_t(args.cache.geometry.head_dim),
                     config.avoid_fp32_subnormals, [&]<class Decoder>() {
                       RunUnit<Decoder>(config, args, plan, items, heads, scratch, outs);
                     });
}

#endif  // MJOLNIR_PORTABLE_TARGET

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

bool HasBf16Dot() {
#if !MJOLNIR_PORTABLE_TARGET && MJOLNIR_BF16_DOT
  return CpuHasBf16Dot();
#else
  return false;
#endif
}

bool HasInt8Dot() {
#if !MJOLNIR_PORTABLE_TARGET && MJOLNIR_INT8_DOT
  return CpuHasInt8Dot();
#else
  return false;
#endif
}

bool HasInt8DotFor(Format format) {
#if !MJOLNIR_PORTABLE_TARGET && MJOLNIR_INT8_DOT
  return CpuHasInt8Dot() && HasIntDecoder(format);
#else
  (void)format;
  return false;
#endif
}

bool HasHalfValuesFor(Format format) {
#if !MJOLNIR_PORTABLE_TARGET && MJOLNIR_HALF_VALUES
  return CpuHasHalfFma() && HasHalfDecoder(format);
#else
  (void)format;
  return false;
#endif
}

// Which rows a unit of `rows` query rows decodes once per tile, P in fp32 and no AMX tiles: what
// ChooseUnitPaths sets, by the same rule (SetDecodedOnce).
DecodedOnce DecodesOnce(Format format, QMode q_mode, int rows, int head_dim) {
#if !MJOLNIR_PORTABLE_TARGET
  UnitPaths paths;
  paths.int8 = q_mode == QMode::int8 && HasInt8DotFor(format) && head_dim % 128 == 0;
  paths.dot_scores = HasBf16Dot() && format != Format::fp16 && head_dim % 64 == 0;
  SetDecodedOnce(format, q_mode, rows, paths);
  return {paths.decoded_keys, paths.decoded_values};
#else
  (void)format, (void)q_mode, (void)rows, (void)head_dim;
  return {};
#endif
}

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

namespace mjolnir::cpu {

HWY_EXPORT(RunWorkUnit);
HWY_EXPORT(TargetName);
HWY_EXPORT(HasBf16Dot);
HWY_EXPORT(HasInt8Dot);
HWY_EXPORT(HasInt8DotFor);
HWY_EXPORT(HasHalfValuesFor);
HWY_EXPORT(DecodesOnce);

float* KernelScratch::floats(int slot, std::size_t count) {
  if (capacity_[slot] < count) {
    floats_[slot] = hwy::AllocateAligned<float>(count);
    capacity_[slot] = count;
  }
  return floats_[slot].get();
}

std::int32_t* KernelScratch::ints(std::size_t count) {
  if (ints_.size() < count) ints_.resize(count);
  return ints_.data();
}

const std::uint8_t** KernelScratch::row_pointers(std::size_t count) {
  if (rows_.size() < count) rows_.resize(count);
  return rows_.data();
}

void* KernelScratch::bytes(std::size_t count) {
  if (bytes_capacity_ < count) {
    bytes_ = hwy::AllocateAligned<std::uint8_t>(count);
    bytes_capacity_ = count;
  }
  return bytes_.get();
}

bool bf16_dot_applies(const KernelConfig& config, Format format, QMode q_mode, int head_dim) {
  // The formats whose codes are all bf16 values (bf16_dot-inl.h has a decoder for each).
  const bool bf16_codes = format != Format::fp16;
  return config.bf16_dot && bf16_codes &&
         (q_mode == QMode::bf16 || q_mode == QMode::fp8 || q_mode == QMode::int8) &&
         head_dim % 64 == 0;
}

bool cpu_has_bf16_dot() { return HWY_DYNAMIC_DISPATCH(HasBf16Dot)(); }

bool cpu_has_int8_dot() { return HWY_DYNAMIC_DISPATCH(HasInt8Dot)(); }

DecodedOnce decoded_once(Format format, QMode q_mode, int rows, int head_dim) {
  return HWY_DYNAMIC_DISPATCH(DecodesOnce)(format, q_mode, rows, head_dim);
}

bool int8_dot_applies(Format format, int head_dim) {
  return head_dim % 128 == 0 && HWY_DYNAMIC_DISPATCH(HasInt8DotFor)(format);
}

bool half_values_apply(Format format, int head_dim) {
  return head_dim % 128 == 0 && HWY_DYNAMIC_DISPATCH(HasHalfValuesFor)(format);
}

bool amx_scores_apply(const KernelConfig& config, Format format, int rows, int head_dim) {
  return rows >= kAmxMinRows && config.amx &&
         bf16_dot_applies(config, format, QMode::bf16, head_dim);
}

bool dot_scores_apply(const KernelConfig& config, Format format, int rows, int head_dim) {
  return bf16_dot_applies(config, format, QMode::bf16, head_dim) &&
         (config.bf16_dot_below_tiles || amx_scores_apply(config, format, rows, head_dim));
}

bool dot_values_apply(const KernelConfig& config, Format format, PMode p_mode, int head_dim) {
  return p_mode == PMode::bf16 && bf16_dot_applies(config, format, QMode::bf16, head_dim);
}

bool amx_values_apply(const KernelConfig& config, Format format, PMode p_mode, int head_dim) {
  // The tiles take V as the dot products' words (config.amx implies config.bf16_dot).
  return config.amx && dot_values_apply(config, format, p_mode, head_dim);
}

void run_work_unit(const KernelConfig& config, const DecodeArgs& args, const Plan& plan,
                   const WorkItem* items, int heads, KernelScratch& scratch,
                   const ItemOutput* outs) {
  HWY_DYNAMIC_DISPATCH(RunWorkUnit)(config, args, plan, items, heads, scratch, outs);
}

std::vector<std::string> kernel_targets() {
  std::vector<std::string> names;
  // Lower bits are better targets in Highway's encoding, so this lists the best first.
  for (std::int64_t targets = HWY_TARGETS; targets != 0; targets &= targets - 1) {
    names.emplace_back(hwy::TargetName(targets & -targets));
  }
  return names;
}

std::string kernel_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace mjolnir::cpu

#endif  // HWY_ONCE

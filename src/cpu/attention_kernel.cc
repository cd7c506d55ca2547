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
//
// Numerics. With P in fp32 scores use FMAs in any order and exp2 is a fast polynomial: they
// differ from the emulator by fp32 rounding only. With P in bf16 P is rounded from those same
// scores, as the contract allows (docs/numerics.md): a P code sitting on a bf16 tie can round
// to its neighbour; from 8 query rows on CPUs with AMX, P . V then runs on the tiles
// (amx_values-inl.h). With P in fp8, whose codes are 16 times coarser, the scores are computed in
// the emulator's exact order from true decoded values (exact_scores-inl.h) and exp2 is glibc's
// exp2f bit for bit (exp2-inl.h): the P codes match the emulator's exactly.
#include "cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention_kernel.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "cpu/amx_scores-inl.h"
#include "cpu/amx_values-inl.h"
#include "cpu/bf16_dot-inl.h"
#include "cpu/exact_scores-inl.h"
#include "cpu/int8_dot-inl.h"
#include "cpu/kernel_blocks-inl.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/minifloat_simd-inl.h"
#include "cpu/non_finite_codes-inl.h"
#include "cpu/online_softmax-inl.h"
#include "cpu/word_decoders-inl.h"
#include "hwy/highway.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <type_traits>

#include "core/minifloat.h"
#include "core/non_finite.h"
#include "core/query_codes.h"
#include "cpu/amx.h"
#include "cpu/attention_kernel.h"
#include "cpu/item_context.h"
#include "cpu/tile_prefetcher.h"

namespace mjolnir::cpu {
extern std::atomic<std::uint64_t> g_bf16_dot_items;  // behind bf16_dot_items()
extern std::atomic<std::uint64_t> g_int8_dot_items;  // behind int8_dot_items()
}  // namespace mjolnir::cpu

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if MJOLNIR_PORTABLE_TARGET

// Highway's fallback target: the scalar portable path item by item, then copy its rows out.
void RunWorkUnit(const DecodeArgs& args, const Plan& plan, const WorkItem* items, int heads,
                 KernelScratch& scratch, const ItemOutput* outs) {
  const int d = args.cache.geometry.head_dim;
  const int rows = items[0].q_count * (args.params.num_q_heads / args.cache.geometry.num_kv_heads);
  for (int h = 0; h < heads; ++h) {
    run_attention_item(args, plan, items[h], scratch.portable);
    for (int r = 0; r < rows; ++r) {
      std::copy_n(&scratch.portable.o[std::size_t(r) * d], d, outs[h].o[r]);
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
// Keys decoded per pass of the exact path: their fp32 rows (16 x D floats, 8 KiB at D = 128)
// stay in L1 while every query row uses them.
constexpr int kSubTokens = 16;
// Largest power of two folded into Q or P to bring raw decoded values back to a normal range
// (kv_decode-inl.h): big enough for every format, small enough that Q up to 2^25 and P up to 256
// stay finite.
constexpr int kMaxFoldExp = 100;

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
  kAmxValues
};

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

// --- Q ------------------------------------------------------------------------------------------

// Step 1 of the contract for all R rows, exactly as the emulator does it: per-channel K scales
// folded in, then rounded per Q mode. Writes qn [R][D] in natural channel order and returns the
// score scale sq * k_scale * softmax_scale * log2(e). A row with a NaN or an infinity is zeroed
// and flagged in poisoned [R] (1, else 0): the fp8 scale of the other rows is as if it were not
// there, and the row comes out NaN (core/non_finite.h).
float PrepareQuery(const ItemContext& it, float* HWY_RESTRICT qn, float* HWY_RESTRICT poisoned) {
  const DecodeArgs& args = *it.args;
  const KvCacheView& cache = args.cache;
  const FloatTag df;
  const std::size_t n = hn::Lanes(df);
  const int d = it.d;
  const bool channel_scales = cache.granularity == ScaleGranularity::channel;
  const float* ks = channel_scales ? &cache.k_scale[std::size_t(it.item->kv_head) * d] : nullptr;
  auto amax = hn::Zero(df);
  for (int r = 0; r < it.rows; ++r) {
    const float* q = args.q_row(*it.item, r, it.g);
    float* out = qn + std::size_t(r) * d;
    auto row_max = hn::Zero(df);
    auto non_finite = hn::Zero(df);  // x - x: NaN where x is not finite
    for (int c = 0; c < d; c += int(n)) {
      auto v = hn::LoadU(df, q + c);
      if (channel_scales) v = hn::Mul(v, hn::LoadU(df, ks + c));
      row_max = hn::Max(row_max, hn::Abs(v));
      non_finite = hn::Add(non_finite, hn::Sub(v, v));
      hn::Store(v, df, out + c);
    }
    poisoned[r] = hn::AllFalse(df, hn::IsNaN(non_finite)) ? 0.0f : 1.0f;
    if (poisoned[r] != 0.0f) {
      std::fill(out, out + d, 0.0f);
    } else {
      amax = hn::Max(amax, row_max);
    }
  }
  const std::size_t total = std::size_t(it.rows) * d;
  float sq = 1.0f;
  if (args.params.q_mode == QMode::bf16) {
    for (std::size_t i = 0; i < total; i += n) {
      hn::Store(RoundToMinifloat<kBf16Spec>(df, hn::Load(df, qn + i)), df, qn + i);
    }
  } else if (args.params.q_mode == QMode::fp8) {
    const float max_abs = hn::GetLane(hn::MaxOfLanes(df, amax));
    if (max_abs > 0.0f) sq = max_abs / kQFp8Max;
    const auto divisor = hn::Set(df, sq);
    for (std::size_t i = 0; i < total; i += n) {
      const auto x = hn::Div(hn::Load(df, qn + i), divisor);
      hn::Store(RoundToMinifloat<kE4M3Spec>(df, x), df, qn + i);
    }
  } else if (args.params.q_mode == QMode::int8) {  // as int8_code: nearest, ties to even
    const float max_abs = hn::GetLane(hn::MaxOfLanes(df, amax));
    if (max_abs > 0.0f) sq = max_abs / kQInt8Max;
    const auto divisor = hn::Set(df, sq);
    const auto top = hn::Set(df, kQInt8Max);
    for (std::size_t i = 0; i < total; i += n) {
      const auto x = hn::Round(hn::Div(hn::Load(df, qn + i), divisor));
      hn::Store(hn::Min(hn::Max(x, hn::Neg(top)), top), df, qn + i);
    }
  }
  const float k_outer = channel_scales ? 1.0f : cache.k_scale_at(it.item->kv_head, 0);
  return sq * k_outer * args.params.effective_softmax_scale(d) * std::numbers::log2e_v<float>;
}

// Whether every one of the count values is a bf16 value (its low 16 bits are zero): Q in fp32
// mode is then Q in bf16 mode, a bf16 model's queries with per-tensor or per-head K scales.
bool AllBf16Values(const float* HWY_RESTRICT x, std::size_t count) {
  const FloatTag df;
  const hn::RebindToUnsigned<FloatTag> du;
  auto low = hn::Zero(du);
  for (std::size_t i = 0; i < count; i += hn::Lanes(df)) {
    low = hn::Or(low, hn::BitCast(du, hn::Load(df, x + i)));
  }
  return hn::AllTrue(du, hn::Eq(hn::And(low, hn::Set(du, 0xFFFFu)), hn::Zero(du)));
}

// Largest |q| of the prepared rows.
float MaxAbs(const float* HWY_RESTRICT x, std::size_t count) {
  const FloatTag df;
  auto m = hn::Zero(df);
  for (std::size_t i = 0; i < count; i += hn::Lanes(df))
    m = hn::Max(m, hn::Abs(hn::Load(df, x + i)));
  return hn::GetLane(hn::MaxOfLanes(df, m));
}

// --- scores -------------------------------------------------------------------------------------

// Stores the scores of 4 rows (`stride` apart) for keys t (a0) and t + 1 (a1) at out[row * stride]
// and out[row * stride + 1]: each row's two scores sit side by side, so two shuffles and four
// 8-byte stores do it, where eight single-lane stores cost a shuffle each.
HWY_INLINE void StoreRowPairs(Float4 a0, Float4 a1, float* out, std::size_t stride) {
  const Float4Tag d4;
  const hn::CappedTag<float, 2> d2;
  const auto rows01 = hn::InterleaveLower(d4, a0, a1);  // r0 t, r0 t+1, r1 t, r1 t+1
  const auto rows23 = hn::InterleaveUpper(d4, a0, a1);
  hn::StoreU(hn::LowerHalf(d2, rows01), d2, out);
  hn::StoreU(hn::UpperHalf(d2, rows01), d2, out + stride);
  hn::StoreU(hn::LowerHalf(d2, rows23), d2, out + 2 * stride);
  hn::StoreU(hn::UpperHalf(d2, rows23), d2, out + 3 * stride);
}

// Stores the scores of 4 rows for one key at out[row * stride].
HWY_INLINE void StoreRowColumn(Float4 a, float* out, std::size_t stride) {
  alignas(16) float s[4];
  hn::Store(a, Float4Tag(), s);
  for (int j = 0; j < 4; ++j) out[j * stride] = s[j];
}

// Fast path: scores[r][first + t] = scale * q_r . k_t for the count K rows at bases[t] + offset,
// with kernel-ready Q [R][D] (the decoder's channel order, folded power of two). The K rows of
// the next tile are prefetched along the way, `prefetch_per_key` rows per key.
template <class Dec>
void ScoresFast(const ItemContext& it, const float* HWY_RESTRICT q,
                const std::uint8_t* const* bases, std::int64_t offset, int count, float scale,
                float* HWY_RESTRICT scores, std::size_t stride, TilePrefetcher& prefetch,
                int prefetch_per_key) {
  const std::size_t d = std::size_t(it.d);
  const std::size_t chunks = d / ChunkChannels<Dec>();
  const auto scale4 = hn::Set(Float4Tag(), scale);
  // Keys per block of 4 rows: 4 where 32 registers hold a 4 x 4 block (whose loop takes 4
  // vectors per step), else 2.
  constexpr int kKeys = kWideRegisterFile ? 4 : 2;
  const bool quads = d % (4 * hn::Lanes(typename Dec::Tag())) == 0;
  // Keys t .. t + keys - 1 (keys 1 to kKeys) against every row.
  const auto score_keys = [&](int t, int keys) HWY_ATTR {
    prefetch.Issue(keys * prefetch_per_key);
    const std::uint8_t* k[4];
    for (int i = 0; i < 4; ++i) k[i] = bases[t + std::min(i, keys - 1)] + offset;
    int r = 0;
    for (; r + 8 <= it.rows; r += 8) {
      for (int i = 0; i < keys; ++i) {
        ScoreBlock8x1<Dec>(q + r * it.ld, it.ld, d, k[i], scale, scores + r * stride + t + i,
                           stride);
      }
    }
    for (; r + 4 <= it.rows; r += 4) {
      float* out = scores + r * stride + t;
      if constexpr (kKeys == 4) {
        if (keys == 4 && quads) {
          ScoreBlock4x4<Dec>(q + r * it.ld, it.ld, d, k, scale, out, stride);
          continue;
        }
      }
      for (int i = 0; i < keys; i += 2) {
        Float4 a0, a1;
        ScoreBlock4x2<Dec>(q + r * it.ld, it.ld, d, k[i], k[i + 1], 0, chunks, a0, a1);
        if (i + 1 < keys) {
          StoreRowPairs(hn::Mul(a0, scale4), hn::Mul(a1, scale4), out + i, stride);
        } else {
          StoreRowColumn(hn::Mul(a0, scale4), out + i, stride);
        }
      }
    }
    for (; r < it.rows; ++r) {
      for (int i = 0; i < keys; i += 2) {
        float s0, s1;
        ScoreBlock1x2<Dec>(q + r * it.ld, d, k[i], k[i + 1], &s0, &s1);
        scores[r * stride + t + i] = s0 * scale;
        if (i + 1 < keys) scores[r * stride + t + i + 1] = s1 * scale;
      }
    }
  };
  for (int t = 0; t < count; t += kKeys) score_keys(t, std::min(kKeys, count - t));
}

// --- P . V ---------------------------------------------------------------------------------------

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

// Where the int8 path keeps each row's starting sum: after Q's [R][D] bytes, 64-byte aligned,
// inside the [R][D + 16] floats of a head's Q buffer.
inline std::int32_t* Int8Starts(float* q, int rows, int d) {
  return reinterpret_cast<std::int32_t*>(q) + (std::size_t(rows) * d + 63) / 64 * 16;
}

// One KV head of a unit: its prepared Q and running softmax state.
struct HeadState {
  ItemContext it;
  float* q;                         // kernel-ready Q: [R][D] (fast) or [D][rows_padded] (exact)
  float kernel_scale;               // turns q . k as computed into log2-scaled scores
  bool dot;                         // Q . K on bf16 dot products (q: bf16 words)
  bool int8;                        // Q . K in integers (q: int8 bytes, then Int8Starts)
  std::uint16_t* q_tiles;           // Q . K on AMX tiles: Q's B tiles, else null
  float* acc;                       // [R][D] O accumulator, decoder channel order
  RowState state;                   // m, l, alpha: [R] each
  float* q_poisoned;                // [R]: 1 where the row's q is not finite
  std::int64_t k_offset, v_offset;  // head's K and V rows from a token's base
};

// The work items of one chunk (same sequence and token range) for `heads` KV heads, tile by
// tile: every tile reads the rows of all the unit's heads, so a page's K and V (for all heads
// in the unit) are read at once, as contiguous memory in every layout.
template <class Decoder>
void RunUnit(const DecodeArgs& args, const Plan& plan, const WorkItem* items, int heads,
             KernelScratch& scratch, const ItemOutput* outs) {
  const KvCacheView& cache = args.cache;
  const CacheGeometry& geo = cache.geometry;
  const FloatTag df;
  const int d = geo.head_dim;
  const int g = args.params.num_q_heads / geo.num_kv_heads;
  const int rows = items[0].q_count * g;  // the unit's items share their query tile
  const bool p_rounded = args.params.p_mode != PMode::fp32;
#if MJOLNIR_BF16_DOT
  using Dot = typename DotDecoderOf<Decoder>::type;
  // P mode bf16 rounds P from the kernel's own scores (docs/numerics.md), and where the tiles
  // exist takes P . V onto them (amx_values-inl.h); P mode fp8, whose codes are 16 times
  // coarser, computes the scores in the emulator's order (the exact path), so that its P codes
  // are the emulator's.
  const bool amx_values = !std::is_void_v<Dot> && rows >= kAmxMinRows &&
                          amx_values_apply(geo.format, args.params.p_mode, d);
  const bool exact = args.params.p_mode == PMode::fp8;
  // Per head below: Q in fp32 mode takes them too where its values are bf16 values.
  const bool dot_format =
      !std::is_void_v<Dot> && !exact && bf16_dot_applies(geo.format, QMode::bf16, d);
  // Where the dot products apply, Q . K goes on AMX tiles instead on CPUs that have them.
  const bool amx_format = dot_format && rows >= kAmxMinRows && amx_enabled() && cpu_has_amx();
#else
  const bool exact = args.params.p_mode == PMode::fp8;
  constexpr bool amx_values = false;
  constexpr bool dot_format = false;
  constexpr bool amx_format = false;
#endif
  // Q mode int8 against e2m1 or e2m3 codes: Q . K in integers on VNNI (int8_dot-inl.h), below the
  // rows where the AMX tiles take it.
#if MJOLNIR_INT8_DOT
  const bool int8_dot = args.params.q_mode == QMode::int8 && HasIntDecoder(geo.format) &&
                        d % int(kInt8Chunk) == 0 && !exact && !amx_format && CpuHasInt8Dot();
#else
  constexpr bool int8_dot = false;
#endif
  // With P rounded, P codes depend on each tile's running max: the plan's tile, as the emulator.
  const int tile =
      p_rounded ? plan.tile_tokens : FastPathTile(plan.tile_tokens, heads, geo.row_bytes());
  static const bool fused = baseline_fuses_multiply_add();
  const std::size_t stride = (std::size_t(tile) + 15) / 16 * 16 + 16;  // scores / probs rows
  const std::size_t ld = std::size_t(d) + 16;
  const std::int32_t* pages =
      args.batch.block_table.data() + std::size_t(items[0].seq) * args.batch.max_pages_per_seq;

  // Channel order of the decoded rows, and whether it is the natural one.
  std::int32_t* channel_of = scratch.ints(std::size_t(d));
  ChannelOrder<Decoder>(std::size_t(d), channel_of);
  bool natural = true;
  for (int i = 0; i < d; ++i) natural &= channel_of[i] == i;

  const hn::CappedTag<float, 4> de4;
  const std::size_t exact_lanes = rows <= 4 ? hn::Lanes(de4) : hn::Lanes(df);
  const std::size_t rows_padded = (std::size_t(rows) + exact_lanes - 1) / exact_lanes * exact_lanes;
  const std::size_t q_floats = exact ? rows_padded * d : std::size_t(rows) * ld;
  // P . V folds 2^p_exp into P: p * 2^p_exp . raw v (= v 2^kRawExp). On the tiles V is decoded
  // to true values and P stays as rounded.
  const int p_exp = amx_values ? 0 : std::min(-Decoder::kRawExp, kMaxFoldExp);
  const int v_raw_exp = amx_values ? 0 : Decoder::kRawExp;
  // The accumulator's rows: padded to whole A tiles on the tiles.
#if MJOLNIR_AMX
  const int acc_rows = amx_values ? AmxPaddedRows(rows) : rows;
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
    hs.q_tiles = nullptr;
    hs.int8 = int8_dot;
    hs.dot = !int8_dot && dot_format &&
             (args.params.q_mode != QMode::fp32 || AllBf16Values(qn, std::size_t(rows) * d));
    if (hs.int8) {  // signed bytes in the decoder's channel order, and each row's start
#if MJOLNIR_INT8_DOT
      g_int8_dot_items.fetch_add(1, std::memory_order_relaxed);
      VisitIntDecoder(geo.format, [&]<class Int>() {
        PrepareInt8Query<Int>(qn, rows, std::size_t(d), reinterpret_cast<std::int8_t*>(hs.q),
                              Int8Starts(hs.q, rows, d));
        hs.kernel_scale = score_scale / Int::kFactor;
      });
#endif
    } else if (hs.dot) {  // bf16 words in the dot decoder's channel order, true values
      g_bf16_dot_items.fetch_add(1, std::memory_order_relaxed);
#if MJOLNIR_BF16_DOT
      if constexpr (!std::is_void_v<Dot>) {
        PrepareDotQuery<Dot>(qn, rows, std::size_t(d), ld, reinterpret_cast<std::uint16_t*>(hs.q));
        if (amx_format) {
          const std::size_t words = AmxQueryWords(rows, std::size_t(d));
          hs.q_tiles =
              reinterpret_cast<std::uint16_t*>(scratch.floats(kQTiles, words / 2 * heads)) +
              words * h;
          PrepareAmxQuery(reinterpret_cast<const std::uint16_t*>(hs.q), 2 * ld, rows,
                          std::size_t(d), hs.q_tiles);
          count_amx_item();
        }
      }
#endif
      hs.kernel_scale = score_scale;
    } else if (exact) {  // true values, transposed: lanes are query rows
      std::fill(hs.q, hs.q + rows_padded * d, 0.0f);
      for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < d; ++c)
          hs.q[std::size_t(c) * rows_padded + r] = qn[std::size_t(r) * d + c];
      }
      hs.kernel_scale = score_scale;
    } else {  // decoder channel order, times 2^q_exp to meet raw k (= k 2^kRawExp)
      int q_top = 0;
      std::frexp(MaxAbs(qn, std::size_t(rows) * d), &q_top);  // max |q| < 2^q_top
      const int q_exp = std::min({-Decoder::kRawExp, kMaxFoldExp, 125 - q_top});
      const float fold = std::ldexp(1.0f, q_exp);
      for (int r = 0; r < rows; ++r) {
        const float* src = qn + std::size_t(r) * d;
        float* dst = hs.q + r * ld;
        if (natural) {
          const auto vf = hn::Set(df, fold);
          for (int c = 0; c < d; c += int(hn::Lanes(df)))
            hn::Store(hn::Mul(hn::Load(df, src + c), vf), df, dst + c);
        } else {
          for (int i = 0; i < d; ++i) dst[i] = src[channel_of[i]] * fold;
        }
      }
      hs.kernel_scale = std::ldexp(score_scale, -(q_exp + Decoder::kRawExp));
    }
  }

  float* keys = exact ? scratch.floats(kKeys, std::size_t(d)) : nullptr;
  float* keys_natural = exact ? scratch.floats(kKeysNatural, std::size_t(kSubTokens) * d) : nullptr;
#if MJOLNIR_AMX
  // On the tiles, scores are kept in the tiles' layout, [keys][padded rows] (amx_values-inl.h).
  const std::size_t column_stride = amx_values ? std::size_t(AmxPaddedRows(rows)) : 0;
  const std::size_t column_floats =
      std::size_t((tile + kAmxKeys - 1) / kAmxKeys) * kAmxKeys * column_stride;
#else
  const std::size_t column_floats = 0;
#endif
  float* scores = scratch.floats(kScores, std::max(std::size_t(rows) * stride, column_floats));
#if MJOLNIR_AMX
  float* amx_sums =
      amx_format ? scratch.floats(kAmxBuffers, kAmxSumFloats + AmxKeyWords(std::size_t(d)) / 2)
                 : nullptr;
  std::uint16_t* amx_keys =
      amx_format ? reinterpret_cast<std::uint16_t*>(amx_sums + kAmxSumFloats) : nullptr;
  // V's B tiles of the tile (one head at a time), then each head's P A-rows.
  std::uint16_t* amx_value_tiles = nullptr;
  std::uint16_t* amx_prob_words = nullptr;
  const std::size_t prob_words = amx_values ? AmxProbWords(tile, rows) : 0;
  if (amx_values) {
    const std::size_t value_words = AmxValueWords(tile, std::size_t(d));
    amx_value_tiles = reinterpret_cast<std::uint16_t*>(
        scratch.floats(kAmxValues, (value_words + prob_words * heads) / 2));
    amx_prob_words = amx_value_tiles + value_words;
    for (int h = 0; h < heads; ++h) count_amx_value_item();
  }
  const AmxTiles amx_tiles(amx_format || amx_values);
#endif
  float* probs_all = scratch.floats(kProbs, std::size_t(rows) * stride * heads);
  // Token bases of this tile and the next, which is prefetched while this one computes.
  const std::uint8_t** bases = scratch.row_pointers(2 * std::size_t(tile));
  const std::uint8_t** next_bases = bases + tile;
  const float raw_k_to_true = std::ldexp(1.0f, -Decoder::kRawExp);

  // K and V row offsets of every head of the unit, for the prefetcher.
  std::int64_t* k_offsets = reinterpret_cast<std::int64_t*>(scratch.floats(kRowOffsets, 4 * heads));
  std::int64_t* v_offsets = k_offsets + heads;
  for (int h = 0; h < heads; ++h) {
    k_offsets[h] = head_state[h].k_offset;
    v_offsets[h] = head_state[h].v_offset;
  }
  TilePrefetcher prefetcher;
  const bool scan_codes = ScansForNonFiniteCodes<Decoder>(geo.format);

  const int begin = items[0].kv_begin, end = items[0].kv_end;
  const auto tile_bases = [&](int first, const std::uint8_t** out) {
    const int n = first < end ? std::min(tile, end - first) : 0;
    if (n > 0) TokenBases(head_state[0].it, pages, first, n, out);
    return n;
  };
  tile_bases(begin, bases);
  // The first tile's K rows, before anything else is in flight.
  prefetcher.Reset(bases, std::min(tile, end - begin), k_offsets, heads,
                   head_state[0].it.row_bytes);
  prefetcher.Issue(prefetcher.rows());
  for (int first = begin; first < end; first += tile) {
    const int count = std::min(tile, end - first);
    const int next_count = tile_bases(first + tile, next_bases);
    // While the scores of this tile compute, its V rows are prefetched; while its values
    // accumulate, the next tile's K rows are. Each phase's prefetch is one phase ahead, and its
    // rows (all heads of a tile) fit in L2 beside the rows being used.
    prefetcher.Reset(bases, count, v_offsets, heads, head_state[0].it.row_bytes);
    int prefetch_rows = (prefetcher.rows() + heads * count - 1) / (heads * count);  // per key

    // NaN and Inf codes this decoder would read as finite values poison the rows that see their
    // token (non_finite_codes-inl.h); a NaN l stays NaN through the softmax updates.
    if (scan_codes) {
      for (int h = 0; h < heads; ++h) {
        HeadState& hs = head_state[h];
        for (int t = 0; t < count; ++t) {
          if (!RowHasNonFiniteCode(geo.format, bases[t] + hs.k_offset, geo.row_bytes()) &&
              !RowHasNonFiniteCode(geo.format, bases[t] + hs.v_offset, geo.row_bytes())) {
            continue;
          }
          for (int r = 0; r < rows; ++r) {
            if (LiveTokens(hs.it, r, first, count) > t) hs.state.l[r] = kPoisonedRow;
          }
        }
      }
    }

    // 1 and 2: scores and softmax, head by head; each head's P stays for step 3.
    for (int h = 0; h < heads; ++h) {
      HeadState& hs = head_state[h];
      const ItemContext& it = hs.it;
      float* probs = probs_all + std::size_t(h) * rows * stride;
      if (hs.q_tiles != nullptr) {
#if MJOLNIR_AMX
        if constexpr (!std::is_void_v<Dot>) {
          if (amx_values) {  // scores, softmax and P in the tiles' layout: no gather
            ScoresAmx<Dot, true>(hs.q_tiles, rows, std::size_t(d), bases, hs.k_offset, count, 1.0f,
                                 scores, column_stride, prefetcher, prefetch_rows, amx_keys,
                                 amx_sums);
            SoftmaxColumns(it, scores, column_stride, first, count, hs.kernel_scale, hs.state,
                           amx_prob_words + prob_words * h);
            continue;
          }
          ScoresAmx<Dot>(hs.q_tiles, rows, std::size_t(d), bases, hs.k_offset, count,
                         hs.kernel_scale, scores, stride, prefetcher, prefetch_rows, amx_keys,
                         amx_sums);
        }
#endif
      } else if (hs.int8) {
#if MJOLNIR_INT8_DOT
        VisitIntDecoder(geo.format, [&]<class Int>() {
          ScoresInt8<Int>(reinterpret_cast<const std::int8_t*>(hs.q), Int8Starts(hs.q, rows, d),
                          rows, std::size_t(d), bases, hs.k_offset, count, hs.kernel_scale, scores,
                          stride, prefetcher, prefetch_rows);
        });
#endif
      } else if (hs.dot) {
#if MJOLNIR_BF16_DOT
        if constexpr (!std::is_void_v<Dot>) {
          ScoresDot<Dot>(reinterpret_cast<const std::uint16_t*>(hs.q), 2 * ld, rows, std::size_t(d),
                         bases, hs.k_offset, count, hs.kernel_scale, scores, stride, prefetcher,
                         prefetch_rows);
        }
#endif
      } else if (!exact) {
        ScoresFast<Decoder>(it, hs.q, bases, hs.k_offset, count, hs.kernel_scale, scores, stride,
                            prefetcher, prefetch_rows);
      } else {
        for (int t0 = 0; t0 < count; t0 += kSubTokens) {
          const int sub = std::min(kSubTokens, count - t0);
          // True values in natural channel order for the emulator's summation order.
          for (int t = 0; t < sub; ++t) {
            prefetcher.Issue(prefetch_rows);
            DecodeRow<Decoder>(bases[t0 + t] + hs.k_offset, d, keys);
            float* dst = keys_natural + std::size_t(t) * d;
            if (natural) {
              const auto f = hn::Set(df, raw_k_to_true);
              for (int c = 0; c < d; c += int(hn::Lanes(df))) {  // x * f + (-0): see DecodeNvfp4
                hn::Store(hn::MulAdd(hn::Load(df, keys + c), f, hn::Set(df, -0.0f)), df, dst + c);
              }
            } else {
              for (int i = 0; i < d; ++i) dst[channel_of[i]] = keys[i] * raw_k_to_true;
            }
          }
          const auto scores_exact = [&](auto de, auto fused_tag) {
            ScoresExactT<decltype(fused_tag)::value>(de, it, hs.q, rows_padded, keys_natural, sub,
                                                     hs.kernel_scale, scores, stride, t0);
          };
          if (rows <= 4) {
            fused ? scores_exact(de4, std::true_type()) : scores_exact(de4, std::false_type());
          } else {
            fused ? scores_exact(df, std::true_type()) : scores_exact(df, std::false_type());
          }
        }
      }
      SoftmaxTile(it, scores, probs, stride, first, count, p_exp, hs.state);
    }

    // 3. P . V, head by head.
    prefetcher.Reset(next_bases, next_count, k_offsets, heads, head_state[0].it.row_bytes);
    const int passes = heads * int(d / hn::Lanes(typename Decoder::Tag()) / 2) * ((rows + 3) / 4);
    prefetch_rows = (prefetcher.rows() + passes - 1) / passes;
    for (int h = 0; h < heads; ++h) {
      HeadState& hs = head_state[h];
      const float* probs = probs_all + std::size_t(h) * rows * stride;
      if (amx_values) {
#if MJOLNIR_AMX
        if constexpr (!std::is_void_v<Dot>) {
          // P is in the A rows already where the scores ran on the tiles (SoftmaxColumns).
          ValuesAmx<Dot>(hs.q_tiles != nullptr ? nullptr : probs, stride, rows, bases, hs.v_offset,
                         count, std::size_t(d), hs.acc, ld, hs.state.alpha, amx_value_tiles,
                         amx_prob_words + prob_words * h, prefetcher,
                         (prefetcher.rows() + heads * count - 1) / std::max(heads * count, 1));
        }
#endif
        continue;
      }
      AccumulateValues<Decoder>(hs.it, probs, stride, bases, hs.v_offset, count, hs.acc,
                                hs.state.alpha, prefetcher, prefetch_rows);
    }
    std::swap(bases, next_bases);
  }

  // Step 5: o = acc * v_scale / l, undoing the fold 2^(p_exp + kRawExp) and the channel order.
  const bool channel_scales = cache.granularity == ScaleGranularity::channel;
  const float p_mode_scale = args.params.p_mode == PMode::fp8 ? 256.0f : 1.0f;
  const float unfold = std::ldexp(1.0f, -(p_exp + v_raw_exp));
  // On the tiles the accumulator's columns are in the tiles' channel order, and channel c of O is
  // gathered from column source_of[c] (Intel cores, which have the tiles, gather fast).
  std::int32_t* source_of = nullptr;
#if MJOLNIR_AMX
  if (amx_values) {
    if constexpr (!std::is_void_v<Dot>) {
      source_of = channel_of;
      for (int i = 0; i < d; ++i) source_of[AmxValueChannel<Dot>(i)] = i;
    }
  }
#endif
  for (int h = 0; h < heads; ++h) {
    const HeadState& hs = head_state[h];
    const int kv_head = items[h].kv_head;
    for (int r = 0; r < rows; ++r) {
      float* o = outs[h].o[r];
      float* lse = outs[h].lse[r];
      const float l = hs.state.l[r];
      if (outs[h].stats != nullptr) {
        outs[h].stats[r][0] = hs.state.m[r];
        outs[h].stats[r][1] = l;
      }
      if (l == 0.0f) {
        std::fill(o, o + d, 0.0f);
        if (lse != nullptr) *lse = kNegInf;
        continue;
      }
      const float inv_l = 1.0f / (l * p_mode_scale);
      const float* a = hs.acc + r * ld;
      if (source_of != nullptr) {
        const hn::RebindToSigned<FloatTag> di;
        const float* vs = channel_scales ? &cache.v_scale[std::size_t(kv_head) * d] : nullptr;
        const auto f = hn::Set(df, (vs ? 1.0f : cache.v_scale_at(kv_head, 0)) * inv_l * unfold);
        for (int c = 0; c < d; c += int(hn::Lanes(df))) {
          const auto v = hn::GatherIndex(df, a, hn::LoadU(di, source_of + c));
          hn::StoreU(hn::Mul(v, vs ? hn::Mul(hn::LoadU(df, vs + c), f) : f), df, o + c);
        }
      } else if (channel_scales) {
        const float* vs = &cache.v_scale[std::size_t(kv_head) * d];
        const float f = inv_l * unfold;
        for (int i = 0; i < d; ++i) o[channel_of[i]] = a[i] * (vs[channel_of[i]] * f);
      } else {
        const float f = cache.v_scale_at(kv_head, 0) * inv_l * unfold;
        if (natural) {
          const auto vf = hn::Set(df, f);
          for (int c = 0; c < d; c += int(hn::Lanes(df)))
            hn::StoreU(hn::Mul(hn::Load(df, a + c), vf), df, o + c);
        } else {
          for (int i = 0; i < d; ++i) o[channel_of[i]] = a[i] * f;
        }
      }
      if (lse != nullptr) *lse = (hs.state.m[r] + std::log2(l)) * std::numbers::ln2_v<float>;
      // The non-finite policy (core/non_finite.h): a non-finite q (flagged), score (l = NaN,
      // hence O) or V value (O) poisons the row. Its l says so to a merge of token parts.
      if (hs.q_poisoned[r] != 0.0f || !FiniteValues(o, std::size_t(d))) {
        poison_row(o, std::size_t(d), lse);
        if (outs[h].stats != nullptr) outs[h].stats[r][1] = kPoisonedRow;
      }
    }
  }
}

void RunWorkUnit(const DecodeArgs& args, const Plan& plan, const WorkItem* items, int heads,
                 KernelScratch& scratch, const ItemOutput* outs) {
  VisitKernelDecoder(
      args.cache.geometry.format, std::size_t(args.cache.geometry.head_dim),
      [&]<class Decoder>() { RunUnit<Decoder>(args, plan, items, heads, scratch, outs); });
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

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

namespace mjolnir::cpu {

HWY_EXPORT(RunWorkUnit);
HWY_EXPORT(TargetName);
HWY_EXPORT(HasBf16Dot);
HWY_EXPORT(HasInt8Dot);
HWY_EXPORT(HasInt8DotFor);

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

std::atomic<std::uint64_t> g_bf16_dot_items{0};
std::atomic<std::uint64_t> g_int8_dot_items{0};

namespace {
std::atomic<bool>& bf16_dot_flag() {
  static std::atomic<bool> flag{[] {
    const char* env = std::getenv("MJOLNIR_CPU_BF16_DOT");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }()};
  return flag;
}
}  // namespace

void set_bf16_dot_enabled(bool enabled) { bf16_dot_flag().store(enabled); }
bool bf16_dot_enabled() { return bf16_dot_flag().load(std::memory_order_relaxed); }

bool bf16_dot_applies(Format format, QMode q_mode, int head_dim) {
  // The formats whose codes are all bf16 values (bf16_dot-inl.h has a decoder for each).
  const bool bf16_codes = format != Format::fp16;
  return bf16_codes && (q_mode == QMode::bf16 || q_mode == QMode::fp8 || q_mode == QMode::int8) &&
         head_dim % 64 == 0 && bf16_dot_enabled() && cpu_has_bf16_dot();
}

bool cpu_has_bf16_dot() { return HWY_DYNAMIC_DISPATCH(HasBf16Dot)(); }

bool cpu_has_int8_dot() { return HWY_DYNAMIC_DISPATCH(HasInt8Dot)(); }

bool int8_dot_applies(Format format, int head_dim) {
  return head_dim % 128 == 0 && HWY_DYNAMIC_DISPATCH(HasInt8DotFor)(format);
}

std::uint64_t bf16_dot_items() { return g_bf16_dot_items.load(); }

std::uint64_t int8_dot_items() { return g_int8_dot_items.load(); }

bool amx_values_apply(Format format, PMode p_mode, int head_dim) {
  return p_mode == PMode::bf16 && format != Format::fp16 && head_dim % 64 == 0 &&
         bf16_dot_enabled() && cpu_has_bf16_dot() && amx_enabled() && cpu_has_amx();
}

void run_work_unit(const DecodeArgs& args, const Plan& plan, const WorkItem* items, int heads,
                   KernelScratch& scratch, const ItemOutput* outs) {
  HWY_DYNAMIC_DISPATCH(RunWorkUnit)(args, plan, items, heads, scratch, outs);
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

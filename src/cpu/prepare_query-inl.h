// Step 1 of the numerics contract on the CPU's SIMD targets (docs/numerics.md): Q times the
// per-channel K scales, rounded per Q mode, for all the rows of a work item, before any score
// path prepares it for its own dot products (kernel_paths-inl.h). Per-target header, see
// kv_decode-inl.h.

#if defined(MJOLNIR_CPU_PREPARE_QUERY_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MJOLNIR_CPU_PREPARE_QUERY_INL_H_
#undef MJOLNIR_CPU_PREPARE_QUERY_INL_H_
#else
#define MJOLNIR_CPU_PREPARE_QUERY_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numbers>

#include "core/minifloat.h"
#include "core/query_codes.h"
#include "cpu/item_context.h"
#include "cpu/kv_decode-inl.h"
#include "cpu/minifloat_simd-inl.h"
#include "hwy/highway.h"
#include "mjolnir/decode.h"

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if !MJOLNIR_PORTABLE_TARGET

using FloatTag = WideFloatTag;

// Step 1 of the contract for all R rows, exactly as the emulator does it: per-channel K scales
// folded in, then rounded per Q mode. Writes qn [R][D] in natural channel order and returns the
// score scale sq * k_scale * softmax_scale * log2(e). A row with a NaN or an infinity is zeroed
// and flagged in poisoned [R] (1, else 0): the fp8 scale of the other rows is as if it were not
// there, and the row comes out NaN (core/non_finite.h).
inline float PrepareQuery(const ItemContext& it, float* HWY_RESTRICT qn,
                          float* HWY_RESTRICT poisoned) {
  const DecodeArgs& args = *it.args;
  const KvCacheView& cache = args.cache;
  const FloatTag df;
  const std::size_t n = hn::Lanes(df);
  const int d = it.d;
  const bool channel_scales = cache.granularity == ScaleGranularity::channel;
  const float* ks = channel_scales ? &cache.k_scale[std::size_t(it.item->kv_head) * d] : nullptr;
  const bool bf16 = args.q.type == RowType::bf16;
  const hn::RebindToUnsigned<FloatTag> du;
  const hn::Rebind<std::uint16_t, FloatTag> d16;
  auto amax = hn::Zero(df);
  for (int r = 0; r < it.rows; ++r) {
    const void* q = args.q_row(*it.item, r, it.g);
    float* out = qn + std::size_t(r) * d;
    auto row_max = hn::Zero(df);
    auto non_finite = hn::Zero(df);  // x - x: NaN where x is not finite
    for (int c = 0; c < d; c += int(n)) {
      // A bf16 Q widens exactly: its bits are the high half of the float's.
      auto v =
          bf16 ? hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(
                                     du, hn::LoadU(d16, static_cast<const std::uint16_t*>(q) + c))))
               : hn::LoadU(df, static_cast<const float*>(q) + c);
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
inline bool AllBf16Values(const float* HWY_RESTRICT x, std::size_t count) {
  const FloatTag df;
  const hn::RebindToUnsigned<FloatTag> du;
  auto low = hn::Zero(du);
  for (std::size_t i = 0; i < count; i += hn::Lanes(df)) {
    low = hn::Or(low, hn::BitCast(du, hn::Load(df, x + i)));
  }
  return hn::AllTrue(du, hn::Eq(hn::And(low, hn::Set(du, 0xFFFFu)), hn::Zero(du)));
}

#endif  // !MJOLNIR_PORTABLE_TARGET

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MJOLNIR_CPU_PREPARE_QUERY_INL_H_

// Fuzz target: the cache descriptor's validator (geometry, named layouts and explicit byte
// strides against the pool's bounds, scale counts and values; mjolnir_cache_create) and
// mjolnir_write_kv (input strides, slot mapping, non-finite values, amax recording).
//
// The pool, the scales and the K/V inputs are heap buffers of exactly the size the call is told,
// so ASan reports any byte the library touches outside what the caller handed it.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fuzz_check.h"

namespace {

using mjolnir_fuzz::tensor_extent;

constexpr std::int64_t kMaxPoolBytes = 1 << 18;

// Mostly values a caller might mean, sometimes anything: the validator must hold for both.
std::int32_t small_or_any(FuzzedDataProvider& in, std::int32_t lo, std::int32_t hi) {
  return in.ConsumeBool() ? in.ConsumeIntegralInRange(lo, hi) : in.ConsumeIntegral<std::int32_t>();
}

float any_float(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      return in.ConsumeFloatingPointInRange(-4.0f, 4.0f);
    case 1:
      return in.ConsumeFloatingPoint<float>();  // anything, NaN and Inf included
    default:
      return in.ConsumeFloatingPointInRange(0.01f, 2.0f);
  }
}

std::vector<float> scales(FuzzedDataProvider& in, std::int64_t count) {
  std::vector<float> values(static_cast<std::size_t>(count));
  for (float& v : values) v = any_float(in);
  return values;
}

void fuzz_write_kv(FuzzedDataProvider& in, mjolnir_cache* cache, const mjolnir_cache_desc& desc) {
  const std::int64_t hk = desc.num_kv_heads, d = desc.head_dim;
  const auto num_tokens = std::int64_t(in.ConsumeIntegralInRange(0, 12));
  std::int64_t strides[2][2];  // K, V: token, head
  for (auto& s : strides) {
    if (in.ConsumeBool()) {
      s[0] = hk * d;
      s[1] = d;
    } else {
      s[0] = in.ConsumeIntegralInRange<std::int64_t>(-2, 3 * hk * d);
      s[1] = in.ConsumeIntegralInRange<std::int64_t>(-2, 2 * d);
    }
  }
  const long long k_extent = tensor_extent(num_tokens, hk, d, strides[0][0], strides[0][1]);
  const long long v_extent = tensor_extent(num_tokens, hk, d, strides[1][0], strides[1][1]);
  if (k_extent < 0 || v_extent < 0) return;
  std::vector<float> k(static_cast<std::size_t>(k_extent)), v(static_cast<std::size_t>(v_extent));
  const bool wild_values = in.ConsumeBool();
  for (auto* buffer : {&k, &v}) {
    for (float& x : *buffer) {
      x = wild_values ? any_float(in) : in.ConsumeFloatingPointInRange(-8.0f, 8.0f);
    }
  }
  const std::int64_t num_slots = std::int64_t(desc.num_pages) * desc.page_size;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(num_tokens));
  for (auto& slot : slots) {
    slot = in.ConsumeBool() ? in.ConsumeIntegralInRange<std::int64_t>(-1, num_slots)
                            : in.ConsumeIntegral<std::int64_t>();
  }
  std::vector<float> k_amax, v_amax;
  if (in.ConsumeBool()) {
    k_amax.assign(std::size_t(hk * d), 0.0f);
    v_amax.assign(std::size_t(hk * d), 0.0f);
  }
  const mjolnir_status status = mjolnir_write_kv(
      cache, k.empty() ? nullptr : k.data(), strides[0][0], strides[0][1],
      v.empty() ? nullptr : v.data(), strides[1][0], strides[1][1],
      slots.empty() ? nullptr : slots.data(), num_tokens, k_amax.empty() ? nullptr : k_amax.data(),
      v_amax.empty() ? nullptr : v_amax.data());
  if (status != MJOLNIR_OK) {
    mjolnir_fuzz::check_failure_explained(status);
    FUZZ_CHECK(status == MJOLNIR_ERROR_INVALID_ARGUMENT);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  mjolnir_cache_desc desc;
  mjolnir_cache_desc_init(&desc);
  desc.format = in.ConsumeIntegralInRange(-1, 8);
  desc.page_size =
      in.ConsumeBool() ? 1 << in.ConsumeIntegralInRange(3, 8) : in.ConsumeIntegral<std::int32_t>();
  desc.num_kv_heads = small_or_any(in, 1, 4);
  desc.head_dim =
      in.ConsumeBool() ? 32 * in.ConsumeIntegralInRange(1, 4) : in.ConsumeIntegral<std::int32_t>();
  desc.num_pages = small_or_any(in, 1, 8);
  desc.layout = in.ConsumeIntegralInRange(-1, 7);
  if (desc.layout == MJOLNIR_LAYOUT_STRIDES) {
    for (std::int64_t* stride :
         {&desc.page_stride, &desc.head_stride, &desc.token_stride, &desc.kv_stride}) {
      *stride = in.ConsumeBool() ? in.ConsumeIntegralInRange<std::int64_t>(-64, 1 << 16)
                                 : in.ConsumeIntegral<std::int64_t>();
    }
  }
  desc.granularity = in.ConsumeIntegralInRange(-1, 3);
  const auto k_count = in.ConsumeIntegralInRange<std::int64_t>(0, 1024);
  const auto v_count =
      in.ConsumeBool() ? k_count : in.ConsumeIntegralInRange<std::int64_t>(0, 1024);
  const std::vector<float> k_scale = scales(in, k_count), v_scale = scales(in, v_count);
  desc.k_scale = k_scale.empty() ? nullptr : k_scale.data();
  desc.k_scale_count = k_count;
  desc.v_scale = v_scale.empty() ? nullptr : v_scale.data();
  desc.v_scale_count = v_count;

  // A dense pool's size, give or take a little, within the fuzzer's budget.
  std::size_t dense = 0;
  const mjolnir_status sized = mjolnir_pool_bytes(&desc, &dense);
  if (sized != MJOLNIR_OK) mjolnir_fuzz::check_failure_explained(sized);
  const auto slack = in.ConsumeIntegralInRange<std::int64_t>(-64, 64);
  const std::int64_t wanted = std::min<std::int64_t>(std::int64_t(dense), kMaxPoolBytes) + slack;
  std::vector<std::uint8_t> pool(
      static_cast<std::size_t>(std::clamp<std::int64_t>(wanted, 1, kMaxPoolBytes)), 0x5a);
  desc.pool = pool.data();
  desc.pool_bytes = pool.size();
  // An older caller's smaller struct, or a newer caller's larger one whose extra bytes the call
  // reads (and must reject unless they are zero): a buffer of exactly the bytes claimed (at
  // least the size field), so a read past them is an ASan report.
  std::size_t struct_size = sizeof(desc);
  if (in.ConsumeBool()) struct_size = in.ConsumeIntegralInRange<std::size_t>(0, 2 * sizeof(desc));
  desc.size = struct_size;
  std::vector<std::uint8_t> passed(std::max(struct_size, sizeof(desc.size)));
  std::memcpy(passed.data(), &desc, std::min(passed.size(), sizeof(desc)));
  for (std::size_t i = sizeof(desc); i < passed.size(); ++i) {
    passed[i] = in.ConsumeBool() ? 0 : in.ConsumeIntegral<std::uint8_t>();
  }

  mjolnir_cache* cache = nullptr;
  const mjolnir_status created =
      mjolnir_cache_create(reinterpret_cast<const mjolnir_cache_desc*>(passed.data()), &cache);
  if (created != MJOLNIR_OK) {
    mjolnir_fuzz::check_failure_explained(created);
    FUZZ_CHECK(cache == nullptr);
    return 0;
  }
  FUZZ_CHECK(cache != nullptr);
  std::int64_t strides[4];
  FUZZ_CHECK(mjolnir_cache_strides(cache, strides) == MJOLNIR_OK);
  for (int i = 0; i < 2 && in.remaining_bytes() > 0; ++i) fuzz_write_kv(in, cache, desc);
  mjolnir_cache_destroy(cache);
  return 0;
}

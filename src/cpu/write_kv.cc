// write_kv: quantize new K/V tokens into their cache slots, after checking every argument, so a
// bad call writes nothing (include/mjolnir/write_kv.h). It lives with the CPU backend: the
// rows are encoded by its SIMD row encoder (row_encoder.h), on the calling thread.
#include "mjolnir/write_kv.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/bf16_rows.h"
#include "cpu/row_encoder.h"
#include "mjolnir/error.h"
#include "mjolnir/format.h"

namespace mjolnir {
namespace {

// K or V of the new tokens, with the name errors call it by.
struct NamedRows {
  const TokenRows& rows;
  const char* name;  // "k" or "v"
  int kv;            // 0 = K, 1 = V: the cache row it goes to and the scales it divides by

  std::int64_t offset(std::int64_t token, int head) const {
    return token * rows.token_stride + head * rows.head_stride;
  }
  const std::uint16_t* bf16_bits(std::int64_t token, int head) const {
    return static_cast<const std::uint16_t*>(rows.data) + offset(token, head);
  }

  // The D channels of (token, head) in float32: in place, or bf16 widened into `buffer` (of
  // kMaxHeadDim floats; exact, a loop the compiler vectorizes).
  const float* at(std::int64_t token, int head, int head_dim, float* buffer) const {
    if (rows.type == RowType::f32)
      return static_cast<const float*>(rows.data) + offset(token, head);
    widen_row(bf16_bits(token, head), RowType::bf16, buffer, std::size_t(head_dim));
    return buffer;
  }

  // Whether the D channels of (token, head) are all finite. bf16 rows are tested on their bits
  // (an exponent of all ones is Inf or NaN), without the widening at() does for the write.
  bool finite(std::int64_t token, int head, int head_dim) const {
    if (rows.type == RowType::f32) {
      return cpu::all_finite(std::span<const float>(
          static_cast<const float*>(rows.data) + offset(token, head), std::size_t(head_dim)));
    }
    const std::uint16_t* bits = bf16_bits(token, head);
    std::int16_t exponent = 0;  // the largest exponent field: a max the compiler vectorizes
    for (int c = 0; c < head_dim; ++c) {
      exponent = std::max(exponent, std::int16_t(bits[c] & 0x7F80u));
    }
    return exponent != 0x7F80;
  }
};

// [num_tokens, Hk, D] with D contiguous: head rows inside a token row must not overlap, nor may
// token rows; a stride is only checked when its dimension has more than one index. Input rows
// that overlap would mean two tokens or heads share their values, which is a caller's mistake.
void check_token_rows(const NamedRows& input, std::int64_t num_tokens, int num_kv_heads,
                      int head_dim) {
  if (num_tokens == 0) return;  // nothing is read: an empty tensor may have a null pointer
  const TokenRows& rows = input.rows;
  MJOLNIR_REQUIRE(rows.data != nullptr, input.name, ".data: is null");
  MJOLNIR_REQUIRE(rows.type == RowType::f32 || rows.type == RowType::bf16, input.name,
                  ".type: ", int(rows.type), " is not a RowType");
  MJOLNIR_REQUIRE(num_kv_heads == 1 || rows.head_stride >= head_dim, input.name,
                  ".head_stride: ", rows.head_stride, " is less than head_dim ", head_dim,
                  " (head rows would overlap)");
  // Spans are computed in 128 bits: a huge stride times many heads or tokens must be reported,
  // not wrap around.
  const __int128 head_span = __int128(rows.head_stride) * (num_kv_heads - 1) + head_dim;
  MJOLNIR_REQUIRE(head_span <= INT64_MAX, input.name, ".head_stride: ", rows.head_stride, " x ",
                  num_kv_heads - 1, " heads overflows 64-bit offsets");
  if (num_tokens == 1) return;
  const auto token_span = static_cast<std::int64_t>(head_span);  // floats one token's heads span
  MJOLNIR_REQUIRE(rows.token_stride >= token_span, input.name, ".token_stride: ", rows.token_stride,
                  " is less than the ", token_span,
                  " floats one token's heads span (token rows would overlap)");
  const __int128 last = __int128(rows.token_stride) * (num_tokens - 1) + token_span;
  MJOLNIR_REQUIRE(last <= INT64_MAX, input.name, ".token_stride: ", rows.token_stride, " x ",
                  num_tokens - 1, " tokens overflows 64-bit offsets");
}

void check_slots(std::span<const std::int64_t> slot_mapping, const CacheGeometry& geometry) {
  const std::int64_t num_slots = std::int64_t(geometry.num_pages) * geometry.page_size;
  for (std::size_t i = 0; i < slot_mapping.size(); ++i) {
    MJOLNIR_REQUIRE(slot_mapping[i] < num_slots, "slot_mapping[", i, "]: slot ", slot_mapping[i],
                    " is outside the pool of ", geometry.num_pages, " pages x ", geometry.page_size,
                    " tokens = ", num_slots, " slots");
  }
}

void check_amax(const AmaxRecorder& amax, const CacheGeometry& geometry) {
  const std::size_t expected = std::size_t(geometry.num_kv_heads) * geometry.head_dim;
  MJOLNIR_REQUIRE(amax.k_amax.size() == expected, "amax.k_amax: ", amax.k_amax.size(),
                  " values, expected ", geometry.num_kv_heads, " heads x ", geometry.head_dim,
                  " channels = ", expected);
  MJOLNIR_REQUIRE(amax.v_amax.size() == expected, "amax.v_amax: ", amax.v_amax.size(),
                  " values, expected ", geometry.num_kv_heads, " heads x ", geometry.head_dim,
                  " channels = ", expected);
}

// Non-finite values would be stored as saturated codes (or NaN) and poison every later attention
// step silently, so they are reported with their index [token][head][channel].
void check_finite(const NamedRows& input, std::span<const std::int64_t> slot_mapping,
                  const CacheGeometry& geometry) {
  for (std::size_t token = 0; token < slot_mapping.size(); ++token) {
    if (slot_mapping[token] < 0) continue;
    for (int head = 0; head < geometry.num_kv_heads; ++head) {
      if (input.finite(static_cast<std::int64_t>(token), head, geometry.head_dim)) continue;
      alignas(64) float buffer[kMaxHeadDim];
      const float* values =
          input.at(static_cast<std::int64_t>(token), head, geometry.head_dim, buffer);
      for (int c = 0; c < geometry.head_dim; ++c) {
        if (std::isfinite(values[c])) continue;
        detail::throw_error(input.name, "[", token, "][", head, "][", c, "] is ",
                            std::isnan(values[c]) ? "NaN" : (values[c] > 0 ? "Inf" : "-Inf"));
      }
    }
  }
}

}  // namespace

void write_kv(const KvCacheView& cache, const TokenRows& k, const TokenRows& v,
              std::span<const std::int64_t> slot_mapping, AmaxRecorder* amax) {
  // --- checks: nothing below this block may throw, so a rejected call writes nothing --------
  validate(cache);
  const CacheGeometry& geometry = cache.geometry;
  const int num_kv_heads = geometry.num_kv_heads;
  const int head_dim = geometry.head_dim;
  const auto num_tokens = static_cast<std::int64_t>(slot_mapping.size());
  const NamedRows inputs[2] = {{k, "k", 0}, {v, "v", 1}};
  for (const NamedRows& input : inputs) {
    check_token_rows(input, num_tokens, num_kv_heads, head_dim);
  }
  check_slots(slot_mapping, geometry);
  if (amax != nullptr) check_amax(*amax, geometry);
  for (const NamedRows& input : inputs) check_finite(input, slot_mapping, geometry);

  // --- writes ----------------------------------------------------------------------------------
  const std::size_t row_bytes = geometry.row_bytes();
  const auto d = static_cast<std::size_t>(head_dim);
  // The scales that divide (head, K or V)'s row: one value, or D per channel.
  const auto row_scales = [&](int head, int kv) {
    const std::span<const float> all = kv == 0 ? cache.k_scale : cache.v_scale;
    switch (cache.granularity) {
      case ScaleGranularity::tensor:
        return all.subspan(0, 1);
      case ScaleGranularity::head:
        return all.subspan(std::size_t(head), 1);
      case ScaleGranularity::channel:
        break;
    }
    return all.subspan(std::size_t(head) * d, d);
  };
  alignas(64) float buffer[kMaxHeadDim];
  for (std::int64_t token = 0; token < num_tokens; ++token) {
    const std::int64_t slot = slot_mapping[static_cast<std::size_t>(token)];
    if (slot < 0) continue;  // skipped (padding), as vLLM's reshape_and_cache_flash does
    const int page = static_cast<int>(slot / geometry.page_size);
    const int offset = static_cast<int>(slot % geometry.page_size);
    for (int head = 0; head < num_kv_heads; ++head) {
      for (const NamedRows& input : inputs) {
        const float* values = input.at(token, head, head_dim, buffer);
        // SIMD, bit for bit encode_row(values / scale) (tested against it over every format).
        cpu::encode_scaled_row(
            geometry.format, std::span<const float>(values, d), row_scales(head, input.kv),
            std::span<std::byte>(cache.row(page, head, offset, input.kv), row_bytes));
        if (amax == nullptr) continue;
        std::span<float> maxima = input.kv == 0 ? amax->k_amax : amax->v_amax;
        float* head_maxima = maxima.data() + std::size_t(head) * head_dim;
        for (int c = 0; c < head_dim; ++c) {
          head_maxima[c] = std::max(head_maxima[c], std::fabs(values[c]));
        }
      }
    }
  }
}

}  // namespace mjolnir

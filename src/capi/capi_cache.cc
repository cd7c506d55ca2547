// C API: the cache handle (a validated KvCacheView over the caller's pool) and write_kv.
#include <cstddef>
#include <cstdint>
#include <span>

#include "capi/capi_internal.h"
#include "mjolnir/write_kv.h"

namespace mjolnir::capi {
namespace {

// The first published mjolnir_cache_desc ends with pool_bytes. Never change this number.
constexpr std::size_t kCacheDescV1 =
    offsetof(mjolnir_cache_desc, pool_bytes) + sizeof(mjolnir_cache_desc::pool_bytes);

CacheGeometry geometry_of(const mjolnir_cache_desc& desc) {
  CacheGeometry geometry;
  geometry.format = to_format(desc.format, "desc->format");
  geometry.num_pages = desc.num_pages;
  geometry.page_size = desc.page_size;
  geometry.num_kv_heads = desc.num_kv_heads;
  geometry.head_dim = desc.head_dim;
  return geometry;
}

CacheStrides strides_of(const mjolnir_cache_desc& desc, const CacheGeometry& geometry) {
  switch (desc.layout) {
    case MJOLNIR_LAYOUT_STRIDES:
      return CacheStrides{desc.page_stride, desc.head_stride, desc.token_stride, desc.kv_stride};
    case MJOLNIR_LAYOUT_BHN2D:
      return layout_strides(geometry, Layout::BHN2D);
    case MJOLNIR_LAYOUT_BNH2D:
      return layout_strides(geometry, Layout::BNH2D);
    case MJOLNIR_LAYOUT_B2NHD:
      return layout_strides(geometry, Layout::B2NHD);
    case MJOLNIR_LAYOUT_B2HND:
      return layout_strides(geometry, Layout::B2HND);
    case MJOLNIR_LAYOUT_2BNHD:
      return layout_strides(geometry, Layout::_2BNHD);
    case MJOLNIR_LAYOUT_2BHND:
      return layout_strides(geometry, Layout::_2BHND);
  }
  fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "desc->layout: ", desc.layout,
       " is not a mjolnir_layout (0 = explicit strides, 1..6 = BHN2D .. 2BHND)");
}

// Copies one scale vector after checking its pointer and count against the granularity (the
// values themselves are checked by validate()).
std::vector<float> copy_scales(const float* values, std::int64_t count, const char* name,
                               ScaleGranularity granularity, const CacheGeometry& geometry) {
  const auto expected =
      static_cast<std::int64_t>(scale_count(granularity, geometry.num_kv_heads, geometry.head_dim));
  if (count != expected) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "desc->", name, "_count: ", count, ", expected ", expected,
         " for granularity ", to_string(granularity), " with ", geometry.num_kv_heads, " heads x ",
         geometry.head_dim, " channels");
  }
  if (values == nullptr) fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "desc->", name, ": is NULL");
  return std::vector<float>(values, values + count);
}

// mjolnir_write_kv and mjolnir_write_kv_rows: the handle and arguments checked, then the
// library's write_kv (which checks the rows, slots and values before writing a byte).
void write_kv_rows(mjolnir_cache* cache, std::int32_t row_type, const void* k,
                   std::int64_t k_token_stride, std::int64_t k_head_stride, const void* v,
                   std::int64_t v_token_stride, std::int64_t v_head_stride,
                   const std::int64_t* slot_mapping, std::int64_t num_tokens, float* k_amax,
                   float* v_amax) {
  const mjolnir_cache& c = require_handle(cache, "cache");
  const RowType type = require_row_type(row_type, "row_type");
  if (num_tokens < 0) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "num_tokens: ", num_tokens, " is negative");
  }
  if (num_tokens > 0) require_pointer(slot_mapping, "slot_mapping");
  if ((k_amax == nullptr) != (v_amax == nullptr)) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, k_amax == nullptr ? "k_amax" : "v_amax", ": is NULL but ",
         k_amax == nullptr ? "v_amax" : "k_amax", " is not (pass both to record amax, or neither)");
  }
  const CacheGeometry& geometry = c.view.geometry;
  const std::size_t amax_count = std::size_t(geometry.num_kv_heads) * geometry.head_dim;
  AmaxRecorder amax{{k_amax, k_amax != nullptr ? amax_count : 0},
                    {v_amax, v_amax != nullptr ? amax_count : 0}};
  write_kv(c.view, TokenRows{k, k_token_stride, k_head_stride, type},
           TokenRows{v, v_token_stride, v_head_stride, type},
           std::span<const std::int64_t>(slot_mapping, std::size_t(num_tokens)),
           k_amax != nullptr ? &amax : nullptr);
}

}  // namespace
}  // namespace mjolnir::capi

using namespace mjolnir;
using namespace mjolnir::capi;

extern "C" {

MJOLNIR_API mjolnir_status mjolnir_pool_bytes(const mjolnir_cache_desc* in, size_t* bytes) {
  return call("mjolnir_pool_bytes", nullptr, [&] {
    require_pointer(bytes, "bytes");
    *bytes = 0;
    const mjolnir_cache_desc desc = read_struct(in, kCacheDescV1, "desc", "mjolnir_cache_desc");
    *bytes = pool_bytes(geometry_of(desc));
  });
}

MJOLNIR_API mjolnir_status mjolnir_cache_create(const mjolnir_cache_desc* in, mjolnir_cache** out) {
  if (out != nullptr) *out = nullptr;
  return call("mjolnir_cache_create", nullptr, [&] {
    require_pointer(out, "out");
    const mjolnir_cache_desc desc = read_struct(in, kCacheDescV1, "desc", "mjolnir_cache_desc");
    const CacheGeometry geometry = geometry_of(desc);
    (void)pool_bytes(geometry);  // validates the geometry before anything is sized from it
    const ScaleGranularity granularity = to_granularity(desc.granularity, "desc->granularity");

    auto cache = std::make_unique<mjolnir_cache>();
    cache->k_scale =
        copy_scales(desc.k_scale, desc.k_scale_count, "k_scale", granularity, geometry);
    cache->v_scale =
        copy_scales(desc.v_scale, desc.v_scale_count, "v_scale", granularity, geometry);
    KvCacheView& view = cache->view;
    view.geometry = geometry;
    view.strides = strides_of(desc, geometry);
    view.data = static_cast<std::byte*>(desc.pool);
    view.bytes = desc.pool_bytes;
    view.granularity = granularity;
    view.k_scale = cache->k_scale;
    view.v_scale = cache->v_scale;
    validate(view);
    *out = cache.release();
  });
}

MJOLNIR_API void mjolnir_cache_destroy(mjolnir_cache* cache) { delete cache; }

MJOLNIR_API const char* mjolnir_cache_last_error(const mjolnir_cache* cache) {
  return cache != nullptr ? cache->error.c_str() : "cache: is NULL";
}

MJOLNIR_API mjolnir_status mjolnir_cache_strides(mjolnir_cache* cache, int64_t strides[4]) {
  return call("mjolnir_cache_strides", cache != nullptr ? &cache->error : nullptr, [&] {
    const mjolnir_cache& c = require_handle(cache, "cache");
    require_pointer(strides, "strides");
    strides[0] = c.view.strides.page;
    strides[1] = c.view.strides.head;
    strides[2] = c.view.strides.token;
    strides[3] = c.view.strides.kv;
  });
}

MJOLNIR_API mjolnir_status mjolnir_write_kv_rows(mjolnir_cache* cache, int32_t row_type,
                                                 const void* k, int64_t k_token_stride,
                                                 int64_t k_head_stride, const void* v,
                                                 int64_t v_token_stride, int64_t v_head_stride,
                                                 const int64_t* slot_mapping, int64_t num_tokens,
                                                 float* k_amax, float* v_amax) {
  return call("mjolnir_write_kv_rows", cache != nullptr ? &cache->error : nullptr, [&] {
    write_kv_rows(cache, row_type, k, k_token_stride, k_head_stride, v, v_token_stride,
                  v_head_stride, slot_mapping, num_tokens, k_amax, v_amax);
  });
}

MJOLNIR_API mjolnir_status mjolnir_write_kv(mjolnir_cache* cache, const float* k,
                                            int64_t k_token_stride, int64_t k_head_stride,
                                            const float* v, int64_t v_token_stride,
                                            int64_t v_head_stride, const int64_t* slot_mapping,
                                            int64_t num_tokens, float* k_amax, float* v_amax) {
  return call("mjolnir_write_kv", cache != nullptr ? &cache->error : nullptr, [&] {
    write_kv_rows(cache, MJOLNIR_ROWS_F32, k, k_token_stride, k_head_stride, v, v_token_stride,
                  v_head_stride, slot_mapping, num_tokens, k_amax, v_amax);
  });
}

}  // extern "C"

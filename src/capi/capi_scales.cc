// C API: the scales file (read, parse, per-layer copies, write) and scales from recorded amax.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "capi/capi_internal.h"

namespace mjolnir::capi {
namespace {

// The first published mjolnir_scales_info ends with scales_per_layer. Never change this number.
constexpr std::size_t kScalesInfoV1 =
    offsetof(mjolnir_scales_info, scales_per_layer) + sizeof(mjolnir_scales_info::scales_per_layer);

// The arguments of a write, checked here so that whatever the C++ writer still reports is about
// the file itself (MJOLNIR_ERROR_FILE).
ScalesFile scales_to_write(const mjolnir_scales_info& info, const float* k_scales,
                           const float* v_scales, std::int64_t count) {
  ScalesFile file;
  file.format = to_format(info.format, "info->format");
  file.granularity = to_granularity(info.granularity, "info->granularity");
  if (info.num_kv_heads < 1) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "info->num_kv_heads: ", info.num_kv_heads,
         " is less than 1");
  }
  if (info.head_dim < 1) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "info->head_dim: ", info.head_dim, " is less than 1");
  }
  if (!std::isfinite(info.headroom) || info.headroom <= 0) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "info->headroom: ", info.headroom,
         " is not a positive finite factor");
  }
  if (info.num_layers < 1) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "info->num_layers: ", info.num_layers, " is less than 1");
  }
  file.num_kv_heads = info.num_kv_heads;
  file.head_dim = info.head_dim;
  file.headroom = info.headroom;
  const auto per_layer =
      static_cast<std::int64_t>(scale_count(file.granularity, file.num_kv_heads, file.head_dim));
  if (info.scales_per_layer != per_layer) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "info->scales_per_layer: ", info.scales_per_layer,
         ", expected ", per_layer, " for granularity ", to_string(file.granularity), " with ",
         file.num_kv_heads, " heads x ", file.head_dim, " channels");
  }
  if (count != std::int64_t(info.num_layers) * per_layer) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "count: ", count, ", expected num_layers ",
         info.num_layers, " x scales_per_layer ", per_layer, " = ",
         std::int64_t(info.num_layers) * per_layer);
  }
  require_pointer(k_scales, "k_scales");
  require_pointer(v_scales, "v_scales");
  file.layers.resize(std::size_t(info.num_layers));
  for (std::int32_t layer = 0; layer < info.num_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const float* values = (kv == 0 ? k_scales : v_scales) + std::int64_t(layer) * per_layer;
      for (std::int64_t i = 0; i < per_layer; ++i) {
        if (!std::isfinite(values[i]) || values[i] <= 0) {
          fail(MJOLNIR_ERROR_INVALID_ARGUMENT, kv == 0 ? "k_scales[" : "v_scales[",
               std::int64_t(layer) * per_layer + i, "] (layer ", layer, "): ", values[i],
               " is not a positive finite scale");
        }
      }
      (kv == 0 ? file.layers[layer].k_scale : file.layers[layer].v_scale)
          .assign(values, values + per_layer);
    }
  }
  return file;
}

}  // namespace
}  // namespace mjolnir::capi

using namespace mjolnir;
using namespace mjolnir::capi;

extern "C" {

MJOLNIR_API mjolnir_status mjolnir_scales_read(const char* path, mjolnir_scales** out) {
  if (out != nullptr) *out = nullptr;
  return call(
      "mjolnir_scales_read", nullptr,
      [&] {
        require_pointer(out, "out");
        require_pointer(path, "path");
        auto scales = std::make_unique<mjolnir_scales>();
        scales->file = read_scales_file(path);
        *out = scales.release();
      },
      MJOLNIR_ERROR_FILE);
}

MJOLNIR_API mjolnir_status mjolnir_scales_parse(const char* text, size_t length,
                                                mjolnir_scales** out) {
  if (out != nullptr) *out = nullptr;
  return call(
      "mjolnir_scales_parse", nullptr,
      [&] {
        require_pointer(out, "out");
        if (length > 0) require_pointer(text, "text");
        auto scales = std::make_unique<mjolnir_scales>();
        scales->file = parse_scales_json(std::string(text != nullptr ? text : "", length), "text");
        *out = scales.release();
      },
      MJOLNIR_ERROR_FILE);
}

MJOLNIR_API void mjolnir_scales_destroy(mjolnir_scales* scales) { delete scales; }

MJOLNIR_API const char* mjolnir_scales_last_error(const mjolnir_scales* scales) {
  return scales != nullptr ? scales->error.c_str() : "scales: is NULL";
}

MJOLNIR_API mjolnir_status mjolnir_scales_get_info(mjolnir_scales* scales,
                                                   mjolnir_scales_info* info) {
  return call("mjolnir_scales_get_info", scales != nullptr ? &scales->error : nullptr, [&] {
    const ScalesFile& file = require_handle(scales, "scales").file;
    mjolnir_scales_info value{};
    value.format = from_format(file.format);
    value.granularity = from_granularity(file.granularity);
    value.num_kv_heads = file.num_kv_heads;
    value.head_dim = file.head_dim;
    value.headroom = file.headroom;
    value.num_layers = static_cast<std::int32_t>(file.layers.size());
    value.scales_per_layer =
        static_cast<std::int64_t>(scale_count(file.granularity, file.num_kv_heads, file.head_dim));
    write_struct(value, info, kScalesInfoV1, "info", "mjolnir_scales_info");
  });
}

MJOLNIR_API mjolnir_status mjolnir_scales_get_layer(mjolnir_scales* scales, int32_t layer,
                                                    float* k_scale, float* v_scale,
                                                    int64_t capacity) {
  return call("mjolnir_scales_get_layer", scales != nullptr ? &scales->error : nullptr, [&] {
    const ScalesFile& file = require_handle(scales, "scales").file;
    if (layer < 0 || std::size_t(layer) >= file.layers.size()) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "layer: ", layer, " is outside [0, ", file.layers.size(),
           ")");
    }
    const ScalesFile::Layer& values = file.layers[std::size_t(layer)];
    const auto needed = static_cast<std::int64_t>(values.k_scale.size());
    if (capacity < needed) {
      fail(MJOLNIR_ERROR_BUFFER_TOO_SMALL, "capacity: ", capacity, " floats, layer ", layer,
           " holds ", needed, " scales for K and ", needed, " for V");
    }
    require_pointer(k_scale, "k_scale");
    require_pointer(v_scale, "v_scale");
    std::copy(values.k_scale.begin(), values.k_scale.end(), k_scale);
    std::copy(values.v_scale.begin(), values.v_scale.end(), v_scale);
  });
}

MJOLNIR_API mjolnir_status mjolnir_scales_write(const char* path, const mjolnir_scales_info* in,
                                                const float* k_scales, const float* v_scales,
                                                int64_t count) {
  return call("mjolnir_scales_write", nullptr, [&] {
    require_pointer(path, "path");
    const mjolnir_scales_info info = read_struct(in, kScalesInfoV1, "info", "mjolnir_scales_info");
    const ScalesFile file = scales_to_write(info, k_scales, v_scales, count);
    try {
      write_scales_file(file, path);
    } catch (const StatusError&) {
      throw;
    } catch (const Error& e) {
      throw StatusError(MJOLNIR_ERROR_FILE, e.what());
    }
  });
}

MJOLNIR_API mjolnir_status mjolnir_scales_from_amax(const float* amax, int64_t amax_count,
                                                    int32_t format, int32_t granularity,
                                                    int32_t num_kv_heads, int32_t head_dim,
                                                    double headroom, float* scales,
                                                    int64_t capacity) {
  return call("mjolnir_scales_from_amax", nullptr, [&] {
    const Format f = to_format(format, "format");
    const ScaleGranularity g = to_granularity(granularity, "granularity");
    if (amax_count < 0) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "amax_count: ", amax_count, " is negative");
    }
    if (amax_count > 0) require_pointer(amax, "amax");
    if (num_kv_heads >= 1 && head_dim >= 1) {
      const auto needed = static_cast<std::int64_t>(scale_count(g, num_kv_heads, head_dim));
      if (capacity < needed) {
        fail(MJOLNIR_ERROR_BUFFER_TOO_SMALL, "capacity: ", capacity, " floats, granularity ",
             to_string(g), " with ", num_kv_heads, " heads x ", head_dim, " channels makes ",
             needed, " scales");
      }
    }
    // The C++ function checks the rest (heads, channels, headroom, amax count and values).
    const std::vector<float> result =
        scales_from_amax({amax, std::size_t(amax_count)}, f, g, num_kv_heads, head_dim, headroom);
    require_pointer(scales, "scales");
    std::copy(result.begin(), result.end(), scales);
  });
}

}  // extern "C"

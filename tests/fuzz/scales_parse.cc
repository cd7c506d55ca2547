// Fuzz target: the scales-file parser (mjolnir_scales_parse), with what a parsed file promises.
// A file either fails with MJOLNIR_ERROR_FILE and a message, or yields layers whose every scale
// is positive and finite, in the count its granularity implies.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  mjolnir_scales* scales = nullptr;
  const mjolnir_status status =
      mjolnir_scales_parse(reinterpret_cast<const char*>(data), size, &scales);
  if (status != MJOLNIR_OK) {
    mjolnir_fuzz::check_failure_explained(status);
    FUZZ_CHECK(status == MJOLNIR_ERROR_FILE);
    FUZZ_CHECK(scales == nullptr);
    return 0;
  }
  FUZZ_CHECK(scales != nullptr);
  mjolnir_scales_info info;
  mjolnir_scales_info_init(&info);
  FUZZ_CHECK(mjolnir_scales_get_info(scales, &info) == MJOLNIR_OK);
  FUZZ_CHECK(mjolnir_format_name(info.format) != nullptr);
  FUZZ_CHECK(mjolnir_granularity_name(info.granularity) != nullptr);
  FUZZ_CHECK(info.num_kv_heads >= 1 && info.head_dim >= 1 && info.num_layers >= 1);
  FUZZ_CHECK(std::isfinite(info.headroom) && info.headroom > 0);
  const std::int64_t expected = info.granularity == MJOLNIR_GRANULARITY_TENSOR ? 1
                                : info.granularity == MJOLNIR_GRANULARITY_HEAD
                                    ? info.num_kv_heads
                                    : std::int64_t(info.num_kv_heads) * info.head_dim;
  FUZZ_CHECK(info.scales_per_layer == expected);
  // Every scale was in the input, so the total is bounded by its size.
  FUZZ_CHECK(info.num_layers * info.scales_per_layer <= std::int64_t(size));

  std::vector<float> k(static_cast<std::size_t>(info.scales_per_layer)), v(k.size());
  for (std::int32_t layer = 0; layer < info.num_layers; ++layer) {
    FUZZ_CHECK(mjolnir_scales_get_layer(scales, layer, k.data(), v.data(), info.scales_per_layer) ==
               MJOLNIR_OK);
    for (std::size_t i = 0; i < k.size(); ++i) {
      FUZZ_CHECK(std::isfinite(k[i]) && k[i] > 0 && std::isfinite(v[i]) && v[i] > 0);
    }
  }
  // Out-of-range layers and short buffers are errors, not reads or writes past the end.
  FUZZ_CHECK(mjolnir_scales_get_layer(scales, info.num_layers, k.data(), v.data(),
                                      info.scales_per_layer) == MJOLNIR_ERROR_INVALID_ARGUMENT);
  FUZZ_CHECK(mjolnir_scales_get_layer(scales, -1, k.data(), v.data(), info.scales_per_layer) ==
             MJOLNIR_ERROR_INVALID_ARGUMENT);
  FUZZ_CHECK(mjolnir_scales_get_layer(scales, 0, k.data(), v.data(), info.scales_per_layer - 1) ==
             MJOLNIR_ERROR_BUFFER_TOO_SMALL);
  mjolnir_scales_destroy(scales);
  return 0;
}

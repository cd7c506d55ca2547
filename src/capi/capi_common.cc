// C API: status names, the thread's last error, the version, and enum names and conversions.
#include <string_view>

#include "capi/capi_internal.h"

namespace mjolnir::capi {
namespace {

// The header's version macros and the project's version (CMake) must agree.
#define MJOLNIR_CAPI_STR2(x) #x
#define MJOLNIR_CAPI_STR(x) MJOLNIR_CAPI_STR2(x)
constexpr const char* kHeaderVersion = MJOLNIR_CAPI_STR(MJOLNIR_VERSION_MAJOR) "." MJOLNIR_CAPI_STR(
    MJOLNIR_VERSION_MINOR) "." MJOLNIR_CAPI_STR(MJOLNIR_VERSION_PATCH);
#ifdef MJOLNIR_VERSION_STRING
static_assert(std::string_view(kHeaderVersion) == MJOLNIR_VERSION_STRING,
              "MJOLNIR_VERSION_* in mjolnir.h differ from the project version in CMakeLists.txt");
#endif

// The C values, indexed by value; the C++ enums are looked up by position in these tables.
constexpr const auto& kFormats = kAllFormats;
static_assert(MJOLNIR_FORMAT_NVFP4 == 7 && std::size(kFormats) == 8);
constexpr ScaleGranularity kGranularities[] = {ScaleGranularity::tensor, ScaleGranularity::head,
                                               ScaleGranularity::channel};
static_assert(MJOLNIR_GRANULARITY_CHANNEL == 2 && std::size(kGranularities) == 3);

}  // namespace

ErrorSlot& thread_error() noexcept {
  thread_local ErrorSlot slot;
  return slot;
}

Format to_format(std::int32_t value, const char* name) {
  if (value < 0 || value >= std::int32_t(std::size(kFormats))) {
    detail::throw_error(name, ": ", value, " is not a mjolnir_format (0..", std::size(kFormats) - 1,
                        ")");
  }
  return kFormats[value];
}

std::int32_t from_format(Format format) {
  for (std::size_t i = 0; i < std::size(kFormats); ++i) {
    if (kFormats[i] == format) return static_cast<std::int32_t>(i);
  }
  detail::throw_error("format: ", static_cast<int>(format), " has no mjolnir_format value");
}

ScaleGranularity to_granularity(std::int32_t value, const char* name) {
  if (value < 0 || value >= std::int32_t(std::size(kGranularities))) {
    detail::throw_error(name, ": ", value, " is not a mjolnir_granularity (0..",
                        std::size(kGranularities) - 1, ")");
  }
  return kGranularities[value];
}

std::int32_t from_granularity(ScaleGranularity granularity) {
  for (std::size_t i = 0; i < std::size(kGranularities); ++i) {
    if (kGranularities[i] == granularity) return static_cast<std::int32_t>(i);
  }
  detail::throw_error("granularity: ", static_cast<int>(granularity),
                      " has no mjolnir_granularity value");
}

}  // namespace mjolnir::capi

using namespace mjolnir::capi;

extern "C" {

MJOLNIR_API const char* mjolnir_status_string(int status) {
  switch (status) {
    case MJOLNIR_OK:
      return "MJOLNIR_OK";
    case MJOLNIR_ERROR_INVALID_ARGUMENT:
      return "MJOLNIR_ERROR_INVALID_ARGUMENT";
    case MJOLNIR_ERROR_NULL_HANDLE:
      return "MJOLNIR_ERROR_NULL_HANDLE";
    case MJOLNIR_ERROR_STRUCT_SIZE:
      return "MJOLNIR_ERROR_STRUCT_SIZE";
    case MJOLNIR_ERROR_BUFFER_TOO_SMALL:
      return "MJOLNIR_ERROR_BUFFER_TOO_SMALL";
    case MJOLNIR_ERROR_UNSUPPORTED:
      return "MJOLNIR_ERROR_UNSUPPORTED";
    case MJOLNIR_ERROR_CAPACITY_EXCEEDED:
      return "MJOLNIR_ERROR_CAPACITY_EXCEEDED";
    case MJOLNIR_ERROR_PLAN_MISMATCH:
      return "MJOLNIR_ERROR_PLAN_MISMATCH";
    case MJOLNIR_ERROR_FILE:
      return "MJOLNIR_ERROR_FILE";
    case MJOLNIR_ERROR_OUT_OF_MEMORY:
      return "MJOLNIR_ERROR_OUT_OF_MEMORY";
    case MJOLNIR_ERROR_INTERNAL:
      return "MJOLNIR_ERROR_INTERNAL";
  }
  return "unknown status";
}

MJOLNIR_API const char* mjolnir_last_error(void) { return thread_error().c_str(); }

MJOLNIR_API unsigned mjolnir_version(void) { return MJOLNIR_VERSION_NUMBER; }

MJOLNIR_API const char* mjolnir_version_string(void) { return kHeaderVersion; }

// The names are the C++ to_string() names (test_capi checks that); they are spelled out here
// because a C string must be NUL-terminated, which a string_view does not promise.
MJOLNIR_API const char* mjolnir_format_name(int32_t format) {
  switch (format) {
    case MJOLNIR_FORMAT_BF16:
      return "bf16";
    case MJOLNIR_FORMAT_FP16:
      return "fp16";
    case MJOLNIR_FORMAT_FP8_E4M3:
      return "fp8_e4m3";
    case MJOLNIR_FORMAT_FP8_E5M2:
      return "fp8_e5m2";
    case MJOLNIR_FORMAT_FP6_E2M3:
      return "fp6_e2m3";
    case MJOLNIR_FORMAT_FP6_E3M2:
      return "fp6_e3m2";
    case MJOLNIR_FORMAT_FP4_E2M1:
      return "fp4_e2m1";
    case MJOLNIR_FORMAT_NVFP4:
      return "nvfp4";
  }
  return nullptr;
}

MJOLNIR_API const char* mjolnir_layout_name(int32_t layout) {
  switch (layout) {
    case MJOLNIR_LAYOUT_STRIDES:
      return "strides";
    case MJOLNIR_LAYOUT_BHN2D:
      return "BHN2D";
    case MJOLNIR_LAYOUT_BNH2D:
      return "BNH2D";
    case MJOLNIR_LAYOUT_B2NHD:
      return "B2NHD";
    case MJOLNIR_LAYOUT_B2HND:
      return "B2HND";
    case MJOLNIR_LAYOUT_2BNHD:
      return "2BNHD";
    case MJOLNIR_LAYOUT_2BHND:
      return "2BHND";
  }
  return nullptr;
}

MJOLNIR_API const char* mjolnir_granularity_name(int32_t granularity) {
  switch (granularity) {
    case MJOLNIR_GRANULARITY_TENSOR:
      return "tensor";
    case MJOLNIR_GRANULARITY_HEAD:
      return "head";
    case MJOLNIR_GRANULARITY_CHANNEL:
      return "channel";
  }
  return nullptr;
}

}  // extern "C"

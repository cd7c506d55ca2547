// Owners of the C API's handles for tests, so a failing assertion or an early return does not
// leak one (the sanitizer suite's leak checker would report it).
#pragma once

#include <memory>

#include "mjolnir/mjolnir.h"

namespace mjolnir::testing {

struct CacheDeleter {
  void operator()(mjolnir_cache* c) const { mjolnir_cache_destroy(c); }
};
struct BackendDeleter {
  void operator()(mjolnir_backend* b) const { mjolnir_backend_destroy(b); }
};
struct PlanDeleter {
  void operator()(mjolnir_plan* p) const { mjolnir_plan_destroy(p); }
};
struct ScalesDeleter {
  void operator()(mjolnir_scales* s) const { mjolnir_scales_destroy(s); }
};
using CachePtr = std::unique_ptr<mjolnir_cache, CacheDeleter>;
using BackendPtr = std::unique_ptr<mjolnir_backend, BackendDeleter>;
using PlanPtr = std::unique_ptr<mjolnir_plan, PlanDeleter>;
using ScalesPtr = std::unique_ptr<mjolnir_scales, ScalesDeleter>;

}  // namespace mjolnir::testing

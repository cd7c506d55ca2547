// A runtime Format as a template constant: the one switch over the formats that the CUDA
// launches (decode, write_kv, the benchmark's fill) and the emulated tests share. Host code.
#pragma once

#include "mjolnir/error.h"
#include "mjolnir/format.h"

namespace mjolnir::cuda {

// Calls visit.template operator()<kFormat>() for `format`'s enumerator; a value outside the enum
// throws, naming cache.geometry.format (where every launch takes its format from).
template <typename Visit>
void with_format(Format format, Visit&& visit) {
  switch (format) {
    case Format::bf16:
      return visit.template operator()<Format::bf16>();
    case Format::fp16:
      return visit.template operator()<Format::fp16>();
    case Format::fp8_e4m3:
      return visit.template operator()<Format::fp8_e4m3>();
    case Format::fp8_e5m2:
      return visit.template operator()<Format::fp8_e5m2>();
    case Format::fp6_e2m3:
      return visit.template operator()<Format::fp6_e2m3>();
    case Format::fp6_e3m2:
      return visit.template operator()<Format::fp6_e3m2>();
    case Format::fp4_e2m1:
      return visit.template operator()<Format::fp4_e2m1>();
    case Format::nvfp4:
      return visit.template operator()<Format::nvfp4>();
  }
  detail::throw_error("cache.geometry.format: unsupported value ", static_cast<int>(format));
}

}  // namespace mjolnir::cuda

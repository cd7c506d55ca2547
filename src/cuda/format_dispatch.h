// A runtime Format as a template constant for the CUDA launches (decode, write_kv, the
// benchmark's fill) and the emulated tests: the library's one switch over the formats
// (core/format_table.h's visit_format), naming where every launch takes its format from. Host
// code.
#pragma once

#include "core/format_table.h"
#include "mjolnir/format.h"

namespace mjolnir::cuda {

// Calls visit.template operator()<kFormat>() for `format`'s enumerator; a value outside the enum
// throws, naming cache.geometry.format.
template <typename Visit>
void with_format(Format format, Visit&& visit) {
  visit_format(format, visit, "cache.geometry.format");
}

}  // namespace mjolnir::cuda

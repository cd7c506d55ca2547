// Backends that take host-memory arguments, as verify::run_case() and the bench's accuracy check
// build them: the registry's backends, except "cuda", whose registered backend wants device
// memory and is wrapped in the staging adapter (same kernels, host arguments copied over).
#pragma once

#include <memory>
#include <string_view>

#include "mjolnir/decode.h"

namespace mjolnir::tools {

std::unique_ptr<Backend> make_host_backend(std::string_view name,
                                           const BackendOptions& options = {});

}  // namespace mjolnir::tools

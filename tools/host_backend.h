// Backends that take host-memory arguments, as verify::run_case() and the bench's accuracy check
// build them: the registry's backends, except "cuda", whose registered backend wants device
// memory and is wrapped in the staging adapter (same kernels, host arguments copied over). The
// CPU kernel variants are the environment's (cpu_kernel_options_from_environment): the CLI's
// MJOLNIR_CPU_* switches, docs/cli.md.
#pragma once

#include <memory>
#include <string_view>

#include "mjolnir/decode.h"

namespace mjolnir::tools {

std::unique_ptr<Backend> make_host_backend(std::string_view name, BackendOptions options = {});

}  // namespace mjolnir::tools

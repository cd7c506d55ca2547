// The CPU backend ("cpu"): runs the plan's work items on a thread pool.
#pragma once

#include <memory>

#include "mjolnir/decode.h"

namespace mjolnir::cpu {

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& options);

}  // namespace mjolnir::cpu

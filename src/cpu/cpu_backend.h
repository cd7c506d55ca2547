// The CPU backend ("cpu"): runs the plan's work items on a thread pool.
#pragma once

#include <memory>

#include "cpu/kernel_config.h"
#include "mjolnir/decode.h"

namespace mjolnir::cpu {

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& options);

// A cpu backend's kernel variants (its options resolved on this CPU), and the work items each
// of its paths has run since it was made: `mjolnir info` shows the first, tests check the second.
// Throw Error for another backend.
KernelConfig kernel_config(const Backend& backend);
KernelPathCounts kernel_path_counts(const Backend& backend);

}  // namespace mjolnir::cpu

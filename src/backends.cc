// The backend registry: the one place that knows every backend. It sits above them (core knows
// none), so adding a backend touches this file and its own folder only.
#include <cstdlib>
#include <string_view>

#include "cpu/cpu_backend.h"
#if MJOLNIR_HAS_CUDA
#include "cuda/cuda_backend.h"
#endif
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "reference/emulator_backend.h"

namespace mjolnir {

CudaKernelOptions cuda_kernel_options_from_environment() {
  CudaKernelOptions options;
  const char* value = std::getenv("MJOLNIR_CUDA_MMA_LAYOUT");
  const std::string_view name = value != nullptr ? value : "";
  if (name == "plain") {
    options.max_mma_layout = CudaMmaLayout::plain;
  } else if (name == "stacked") {
    options.max_mma_layout = CudaMmaLayout::stacked;
  } else {
    MJOLNIR_REQUIRE(name.empty() || name == "tokens_on_m", "MJOLNIR_CUDA_MMA_LAYOUT: '", name,
                    "' is not plain, stacked or tokens_on_m");
  }
  return options;
}

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names{"cpu", "reference"};
#if MJOLNIR_HAS_CUDA
  names.insert(names.begin(), "cuda");  // device arguments: see src/cuda/cuda_backend.h
#endif
  return names;
}

void check_cpu_threads(std::int64_t threads, std::string_view arg_name) {
  MJOLNIR_REQUIRE(threads >= 0 && threads <= kMaxCpuThreads, arg_name, ": ", threads,
                  " is outside [0, ", kMaxCpuThreads, "] (0 = every core)");
}

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  check_cpu_threads(options.threads, "options.threads");
  MJOLNIR_REQUIRE(options.threads == 0 || options.executor == nullptr,
                  "options.threads: ", options.threads,
                  " with an executor, whose workers are the threads (leave it 0)");
  if (name == "cpu") return cpu::make_cpu_backend(options);
  if (name == "reference") return reference::make_emulator_backend();
#if MJOLNIR_HAS_CUDA
  if (name == "cuda") return cuda::make_cuda_backend(options);
  detail::throw_error("backend: '", name, "' is not one of cuda, cpu, reference");
#else
  if (name == "cuda") {
    detail::throw_error(
        "backend: 'cuda' is not in this build (configure with nvcc found and "
        "MJOLNIR_CUDA=ON)");
  }
  detail::throw_error("backend: '", name, "' is not one of cpu, reference");
#endif
}

}  // namespace mjolnir

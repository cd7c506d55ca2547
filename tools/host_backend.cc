#include "host_backend.h"

#if MJOLNIR_HAS_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace mjolnir::tools {

std::unique_ptr<Backend> make_host_backend(std::string_view name, BackendOptions options) {
  options.cpu_kernels = cpu_kernel_options_from_environment();
  options.cuda_kernels = cuda_kernel_options_from_environment();
#if MJOLNIR_HAS_CUDA
  if (name == "cuda") return cuda::make_staging_backend(options);
#endif
  return make_backend(name, options);
}

}  // namespace mjolnir::tools

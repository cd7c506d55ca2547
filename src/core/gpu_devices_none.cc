// cuda_devices() for builds without the CUDA backend (src/cuda/gpu_devices.cu otherwise).
#include "core/gpu_devices.h"

#if !MJOLNIR_HAS_CUDA
namespace mjolnir {

std::vector<GpuDevice> cuda_devices(std::string* why_none) {
  if (why_none) *why_none = "the CUDA backend is not compiled in (configure with nvcc and MJOLNIR_CUDA=ON)";
  return {};
}

}  // namespace mjolnir
#endif

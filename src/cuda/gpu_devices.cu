// cuda_devices() through the CUDA runtime: the one place that asks the driver what is there.
#include <cuda_runtime.h>

#include <string>

#include "core/gpu_devices.h"

namespace mjolnir {

std::vector<GpuDevice> cuda_devices(std::string* why_none) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    if (why_none) {
      if (status == cudaErrorInsufficientDriver) {
        // What the runtime says where no NVIDIA driver is installed at all, as on a machine
        // without a GPU: "CUDA driver version is insufficient" would send a user after a driver
        // upgrade.
        int driver = 0;
        cudaDriverGetVersion(&driver);
        *why_none = driver == 0 ? std::string("no CUDA device: no NVIDIA driver is loaded")
                                : "no CUDA device: the NVIDIA driver (CUDA " +
                                      std::to_string(driver / 1000) + "." +
                                      std::to_string(driver % 1000 / 10) +
                                      ") is older than the CUDA runtime this build uses (CUDA " +
                                      std::to_string(CUDART_VERSION / 1000) + ")";
      } else {
        *why_none = status != cudaSuccess
                        ? std::string("no CUDA device: ") + cudaGetErrorString(status)
                        : std::string("no CUDA device");
      }
    }
    return {};
  }
  std::vector<GpuDevice> devices;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    devices.push_back(GpuDevice{prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                                double(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0)});
  }
  return devices;
}

}  // namespace mjolnir

// The dispatch layer of the decode kernels: runtime values (format, D, group, tile) become the
// kernel's template constants and launch configuration here, and only here; an unsupported value
// fails here, naming itself. Internal to the CUDA backend.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <string>

#include "cuda/cuda_decode.h"
#include "cuda/decode_config.h"
#include "mjolnir/decode.h"

namespace mjolnir::cuda {

// Builds the kernel parameters from `args` (device pointers: cache.data, q, o, lse; shapes) and
// `scales`, picks the launch configuration, and launches decode then merge on `stream`.
// `step_device` is a DecodeStep's device buffer. Throws Error for a configuration the kernels
// cannot run (see unsupported_reason()). `layout_limit`: the tensor-core body's best layout
// allowed (CudaKernelOptions::max_mma_layout).
void launch_decode(const DecodeArgs& args, const DeviceScales& scales, const std::byte* step_device,
                   std::span<std::byte> workspace, const LaunchShape& shape, cudaStream_t stream,
                   MmaLayout layout_limit = MmaLayout::tokens_on_m);

// The CTA body launch_decode() runs for these arguments on the current device.
DecodeBody chosen_body(const DecodeArgs& args);

// Device properties the launch layer and the backend use, for the current device.
struct DeviceLimits {
  int device = 0;
  int multiprocessors = 0;
  int max_smem_per_block = 0;  // with the opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize)
  int compute_capability = 0;  // major * 10 + minor
};
DeviceLimits current_device_limits();

}  // namespace mjolnir::cuda

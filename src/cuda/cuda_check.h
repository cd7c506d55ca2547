// CUDA runtime errors as mjolnir::Error: every runtime call of the CUDA backend goes through
// MJOLNIR_CUDA_CHECK, so a failure names the call and the driver's message instead of being lost.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "mjolnir/error.h"

namespace mjolnir::cuda {

// Throws Error("cuda: <what>: <error name> (<message>)") unless `status` is cudaSuccess.
inline void check_cuda(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  throw Error(std::string("cuda: ") + what + ": " + cudaGetErrorName(status) + " (" +
              cudaGetErrorString(status) + ")");
}

}  // namespace mjolnir::cuda

#define MJOLNIR_CUDA_CHECK(call) ::mjolnir::cuda::check_cuda((call), #call)

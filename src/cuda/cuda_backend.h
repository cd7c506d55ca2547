// The CUDA backend ("cuda") behind the Backend interface, without CUDA headers, so the registry
// (core/decode.cc) and host code can name it. The stream-level API (device step buffers, graph
// capture, write_kv on device tensors) is in cuda/cuda_decode.h.
//
// Where the arguments of the "cuda" backend live (docs/cuda.md):
//   device memory: cache.data, q.data, o.data, lse.data(), and the workspace of run();
//   host memory:   cache.k_scale, cache.v_scale, batch.block_table, batch.seq_lens.
// The host parts are what validate(DecodeArgs) reads and make_plan() needs; run() uploads them
// (with the plan) into device buffers on every call. Nothing on the device is read by the host.
#pragma once

#include <memory>

#include "mjolnir/decode.h"

namespace mjolnir::cuda {

// The device backend. run() validates, uploads the plan, the batch and the scales, launches the
// decode and merge kernels on the legacy default stream and waits for them; its workspace must
// be device memory of workspace_bytes(). Without a device it constructs, and
// unavailable_reason() says why ("no CUDA device: ...").
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options);

// The same kernels behind host-memory arguments, for the verify checks and the tests: run()
// copies the pool, queries and outputs to the device (with poisoned guard regions around the
// outputs and the workspace, checked afterwards), runs the device backend and copies o and lse
// back. workspace_bytes() is 0 (it keeps its own device workspace). Named "cuda" too, since it
// runs exactly the "cuda" kernels; it is slow (whole-pool copies) and not for serving.
std::unique_ptr<Backend> make_staging_backend(const BackendOptions& options);

}  // namespace mjolnir::cuda

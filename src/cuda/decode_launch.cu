// The dispatch layer (decode_launch.h): kernel parameters, launch configuration, and the one
// switch that turns a runtime Format into the kernel's template constant.
#include "cuda/decode_launch.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/decode_kernel.cuh"
#include "cuda/decode_mma_kernel.cuh"
#include "mjolnir/error.h"

namespace mjolnir::cuda {

namespace {

// The merge of split sequences, after either decode body.
void launch_merge(const DecodeKernelParams& p, const LaunchShape& shape, cudaStream_t stream) {
  if (shape.merge_ctas > 0) {
    merge_kernel<<<shape.merge_ctas, kMergeThreads, kMergeSmemBytes, stream>>>(p);
    MJOLNIR_CUDA_CHECK(cudaGetLastError());
  }
}

template <Format kFormat>
void launch_format(const DecodeKernelParams& p, std::size_t smem_bytes, const LaunchShape& shape,
                   cudaStream_t stream) {
  if (shape.decode_ctas > 0) {
    decode_kernel<kFormat><<<shape.decode_ctas, kDecodeThreads, smem_bytes, stream>>>(p);
    MJOLNIR_CUDA_CHECK(cudaGetLastError());
  }
  launch_merge(p, shape, stream);
}

template <Format kFormat, int kHeadDim>
void launch_mma(const DecodeKernelParams& p, std::size_t smem_bytes, const LaunchShape& shape,
                cudaStream_t stream) {
  if (shape.decode_ctas > 0) {
    decode_mma_kernel<kFormat, kHeadDim><<<shape.decode_ctas, kMmaThreads, smem_bytes, stream>>>(p);
    MJOLNIR_CUDA_CHECK(cudaGetLastError());
  }
  launch_merge(p, shape, stream);
}

// The exact-order body for a runtime format (format_dispatch.h): every format of format.h has a
// kernel.
void launch_for_format(Format format, const DecodeKernelParams& p, std::size_t smem_bytes,
                       const LaunchShape& shape, cudaStream_t stream) {
  with_format(format,
              [&]<Format kFormat>() { launch_format<kFormat>(p, smem_bytes, shape, stream); });
}

// Lets every decode kernel use the device's opt-in shared memory. Done once per device when its
// limits are first read (before any launch, so never while a graph is being captured).
void allow_max_smem(int bytes) {
  for (const auto kernel : {decode_kernel<Format::bf16>, decode_kernel<Format::fp16>,
                            decode_kernel<Format::fp8_e4m3>, decode_kernel<Format::fp8_e5m2>,
                            decode_kernel<Format::fp6_e2m3>, decode_kernel<Format::fp6_e3m2>,
                            decode_kernel<Format::fp4_e2m1>, decode_kernel<Format::nvfp4>}) {
    MJOLNIR_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  }
  for (const Format format : kAllFormats) {
    for (const int head_dim : {64, 128, 256}) {
      if (!mma_shape(format, head_dim)) continue;
      with_mma_shape(format, head_dim, [&]<Format kFormat, int kHeadDim>() {
        MJOLNIR_CUDA_CHECK(cudaFuncSetAttribute(decode_mma_kernel<kFormat, kHeadDim>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                bytes));
      });
    }
  }
}

}  // namespace

DeviceLimits current_device_limits() {
  static std::mutex mutex;
  static std::vector<DeviceLimits> known;  // per device ordinal, filled on first use
  DeviceLimits limits;
  MJOLNIR_CUDA_CHECK(cudaGetDevice(&limits.device));
  std::lock_guard lock(mutex);
  for (const DeviceLimits& entry : known) {
    if (entry.device == limits.device) return entry;
  }
  MJOLNIR_CUDA_CHECK(cudaDeviceGetAttribute(&limits.multiprocessors, cudaDevAttrMultiProcessorCount,
                                            limits.device));
  MJOLNIR_CUDA_CHECK(cudaDeviceGetAttribute(
      &limits.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, limits.device));
  int major = 0, minor = 0;
  MJOLNIR_CUDA_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, limits.device));
  MJOLNIR_CUDA_CHECK(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, limits.device));
  limits.compute_capability = major * 10 + minor;
  allow_max_smem(limits.max_smem_per_block);
  known.push_back(limits);
  return limits;
}

std::string unsupported_reason(const CacheGeometry& geometry, const DecodeParams& params,
                               int max_tile_tokens) {
  const int d = geometry.head_dim;
  if (d < 32 || d > 256 || d % 32 != 0) {
    return "head_dim " + std::to_string(d) + " is not a multiple of 32 in [32, 256]";
  }
  if (static_cast<std::size_t>(geometry.format) >= std::size(kAllFormats)) {
    return "format value " + std::to_string(static_cast<int>(geometry.format)) + " is unknown";
  }
  if (max_tile_tokens < 1) return "tile_tokens " + std::to_string(max_tile_tokens) + " < 1";
  if (params.p_mode == PMode::fp16) {
    return "P mode fp16 (fp16 sums, for CPUs with AVX512-FP16) is not implemented on CUDA; the "
           "cpu and reference backends run it";
  }
  if (params.q_len == 0) {
    return "ragged steps (q_len 0 with query_start: prefill, mixed query lengths) are not "
           "implemented on CUDA yet; the cpu and reference backends run them";
  }
  // One query row must fit the device's shared memory with the largest tile.
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    cudaGetLastError();  // no device: nothing more to check here
    return {};
  }
  const int sub = sub_tokens_for(d);
  const int raw_stride = static_cast<int>(align16(geometry.row_bytes()));
  const std::size_t one_row = decode_smem(1, d, sub, max_tile_tokens, raw_stride).bytes;
  const DeviceLimits limits = current_device_limits();
  if (one_row > static_cast<std::size_t>(limits.max_smem_per_block)) {
    return "tile_tokens " + std::to_string(max_tile_tokens) + " with head_dim " +
           std::to_string(d) + " needs " + std::to_string(one_row) +
           " bytes of shared memory per CTA; the device allows " +
           std::to_string(limits.max_smem_per_block);
  }
  return {};
}

DecodeBody chosen_body(const DecodeArgs& args) {
  const DeviceLimits limits = current_device_limits();
  const int rows = args.params.q_len * (args.params.num_q_heads / args.cache.geometry.num_kv_heads);
  return tensor_core_unsupported(args.cache, args.params, rows, limits.compute_capability,
                                 static_cast<std::size_t>(limits.max_smem_per_block))
                 .empty()
             ? DecodeBody::tensor_core
             : DecodeBody::exact_order;
}

void launch_decode(const DecodeArgs& args, const DeviceScales& scales, const std::byte* step_device,
                   std::span<std::byte> workspace, const LaunchShape& shape, cudaStream_t stream,
                   MmaLayout layout_limit) {
  const DeviceLimits limits = current_device_limits();
  const DecodeConfig config = make_decode_config(
      args, scales.k, scales.v, step_device, workspace, shape,
      static_cast<std::size_t>(limits.max_smem_per_block), limits.compute_capability, layout_limit);
  if (config.body == DecodeBody::tensor_core) {
    with_mma_shape(args.cache.geometry.format, args.cache.geometry.head_dim,
                   [&]<Format kFormat, int kHeadDim>() {
                     launch_mma<kFormat, kHeadDim>(config.params, config.smem_bytes, shape, stream);
                   });
    return;
  }
  launch_for_format(args.cache.geometry.format, config.params, config.smem_bytes, shape, stream);
}

}  // namespace mjolnir::cuda

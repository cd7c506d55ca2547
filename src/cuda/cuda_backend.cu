// The "cuda" Backend (device arguments) and the staging adapter (host arguments), both over the
// kernels of decode_launch.cu. See cuda_backend.h for where each argument lives.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/gpu_devices.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_decode.h"
#include "cuda/decode_launch.h"
#include "mjolnir/error.h"

namespace mjolnir::cuda {

namespace {

// Plans are made for SMs x this many CTAs. The tensor-core CTA (four warps, 95-254 registers a
// thread: 168 for fp8 at D 128) fits two to five to an SM, and more items than resident slots
// keep loads in flight while the last items of a step drain; the exact-order CTA fits two or
// three, so its plans take several waves (on an H200, 8 made it 1.1-1.4x faster than 2; the
// tensor-core body was measured with 8 only).
constexpr int kPlannedCtasPerSm = 8;

// CTAs of the tensor-core body resident on an SM at once (168 registers a thread for fp8 at
// D 128: three CTAs of 128 threads), PlanOptions::wave_workers. A step of one to three sequences
// is cut into chunks that fit one wave of them: on an H200 (2026-12-04, fp8, Hk 8, batch 1) a
// cap of 48 chunks took 39.5 us at 32k tokens and 90 us at 128k, where 64 took 52.6 and 126 us
// and the fill rule of `workers` (128 chunks) 67 and 131 us
// (bench/results/cuda-splits-2026-12-04-h200.json; fp4 the same shape). Batches of 2 and 3 follow
// the same rule unmeasured.
constexpr int kResidentCtasPerSm = 3;

// A device buffer that grows and is never shrunk.
class DeviceBuffer {
 public:
  ~DeviceBuffer() { cudaFree(data_); }
  std::byte* reserve(std::size_t bytes) {
    if (bytes > size_) {
      cudaFree(data_);
      data_ = nullptr;
      size_ = 0;
      MJOLNIR_CUDA_CHECK(cudaMalloc(&data_, bytes));
      size_ = bytes;
    }
    return data_;
  }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaKernelOptions& kernels) : kernels_(kernels) {
    std::string why;
    const std::vector<GpuDevice> devices = cuda_devices(&why);
    if (devices.empty()) {
      unavailable_ = why.empty() ? "no CUDA device" : why;
      return;
    }
    try {
      const DeviceLimits limits = current_device_limits();
      workers_ = std::max(1, limits.multiprocessors * kPlannedCtasPerSm);
      wave_workers_ = std::max(1, limits.multiprocessors * kResidentCtasPerSm);
    } catch (const Error& e) {
      unavailable_ = std::string("no usable CUDA device: ") + e.what();
    }
  }

  std::string_view name() const override { return "cuda"; }
  std::string unavailable_reason() const override { return unavailable_; }
  std::string unsupported_reason(const CacheGeometry& geometry,
                                 const DecodeParams& params) const override {
    // Checked for the default tile here; run() checks the plan's own.
    return cuda::unsupported_reason(geometry, params, PlanOptions{}.tile_tokens);
  }
  int workers() const override { return workers_; }
  int wave_workers() const override { return wave_workers_; }

  void run(const DecodeArgs& args, const BackendPlan& planned,
           std::span<std::byte> workspace) const override {
    MJOLNIR_REQUIRE(unavailable_.empty(), "backend cuda: ", unavailable_);
    const Plan& plan = planned.plan();
    validate(args);
    require_float32_rows(args);
    const CacheGeometry& geo = args.cache.geometry;
    const int num_seqs = args.batch.num_seqs();
    if (num_seqs == 0) return;
    require_device_pointer(args.cache.data, "cache.data");
    require_device_pointer(args.q.data, "q.data");
    require_device_pointer(args.o.data, "o.data");
    require_device_pointer(args.lse.data(), "lse");
    require_device_pointer(workspace.data(), "workspace");
    check_run(args, planned, workspace);
    const std::string why = cuda::unsupported_reason(geo, args.params, plan.tile_tokens);
    MJOLNIR_REQUIRE(why.empty(), "backend cuda: ", why);

    std::lock_guard lock(mutex_);
    // Legacy default stream: ordered after the caller's work on blocking streams.
    const cudaStream_t stream = nullptr;
    const StepCapacity need = step_capacity_for(plan, args.batch);
    if (!step_ || !step_->capacity().covers(need)) {
      step_.reset();
      step_ = std::make_unique<DecodeStep>(need);
    }
    step_->upload(args.batch, plan, geo, stream);

    // The scales' host values, copied next to each other on the device.
    const std::size_t count = args.cache.k_scale.size();
    auto* scales = reinterpret_cast<float*>(scales_.reserve(2 * count * sizeof(float)));
    MJOLNIR_CUDA_CHECK(cudaMemcpyAsync(scales, args.cache.k_scale.data(), count * sizeof(float),
                                       cudaMemcpyHostToDevice, stream));
    MJOLNIR_CUDA_CHECK(cudaMemcpyAsync(scales + count, args.cache.v_scale.data(),
                                       count * sizeof(float), cudaMemcpyHostToDevice, stream));

    enqueue_planned_decode(args, plan, DeviceScales{scales, scales + count}, *step_, workspace,
                           stream, kernels_);
    MJOLNIR_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

 private:
  const CudaKernelOptions kernels_;  // BackendOptions::cuda_kernels
  std::string unavailable_;
  int workers_ = 1;
  int wave_workers_ = 0;
  mutable std::mutex mutex_;  // run() reuses the step and scale buffers: one call at a time
  mutable std::unique_ptr<DecodeStep> step_;
  mutable DeviceBuffer scales_;
};

// --- the staging adapter ------------------------------------------------------------------------

constexpr std::size_t kGuardFloats = 64;
constexpr std::size_t kWorkspaceGuardBytes = 256;
constexpr unsigned char kOutputPoison = 0xFF;  // every float NaN
constexpr unsigned char kWorkspacePoison = 0x5A;

// Floats a [rows, Hq, D] tensor with these strides spans, from its first element to its last.
std::size_t tensor_extent(std::int64_t rows, int num_q_heads, int head_dim,
                          std::int64_t token_stride, std::int64_t head_stride) {
  if (rows == 0) return 0;
  return std::size_t((rows - 1) * token_stride + std::int64_t(num_q_heads - 1) * head_stride +
                     head_dim);
}

// A device allocation with guard bytes on both sides, filled with `poison`.
class GuardedBuffer {
 public:
  GuardedBuffer(std::size_t bytes, std::size_t guard, unsigned char poison)
      : bytes_(bytes), guard_(guard), poison_(poison) {
    if (bytes + 2 * guard == 0) return;  // nothing to hold: data() is null
    MJOLNIR_CUDA_CHECK(cudaMalloc(&base_, bytes + 2 * guard));
    MJOLNIR_CUDA_CHECK(cudaMemset(base_, poison, bytes + 2 * guard));
  }
  ~GuardedBuffer() { cudaFree(base_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  std::byte* data() const { return base_ == nullptr ? nullptr : base_ + guard_; }
  // True when both guards still hold the poison.
  bool guards_intact() const {
    if (guard_ == 0) return true;
    std::vector<unsigned char> host(2 * guard_);
    MJOLNIR_CUDA_CHECK(cudaMemcpy(host.data(), base_, guard_, cudaMemcpyDeviceToHost));
    MJOLNIR_CUDA_CHECK(
        cudaMemcpy(host.data() + guard_, base_ + guard_ + bytes_, guard_, cudaMemcpyDeviceToHost));
    return std::all_of(host.begin(), host.end(), [&](unsigned char b) { return b == poison_; });
  }

 private:
  std::byte* base_ = nullptr;
  std::size_t bytes_, guard_;
  unsigned char poison_;
};

// cudaMemcpy that does nothing for zero bytes (where either pointer may be null).
void copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  if (bytes > 0) MJOLNIR_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
}

class StagingBackend final : public Backend {
 public:
  explicit StagingBackend(const BackendOptions& options) : device_(make_cuda_backend(options)) {}

  std::string_view name() const override { return "cuda"; }
  std::string unavailable_reason() const override { return device_->unavailable_reason(); }
  std::string unsupported_reason(const CacheGeometry& geometry,
                                 const DecodeParams& params) const override {
    return device_->unsupported_reason(geometry, params);
  }
  int workers() const override { return device_->workers(); }
  int wave_workers() const override { return device_->wave_workers(); }
  std::size_t workspace_bytes(const Plan&, const CacheGeometry&,
                              const DecodeParams&) const override {
    return 0;  // the device workspace is this adapter's own
  }

  void run(const DecodeArgs& host, const BackendPlan& planned,
           std::span<std::byte>) const override {
    validate(host);
    const Plan& plan = planned.plan();
    require_float32_rows(host);
    const CacheGeometry& geo = host.cache.geometry;
    const DecodeParams& params = host.params;
    const std::int64_t rows = std::int64_t(host.batch.num_seqs()) * params.q_len;
    const int d = geo.head_dim;
    const std::size_t q_floats =
        tensor_extent(rows, params.num_q_heads, d, host.q.token_stride, host.q.head_stride);
    const std::size_t o_floats =
        tensor_extent(rows, params.num_q_heads, d, host.o.token_stride, host.o.head_stride);

    GuardedBuffer pool(host.cache.bytes, 0, 0);
    copy(pool.data(), host.cache.data, host.cache.bytes, cudaMemcpyHostToDevice);
    GuardedBuffer q(q_floats * sizeof(float), 0, 0);
    copy(q.data(), host.q.data, q_floats * sizeof(float), cudaMemcpyHostToDevice);
    // o and lse start as the caller's bytes (gaps between rows must come back unchanged) with
    // poisoned guards around them.
    GuardedBuffer o(o_floats * sizeof(float), kGuardFloats * sizeof(float), kOutputPoison);
    copy(o.data(), host.o.data, o_floats * sizeof(float), cudaMemcpyHostToDevice);
    GuardedBuffer lse(host.lse.size() * sizeof(float), kGuardFloats * sizeof(float), kOutputPoison);
    copy(lse.data(), host.lse.data(), host.lse.size() * sizeof(float), cudaMemcpyHostToDevice);
    const std::size_t ws_bytes = device_->workspace_bytes(plan, geo, params);
    GuardedBuffer workspace(ws_bytes, kWorkspaceGuardBytes, kWorkspacePoison);

    DecodeArgs dev = host;
    dev.cache.data = pool.data();
    dev.q.data = q.data();
    dev.o.data = o.data();
    dev.lse = host.lse.empty()
                  ? std::span<float>()
                  : std::span<float>(reinterpret_cast<float*>(lse.data()), host.lse.size());
    device_->run(dev, planned, {workspace.data(), ws_bytes});

    MJOLNIR_REQUIRE(o.guards_intact(), "backend cuda: wrote outside the o tensor");
    MJOLNIR_REQUIRE(lse.guards_intact(), "backend cuda: wrote outside the lse tensor");
    MJOLNIR_REQUIRE(workspace.guards_intact(), "backend cuda: wrote outside its workspace");
    copy(host.o.data, o.data(), o_floats * sizeof(float), cudaMemcpyDeviceToHost);
    copy(host.lse.data(), lse.data(), host.lse.size() * sizeof(float), cudaMemcpyDeviceToHost);
  }

 private:
  std::unique_ptr<Backend> device_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options) {
  return std::make_unique<CudaBackend>(options.cuda_kernels);
}

std::unique_ptr<Backend> make_staging_backend(const BackendOptions& options) {
  return std::make_unique<StagingBackend>(options);
}

}  // namespace mjolnir::cuda

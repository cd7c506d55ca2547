#include "graph_buffers.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "mjolnir/error.h"
#include "tensor_views.h"

#if MJOLNIR_PY_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "cuda/cuda_decode.h"
#endif

namespace mjolnir::python {
namespace {

void require_range(std::int64_t value, std::int64_t lo, std::int64_t hi, const char* name) {
  if (value < lo || value > hi) {
    raise_value_error(std::string(name) + ": " + std::to_string(value) + " is outside [" +
                      std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
}

#if MJOLNIR_PY_CUDA
// A float32 tensor of scales on the buffers' device, which a captured graph can read at replay:
// a host tensor would be copied on every call (a copy a graph cannot capture), another dtype
// converted into a temporary the graph would keep a dangling pointer to.
void require_graph_scales(const at::Tensor& t, const char* name, std::int64_t device) {
  if (!t.is_cuda() || t.device().index() != device || t.scalar_type() != at::kFloat ||
      !t.is_contiguous()) {
    raise_value_error(std::string(name) + ": " + dtype_name(t.scalar_type()) + " on " +
                      t.device().str() +
                      "; a step planned into graph buffers takes contiguous "
                      "float32 scales on cuda:" +
                      std::to_string(device) + " (a captured graph reads them there at replay)");
  }
}
#endif

}  // namespace

GraphBuffers::GraphBuffers(std::int64_t max_seqs, std::int64_t max_pages_per_seq,
                           std::int64_t q_len, std::int64_t num_q_heads, std::int64_t num_kv_heads,
                           std::int64_t head_dim, std::int64_t max_splits, std::int64_t page_size,
                           std::int64_t num_pages, std::int64_t device)
    : q_len_(q_len), num_q_heads_(num_q_heads), max_splits_(max_splits), device_(device) {
#if !MJOLNIR_PY_CUDA
  (void)max_seqs, (void)max_pages_per_seq, (void)num_kv_heads, (void)head_dim, (void)page_size,
      (void)num_pages;
  raise_value_error(
      "GraphBuffers: this build of mjolnir has no CUDA backend (MJOLNIR_PYTHON_CUDA=ON builds it)");
#else
  if (c10::cuda::device_count() == 0) {
    raise_value_error("GraphBuffers: no CUDA device is visible to this process");
  }
  require_range(max_seqs, 1, 1 << 16, "max_seqs");
  require_range(max_pages_per_seq, 1, 1 << 20, "max_pages_per_seq");
  require_range(q_len, 1, 64, "q_len");
  require_range(num_kv_heads, 1, 1024, "num_kv_heads");
  if (num_q_heads < 1 || num_q_heads % num_kv_heads != 0) {
    raise_value_error("num_q_heads: " + std::to_string(num_q_heads) +
                      " is not a positive multiple of num_kv_heads " +
                      std::to_string(num_kv_heads));
  }
  check_head_dim(head_dim, "head_dim");
  require_range(max_splits, 1, 256, "max_splits");
  require_range(num_pages, 1, std::int64_t(1) << 30, "num_pages");
  require_range(device, 0, std::int64_t(c10::cuda::device_count()) - 1, "device");
  max_rows_ = max_seqs * q_len;
  geometry_.format = Format::bf16;  // steps are checked against the pool's shape, not its codes
  geometry_.num_pages = int(num_pages);
  geometry_.page_size = int(page_size);
  geometry_.num_kv_heads = int(num_kv_heads);
  geometry_.head_dim = int(head_dim);
  with_op_errors([&] { validate(PagedBatch{}, geometry_, int(q_len)); });  // page_size

  const c10::cuda::CUDAGuard guard(c10::DeviceIndex(device));
  cuda::StepCapacity capacity;
  capacity.plan.max_seqs = int(max_seqs);
  capacity.plan.num_kv_heads = int(num_kv_heads);
  capacity.plan.max_splits = int(max_splits);
  capacity.max_pages_per_seq = int(max_pages_per_seq);
  capacity.max_tile_tokens = PlanOptions{}.tile_tokens;  // the tile every step is planned with
  DecodeParams params;
  params.q_len = int(q_len);
  params.num_q_heads = int(num_q_heads);
  const std::size_t bytes = with_op_errors([&] {
    step_ = std::make_shared<cuda::DecodeStep>(capacity);
    return cuda::decode_workspace_bytes(capacity, geometry_, params);
  });
  const auto on_device = at::TensorOptions().device(at::kCUDA, c10::DeviceIndex(device));
  workspace_ =
      at::empty({std::int64_t(std::max<std::size_t>(bytes, 1))}, on_device.dtype(at::kByte));
  // Zeros: the output rows of sequences past a step's batch are copied out as they are.
  q_rows_ = at::zeros({max_rows_, num_q_heads, head_dim}, on_device.dtype(at::kFloat));
  o_rows_ = at::zeros({max_rows_, num_q_heads, head_dim}, on_device.dtype(at::kFloat));
#endif
}

GraphBuffers::~GraphBuffers() = default;

std::string GraphBuffers::describe() const {
  const double bytes = double(workspace_.defined() ? workspace_.nbytes() : 0) +
                       2.0 * double(q_rows_.defined() ? q_rows_.nbytes() : 0);
  char text[256];
  std::snprintf(text, sizeof(text),
                "%lld sequences x %lld query tokens, %d-token pages from a pool of %d, %lld "
                "chunks, %d KV heads x %d channels, %.1f MiB on cuda:%lld",
                static_cast<long long>(q_len_ ? max_rows_ / q_len_ : 0),
                static_cast<long long>(q_len_), geometry_.page_size, geometry_.num_pages,
                static_cast<long long>(max_splits_), geometry_.num_kv_heads, geometry_.head_dim,
                bytes / (1024.0 * 1024.0), static_cast<long long>(device_));
  return text;
}

void GraphBuffers::upload([[maybe_unused]] const PagedBatch& batch,
                          [[maybe_unused]] const Plan& plan) const {
#if MJOLNIR_PY_CUDA
  const c10::cuda::CUDAGuard guard(c10::DeviceIndex(device_));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(device_)).stream();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) == cudaSuccess &&
      capturing != cudaStreamCaptureStatusNone) {
    raise_value_error(
        "graph: the current stream is capturing a CUDA graph; plan a step into graph buffers "
        "before the capture (its upload is a copy from host memory, which a replay would repeat "
        "with the captured step's plan)");
  }
  with_op_errors([&] { step_->upload(batch, plan, geometry_, stream); });
#endif
}

void GraphBuffers::enqueue([[maybe_unused]] at::Tensor& output,
                           [[maybe_unused]] const at::Tensor& q,
                           [[maybe_unused]] const KvCacheView& cache,
                           [[maybe_unused]] const DecodeParams& params,
                           [[maybe_unused]] const at::Tensor& k_scale,
                           [[maybe_unused]] const at::Tensor& v_scale) const {
#if MJOLNIR_PY_CUDA
  const std::int64_t rows = q.size(0);
  if (!q.is_cuda() || q.device().index() != device_) {
    raise_value_error("q: on " + q.device().str() +
                      ", the graph buffers are on cuda:" + std::to_string(device_));
  }
  if (rows > max_rows_ || q.size(1) != num_q_heads_ || q.size(2) != geometry_.head_dim) {
    raise_value_error("q: shape " + shape_of(q) + "; the graph buffers hold at most " +
                      std::to_string(max_rows_) + " rows (max_seqs x q_len) of " +
                      std::to_string(num_q_heads_) + " heads x " +
                      std::to_string(geometry_.head_dim));
  }
  const CacheGeometry& geo = cache.geometry;
  if (geo.page_size != geometry_.page_size || geo.num_pages != geometry_.num_pages ||
      geo.num_kv_heads != geometry_.num_kv_heads || geo.head_dim != geometry_.head_dim) {
    raise_value_error("kv_cache: " + std::to_string(geo.num_pages) + " pages of " +
                      std::to_string(geo.page_size) + " tokens, " +
                      std::to_string(geo.num_kv_heads) + " KV heads x " +
                      std::to_string(geo.head_dim) + "; the graph buffers were made for " +
                      describe());
  }
  require_graph_scales(k_scale, "k_scale", device_);
  require_graph_scales(v_scale, "v_scale", device_);

  const c10::cuda::CUDAGuard guard(c10::DeviceIndex(device_));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(device_)).stream();
  q_rows_.narrow(0, 0, rows).copy_(q);
  DecodeArgs args;
  args.cache = cache;
  args.params = params;
  const std::int64_t token_stride = num_q_heads_ * geometry_.head_dim;
  args.q = {q_rows_.const_data_ptr<float>(), token_stride, geometry_.head_dim, RowType::f32};
  args.o = {o_rows_.data_ptr<float>(), token_stride, geometry_.head_dim, RowType::f32};
  const CudaKernelOptions& kernels = cuda_kernels_from_environment();
  with_op_errors([&] {
    const std::string why =
        cuda::unsupported_reason(geo, params, step_->capacity().max_tile_tokens);
    MJOLNIR_REQUIRE(why.empty(), "backend cuda: ", why);
    cuda::enqueue_decode(
        args, cuda::DeviceScales{k_scale.const_data_ptr<float>(), v_scale.const_data_ptr<float>()},
        *step_, {static_cast<std::byte*>(workspace_.data_ptr()), workspace_.nbytes()}, stream,
        kernels);
  });
  output.narrow(0, 0, rows).copy_(o_rows_.narrow(0, 0, rows));
#endif
}

}  // namespace mjolnir::python

// torch.ops.mjolnir: the library's cache write and attention as PyTorch operators, registered
// from C++ (TORCH_LIBRARY) so that a call costs the dispatcher's few microseconds, not a Python
// function's hundreds, with Meta kernels for torch.compile and FakeTensor.
//
//   write_kv(key, value, kv_cache!, slot_mapping, k_scale, v_scale, kv_format, layout)
//   decode(q, kv_cache, block_table, seq_lens, k_scale, v_scale, kv_format, q_len, layout, ...,
//          query_start=None) -> Tensor        one step, planned and run in one call
//   decode_into(output!, q, ...)                the same into `output`
//   plan_step(seq_lens, block_table, query_start, q_len, num_q_heads, num_kv_heads, ...)
//       -> torch.classes.mjolnir.Step          a step's plan, made once (a serving engine's
//                                               metadata builder)
//   attend(step, output!, q, kv_cache, k_scale, v_scale, kv_format, layout, softmax_scale)
//                                               that plan run for one layer: no planning, no
//                                               allocation
//   plan_step(..., graph=torch.classes.mjolnir.GraphBuffers(...))
//                                               the plan uploaded into buffers of fixed
//                                               capacity, so that a CUDA graph can capture a
//                                               layer's attend once and replay it over later
//                                               steps (graph_buffers.h)
// Tensors are taken as vLLM lays them out (docs/python.md); every check lives in
// tensor_views.cpp or in the library, and names the op's argument.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "graph_buffers.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "mjolnir/plan.h"
#include "mjolnir/write_kv.h"
#include "tensor_views.h"

#if MJOLNIR_PY_CUDA
#include <c10/cuda/CUDAStream.h>

#include "cuda/cuda_decode.h"
#else
namespace mjolnir::cuda {
class DecodeStep;  // a device step buffer (cuda/cuda_decode.h), only held here
}
#endif

namespace mjolnir::python {
namespace {

using OptionalTensor = std::optional<at::Tensor>;
using OptionalGraph = std::optional<c10::intrusive_ptr<GraphBuffers>>;

// Host buffers of recent steps' workspaces: a step's plan lives for one engine step, and a
// fresh allocation of megabytes every step would page-fault its way in each time.
class HostWorkspaces {
 public:
  static std::unique_ptr<std::byte[]> take(std::size_t bytes, std::size_t& capacity) {
    std::lock_guard lock(mutex());
    auto& free = buffers();
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->first >= bytes) {
        capacity = it->first;
        std::unique_ptr<std::byte[]> buffer = std::move(it->second);
        free.erase(it);
        return buffer;
      }
    }
    capacity = bytes;
    return std::unique_ptr<std::byte[]>(new std::byte[std::max<std::size_t>(bytes, 1)]);
  }
  static void give_back(std::unique_ptr<std::byte[]> buffer, std::size_t capacity) {
    std::lock_guard lock(mutex());
    auto& free = buffers();
    if (free.size() >= kKept) free.erase(free.begin());  // the oldest goes
    free.emplace_back(capacity, std::move(buffer));
  }

 private:
  static constexpr std::size_t kKept = 4;
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::pair<std::size_t, std::unique_ptr<std::byte[]>>>& buffers() {
    static std::vector<std::pair<std::size_t, std::unique_ptr<std::byte[]>>> b;
    return b;
  }
};

DecodeParams decode_params(std::int64_t q_len, std::int64_t num_q_heads, bool causal,
                           double softmax_scale, const std::string& q_mode,
                           const std::string& p_mode) {
  DecodeParams params;
  params.q_len = int(q_len);
  params.num_q_heads = int(num_q_heads);
  params.causal = causal;
  params.softmax_scale = float(softmax_scale);
  with_op_errors([&] {
    params.q_mode = parse_q_mode(q_mode);
    params.p_mode = parse_p_mode(p_mode);
  });
  return params;
}

// The sequences of a step, from host int32 tensors it keeps alive.
struct StepTensors {
  at::Tensor block_table, seq_lens, query_start;
  PagedBatch batch() const {
    PagedBatch b;
    const std::int64_t num_seqs = seq_lens.numel();
    b.block_table = {block_table.data_ptr<std::int32_t>(), std::size_t(block_table.numel())};
    b.max_pages_per_seq = int(block_table.size(1));
    b.seq_lens = {seq_lens.data_ptr<std::int32_t>(), std::size_t(num_seqs)};
    if (query_start.defined()) {
      b.query_start = {query_start.data_ptr<std::int32_t>(), std::size_t(query_start.numel())};
    }
    return b;
  }
};

StepTensors step_tensors(const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const OptionalTensor& query_start) {
  StepTensors t;
  t.block_table = host_int32(block_table, "block_table", 2);
  t.seq_lens = host_int32(seq_lens, "seq_lens", 1);
  if (t.seq_lens.numel() != t.block_table.size(0)) {
    raise_value_error("seq_lens: " + std::to_string(t.seq_lens.numel()) +
                      " sequences, but block_table has " + std::to_string(t.block_table.size(0)) +
                      " rows");
  }
  if (query_start.has_value()) t.query_start = host_int32(*query_start, "query_start", 1);
  return t;
}

DecodeArgs decode_args(const KvCacheView& cache, const PagedBatch& batch,
                       const DecodeParams& params, const LibraryRows& q, const LibraryRows& o) {
  DecodeArgs args;
  args.cache = cache;
  args.batch = batch;
  args.params = params;
  args.q = {q.data, q.token_stride, q.head_stride, q.type};
  args.o = {o.data, o.token_stride, o.head_stride, o.type};
  return args;
}

// The float32 rows of q and o a call hands the library when the tensors are not float32 (a
// bf16 model's): per calling thread, kept between decode steps.
struct RowScratch {
  FloatScratch q, o;
  ~RowScratch() = default;
  void release() {
    release_scratch(q);
    release_scratch(o);
  }
};
RowScratch& row_scratch() {
  thread_local RowScratch scratch;
  return scratch;
}

// A host workspace from HostWorkspaces for one call, given back when it ends.
class CallWorkspace {
 public:
  explicit CallWorkspace(std::size_t bytes)
      : bytes_(bytes), buffer_(HostWorkspaces::take(bytes, capacity_)) {}
  ~CallWorkspace() { HostWorkspaces::give_back(std::move(buffer_), capacity_); }
  std::span<std::byte> span() { return {buffer_.get(), bytes_}; }

 private:
  std::size_t bytes_, capacity_ = 0;
  std::unique_ptr<std::byte[]> buffer_;
};

// Which shared buffer holds a plan's upload, and what it was checked against.
struct DeviceUpload {
  std::shared_ptr<cuda::DecodeStep> buffer;
  std::uint64_t uploads = 0;         // the buffer's upload count right after this plan's upload
  int page_size = 0, num_pages = 0;  // the cache geometry the batch was validated against
};

#if MJOLNIR_PY_CUDA
// --- the device path: enqueued on torch's current stream, never waited for ---------------------

// The device step buffer (cuda::DecodeStep: the plan and batch the kernels read) that every plan
// run on one (device, stream, KV heads) shares. One costs a device allocation and pinned host
// memory, too much to make for every engine step; it grows, never shrinks. Each plan is
// uploaded before its first layer and again only when another plan was uploaded since (the
// upload count tells), so the layers of a step launch their kernels and nothing else. The
// uploads and launches of one stream are ordered by it: a buffer is rewritten only after the
// kernels enqueued before the rewrite have read it.
class SharedDeviceSteps {
 public:
  // The buffer for `need` on this stream, grown (to twice the sequences and pages asked for, so
  // that a growing batch reallocates a few times, not every step) when it does not cover it.
  // The caller holds lock() while it uploads and launches.
  static std::shared_ptr<cuda::DecodeStep> at_least(int device, cudaStream_t stream,
                                                    const cuda::StepCapacity& need) {
    auto& buffer = buffers()[{device, stream, need.plan.num_kv_heads}];
    if (!buffer || !buffer->capacity().covers(need)) {
      cuda::StepCapacity grown = need;
      if (buffer) {
        const cuda::StepCapacity& had = buffer->capacity();
        grown.plan.max_seqs = std::max(2 * need.plan.max_seqs, had.plan.max_seqs);
        grown.plan.max_splits = std::max(need.plan.max_splits, had.plan.max_splits);
        grown.max_pages_per_seq = std::max(2 * need.max_pages_per_seq, had.max_pages_per_seq);
        grown.max_tile_tokens = std::max(need.max_tile_tokens, had.max_tile_tokens);
      }
      // A buffer the steps of earlier layers still hold is freed when the last of them goes;
      // cudaFree waits for the kernels that read it.
      buffer = std::make_shared<cuda::DecodeStep>(grown);
    }
    return buffer;
  }
  static std::mutex& lock() {
    static std::mutex m;
    return m;
  }

 private:
  using Key = std::tuple<int, cudaStream_t, int>;
  static std::map<Key, std::shared_ptr<cuda::DecodeStep>>& buffers() {
    static std::map<Key, std::shared_ptr<cuda::DecodeStep>> b;
    return b;
  }
};

// A [count] float32 tensor of scales on `device`: the tensor itself when it already is one (a
// serving engine's device scales), else a copy (from host memory that copy waits for the
// stream: pass device scales to avoid it).
at::Tensor device_scales(const at::Tensor& t, const at::Device& device) {
  return t.detach().reshape({-1}).to(device, at::kFloat).contiguous();
}

// Runs a validated step's plan for one layer on torch's current stream of `device`: uploads
// the plan and batch unless the shared buffer still holds them, and launches the decode and
// merge kernels with grids sized to the plan. Returns without waiting for them. The workspace
// comes from torch's caching allocator, which orders its reuse by the stream.
void enqueue_on_device(const Backend& backend, const DecodeArgs& args, const BackendPlan& planned,
                       const at::Tensor& k_scale, const at::Tensor& v_scale,
                       const at::Device& device, DeviceUpload& upload) {
  const Plan& plan = planned.plan();
  const CacheGeometry& geo = args.cache.geometry;
  const at::Tensor ks = device_scales(k_scale, device);
  const at::Tensor vs = device_scales(v_scale, device);
  // What Backend::run checks before its upload (the plan is this backend's: Step and decode
  // made it).
  const std::size_t bytes = with_op_errors([&] {
    check_plan(plan, args);
    const std::string why = cuda::unsupported_reason(geo, args.params, plan.tile_tokens);
    MJOLNIR_REQUIRE(why.empty(), "backend cuda: ", why);
    return backend.workspace_bytes(plan, geo, args.params);
  });
  const at::Tensor workspace = at::empty({std::int64_t(std::max<std::size_t>(bytes, 1))},
                                         at::TensorOptions().dtype(at::kByte).device(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const CudaKernelOptions& kernels = cuda_kernels_from_environment();
  std::lock_guard lock(SharedDeviceSteps::lock());
  with_op_errors([&] {
    const cuda::StepCapacity need = cuda::step_capacity_for(plan, args.batch);
    std::shared_ptr<cuda::DecodeStep> buffer =
        SharedDeviceSteps::at_least(device.index(), stream, need);
    if (buffer != upload.buffer || buffer->uploads() != upload.uploads ||
        geo.page_size != upload.page_size || geo.num_pages != upload.num_pages) {
      buffer->upload(args.batch, plan, geo, stream);
      upload = DeviceUpload{buffer, buffer->uploads(), geo.page_size, geo.num_pages};
    }
    cuda::enqueue_planned_decode(
        args, plan, cuda::DeviceScales{ks.const_data_ptr<float>(), vs.const_data_ptr<float>()},
        *buffer, {static_cast<std::byte*>(workspace.data_ptr()), bytes}, stream, kernels);
  });
}
#endif

// Runs a validated step with a plan made for it: on the host, or enqueued on the device
// (`upload` keeps the plan's place in the device's shared step buffer between layers).
void run_planned(const Backend& backend, const DecodeArgs& args, const BackendPlan& plan,
                 std::span<std::byte> host_workspace, const at::Device& device,
                 const at::Tensor& k_scale, const at::Tensor& v_scale,
                 [[maybe_unused]] DeviceUpload* upload) {
  if (device.is_cpu()) {
    with_op_errors([&] { backend.run(args, plan, host_workspace); });
    return;
  }
#if MJOLNIR_PY_CUDA
  DeviceUpload once;
  enqueue_on_device(backend, args, plan, k_scale, v_scale, device, upload ? *upload : once);
#else
  raise_value_error("q: on " + device.str() + ", but this build of mjolnir has no CUDA backend");
#endif
}

// --- decode / decode_into: plan and run in one call --------------------------------------------

void decode_step(at::Tensor& output, const at::Tensor& q, const at::Tensor& kv_cache,
                 const at::Tensor& block_table, const at::Tensor& seq_lens,
                 const at::Tensor& k_scale, const at::Tensor& v_scale, const std::string& kv_format,
                 std::int64_t q_len, const std::string& layout, bool causal, double softmax_scale,
                 const std::string& q_mode, const std::string& p_mode, std::int64_t max_splits,
                 std::int64_t threads, const std::string& backend_name,
                 const OptionalTensor& query_start) {
  check_rows(q, "q");
  const std::int64_t num_tokens = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  check_head_dim(head_dim, "q");
  check_same_device(kv_cache, "kv_cache", q, "q");
  // On a device the kernels read the scales where they are (no wait for the device here).
  const CacheTensor cache = cache_tensor(kv_cache, kv_format, layout, int(head_dim), k_scale,
                                         v_scale, /*leave_device_scales=*/q.is_cuda());
  const StepTensors step = step_tensors(block_table, seq_lens, query_start);
  const std::int64_t num_seqs = step.seq_lens.numel();
  if (!step.query_start.defined() && num_tokens != num_seqs * q_len) {
    raise_value_error("q: " + std::to_string(num_tokens) + " token rows, but " +
                      std::to_string(num_seqs) + " sequences x q_len " + std::to_string(q_len) +
                      " = " + std::to_string(num_seqs * q_len));
  }
  const DecodeParams params =
      decode_params(q_len, num_q_heads, causal, softmax_scale, q_mode, p_mode);
  const Backend& backend = backend_for(q.device(), backend_name, threads);
  check_rows(output, "output");
  check_same_device(output, "output", q, "q");
  if (output.sizes() != q.sizes()) {
    raise_value_error("output: shape " + shape_of(output) + ", expected " + shape_of(q));
  }
  if (num_tokens == 0) {
    // An empty step reads and writes nothing, but its arguments are still checked as validate()
    // checks them (the cache, then the batch): q_len 0 without query_start, say, is an error
    // however few rows q has.
    with_op_errors([&] {
      validate(cache.view);
      validate(step.batch(), cache.view.geometry, params.q_len);
    });
    return;
  }

  RowScratch& scratch = row_scratch();
  // A bf16 model's q and output go to the CPU backend as they are (it widens and rounds them
  // row by row); other types and backends through float32 rows.
  const bool bf16_ok = backend.takes_rows(RowType::bf16);
  const LibraryRows q_rows = rows_in(q, num_tokens, scratch.q, bf16_ok);
  const LibraryRows o_rows = rows_out(output, num_tokens, scratch.o, bf16_ok);
  const DecodeArgs args = decode_args(cache.view, step.batch(), params, q_rows, o_rows);
  with_op_errors([&] {
    validate(args);
    const std::string why = backend.unsupported_reason(args.cache.geometry, args.params);
    MJOLNIR_REQUIRE(why.empty(), "backend ", backend.name(), ": ", why);
  });
  PlanOptions options = backend.plan_options();
  options.max_splits = int(max_splits);
  const StepShape shape = args.step_shape();
  BackendPlan plan;
  with_op_errors([&] {
    const int cap = effective_max_splits(options, shape.num_seqs(), shape.num_kv_heads);
    if (cap >= 0) options.max_splits = cap;
    plan = BackendPlan(capacity_for(shape, options));
    backend.plan(plan, shape, options);
  });
  CallWorkspace workspace(
      q.device().is_cpu() ? backend.workspace_bytes(plan.plan(), args.cache.geometry, args.params)
                          : 0);
  run_planned(backend, args, plan, workspace.span(), q.device(), k_scale, v_scale, nullptr);
  finish_rows_out(output, num_tokens, o_rows);
  scratch.release();
}

void decode_into(at::Tensor output, const at::Tensor& q, const at::Tensor& kv_cache,
                 const at::Tensor& block_table, const at::Tensor& seq_lens,
                 const at::Tensor& k_scale, const at::Tensor& v_scale, const std::string& kv_format,
                 std::int64_t q_len, const std::string& layout, bool causal, double softmax_scale,
                 const std::string& q_mode, const std::string& p_mode, std::int64_t max_splits,
                 std::int64_t threads, const std::string& backend,
                 const OptionalTensor& query_start) {
  decode_step(output, q, kv_cache, block_table, seq_lens, k_scale, v_scale, kv_format, q_len,
              layout, causal, softmax_scale, q_mode, p_mode, max_splits, threads, backend,
              query_start);
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const at::Tensor& seq_lens, const at::Tensor& k_scale, const at::Tensor& v_scale,
                  const std::string& kv_format, std::int64_t q_len, const std::string& layout,
                  bool causal, double softmax_scale, const std::string& q_mode,
                  const std::string& p_mode, std::int64_t max_splits, std::int64_t threads,
                  const std::string& backend, const OptionalTensor& query_start) {
  check_rows(q, "q");
  at::Tensor output = at::empty(q.sizes(), q.options());
  decode_step(output, q, kv_cache, block_table, seq_lens, k_scale, v_scale, kv_format, q_len,
              layout, causal, softmax_scale, q_mode, p_mode, max_splits, threads, backend,
              query_start);
  return output;
}

// --- write_kv ----------------------------------------------------------------------------------

void write_kv_op(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                 const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                 const at::Tensor& v_scale, const std::string& kv_format,
                 const std::string& layout) {
  check_rows(key, "key");
  check_rows(value, "value");
  const std::int64_t num_tokens = key.size(0), head_dim = key.size(2);
  check_head_dim(head_dim, "key");
  if (value.sizes() != key.sizes()) {
    raise_value_error("value: shape " + shape_of(value) + ", but key has " + shape_of(key));
  }
  check_same_device(value, "value", key, "key");
  check_same_device(kv_cache, "kv_cache", key, "key");
  const CacheTensor cache =
      cache_tensor(kv_cache, kv_format, layout, int(head_dim), k_scale, v_scale);
  check_rows(key, "key", cache.view.geometry.num_kv_heads);
  check_rows(value, "value", cache.view.geometry.num_kv_heads);
  const auto slot_type = slot_mapping.scalar_type();
  if ((slot_type != at::kLong && slot_type != at::kInt) || slot_mapping.dim() != 1) {
    raise_value_error("slot_mapping: expected a 1-D int64 tensor, got " + dtype_name(slot_type) +
                      " of shape " + shape_of(slot_mapping));
  }
  if (slot_mapping.numel() != num_tokens) {
    raise_value_error("slot_mapping: " + std::to_string(slot_mapping.numel()) +
                      " slots, but key has " + std::to_string(num_tokens) + " tokens");
  }
  if (num_tokens == 0) return;
  RowScratch& scratch = row_scratch();
  // A bf16 model's K and V on the CPU go to the library as they are (it widens a row at a
  // time): converting a prompt's rows to float32 first cost as much as the write itself.
  // `kept` keeps a float32 copy (a device tensor's) alive for the call.
  const auto token_rows = [&](const at::Tensor& t, FloatScratch& s, LibraryRows& kept) {
    kept = rows_in(t, num_tokens, s, /*bf16_ok=*/t.device().is_cpu());
    return TokenRows{kept.data, kept.token_stride, kept.head_stride, kept.type};
  };
  LibraryRows k_kept, v_kept;
  const TokenRows k_rows = token_rows(key, scratch.q, k_kept);
  const TokenRows v_rows = token_rows(value, scratch.o, v_kept);
  struct Release {
    RowScratch& s;
    ~Release() { s.release(); }
  } release{scratch};
  if (key.device().is_cpu()) {
    const at::Tensor slots = slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous()
                                 ? slot_mapping
                                 : slot_mapping.to(at::kLong).contiguous();
    with_op_errors([&] {
      write_kv(cache.view, k_rows, v_rows,
               {slots.data_ptr<std::int64_t>(), std::size_t(num_tokens)});
    });
    return;
  }
#if MJOLNIR_PY_CUDA
  if (key.device().is_cuda()) {
    const at::Tensor slots = slot_mapping.to(key.device(), at::kLong).contiguous();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(key.device().index()).stream();
    with_op_errors([&] {
      cuda::write_kv(cache.view, k_rows, v_rows, slots.data_ptr<std::int64_t>(), int(num_tokens),
                     stream);
    });
    return;
  }
#endif
  raise_value_error("key: device " + key.device().str() +
                    " is not supported (cpu, or cuda when built with CUDA)");
}

// --- a step planned once, run per layer --------------------------------------------------------

// The plan of one engine step and what it was made for. Made by plan_step (the metadata
// builder, once a step); attend runs it for each layer's cache and queries, which may differ
// from layer to layer in all but the step's sequences and head counts.
class Step final : public torch::CustomClassHolder {
 public:
  Step(const at::Tensor& seq_lens, const at::Tensor& block_table, const OptionalTensor& query_start,
       std::int64_t q_len, std::int64_t num_q_heads, std::int64_t num_kv_heads, bool causal,
       const std::string& q_mode, const std::string& p_mode, std::int64_t max_splits,
       std::int64_t threads, const std::string& backend, const OptionalGraph& graph)
      : tensors_(step_tensors(block_table, seq_lens, query_start)),
        params_(decode_params(query_start.has_value() ? 0 : q_len, num_q_heads, causal, 0.0,
                              q_mode == "auto" ? "fp32" : q_mode,
                              p_mode == "auto" ? "fp32" : p_mode)),
        q_auto_(q_mode == "auto"),
        p_auto_(p_mode == "auto"),
        device_(backend == "cuda" ? at::Device(at::kCUDA) : at::Device(at::kCPU)),
        backend_(&backend_for(device_, backend, threads)),
        graph_(graph.value_or(nullptr)) {
    if (query_start.has_value() && q_len != 0) {
      raise_value_error("q_len: " + std::to_string(q_len) +
                        " with query_start given; a ragged step takes its query lengths from "
                        "query_start (q_len 0)");
    }
    if (num_kv_heads < 1 || num_q_heads < 1 || num_q_heads % num_kv_heads != 0) {
      raise_value_error("num_q_heads: " + std::to_string(num_q_heads) +
                        " is not a positive multiple of num_kv_heads " +
                        std::to_string(num_kv_heads));
    }
    if (graph_) check_graph(query_start.has_value(), q_len, num_q_heads, num_kv_heads);
    batch_ = tensors_.batch();
    const StepShape shape{batch_.seq_lens, batch_.query_start, params_.q_len, int(num_kv_heads),
                          causal};
    PlanOptions options = backend_->plan_options();
    options.max_splits = int(max_splits);
    with_op_errors([&] {
      int cap = effective_max_splits(options, shape.num_seqs(), shape.num_kv_heads);
      if (graph_ && cap >= 0) cap = int(std::min<std::int64_t>(cap, graph_->max_splits()));
      if (cap >= 0) options.max_splits = cap;
      plan_ = BackendPlan(capacity_for(shape, options));
      backend_->plan(plan_, shape, options);
    });
    // Into the graph buffers now, before any layer: a replayed graph runs no layer's call.
    if (graph_) graph_->upload(batch_, plan_.plan());
    rows_ = shape.query_start.empty() ? std::int64_t(shape.num_seqs()) * params_.q_len
                                      : std::int64_t(shape.query_start.back());
    const int g = int(num_q_heads / num_kv_heads);
    for (int i = 0; i < plan_.plan().num_query_tiles; ++i) {
      max_tile_rows_ = std::max(max_tile_rows_, plan_.plan().query_tiles[i].q_count * g);
    }
  }
  ~Step() override;
  void release_resources() override;

  // The plan for one layer: its cache (any format and scales) and its q / output rows.
  void run(at::Tensor& output, const at::Tensor& q, const at::Tensor& kv_cache,
           const at::Tensor& k_scale, const at::Tensor& v_scale, const std::string& kv_format,
           const std::string& layout, double softmax_scale) {
    check_rows(q, "q", 0);
    check_rows(output, "output");
    check_same_device(output, "output", q, "q");
    check_same_device(kv_cache, "kv_cache", q, "q");
    if (q.device().type() != device_.type()) {
      raise_value_error("q: on " + q.device().str() + ", but the step was planned for " +
                        device_.str());
    }
    if (q.size(0) < rows_ || q.size(1) != params_.num_q_heads) {
      raise_value_error("q: shape " + shape_of(q) + ", the step has " + std::to_string(rows_) +
                        " query rows of " + std::to_string(params_.num_q_heads) + " heads");
    }
    if (output.sizes() != q.sizes()) {
      raise_value_error("output: shape " + shape_of(output) + ", expected " + shape_of(q));
    }
    const std::int64_t head_dim = q.size(2);
    check_head_dim(head_dim, "q");
    if (rows_ == 0 && !graph_) return;
    const CacheTensor cache = cache_tensor(kv_cache, kv_format, layout, int(head_dim), k_scale,
                                           v_scale, /*leave_device_scales=*/q.is_cuda());
    DecodeParams params = params_;
    params.softmax_scale = float(softmax_scale);
    if (q_auto_ || p_auto_) {  // the backend's choice for this layer's format and queries
      const NumericsModes modes = backend_->auto_modes(cache.view.geometry, max_tile_rows_,
                                                       q.scalar_type() == at::kBFloat16);
      if (q_auto_) params.q_mode = modes.q_mode;
      if (p_auto_) params.p_mode = modes.p_mode;
    }
    if (graph_) {
      // Every row q holds, not only this step's: a graph captured now replays this call over
      // later steps of up to that many rows (vLLM pads a captured batch's tensors to its size).
      graph_->enqueue(output, q, cache.view, params, k_scale, v_scale);
      return;
    }
    // Only the step's rows: vLLM pads its query and output tensors past them. The step keeps
    // its conversion buffers for every layer (a prompt's rows are tens of MiB: allocating them
    // per layer cost their page faults each time), and frees them with itself.
    RowScratch& scratch = scratch_;
    const bool bf16_ok = backend_->takes_rows(RowType::bf16);
    const LibraryRows q_rows = rows_in(q, rows_, scratch.q, bf16_ok);
    const LibraryRows o_rows = rows_out(output, rows_, scratch.o, bf16_ok);
    const DecodeArgs args = decode_args(cache.view, batch_, params, q_rows, o_rows);
    with_op_errors([&] {
      validate(args);
      const std::string why = backend_->unsupported_reason(args.cache.geometry, args.params);
      MJOLNIR_REQUIRE(why.empty(), "backend ", backend_->name(), ": ", why);
    });
    std::span<std::byte> workspace;
    if (device_.is_cpu()) {
      const std::size_t bytes = with_op_errors([&] {
        return backend_->workspace_bytes(plan_.plan(), args.cache.geometry, args.params);
      });
      if (bytes > workspace_capacity_ || !workspace_) {
        if (workspace_) HostWorkspaces::give_back(std::move(workspace_), workspace_capacity_);
        workspace_ = HostWorkspaces::take(bytes, workspace_capacity_);
      }
      workspace = {workspace_.get(), bytes};
    }
    run_planned(*backend_, args, plan_, workspace, q.device(), k_scale, v_scale, &upload_);
    finish_rows_out(output, rows_, o_rows);
  }

  // step.attend(...) from Python: the operator's work without its dispatch, which for an
  // argument that is a torchbind object goes through Python on every call.
  void attend_method(at::Tensor output, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                     const std::string& kv_format, const std::string& layout,
                     double softmax_scale) {
    run(output, q, kv_cache, k_scale, v_scale, kv_format, layout, softmax_scale);
  }

  std::int64_t num_items() const { return plan_.plan().num_items; }
  std::int64_t num_query_tiles() const { return plan_.plan().num_query_tiles; }
  // The Q and P modes attend runs a layer of this format and head size in (the step's own, or
  // the backend's choice where they are "auto"), as "q_mode,p_mode": for logs.
  std::string modes_for(const std::string& kv_format, std::int64_t head_dim,
                        bool bf16_queries) const {
    NumericsModes modes{params_.q_mode, params_.p_mode};
    if (q_auto_ || p_auto_) {
      CacheGeometry geometry;
      geometry.format = with_op_errors([&] { return parse_format(kv_format, "kv_format"); });
      geometry.head_dim = int(head_dim);
      const NumericsModes chosen = backend_->auto_modes(geometry, max_tile_rows_, bf16_queries);
      if (q_auto_) modes.q_mode = chosen.q_mode;
      if (p_auto_) modes.p_mode = chosen.p_mode;
    }
    return std::string(to_string(modes.q_mode)) + "," + std::string(to_string(modes.p_mode));
  }
  std::int64_t workers() const { return backend_->workers(); }
  // Query tokens per sequence (0: a ragged step).
  std::int64_t q_len() const { return params_.q_len; }
  // The query rows of the graph buffers the step was planned into (plan_step's `graph`), which
  // each layer's attend runs over; 0 when it was not.
  std::int64_t graph_rows() const { return graph_ ? graph_->max_rows() : 0; }
  std::int64_t query_rows() const { return rows_; }
  // The handle attend_step takes: unique in the process, never reused.
  std::int64_t id() const { return id_; }

 private:
  StepTensors tensors_;
  PagedBatch batch_;
  DecodeParams params_;
  bool q_auto_ = false, p_auto_ = false;  // "auto": Backend::auto_modes per layer
  int max_tile_rows_ = 0;                 // the most query rows of one query tile
  at::Device device_;
  const Backend* backend_;
  BackendPlan plan_;  // the plan and what the backend prepared from it, for every layer
  std::int64_t rows_ = 0;
  std::unique_ptr<std::byte[]> workspace_;
  std::size_t workspace_capacity_ = 0;
  RowScratch scratch_;   // q and o rows converted to float32, reused by every layer
  DeviceUpload upload_;  // a device step: where its plan was uploaded (SharedDeviceSteps)
  c10::intrusive_ptr<GraphBuffers> graph_;  // or null: the buffers its plan was uploaded into
  const std::int64_t id_ = next_step_id();

  // A step planned into graph buffers runs their capacity's fixed kernels: one uniform decode
  // step of the buffers' q_len and heads, on the CUDA backend.
  void check_graph(bool ragged, std::int64_t q_len, std::int64_t num_q_heads,
                   std::int64_t num_kv_heads) const {
    if (!device_.is_cuda()) {
      raise_value_error("graph: graph buffers are for the cuda backend, the step is planned for " +
                        std::string(backend_->name()));
    }
    if (ragged || q_len != graph_->q_len()) {
      raise_value_error("q_len: " + std::string(ragged ? "a ragged step" : std::to_string(q_len)) +
                        ", but the graph buffers were made for steps of q_len " +
                        std::to_string(graph_->q_len()));
    }
    if (num_q_heads != graph_->num_q_heads() || num_kv_heads != graph_->num_kv_heads()) {
      raise_value_error("num_q_heads: " + std::to_string(num_q_heads) + " with " +
                        std::to_string(num_kv_heads) + " KV heads, but the graph buffers " +
                        "were made for " + std::to_string(graph_->num_q_heads()) + " with " +
                        std::to_string(graph_->num_kv_heads()));
    }
  }

  static std::int64_t next_step_id() {
    static std::atomic<std::int64_t> next{1};
    return next.fetch_add(1);
  }
};

// The live steps by id, for attend_step. A method of a torchbind object is called through
// TorchScript's method dispatch, and an operator with a torchbind argument through Python: both
// cost more per call than an operator of plain arguments, most when the core's caches are cold,
// as a layer's call finds them (an nvfp4 decode call at 256 tokens: 112 us cold, 60 warm
// through step.attend; 96 and 54 through attend_step; docs/python.md). So the plugin passes the
// step's id. The registry holds weak references: a call holds the step for its duration, and an
// id whose step is gone is an error, not a dangling pointer.
class StepRegistry {
 public:
  static StepRegistry& instance() {
    static StepRegistry registry;
    return registry;
  }
  void add(const c10::intrusive_ptr<Step>& step) {
    std::lock_guard lock(mutex_);
    steps_.emplace(step->id(), c10::weak_intrusive_ptr<Step>(step));
  }
  void remove(std::int64_t id) {
    std::lock_guard lock(mutex_);
    steps_.erase(id);
  }
  c10::intrusive_ptr<Step> find(std::int64_t id) {
    std::lock_guard lock(mutex_);
    const auto it = steps_.find(id);
    c10::intrusive_ptr<Step> step =
        it == steps_.end() ? c10::intrusive_ptr<Step>() : it->second.lock();
    if (!step) {
      raise_value_error(
          "step: no live step has id " + std::to_string(id) +
          " (a Step from plan_step must outlive the attend_step calls given its id())");
    }
    return step;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::int64_t, c10::weak_intrusive_ptr<Step>> steps_;
};

Step::~Step() {
  if (workspace_) HostWorkspaces::give_back(std::move(workspace_), workspace_capacity_);
}

// The last strong reference is gone while the registry's weak one remains (c10 calls this then,
// and deletes the step when the weak ones are gone too): leave the registry, which frees it.
void Step::release_resources() { StepRegistry::instance().remove(id_); }

c10::intrusive_ptr<Step> plan_step(const at::Tensor& seq_lens, const at::Tensor& block_table,
                                   const OptionalTensor& query_start, std::int64_t q_len,
                                   std::int64_t num_q_heads, std::int64_t num_kv_heads, bool causal,
                                   const std::string& q_mode, const std::string& p_mode,
                                   std::int64_t max_splits, std::int64_t threads,
                                   const std::string& backend, const OptionalGraph& graph) {
  auto step = c10::make_intrusive<Step>(seq_lens, block_table, query_start, q_len, num_q_heads,
                                        num_kv_heads, causal, q_mode, p_mode, max_splits, threads,
                                        backend, graph);
  StepRegistry::instance().add(step);
  return step;
}

void attend(const c10::intrusive_ptr<Step>& step, at::Tensor output, const at::Tensor& q,
            const at::Tensor& kv_cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
            const std::string& kv_format, const std::string& layout, double softmax_scale) {
  step->run(output, q, kv_cache, k_scale, v_scale, kv_format, layout, softmax_scale);
}

// attend for the step with this id (Step::id()): the same work, dispatched as an operator of
// plain arguments (see StepRegistry).
void attend_step(std::int64_t step, at::Tensor output, const at::Tensor& q,
                 const at::Tensor& kv_cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
                 const std::string& kv_format, const std::string& layout, double softmax_scale) {
  StepRegistry::instance().find(step)->run(output, q, kv_cache, k_scale, v_scale, kv_format, layout,
                                           softmax_scale);
}

// --- Meta kernels: shapes only, for torch.compile and FakeTensor -------------------------------

// Every tensor argument on the meta device; a real tensor among them is a caller's mistake (the
// dispatcher picks this kernel when any argument is meta), not a step to skip silently.
void require_meta(std::initializer_list<std::pair<const at::Tensor*, const char*>> tensors) {
  for (const auto& [t, name] : tensors) {
    if (t->defined() && !t->is_meta()) {
      raise_value_error(std::string(name) + ": on " + t->device().str() +
                        ", but other arguments are on meta");
    }
  }
}

at::Tensor decode_meta(const at::Tensor& q, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens,
                       const at::Tensor& k_scale, const at::Tensor& v_scale, const std::string&,
                       std::int64_t, const std::string&, bool, double, const std::string&,
                       const std::string&, std::int64_t, std::int64_t, const std::string&,
                       const OptionalTensor& query_start) {
  const at::Tensor none;
  require_meta({{&q, "q"},
                {&kv_cache, "kv_cache"},
                {&block_table, "block_table"},
                {&seq_lens, "seq_lens"},
                {&k_scale, "k_scale"},
                {&v_scale, "v_scale"},
                {query_start ? &*query_start : &none, "query_start"}});
  return at::empty(q.sizes(), q.options());
}

void decode_into_meta(at::Tensor output, const at::Tensor& q, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& k_scale, const at::Tensor& v_scale, const std::string&,
                      std::int64_t, const std::string&, bool, double, const std::string&,
                      const std::string&, std::int64_t, std::int64_t, const std::string&,
                      const OptionalTensor& query_start) {
  const at::Tensor none;
  require_meta({{&output, "output"},
                {&q, "q"},
                {&kv_cache, "kv_cache"},
                {&block_table, "block_table"},
                {&seq_lens, "seq_lens"},
                {&k_scale, "k_scale"},
                {&v_scale, "v_scale"},
                {query_start ? &*query_start : &none, "query_start"}});
}

void attend_step_meta(std::int64_t, at::Tensor output, const at::Tensor& q,
                      const at::Tensor& kv_cache, const at::Tensor& k_scale,
                      const at::Tensor& v_scale, const std::string&, const std::string&, double) {
  require_meta({{&output, "output"},
                {&q, "q"},
                {&kv_cache, "kv_cache"},
                {&k_scale, "k_scale"},
                {&v_scale, "v_scale"}});
}

void write_kv_meta(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                   const at::Tensor& v_scale, const std::string&, const std::string&) {
  require_meta({{&key, "key"},
                {&value, "value"},
                {&kv_cache, "kv_cache"},
                {&slot_mapping, "slot_mapping"},
                {&k_scale, "k_scale"},
                {&v_scale, "v_scale"}});
}

}  // namespace
}  // namespace mjolnir::python

TORCH_LIBRARY(mjolnir, m) {
  using namespace mjolnir::python;
  m.class_<GraphBuffers>("GraphBuffers")
      .def(torch::init<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                       std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>())
      .def("describe", &GraphBuffers::describe)
      .def("q_len", &GraphBuffers::q_len)
      .def("max_rows", &GraphBuffers::max_rows)
      .def("max_splits", &GraphBuffers::max_splits);
  m.class_<Step>("Step")
      .def("attend", &Step::attend_method)
      .def("num_items", &Step::num_items)
      .def("num_query_tiles", &Step::num_query_tiles)
      .def("modes_for", &Step::modes_for)
      .def("workers", &Step::workers)
      .def("query_rows", &Step::query_rows)
      .def("q_len", &Step::q_len)
      .def("graph_rows", &Step::graph_rows)
      .def("id", &Step::id);
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor k_scale, Tensor v_scale, str kv_format, str layout=\"2BNHD\") -> ()");
#define MJOLNIR_DECODE_ARGS                                                               \
  "Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor k_scale, "      \
  "Tensor v_scale, str kv_format, int q_len=1, str layout=\"2BNHD\", bool causal=True, "  \
  "float softmax_scale=0.0, str q_mode=\"fp32\", str p_mode=\"fp32\", int max_splits=0, " \
  "int threads=0, str backend=\"\", Tensor? query_start=None"
  m.def("decode(" MJOLNIR_DECODE_ARGS ") -> Tensor");
  m.def("decode_into(Tensor(a!) output, " MJOLNIR_DECODE_ARGS ") -> ()");
#undef MJOLNIR_DECODE_ARGS
  m.def(
      "plan_step(Tensor seq_lens, Tensor block_table, Tensor? query_start, int q_len, "
      "int num_q_heads, int num_kv_heads, bool causal=True, str q_mode=\"fp32\", "
      "str p_mode=\"fp32\", int max_splits=0, int threads=0, str backend=\"cpu\", "
      "__torch__.torch.classes.mjolnir.GraphBuffers? graph=None) -> "
      "__torch__.torch.classes.mjolnir.Step",
      &plan_step);
  m.def(
      "attend(__torch__.torch.classes.mjolnir.Step step, Tensor(a!) output, Tensor q, "
      "Tensor kv_cache, Tensor k_scale, Tensor v_scale, str kv_format, "
      "str layout=\"2BNHD\", float softmax_scale=0.0) -> ()");
  m.def(
      "attend_step(int step, Tensor(a!) output, Tensor q, Tensor kv_cache, Tensor k_scale, "
      "Tensor v_scale, str kv_format, str layout=\"2BNHD\", float softmax_scale=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(mjolnir, CPU, m) {
  using namespace mjolnir::python;
  m.impl("write_kv", &write_kv_op);
  m.impl("decode", &decode);
  m.impl("decode_into", &decode_into);
  m.impl("attend", &attend);
  m.impl("attend_step", &attend_step);
}

#if MJOLNIR_PY_CUDA
TORCH_LIBRARY_IMPL(mjolnir, CUDA, m) {
  using namespace mjolnir::python;
  m.impl("write_kv", &write_kv_op);
  m.impl("decode", &decode);
  m.impl("decode_into", &decode_into);
  m.impl("attend", &attend);
  m.impl("attend_step", &attend_step);
}
#endif

TORCH_LIBRARY_IMPL(mjolnir, Meta, m) {
  using namespace mjolnir::python;
  m.impl("write_kv", &write_kv_meta);
  m.impl("decode", &decode_meta);
  m.impl("decode_into", &decode_into_meta);
  m.impl("attend_step", &attend_step_meta);
}

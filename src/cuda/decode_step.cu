// Device step buffers, scale copies and the capturable decode launch (cuda_decode.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_decode.h"
#include "cuda/decode_launch.h"
#include "cuda/decode_params.h"
#include "cuda/step_layout.h"
#include "mjolnir/error.h"

namespace mjolnir::cuda {

// --- device pointers -------------------------------------------------------------------------

void require_device_pointer(const void* pointer, const char* name) {
  if (pointer == nullptr) return;
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, pointer);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear it: a failed query is not a sticky error
    detail::throw_error(name, ": cannot tell where this pointer lives (", cudaGetErrorName(status),
                        "); the cuda backend needs device memory");
  }
  MJOLNIR_REQUIRE(attributes.type != cudaMemoryTypeUnregistered, name,
                  ": is pageable host memory; the cuda backend reads and writes device memory "
                  "(cache.data, q, o, lse, workspace; see docs/cuda.md, or use "
                  "cuda::make_staging_backend() for host arguments)");
}

// --- scales ------------------------------------------------------------------------------------

ScaleBuffers::ScaleBuffers(const KvCacheView& cache) {
  validate(cache);
  count_ = cache.k_scale.size();
  std::vector<float> both(cache.k_scale.begin(), cache.k_scale.end());
  both.insert(both.end(), cache.v_scale.begin(), cache.v_scale.end());
  MJOLNIR_CUDA_CHECK(cudaMalloc(&k_, both.size() * sizeof(float)));
  const cudaError_t status =
      cudaMemcpy(k_, both.data(), both.size() * sizeof(float), cudaMemcpyHostToDevice);
  if (status != cudaSuccess) {
    cudaFree(k_);
    check_cuda(status, "cudaMemcpy(scales)");
  }
}

ScaleBuffers::~ScaleBuffers() { cudaFree(k_); }

// --- the step buffers ----------------------------------------------------------------------------

std::size_t StepCapacity::device_bytes() const {
  return step_regions(std::size_t(max_items()), std::size_t(plan.max_seqs),
                      std::size_t(plan.max_seqs) * std::size_t(max_pages_per_seq))
      .end;
}

bool StepCapacity::covers(const StepCapacity& need) const {
  return plan.max_seqs >= need.plan.max_seqs && plan.num_kv_heads == need.plan.num_kv_heads &&
         plan.max_splits >= need.plan.max_splits && max_pages_per_seq >= need.max_pages_per_seq &&
         max_tile_tokens >= need.max_tile_tokens;
}

StepCapacity step_capacity_for(const Plan& plan, const PagedBatch& batch) {
  StepCapacity need;
  need.plan = plan.capacity;
  need.plan.max_seqs = std::max(plan.capacity.max_seqs, batch.num_seqs());
  need.max_pages_per_seq = std::max(1, batch.max_pages_per_seq);
  need.max_tile_tokens = plan.tile_tokens;
  return need;
}

DecodeStep::DecodeStep(const StepCapacity& capacity) : capacity_(capacity) {
  MJOLNIR_REQUIRE(capacity.plan.max_seqs >= 0 && capacity.plan.num_kv_heads >= 1 &&
                      capacity.plan.max_splits >= 1,
                  "capacity.plan: max_seqs ", capacity.plan.max_seqs, ", num_kv_heads ",
                  capacity.plan.num_kv_heads, ", max_splits ", capacity.plan.max_splits,
                  " (need >= 0, >= 1, >= 1)");
  MJOLNIR_REQUIRE(capacity.max_pages_per_seq >= 0,
                  "capacity.max_pages_per_seq: ", capacity.max_pages_per_seq, " is negative");
  MJOLNIR_REQUIRE(capacity.max_tile_tokens >= 1 && capacity.max_tile_tokens <= 1024,
                  "capacity.max_tile_tokens: ", capacity.max_tile_tokens, " is outside [1, 1024]");
  const std::size_t bytes = capacity.device_bytes();
  try {
    MJOLNIR_CUDA_CHECK(cudaMalloc(&device_, bytes));
    // A zeroed header means "no items, no sequences": a graph launched before any upload does
    // nothing instead of reading garbage.
    MJOLNIR_CUDA_CHECK(cudaMemset(device_, 0, kStepHeaderBytes));
    MJOLNIR_CUDA_CHECK(cudaMallocHost(&staging_, bytes));
    MJOLNIR_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  } catch (...) {
    cudaFreeHost(staging_);
    cudaFree(device_);
    throw;
  }
}

DecodeStep::~DecodeStep() {
  if (copy_pending_) cudaEventSynchronize(copied_);
  cudaEventDestroy(copied_);
  cudaFreeHost(staging_);
  cudaFree(device_);
}

void DecodeStep::upload(const PagedBatch& batch, const Plan& plan, const CacheGeometry& geometry,
                        cudaStream_t stream) {
  const PlanCapacity& cap = capacity_.plan;
  validate(batch, geometry, plan.q_len);
  const int num_seqs = batch.num_seqs();
  MJOLNIR_REQUIRE(geometry.num_kv_heads == cap.num_kv_heads,
                  "geometry.num_kv_heads: ", geometry.num_kv_heads,
                  " differs from the step capacity's ", cap.num_kv_heads);
  MJOLNIR_REQUIRE(plan.capacity.num_kv_heads == cap.num_kv_heads,
                  "plan.capacity.num_kv_heads: ", plan.capacity.num_kv_heads,
                  " differs from the step capacity's ", cap.num_kv_heads);
  MJOLNIR_REQUIRE(plan.num_seqs == num_seqs, "plan: made for ", plan.num_seqs,
                  " sequences, the batch has ", num_seqs);
  MJOLNIR_REQUIRE(num_seqs <= cap.max_seqs, "batch: ", num_seqs,
                  " sequences exceed the step capacity of ", cap.max_seqs);
  MJOLNIR_REQUIRE(plan.num_items >= 0 && plan.num_items <= capacity_.max_items(),
                  "plan.num_items: ", plan.num_items, " exceeds the step capacity of ",
                  capacity_.max_items(), " items");
  const int max_partials = cap.max_seqs * cap.max_splits;
  MJOLNIR_REQUIRE(plan.num_partials >= 0 && plan.num_partials <= max_partials,
                  "plan.num_partials: ", plan.num_partials, " exceeds the ", max_partials,
                  " partial slots of the step capacity");
  MJOLNIR_REQUIRE(plan.tile_tokens >= 1 && plan.tile_tokens <= capacity_.max_tile_tokens,
                  "plan.tile_tokens: ", plan.tile_tokens, " is outside [1, ",
                  capacity_.max_tile_tokens, "] (capacity.max_tile_tokens)");
  MJOLNIR_REQUIRE(locked_q_len_ == 0 || plan.q_len == locked_q_len_, "plan.q_len: ", plan.q_len,
                  " differs from the q_len ", locked_q_len_,
                  " the step's kernels were enqueued (captured) with");

  // The plan must stay inside the batch: items read positions [kv_begin, kv_end) of their
  // sequence and write partial slots below num_partials; anything else would read outside the
  // sequence's pages or write outside the workspace.
  for (int i = 0; i < plan.num_items; ++i) {
    const WorkItem& item = plan.items[i];
    const bool seq_ok = item.seq >= 0 && item.seq < num_seqs;
    MJOLNIR_REQUIRE(seq_ok && item.kv_head >= 0 && item.kv_head < cap.num_kv_heads &&
                        item.kv_begin >= 0 && item.kv_begin <= item.kv_end &&
                        item.kv_end <= batch.seq_lens[item.seq] && item.partial_slot >= -1 &&
                        item.partial_slot < plan.num_partials,
                    "plan.items[", i, "]: (seq ", item.seq, ", head ", item.kv_head, ", tokens [",
                    item.kv_begin, ", ", item.kv_end, "), slot ", item.partial_slot,
                    ") does not fit the batch");
  }
  std::size_t total_pages = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const int pages = used_pages(batch.seq_lens[b], geometry.page_size);
    MJOLNIR_REQUIRE(pages <= capacity_.max_pages_per_seq, "batch.seq_lens[", b,
                    "]: ", batch.seq_lens[b], " tokens use ", pages,
                    " pages, over the step capacity of ", capacity_.max_pages_per_seq,
                    " pages per sequence");
    const int splits = plan.num_splits[b];
    MJOLNIR_REQUIRE(
        splits >= 1 && (splits == 1 || (plan.first_partial[b] >= 0 &&
                                        plan.first_partial[b] + splits <= plan.num_partials)),
        "plan.num_splits[", b, "]: ", splits, " chunks from slot ", plan.first_partial[b],
        " do not fit ", plan.num_partials, " partial slots");
    total_pages += std::size_t(pages);
  }

  // The previous upload's copy must have left the staging buffer before it is rewritten.
  if (copy_pending_) MJOLNIR_CUDA_CHECK(cudaEventSynchronize(copied_));
  copy_pending_ = false;

  const std::size_t bytes = pack_step(batch, plan, geometry.page_size, staging_);
  MJOLNIR_CUDA_CHECK(cudaMemcpyAsync(device_, staging_, bytes, cudaMemcpyHostToDevice, stream));
  MJOLNIR_CUDA_CHECK(cudaEventRecord(copied_, stream));
  copy_pending_ = true;
  uploaded_q_len_ = plan.q_len;
  uploaded_seqs_ = plan.num_seqs;
  uploaded_items_ = plan.num_items;
  uploaded_partials_ = plan.num_partials;
  uploaded_tile_ = plan.tile_tokens;
  ++uploads_;
}

bool DecodeStep::holds(const Plan& plan) const {
  return uploads_ > 0 && plan.num_seqs == uploaded_seqs_ && plan.num_items == uploaded_items_ &&
         plan.num_partials == uploaded_partials_ && plan.q_len == uploaded_q_len_ &&
         plan.tile_tokens == uploaded_tile_;
}

std::size_t decode_workspace_bytes(const StepCapacity& capacity, const CacheGeometry& geometry,
                                   const DecodeParams& params) {
  MJOLNIR_REQUIRE(geometry.num_kv_heads >= 1 && params.num_q_heads % geometry.num_kv_heads == 0,
                  "num_q_heads: ", params.num_q_heads, " is not a multiple of num_kv_heads ",
                  geometry.num_kv_heads);
  const int g = params.num_q_heads / geometry.num_kv_heads;
  const PartialLayout layout{geometry.num_kv_heads, params.q_len * g, geometry.head_dim};
  const int slots = capacity.plan.max_seqs * capacity.plan.max_splits;
  return (layout.o_floats(slots) + layout.lse_floats(slots)) * sizeof(float);
}

void require_float32_rows(const DecodeArgs& args) {
  MJOLNIR_REQUIRE(args.q.type == RowType::f32,
                  "q.type: bf16 rows are not taken by the cuda backend (pass float32)");
  MJOLNIR_REQUIRE(args.o.type == RowType::f32,
                  "o.type: bf16 rows are not taken by the cuda backend (pass float32)");
}

void enqueue_decode(const DecodeArgs& args, const DeviceScales& scales, const DecodeStep& step,
                    std::span<std::byte> workspace, cudaStream_t stream,
                    const CudaKernelOptions& kernels) {
  const StepCapacity& capacity = step.capacity();
  const CacheGeometry& geo = args.cache.geometry;
  const DecodeParams& params = args.params;
  const int max_seqs = capacity.plan.max_seqs;

  // Validate shapes and strides without reading device memory: the scales and the batch are
  // replaced by host stand-ins (the real ones are on the device and in the step buffer), with
  // max_seqs padding sequences so q and o are checked for the capacity's token rows.
  DecodeArgs check = args;
  const std::size_t scale_floats =
      scale_count(args.cache.granularity, geo.num_kv_heads, geo.head_dim);
  const std::vector<float> ones(scale_floats, 1.0f);
  check.cache.k_scale = ones;
  check.cache.v_scale = ones;
  const std::vector<std::int32_t> padding(std::size_t(std::max(max_seqs, 0)), 0);
  check.batch = PagedBatch{{}, 0, padding};
  check.lse = {};
  validate(check);
  require_float32_rows(args);
  const std::size_t lse_floats = std::size_t(max_seqs) * params.q_len * params.num_q_heads;
  MJOLNIR_REQUIRE(args.lse.empty() || args.lse.size() == lse_floats, "lse: ", args.lse.size(),
                  " floats, expected ", lse_floats, " ([capacity.max_seqs * q_len, Hq]) or none");
  MJOLNIR_REQUIRE(scales.k != nullptr && scales.v != nullptr, "scales: null device pointer");
  MJOLNIR_REQUIRE(geo.num_kv_heads == capacity.plan.num_kv_heads,
                  "cache.geometry.num_kv_heads: ", geo.num_kv_heads,
                  " differs from the step capacity's ", capacity.plan.num_kv_heads);
  const std::size_t needed = decode_workspace_bytes(capacity, geo, params);
  MJOLNIR_REQUIRE(workspace.size() >= needed, "workspace: ", workspace.size(),
                  " bytes, decode_workspace_bytes() is ", needed);
  MJOLNIR_REQUIRE(step.uploaded_q_len() == 0 || step.uploaded_q_len() == params.q_len,
                  "params.q_len: ", params.q_len, " differs from the uploaded plan's q_len ",
                  step.uploaded_q_len());
  step.lock_q_len(params.q_len);

  LaunchShape shape;
  shape.decode_ctas = capacity.max_items();
  shape.merge_ctas = capacity.max_merges(params.q_len * (params.num_q_heads / geo.num_kv_heads));
  shape.score_tokens = capacity.max_tile_tokens;
  shape.partial_slots = std::size_t(max_seqs) * capacity.plan.max_splits;
  launch_decode(args, scales, step.device_data(), workspace, shape, stream,
                mma_layout_limit(kernels));
}

void enqueue_planned_decode(const DecodeArgs& args, const Plan& plan, const DeviceScales& scales,
                            const DecodeStep& step, std::span<std::byte> workspace,
                            cudaStream_t stream, const CudaKernelOptions& kernels) {
  MJOLNIR_REQUIRE(step.holds(plan), "plan: not the plan last uploaded to the step buffer (",
                  plan.num_seqs, " sequences, ", plan.num_items,
                  " items); upload it first (DecodeStep::upload)");
  MJOLNIR_REQUIRE(args.params.q_len == plan.q_len, "params.q_len: ", args.params.q_len,
                  " differs from the plan's ", plan.q_len);
  MJOLNIR_REQUIRE(args.batch.num_seqs() == plan.num_seqs, "batch: ", args.batch.num_seqs(),
                  " sequences, the plan was made for ", plan.num_seqs);
  MJOLNIR_REQUIRE(scales.k != nullptr && scales.v != nullptr, "scales: null device pointer");
  require_float32_rows(args);
  const CacheGeometry& geo = args.cache.geometry;
  MJOLNIR_REQUIRE(geo.num_kv_heads == step.capacity().plan.num_kv_heads,
                  "cache.geometry.num_kv_heads: ", geo.num_kv_heads,
                  " differs from the step capacity's ", step.capacity().plan.num_kv_heads);
  if (plan.num_items == 0) return;
  // launch_decode checks the workspace against the shape's partial slots.
  const LaunchShape shape = planned_launch_shape(plan, args.params.num_q_heads);
  launch_decode(args, scales, step.device_data(), workspace, shape, stream,
                mma_layout_limit(kernels));
}

}  // namespace mjolnir::cuda

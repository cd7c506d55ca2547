// The CUDA backend's stream-level API: device copies of the scales, fixed-capacity device step
// buffers (plan and batch), kernel launches that a CUDA graph can capture and replay with new
// plans, and write_kv on device tensors. See docs/cuda.md for the whole picture.
//
// A serving step with a captured graph:
//   setup:    DecodeStep step(capacity);  ScaleBuffers scales(layer_cache_view);
//             workspace = cudaMalloc(decode_workspace_bytes(capacity, geometry, params));
//             step.upload(batch0, plan0, geometry, stream);          // something valid first
//             cudaStreamBeginCapture(stream, ...);
//             enqueue_decode(args, scales.device(), step, workspace, stream);  // kernels only
//             cudaStreamEndCapture(stream, &graph); cudaGraphInstantiate(...);
//   each step: make_plan(plan, seq_lens, ...);  step.upload(batch, plan, geometry, stream);
//              cudaGraphLaunch(exec, stream);
// The graph holds the pointers (pool, q, o, lse, scales, workspace, the step buffer) and the
// shapes (geometry, strides, heads, q_len, modes); the plan, sequence lengths, block table and
// tile size are read from the step buffer on the device, so they may change between replays as
// long as they fit the capacity.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "mjolnir/decode.h"
#include "mjolnir/write_kv.h"

namespace mjolnir::cuda {

// --- scales ---------------------------------------------------------------------------------

// Device copies of a cache's K and V scales: scale_count(granularity, Hk, D) floats each.
struct DeviceScales {
  const float* k = nullptr;
  const float* v = nullptr;
};

// Owns device copies of the scales of a (validated) host view. Scales are static (calibrated),
// so a serving loop makes one per layer at setup; the copy is synchronous.
class ScaleBuffers {
 public:
  explicit ScaleBuffers(const KvCacheView& cache);
  ~ScaleBuffers();
  ScaleBuffers(const ScaleBuffers&) = delete;
  ScaleBuffers& operator=(const ScaleBuffers&) = delete;
  DeviceScales device() const { return {k_, k_ + count_}; }
  std::size_t count() const { return count_; }

 private:
  float* k_ = nullptr;  // [2 * count]: K scales, then V scales
  std::size_t count_ = 0;
};

// --- the step buffers -----------------------------------------------------------------------

// Sizes the device step buffers are allocated for. A step fits when its plan fits
// `plan` (max_seqs, num_kv_heads, max_splits), no sequence uses more than max_pages_per_seq
// pages, and its tile is at most max_tile_tokens (shared memory is sized for that tile).
struct StepCapacity {
  PlanCapacity plan;
  int max_pages_per_seq = 0;
  int max_tile_tokens = 128;

  // Work items (and decode CTAs: the grid is fixed at this many) and merge CTAs, one per query
  // row (q_len * g of them per KV head).
  int max_items() const { return plan.max_seqs * plan.num_kv_heads * plan.max_splits; }
  int max_merges(int rows) const { return plan.max_seqs * plan.num_kv_heads * rows; }
  std::size_t device_bytes() const;  // of the step buffer
  // Whether every step that fits `need` fits this capacity (the same KV heads, nothing larger).
  bool covers(const StepCapacity& need) const;
};

// The smallest capacity that holds `plan` over `batch`: its sequences (at least the plan's
// capacity), pages per sequence and tile.
StepCapacity step_capacity_for(const Plan& plan, const PagedBatch& batch);

// One decode step's plan and batch on the device, in buffers of fixed capacity (one device
// allocation, one pinned host staging buffer of the same size). Not thread-safe; one per stream.
class DecodeStep {
 public:
  explicit DecodeStep(const StepCapacity& capacity);
  ~DecodeStep();
  DecodeStep(const DecodeStep&) = delete;
  DecodeStep& operator=(const DecodeStep&) = delete;

  const StepCapacity& capacity() const { return capacity_; }

  // Validates `batch` (against `geometry` and plan.q_len) and `plan` (against the batch and the
  // capacity), packs both into the pinned staging buffer (first waiting until the previous
  // upload's copy has left it), and enqueues one host-to-device copy of the bytes in use on
  // `stream`. Throws Error naming the argument that does not fit. Not capturable: call it on the
  // stream the graph is launched on, before the launch.
  void upload(const PagedBatch& batch, const Plan& plan, const CacheGeometry& geometry,
              cudaStream_t stream);

  // For the kernels: the device buffer (header, items, per-sequence entries, page lists).
  const std::byte* device_data() const { return device_; }
  // q_len of the last upload (0 before the first), and the q_len the first enqueue_decode()
  // baked into its launch (0 before): a later upload must keep it.
  int uploaded_q_len() const { return uploaded_q_len_; }
  void lock_q_len(int q_len) const { locked_q_len_ = q_len; }
  // Uploads so far: a caller that shares the buffer between plans compares it with the count
  // after its own upload to tell whether another plan has replaced its own since.
  std::uint64_t uploads() const { return uploads_; }
  // Whether `plan` has the shape of the plan last uploaded (its sequences, items, partial slots,
  // q_len and tile): what enqueue_planned_decode() checks before sizing its grids to it. A plan
  // of the same shape passes too; uploads() tells whose it is.
  bool holds(const Plan& plan) const;

 private:
  StepCapacity capacity_;
  std::byte* device_ = nullptr;
  std::byte* staging_ = nullptr;  // pinned
  cudaEvent_t copied_ = nullptr;  // recorded after each upload's copy
  bool copy_pending_ = false;
  int uploaded_q_len_ = 0;
  mutable int locked_q_len_ = 0;
  std::uint64_t uploads_ = 0;
  int uploaded_seqs_ = 0, uploaded_items_ = 0, uploaded_partials_ = 0, uploaded_tile_ = 0;
};

// Bytes of device workspace enqueue_decode() needs: the split partials of every slot the
// capacity allows (PartialLayout), O then LSE.
std::size_t decode_workspace_bytes(const StepCapacity& capacity, const CacheGeometry& geometry,
                                   const DecodeParams& params);

// Enqueues the decode kernel (one CTA per work item, a fixed grid of capacity.max_items() CTAs;
// those past the uploaded plan's item count exit at once) and the LSE merge of split sequences
// (a fixed grid of max_merges(q_len * g) CTAs) on `stream`. Capturable: no allocation, no
// host-device copy, no synchronization. `args` gives the device pointers (cache.data, q, o, lse)
// and shapes; its batch and cache.k_scale / v_scale are not read (the step buffer and `scales`
// are). q, o and lse must hold capacity.plan.max_seqs * q_len token rows (lse: that many times Hq
// floats, or empty); rows of sequences past the uploaded batch are not written. `kernels`: the
// variants the launch may take (BackendOptions::cuda_kernels).
void enqueue_decode(const DecodeArgs& args, const DeviceScales& scales, const DecodeStep& step,
                    std::span<std::byte> workspace, cudaStream_t stream,
                    const CudaKernelOptions& kernels = {});

// Enqueues the decode of `plan`, the plan last uploaded to `step`, with grids sized to it:
// plan.num_items decode CTAs and one merge CTA per query row of its sequences, not the
// capacity's. Its shape is checked against the upload (DecodeStep::holds); that it is the same
// plan, not another of the same shape, the caller knows from DecodeStep::uploads(). For eager
// calls that run each step's own plan (a serving engine's layers, Backend::run): no allocation,
// no copy, no synchronization. A graph that captured it would replay the captured plan's grids,
// so use enqueue_decode() for graphs. `args` must have passed validate() (its batch is the
// uploaded one; its scales are not read, `scales` are); the workspace holds
// Backend::workspace_bytes(plan, ...): plan.partial_slots() partials, and the configuration runs
// with the plan's tile (unsupported_reason: checked before the upload, which it must precede).
void enqueue_planned_decode(const DecodeArgs& args, const Plan& plan, const DeviceScales& scales,
                            const DecodeStep& step, std::span<std::byte> workspace,
                            cudaStream_t stream, const CudaKernelOptions& kernels = {});

// Empty when the kernels run this configuration on the current device, otherwise why not.
std::string unsupported_reason(const CacheGeometry& geometry, const DecodeParams& params,
                               int max_tile_tokens);

// --- write_kv on device tensors ---------------------------------------------------------------

// The outcome of enqueue_write_kv(), kept on the device: the first bad input in the order the
// host write_kv checks (slots, then K values, then V values), or none. A bad call writes nothing.
class WriteKvStatus {
 public:
  WriteKvStatus();
  ~WriteKvStatus();
  WriteKvStatus(const WriteKvStatus&) = delete;
  WriteKvStatus& operator=(const WriteKvStatus&) = delete;
  // Waits for `stream` and throws Error with the host write_kv's message ("k[5][2][17] is NaN",
  // "slot_mapping[3]: slot 999 is outside the pool ...") if the last call found bad input.
  void check(cudaStream_t stream) const;
  unsigned long long* device_word() const { return word_; }
  // The slot mapping and the geometry of the last call, for check()'s message.
  const std::int64_t* slot_mapping = nullptr;
  CacheGeometry geometry;

 private:
  unsigned long long* word_ = nullptr;  // device: all ones = no error, else the encoded first one
};

// Quantizes token i of k and v ([num_tokens, Hk, D] float32 on the device) into slot
// slot_mapping[i] (device int64; negative = skipped) of `cache` (data on the device; geometry
// and strides validated here; its k_scale / v_scale spans are not read, `scales` are). Two
// kernels: a check (slots inside the pool, every value of a written token finite) that records
// the first bad input in `status`, and the write, which writes nothing when the check failed.
// The bytes written equal encode_row() of value / scale, bit for bit. Capturable. Two tokens
// mapped to one slot race (the host write_kv lets the later one win). No amax recording.
void enqueue_write_kv(const KvCacheView& cache, const DeviceScales& scales, const TokenRows& k,
                      const TokenRows& v, const std::int64_t* slot_mapping, int num_tokens,
                      WriteKvStatus& status, cudaStream_t stream);

// Convenience: `cache` with device data and HOST scales (validated and uploaded here), device
// k, v and slot_mapping; runs on `stream`, waits, and throws Error on bad input like the host
// write_kv. Not capturable.
void write_kv(const KvCacheView& cache, const TokenRows& k, const TokenRows& v,
              const std::int64_t* slot_mapping, int num_tokens, cudaStream_t stream);

// --- device pointers --------------------------------------------------------------------------

// Throws Error("<name>: ... is host memory ...") when `pointer` is non-null pageable host memory,
// which the kernels cannot read. Device, managed and pinned memory pass.
void require_device_pointer(const void* pointer, const char* name);

// Throws Error("q.type: ...") unless Q and O are float32 rows: the CUDA kernels take no other
// (bf16 rows: the CPU and reference backends).
void require_float32_rows(const DecodeArgs& args);

}  // namespace mjolnir::cuda

// torch.classes.mjolnir.GraphBuffers: the device buffers of fixed capacity that let a CUDA graph
// capture a layer's decode once and replay it over every later step (docs/python.md, "CUDA
// graphs"). A step planned into them (plan_step(..., graph=buffers)) uploads its plan and batch
// there when it is planned, before the graph replays; a layer's attend then enqueues only
// kernels whose grids and pointers do not depend on the step: q's rows into float32 staging
// rows, the decode over the capacity's fixed grids (cuda::enqueue_decode), the output rows back.
//
// In a build without the CUDA backend the class exists (the ops' schemas name it) and making
// one raises ValueError.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <memory>
#include <string>

#include "mjolnir/cache.h"
#include "mjolnir/decode.h"
#include "mjolnir/plan.h"

namespace mjolnir::cuda {
class DecodeStep;
}

namespace mjolnir::python {

class GraphBuffers final : public torch::CustomClassHolder {
 public:
  // Steps of at most max_seqs sequences of q_len query tokens each, max_pages_per_seq pages of
  // page_size tokens from a pool of num_pages, num_q_heads / num_kv_heads heads of head_dim
  // channels, at most max_splits chunks per sequence, on CUDA device `device`. Allocates the
  // step buffer, the workspace and the staging rows (max_seqs * q_len rows of Hq x D floats for
  // q and for the output) once; raises ValueError naming the argument that is out of range.
  GraphBuffers(std::int64_t max_seqs, std::int64_t max_pages_per_seq, std::int64_t q_len,
               std::int64_t num_q_heads, std::int64_t num_kv_heads, std::int64_t head_dim,
               std::int64_t max_splits, std::int64_t page_size, std::int64_t num_pages,
               std::int64_t device);
  ~GraphBuffers() override;

  std::int64_t q_len() const { return q_len_; }
  std::int64_t num_q_heads() const { return num_q_heads_; }
  std::int64_t num_kv_heads() const { return geometry_.num_kv_heads; }
  std::int64_t max_splits() const { return max_splits_; }
  std::int64_t device() const { return device_; }
  // Query rows the staging holds: max_seqs * q_len.
  std::int64_t max_rows() const { return max_rows_; }
  // The capacity in words, for logs: "256 sequences x 1 query token, 512 pages of 16 tokens
  // per sequence, 16 chunks, 8 KV heads x 128 channels, 34.2 MiB".
  std::string describe() const;

  // Uploads a step's batch and plan on torch's current stream of the device. Raises ValueError
  // when the step does not fit the capacity or the pool (naming what does not), and when the
  // stream is capturing a graph (the upload is a copy from host memory the graph would replay).
  void upload(const PagedBatch& batch, const Plan& plan) const;

  // One layer's decode of the uploaded step on torch's current stream: q's first q.size(0) rows
  // into the staging rows, the kernels over the capacity's grids, as many rows of the staged
  // output back into `output`. Capturable. `cache`'s data is on this device and its geometry the
  // buffers' (page size, pool, heads, head_dim); k_scale and v_scale are float32 tensors on the
  // device, which the captured kernels read at replay. `params` hold the step's modes.
  void enqueue(at::Tensor& output, const at::Tensor& q, const KvCacheView& cache,
               const DecodeParams& params, const at::Tensor& k_scale,
               const at::Tensor& v_scale) const;

 private:
  std::int64_t q_len_ = 0, num_q_heads_ = 0, max_splits_ = 0, max_rows_ = 0, device_ = 0;
  CacheGeometry geometry_;  // page size, pool, heads and head_dim the steps are checked against
  std::shared_ptr<cuda::DecodeStep> step_;
  at::Tensor workspace_, q_rows_, o_rows_;
};

}  // namespace mjolnir::python

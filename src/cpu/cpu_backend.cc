// The CPU backend: work items on a thread pool, then the LSE merge of split sequences.
#include "cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>

#include "cpu/attention_item.h"
#include "cpu/thread_pool.h"

namespace mjolnir::cpu {

namespace {

// Output addressing of one (sequence, KV head)'s query rows r = t * g + j.
struct RowAddress {
  const DecodeArgs& args;
  int g;
  float* o(int seq, int kv_head, int r) const {
    const int q_len = args.params.q_len;
    return args.o.data + (std::int64_t(seq) * q_len + r / g) * args.o.token_stride +
           std::int64_t(kv_head * g + r % g) * args.o.head_stride;
  }
  float* lse(int seq, int kv_head, int r) const {
    if (args.lse.empty()) return nullptr;
    const std::size_t token = std::size_t(seq) * args.params.q_len + r / g;
    return &args.lse[token * args.params.num_q_heads + kv_head * g + r % g];
  }
};

// O = sum_i exp(lse_i - L) O_i with L = log sum_i exp(lse_i), for one query row of a split
// sequence; chunks whose rows saw nothing (lse = -inf) weigh 0, all-empty gives O = 0.
void merge_row(const float* partial_o, const float* partial_lse, std::size_t o_stride,
               std::size_t lse_stride, int chunks, int d, float* o, float* lse) {
  float max_lse = -std::numeric_limits<float>::infinity();
  for (int s = 0; s < chunks; ++s) max_lse = std::max(max_lse, partial_lse[s * lse_stride]);
  std::fill(o, o + d, 0.0f);
  if (max_lse == -std::numeric_limits<float>::infinity()) {
    if (lse) *lse = max_lse;
    return;
  }
  float weight_sum = 0.0f;
  for (int s = 0; s < chunks; ++s) weight_sum += std::exp(partial_lse[s * lse_stride] - max_lse);
  for (int s = 0; s < chunks; ++s) {
    const float w = std::exp(partial_lse[s * lse_stride] - max_lse) / weight_sum;
    const float* src = partial_o + s * o_stride;
    for (int c = 0; c < d; ++c) o[c] += w * src[c];
  }
  if (lse) *lse = max_lse + std::log(weight_sum);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads)
      : pool_(threads > 0 ? threads : hardware_threads()), scratch_(pool_.size()) {}

  std::string_view name() const override { return "cpu"; }
  std::string unsupported_reason(const CacheGeometry&, const DecodeParams&) const override {
    return {};
  }
  int workers() const override { return pool_.size(); }

  void run(const DecodeArgs& args, const Plan& plan,
           std::span<std::byte> workspace) const override {
    // The pool and scratch serve one call at a time; concurrent callers wait their turn.
    std::lock_guard lock(run_mutex_);
    const int d = args.cache.geometry.head_dim;
    const int hk = args.cache.geometry.num_kv_heads;
    const int g = args.params.num_q_heads / hk;
    const int rows = args.params.q_len * g;
    const PartialLayout layout{hk, rows, d};
    const int slots = plan.capacity.max_seqs * plan.capacity.max_splits;
    float* partial_o = reinterpret_cast<float*>(workspace.data());
    float* partial_lse = partial_o + layout.o_floats(slots);
    const RowAddress out{args, g};

    pool_.parallel_for(plan.num_items, [&](std::int64_t index, int worker) {
      const WorkItem& item = plan.items[index];
      ItemScratch& s = scratch_[worker];
      run_attention_item(args, plan, item, s);
      for (int r = 0; r < rows; ++r) {
        const float* src = &s.o[std::size_t(r) * d];
        if (item.partial_slot < 0) {
          std::copy(src, src + d, out.o(item.seq, item.kv_head, r));
          if (float* lse = out.lse(item.seq, item.kv_head, r)) *lse = s.lse[r];
        } else {
          std::copy(src, src + d, partial_o + layout.o_offset(item.partial_slot, item.kv_head, r));
          partial_lse[layout.lse_offset(item.partial_slot, item.kv_head, r)] = s.lse[r];
        }
      }
    });

    // Merge: one task per (split sequence, KV head).
    std::vector<std::pair<int, int>> merges;
    for (int b = 0; b < plan.num_seqs; ++b) {
      if (plan.num_splits[b] > 1) {
        for (int h = 0; h < hk; ++h) merges.emplace_back(b, h);
      }
    }
    pool_.parallel_for(std::int64_t(merges.size()), [&](std::int64_t index, int) {
      const auto [b, h] = merges[index];
      const int first = plan.first_partial[b];
      for (int r = 0; r < rows; ++r) {
        merge_row(partial_o + layout.o_offset(first, h, r),
                  partial_lse + layout.lse_offset(first, h, r), layout.o_offset(1, 0, 0),
                  layout.lse_offset(1, 0, 0), plan.num_splits[b], d, out.o(b, h, r),
                  out.lse(b, h, r));
      }
    });
  }

 private:
  mutable ThreadPool pool_;
  mutable std::vector<ItemScratch> scratch_;
  mutable std::mutex run_mutex_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options.threads);
}

}  // namespace mjolnir::cpu

// The plan: decode work cut into items that fill the device in one wave (DESIGN.md section 5).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace mjolnir {

// One unit of work: the q_len * g query rows of one (sequence, KV head) against KV tokens
// [kv_begin, kv_end). Each KV row of the range is read once for all of those query rows.
struct WorkItem {
  std::int32_t seq = 0;
  std::int32_t kv_head = 0;
  std::int32_t kv_begin = 0;
  std::int32_t kv_end = 0;
  std::int32_t split = 0;  // chunk index within the sequence, 0..num_splits(seq)-1
  // -1: the sequence is not split and the item writes the final output and LSE directly;
  // otherwise the partial slot this item's normalized O and LSE go to (see PartialLayout).
  std::int32_t partial_slot = -1;
};

struct PlanOptions {
  int workers = 1;             // device capacity: CPU threads, or GPU SMs x CTAs per SM
  int max_splits = 16;         // cap on chunks per sequence; 0: max_splits_to_fill (below)
  int tile_tokens = 64;        // T of the online softmax; chunk bounds are multiples of it
  int min_chunk_tokens = 256;  // a sequence is not cut into chunks shorter than this
  int fixed_splits = 0;        // > 0: cut every sequence into this many chunks (tests, tuning)
};

// Buffer sizes a plan is created with. A plan never grows past them, so a CUDA graph captured
// with the plan's buffers replays any later plan that fits.
struct PlanCapacity {
  int max_seqs = 0;
  int num_kv_heads = 0;
  int max_splits = 16;
};

// A plan in fixed-capacity buffers. `items` and the per-sequence arrays are sized once from the
// capacity; make_plan() refills them and sets the counts.
struct Plan {
  PlanCapacity capacity;
  int tile_tokens = 64;
  int q_len = 1;
  int num_seqs = 0;
  int num_items = 0;            // valid prefix of `items`
  int num_partials = 0;         // partial slots in use: one per chunk of each split sequence
  std::vector<WorkItem> items;  // [max_seqs * Hk * max_splits]
  std::vector<std::int32_t> num_splits;     // [max_seqs]: 1 when not split
  std::vector<std::int32_t> first_partial;  // [max_seqs]: slot of chunk 0, -1 when not split

  explicit Plan(PlanCapacity cap = {});
  std::span<const WorkItem> work() const { return {items.data(), std::size_t(num_items)}; }
};

// Cuts the step into work items. Every (sequence, KV head, KV token) is covered exactly once;
// padding requests (seq_len 0) get one empty item per KV head, which writes O = 0 and
// LSE = -inf and reads nothing. Chunk bounds are multiples of options.tile_tokens. Throws Error
// when the step does not fit the plan's capacity or an argument is out of range.
void make_plan(Plan& plan, std::span<const std::int32_t> seq_lens, int q_len, int num_kv_heads,
               const PlanOptions& options);

// A max_splits (for PlanOptions and PlanCapacity) with which make_plan can fill one wave of
// `workers` when `num_seqs` sequences of about equal length share the step: at least the
// default 16, and ceil(workers / (num_seqs * Hk)). A CPU (workers = threads) never needs more
// than 16; a GPU at batch 1 does: an H200 plans 132 SMs x 8 CTAs, so one sequence over 8 KV heads
// needs 132 chunks to occupy it, and the default 16 leaves 128 CTAs on 132 SMs. Every chunk
// costs a partial slot of workspace (max_seqs * max_splits slots are reserved), so size it for
// the batches that are small.
int max_splits_to_fill(int workers, int num_seqs, int num_kv_heads);

// The cap on chunks per sequence that make_plan applies (before the plan's capacity):
// options.max_splits, or max_splits_to_fill(options.workers, ...) when it is 0. Size a
// PlanCapacity with it to let a max_splits of 0 take effect.
int effective_max_splits(const PlanOptions& options, int num_seqs, int num_kv_heads);

// Where split partials live in a backend's workspace: for slot s, KV head h, query row r
// (r = t * g + j for query token t and head j of the group), O at
// o[((s * Hk + h) * rows + r) * D] and LSE at lse[(s * Hk + h) * rows + r].
struct PartialLayout {
  int num_kv_heads = 0;
  int rows = 0;  // q_len * g
  int head_dim = 0;
  std::size_t o_offset(int slot, int kv_head, int row) const {
    return ((std::size_t(slot) * num_kv_heads + kv_head) * rows + row) * head_dim;
  }
  std::size_t lse_offset(int slot, int kv_head, int row) const {
    return (std::size_t(slot) * num_kv_heads + kv_head) * rows + row;
  }
  std::size_t o_floats(int slots) const { return o_offset(slots, 0, 0); }
  std::size_t lse_floats(int slots) const { return lse_offset(slots, 0, 0); }
};

}  // namespace mjolnir

// The plan: decode work cut into items that fill the device in one wave (docs/design.md section 5).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace mjolnir {

// Most query tokens of a decode step (1 + the speculative tokens being verified).
inline constexpr int kMaxQLen = 8;
// Query tokens of a ragged step's query tile (prefill, chunked prefill, mixed query lengths): the
// most one work item holds there. Each KV tile a work item reads serves all its query rows (32 x g
// here), so larger tiles decode and load each KV row fewer times over a prompt.
inline constexpr int kQueryTileTokens = 32;

// The one check of how a step gives its query tokens, for make_plan, validate() and the bindings:
// q_len in [1, kMaxQLen] for every sequence, or (a ragged step) q_len 0 with query_start holding
// num_seqs + 1 entries from 0 that never decrease. Throws Error naming the argument as the
// caller's API names it (`q_len_name`, `query_start_name`).
void check_query_tokens(int q_len, std::span<const std::int32_t> query_start, std::size_t num_seqs,
                        std::string_view q_len_name = "q_len",
                        std::string_view query_start_name = "query_start");

// One unit of work: the q_count * g query rows of one (sequence, KV head), query tokens
// [q_begin, q_begin + q_count) of the sequence, against KV tokens [kv_begin, kv_end). Each KV row
// of the range is read once for all of those query rows.
struct WorkItem {
  std::int32_t seq = 0;
  std::int32_t kv_head = 0;
  std::int32_t kv_begin = 0;
  std::int32_t kv_end = 0;
  std::int32_t split = 0;  // chunk index within the query tile, 0..num_splits[tile]-1
  // -1: the query tile is not split and the item writes the final output and LSE directly;
  // otherwise the partial slot this item's normalized O and LSE go to (see PartialLayout).
  std::int32_t partial_slot = -1;
  // The item's query tile: tokens [q_begin, q_begin + q_count) of the sequence's query tokens
  // (a decode step: 0 and q_len). Row r = t * g + j of the item is token q_begin + t, head j of
  // the group.
  std::int32_t q_begin = 0;
  std::int32_t q_count = 1;
  std::int32_t tile = 0;  // index of the query tile in Plan::query_tiles
};

// Query tokens [q_begin, q_begin + q_count) of sequence `seq`, with the KV tokens they may see:
// [0, kv_len) for the last of them (causal), or all of the sequence's (non-causal).
struct QueryTile {
  std::int32_t seq = 0;
  std::int32_t q_begin = 0;
  std::int32_t q_count = 1;
  std::int32_t kv_len = 0;
};

struct PlanOptions {
  int workers = 1;  // device capacity: CPU threads, or GPU SMs x CTAs per SM
  // Work items that run at once (a GPU's resident CTAs), when fewer than workers; 0: workers.
  // max_splits 0 then cuts a step of few sequences into chunks that fit one wave of them.
  int wave_workers = 0;
  int max_splits = 16;         // cap on chunks per sequence; 0: max_splits_to_fill (below)
  int tile_tokens = 64;        // T of the online softmax; chunk bounds are multiples of it
  int min_chunk_tokens = 256;  // a sequence is not cut into chunks shorter than this
  int fixed_splits = 0;        // > 0: cut every sequence into this many chunks (tests, tuning)
  // How the backend shares a step among its workers (Backend::heads_together_min_tokens).
  // 0: each KV head's items run apart (a GPU's CTAs), so sequences x KV heads items share the
  // workers and a sequence is cut only where they fall short. > 0: the backend runs the KV heads
  // of one chunk as one unit (the CPU, whose tiles then read whole pages), so only chunks share
  // the workers: a step of fewer sequences than workers is cut into about one chunk per worker,
  // but a sequence of at most this many tokens stays whole (the backend shares out its heads).
  int heads_together_min_tokens = 0;
};

// Buffer sizes a plan is created with. A plan never grows past them, so a CUDA graph captured
// with the plan's buffers replays any later plan that fits.
struct PlanCapacity {
  int max_seqs = 0;
  int num_kv_heads = 0;
  int max_splits = 16;
  // Query tiles (one per sequence in a decode step; query_tiles_needed() for a ragged one).
  // 0: max_seqs.
  int max_query_tiles = 0;
  // Split partial slots the workspace holds; -1: max_query_tiles * max_splits, as many as any
  // plan of the capacity can use (what a captured CUDA graph needs).
  int max_partials = -1;

  int query_tiles() const { return max_query_tiles > 0 ? max_query_tiles : max_seqs; }
  int partial_slots() const {
    return max_partials >= 0 ? max_partials : query_tiles() * max_splits;
  }
};

// The shape of one step, all a plan depends on: each sequence's KV length and query tokens.
struct StepShape {
  std::span<const std::int32_t> seq_lens;  // [num_seqs]: KV tokens, the new ones included
  // Optional [num_seqs + 1], nondecreasing from 0: sequence b's query tokens are rows
  // [query_start[b], query_start[b + 1]) of the step (vLLM's query_start_loc). Empty: q_len each.
  std::span<const std::int32_t> query_start;
  int q_len = 1;  // query tokens of every sequence, 1..kMaxQLen; 0 when query_start is given
  int num_kv_heads = 0;
  bool causal = true;  // the last query token sees every KV token, token t one fewer per step
  int num_seqs() const { return static_cast<int>(seq_lens.size()); }
  // Query tokens of sequence `seq` in this step.
  int query_len(int seq) const {
    return query_start.empty() ? q_len : query_start[seq + 1] - query_start[seq];
  }
};

// A plan in fixed-capacity buffers. `items` and the per-tile arrays are sized once from the
// capacity; make_plan() refills them and sets the counts.
struct Plan {
  PlanCapacity capacity;
  int tile_tokens = 64;
  // Query tokens per work item, at most: the step's q_len, or kQueryTileTokens for a ragged step
  // (so rows of split partials are q_len * g apart, PartialLayout).
  int q_len = 1;
  bool ragged = false;  // made for a step with query_start
  int num_seqs = 0;
  int num_query_tiles = 0;      // valid prefix of `query_tiles`, num_splits and first_partial
  int num_items = 0;            // valid prefix of `items`
  int num_partials = 0;         // partial slots in use: one per chunk of each split query tile
  std::vector<WorkItem> items;  // [max_query_tiles * Hk * max_splits]
  // Per query tile: in a decode step tile b is sequence b, all its q_len query tokens.
  std::vector<QueryTile> query_tiles;       // [max_query_tiles]
  std::vector<std::int32_t> num_splits;     // [max_query_tiles]: 1 when not split
  std::vector<std::int32_t> first_partial;  // [max_query_tiles]: slot of chunk 0, -1 if not split

  explicit Plan(PlanCapacity cap = {});
  std::span<const WorkItem> work() const { return {items.data(), std::size_t(num_items)}; }
  // Partial slots the capacity reserves (PlanCapacity::partial_slots).
  int partial_slots() const { return capacity.partial_slots(); }
};

// Cuts the step into work items. A ragged step's sequences are cut into query tiles of at most
// kQueryTileTokens tokens (a decode step has one per sequence); every (query tile, KV head, visible
// KV token) is covered exactly once. Padding requests (seq_len 0 in a decode step) get one empty
// item per KV head, which writes O = 0 and LSE = -inf and reads nothing. Chunk bounds are
// multiples of options.tile_tokens. Throws Error when the step does not fit the plan's capacity
// or an argument is out of range. It writes `plan`: not while a Backend::run() reads it.
void make_plan(Plan& plan, const StepShape& step, const PlanOptions& options);
// A decode step: q_len query tokens per sequence.
void make_plan(Plan& plan, std::span<const std::int32_t> seq_lens, int q_len, int num_kv_heads,
               const PlanOptions& options);

// The smallest capacity whose plan holds make_plan(step, options): exactly the query tiles,
// splits and partial slots this step uses. For plans made once per step (a ragged step's,
// whose prefill chunks would otherwise reserve partial slots they never use); a captured CUDA
// graph keeps one capacity for every step instead.
PlanCapacity capacity_for(const StepShape& step, const PlanOptions& options);

// Query tiles make_plan cuts a ragged step into: ceil(query tokens / kQueryTileTokens) per
// sequence.
// Size PlanCapacity::max_query_tiles with it. Throws Error naming query_start when it is not
// nondecreasing from 0.
int query_tiles_needed(std::span<const std::int32_t> query_start);

// A max_splits (for PlanOptions and PlanCapacity) with which make_plan can fill one wave of
// `workers` when `num_seqs` sequences of about equal length share the step: at least the
// default 16, and ceil(workers / (num_seqs * Hk)). A CPU (workers = threads) never needs more
// than 16; a GPU at batch 1 does: an H200 plans 132 SMs x 8 CTAs, so one sequence over 8 KV heads
// needs 132 chunks to occupy it, and the default 16 leaves 128 CTAs on 132 SMs. Every chunk
// costs a partial slot of workspace (max_seqs * max_splits slots are reserved), so size it for
// the batches that are small.
int max_splits_to_fill(int workers, int num_seqs, int num_kv_heads);

// The cap on chunks per sequence that make_plan applies (before the plan's capacity):
// options.max_splits; when it is 0, max_splits_to_fill(options.workers, ...), except that with
// options.wave_workers set and floor(wave_workers / (num_seqs * Hk)) at least the default 16,
// it is that: the chunks of a step of few sequences fit one wave of resident CTAs, since a
// second, partial wave costs about as much as the first (docs/cuda.md). Size a PlanCapacity with
// it to let a max_splits of 0 take effect.
int effective_max_splits(const PlanOptions& options, int num_seqs, int num_kv_heads);

// Where split partials live in a backend's workspace: for slot s, KV head h, query row r of the
// item (r = t * g + j for query token t of its tile and head j of the group), O at
// o[((s * Hk + h) * rows + r) * D] and LSE at lse[(s * Hk + h) * rows + r].
struct PartialLayout {
  int num_kv_heads = 0;
  int rows = 0;  // plan.q_len * g
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

// make_plan: cut a decode step into work items that fill the device in one wave.
#include "mjolnir/plan.h"

#include <algorithm>

#include "mjolnir/decode.h"
#include "mjolnir/error.h"

namespace mjolnir {

Plan::Plan(PlanCapacity cap) : capacity(cap) {
  MJOLNIR_REQUIRE(cap.max_seqs >= 0, "plan capacity.max_seqs: ", cap.max_seqs, " is negative");
  MJOLNIR_REQUIRE(cap.num_kv_heads >= 0, "plan capacity.num_kv_heads: ", cap.num_kv_heads,
                  " is negative");
  MJOLNIR_REQUIRE(cap.max_splits >= 1, "plan capacity.max_splits: ", cap.max_splits,
                  " must be at least 1");
  items.resize(std::size_t(cap.max_seqs) * cap.num_kv_heads * cap.max_splits);
  num_splits.resize(cap.max_seqs);
  first_partial.resize(cap.max_seqs);
}

namespace {

int ceil_div(std::int64_t a, std::int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Tokens per chunk so that all items together make about one wave of `workers`: the split
// heuristic lives here only, and every backend plans through it.
std::int64_t chunk_tokens_for_one_wave(std::span<const std::int32_t> seq_lens, int num_kv_heads,
                                       const PlanOptions& options) {
  std::int64_t total = 0;
  for (std::int32_t len : seq_lens) total += len;
  const std::int64_t per_worker = (total * num_kv_heads + options.workers - 1) / options.workers;
  std::int64_t chunk = std::max<std::int64_t>(per_worker, options.min_chunk_tokens);
  return (chunk + options.tile_tokens - 1) / options.tile_tokens * options.tile_tokens;
}

}  // namespace

void make_plan(Plan& plan, std::span<const std::int32_t> seq_lens, int q_len, int num_kv_heads,
               const PlanOptions& options) {
  const int num_seqs = static_cast<int>(seq_lens.size());
  MJOLNIR_REQUIRE(q_len >= 1 && q_len <= kMaxQLen, "q_len: ", q_len, " is outside [1, ", kMaxQLen,
                  "]");
  MJOLNIR_REQUIRE(options.workers >= 1, "plan options.workers: ", options.workers,
                  " must be at least 1");
  MJOLNIR_REQUIRE(options.tile_tokens >= 1 && options.tile_tokens <= 1024,
                  "plan options.tile_tokens: ", options.tile_tokens, " is outside [1, 1024]");
  MJOLNIR_REQUIRE(options.max_splits >= 0, "plan options.max_splits: ", options.max_splits,
                  " is negative (0: as many chunks as fill the workers)");
  MJOLNIR_REQUIRE(options.fixed_splits >= 0, "plan options.fixed_splits: ", options.fixed_splits,
                  " is negative");
  MJOLNIR_REQUIRE(options.min_chunk_tokens >= 1,
                  "plan options.min_chunk_tokens: ", options.min_chunk_tokens,
                  " must be at least 1");
  MJOLNIR_REQUIRE(num_seqs <= plan.capacity.max_seqs, "seq_lens: ", num_seqs,
                  " sequences exceed the plan's capacity of ", plan.capacity.max_seqs);
  MJOLNIR_REQUIRE(num_kv_heads == plan.capacity.num_kv_heads, "num_kv_heads: ", num_kv_heads,
                  " differs from the plan's capacity (", plan.capacity.num_kv_heads, ")");
  for (int b = 0; b < num_seqs; ++b) {
    MJOLNIR_REQUIRE(seq_lens[b] >= 0, "seq_lens[", b, "]: ", seq_lens[b], " is negative");
  }

  const int max_splits =
      std::min(effective_max_splits(options, num_seqs, num_kv_heads), plan.capacity.max_splits);
  const std::int64_t wave_chunk = chunk_tokens_for_one_wave(seq_lens, num_kv_heads, options);
  const int tile = options.tile_tokens;

  plan.tile_tokens = tile;
  plan.q_len = q_len;
  plan.num_seqs = num_seqs;
  int items = 0;
  int partials = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const int len = seq_lens[b];
    const int tiles = ceil_div(len, tile);
    // Chunks are whole tiles; never more chunks than tiles, so no chunk is empty.
    int splits = options.fixed_splits > 0 ? options.fixed_splits : ceil_div(len, wave_chunk);
    splits = std::clamp(std::min(splits, tiles), 1, max_splits);
    const int tiles_per_chunk = ceil_div(tiles, splits);
    if (tiles > 0) splits = ceil_div(tiles, tiles_per_chunk);  // drop chunks left empty
    plan.num_splits[b] = splits;
    plan.first_partial[b] = splits > 1 ? partials : -1;
    for (int s = 0; s < splits; ++s) {
      const int begin = std::min(len, s * tiles_per_chunk * tile);
      const int end = std::min(len, (s + 1) * tiles_per_chunk * tile);
      for (int h = 0; h < num_kv_heads; ++h) {
        plan.items[items++] = WorkItem{b, h, begin, end, s, splits > 1 ? partials + s : -1};
      }
    }
    if (splits > 1) partials += splits;
  }
  plan.num_items = items;
  plan.num_partials = partials;
}

int max_splits_to_fill(int workers, int num_seqs, int num_kv_heads) {
  MJOLNIR_REQUIRE(workers >= 1, "workers: ", workers, " must be at least 1");
  MJOLNIR_REQUIRE(num_seqs >= 0, "num_seqs: ", num_seqs, " is negative");
  MJOLNIR_REQUIRE(num_kv_heads >= 1, "num_kv_heads: ", num_kv_heads, " must be at least 1");
  const std::int64_t pairs = std::int64_t(std::max(num_seqs, 1)) * num_kv_heads;
  return std::max(PlanOptions{}.max_splits, ceil_div(workers, pairs));
}

int effective_max_splits(const PlanOptions& options, int num_seqs, int num_kv_heads) {
  // Only 0 is replaced: make_plan still rejects a negative cap, naming it.
  return options.max_splits != 0 ? options.max_splits
                                 : max_splits_to_fill(options.workers, num_seqs, num_kv_heads);
}

}  // namespace mjolnir

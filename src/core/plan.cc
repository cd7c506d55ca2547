// make_plan: cut a step into work items that fill the device in one wave.
#include "mjolnir/plan.h"

#include <algorithm>
#include <limits>

#include "mjolnir/decode.h"
#include "mjolnir/error.h"

namespace mjolnir {

Plan::Plan(PlanCapacity cap) : capacity(cap) {
  MJOLNIR_REQUIRE(cap.max_seqs >= 0, "plan capacity.max_seqs: ", cap.max_seqs, " is negative");
  MJOLNIR_REQUIRE(cap.num_kv_heads >= 0, "plan capacity.num_kv_heads: ", cap.num_kv_heads,
                  " is negative");
  MJOLNIR_REQUIRE(cap.max_splits >= 1, "plan capacity.max_splits: ", cap.max_splits,
                  " must be at least 1");
  MJOLNIR_REQUIRE(cap.max_query_tiles >= 0, "plan capacity.max_query_tiles: ", cap.max_query_tiles,
                  " is negative (0: one per sequence)");
  MJOLNIR_REQUIRE(cap.max_partials >= -1, "plan capacity.max_partials: ", cap.max_partials,
                  " is below -1 (-1: max_query_tiles * max_splits)");
  const std::size_t tiles = static_cast<std::size_t>(cap.query_tiles());
  items.resize(tiles * cap.num_kv_heads * cap.max_splits);
  query_tiles.resize(tiles);
  num_splits.resize(tiles);
  first_partial.resize(tiles);
}

void check_query_tokens(int q_len, std::span<const std::int32_t> query_start, std::size_t num_seqs,
                        std::string_view q_len_name, std::string_view query_start_name) {
  if (query_start.empty()) {
    MJOLNIR_REQUIRE(q_len >= 1 && q_len <= kMaxQLen, q_len_name, ": ", q_len, " is outside [1, ",
                    kMaxQLen, "] (0: a ragged step, with ", query_start_name, ")");
    return;
  }
  MJOLNIR_REQUIRE(q_len == 0, q_len_name, ": ", q_len, " with ", query_start_name,
                  " given; a ragged step takes its query lengths from ", query_start_name,
                  " (q_len 0)");
  MJOLNIR_REQUIRE(query_start.size() == num_seqs + 1, query_start_name, ": ", query_start.size(),
                  " entries, expected num_seqs + 1 = ", num_seqs + 1);
  MJOLNIR_REQUIRE(query_start[0] == 0, query_start_name, "[0]: ", query_start[0], ", expected 0");
  for (std::size_t b = 0; b < num_seqs; ++b) {
    MJOLNIR_REQUIRE(query_start[b + 1] >= query_start[b], query_start_name, "[", b + 1,
                    "]: ", query_start[b + 1], " is less than ", query_start_name, "[", b, "] ",
                    query_start[b], " (it must not decrease)");
  }
}

namespace {

int ceil_div(std::int64_t a, std::int64_t b) { return static_cast<int>((a + b - 1) / b); }

void check_step(const StepShape& step, const PlanOptions& options) {
  const int num_seqs = step.num_seqs();
  const bool ragged = !step.query_start.empty();
  check_query_tokens(step.q_len, step.query_start, step.seq_lens.size());
  MJOLNIR_REQUIRE(step.num_kv_heads >= 1, "num_kv_heads: ", step.num_kv_heads,
                  " must be at least 1");
  MJOLNIR_REQUIRE(options.workers >= 1, "plan options.workers: ", options.workers,
                  " must be at least 1");
  MJOLNIR_REQUIRE(options.wave_workers >= 0, "plan options.wave_workers: ", options.wave_workers,
                  " is negative (0: workers)");
  MJOLNIR_REQUIRE(options.tile_tokens >= 1 && options.tile_tokens <= 1024,
                  "plan options.tile_tokens: ", options.tile_tokens, " is outside [1, 1024]");
  MJOLNIR_REQUIRE(options.max_splits >= 0, "plan options.max_splits: ", options.max_splits,
                  " is negative (0: as many chunks as fill the workers)");
  MJOLNIR_REQUIRE(options.fixed_splits >= 0, "plan options.fixed_splits: ", options.fixed_splits,
                  " is negative");
  MJOLNIR_REQUIRE(options.heads_together_min_tokens >= 0,
                  "plan options.heads_together_min_tokens: ", options.heads_together_min_tokens,
                  " is negative (0: the backend runs KV heads apart)");
  MJOLNIR_REQUIRE(options.min_chunk_tokens >= 1,
                  "plan options.min_chunk_tokens: ", options.min_chunk_tokens,
                  " must be at least 1");
  for (int b = 0; b < num_seqs; ++b) {
    MJOLNIR_REQUIRE(step.seq_lens[b] >= 0, "seq_lens[", b, "]: ", step.seq_lens[b], " is negative");
    MJOLNIR_REQUIRE(!ragged || step.query_len(b) <= step.seq_lens[b], "query_start: sequence ", b,
                    " has ", step.query_len(b), " query tokens but seq_lens[", b, "] is ",
                    step.seq_lens[b], " (its query tokens are in the cache)");
  }
}

// Calls f(tile) for the step's query tiles in order: one per sequence in a decode step, the
// sequence's query tokens kQueryTileTokens at a time in a ragged one.
template <class F>
void for_each_query_tile(const StepShape& step, F&& f) {
  const bool ragged = !step.query_start.empty();
  for (int b = 0; b < step.num_seqs(); ++b) {
    const int len = step.seq_lens[b];
    const int queries = step.query_len(b);
    const int count = ragged ? ceil_div(queries, kQueryTileTokens) : 1;
    for (int i = 0; i < count; ++i) {
      const int q_begin = i * kQueryTileTokens;
      const int q_count = ragged ? std::min(kQueryTileTokens, queries - q_begin) : queries;
      f(QueryTile{b, q_begin, q_count, step.causal ? len - queries + q_begin + q_count : len});
    }
  }
}

// How make_plan cuts each query tile's KV tokens into chunks: whole tiles of T tokens, about
// one wave of `workers` in all. The split heuristic lives here only, and every backend plans
// through it.
class ChunkCut {
 public:
  ChunkCut(const StepShape& step, const PlanOptions& options, int max_splits)
      : options_(options), max_splits_(max_splits) {
    std::int64_t kv_tokens = 0;  // what every query tile sees, summed
    for_each_query_tile(step, [&](const QueryTile& qt) { kv_tokens += qt.kv_len; });
    // Work that runs apart: every KV head's tokens, or only the chunks' where a backend runs
    // a chunk's heads together.
    const bool heads_together = options.heads_together_min_tokens > 0;
    const std::int64_t work = kv_tokens * (heads_together ? 1 : step.num_kv_heads);
    const std::int64_t per_worker = (work + options.workers - 1) / options.workers;
    const std::int64_t chunk = std::max<std::int64_t>(
        {per_worker, options.min_chunk_tokens, options.heads_together_min_tokens});
    wave_chunk_ = (chunk + options.tile_tokens - 1) / options.tile_tokens * options.tile_tokens;
  }
  // Chunks of a query tile that sees kv_len tokens; never more than its KV tiles, so no chunk
  // is empty.
  int splits(int kv_len) const {
    const int kv_tiles = ceil_div(kv_len, options_.tile_tokens);
    int splits = options_.fixed_splits > 0 ? options_.fixed_splits : ceil_div(kv_len, wave_chunk_);
    splits = std::clamp(std::min(splits, kv_tiles), 1, max_splits_);
    return kv_tiles > 0 ? ceil_div(kv_tiles, tiles_per_chunk(kv_len, splits)) : splits;
  }
  int tiles_per_chunk(int kv_len, int splits) const {
    return ceil_div(ceil_div(kv_len, options_.tile_tokens), splits);
  }

 private:
  const PlanOptions& options_;
  int max_splits_;
  std::int64_t wave_chunk_ = 0;
};

}  // namespace

int query_tiles_needed(std::span<const std::int32_t> query_start) {
  MJOLNIR_REQUIRE(!query_start.empty(), "query_start: is empty, expected num_seqs + 1 entries");
  check_query_tokens(0, query_start, query_start.size() - 1);
  std::int64_t tiles = 0;
  for (std::size_t b = 0; b + 1 < query_start.size(); ++b) {
    tiles += ceil_div(query_start[b + 1] - query_start[b], kQueryTileTokens);
  }
  return static_cast<int>(tiles);
}

PlanCapacity capacity_for(const StepShape& step, const PlanOptions& options) {
  check_step(step, options);
  const int max_splits = effective_max_splits(options, step.num_seqs(), step.num_kv_heads);
  const ChunkCut cut(step, options, max_splits);
  int tiles = 0, most_splits = 1, partials = 0;
  for_each_query_tile(step, [&](const QueryTile& qt) {
    const int splits = cut.splits(qt.kv_len);
    ++tiles;
    most_splits = std::max(most_splits, splits);
    if (splits > 1) partials += splits;
  });
  return PlanCapacity{.max_seqs = step.num_seqs(),
                      .num_kv_heads = step.num_kv_heads,
                      .max_splits = most_splits,
                      .max_query_tiles = tiles,
                      .max_partials = partials};
}

void make_plan(Plan& plan, std::span<const std::int32_t> seq_lens, int q_len, int num_kv_heads,
               const PlanOptions& options) {
  make_plan(plan, StepShape{.seq_lens = seq_lens, .q_len = q_len, .num_kv_heads = num_kv_heads},
            options);
}

void make_plan(Plan& plan, const StepShape& step, const PlanOptions& options) {
  check_step(step, options);
  const int num_seqs = step.num_seqs();
  MJOLNIR_REQUIRE(num_seqs <= plan.capacity.max_seqs, "seq_lens: ", num_seqs,
                  " sequences exceed the plan's capacity of ", plan.capacity.max_seqs);
  MJOLNIR_REQUIRE(step.num_kv_heads == plan.capacity.num_kv_heads,
                  "num_kv_heads: ", step.num_kv_heads, " differs from the plan's capacity (",
                  plan.capacity.num_kv_heads, ")");
  const bool ragged = !step.query_start.empty();
  if (ragged) {
    const int needed = query_tiles_needed(step.query_start);
    MJOLNIR_REQUIRE(needed <= plan.capacity.query_tiles(), "query_start: the step needs ", needed,
                    " query tiles, more than the plan's capacity.max_query_tiles of ",
                    plan.capacity.query_tiles());
  }

  const int max_splits = std::min(effective_max_splits(options, num_seqs, step.num_kv_heads),
                                  plan.capacity.max_splits);
  const ChunkCut cut(step, options, max_splits);
  const int tile = options.tile_tokens;
  const int slots = plan.partial_slots();

  plan.tile_tokens = tile;
  plan.q_len = ragged ? kQueryTileTokens : step.q_len;
  plan.ragged = ragged;
  plan.num_seqs = num_seqs;
  int tiles = 0;
  int items = 0;
  int partials = 0;
  for_each_query_tile(step, [&](const QueryTile& qt) {
    const int len = qt.kv_len;
    const int splits = cut.splits(len);
    const int tiles_per_chunk = cut.tiles_per_chunk(len, splits);
    MJOLNIR_REQUIRE(splits == 1 || partials + splits <= slots,
                    "plan capacity.max_partials: ", slots,
                    " partial slots are fewer than this step's split chunks need");
    const int i = tiles++;
    plan.query_tiles[i] = qt;
    plan.num_splits[i] = splits;
    plan.first_partial[i] = splits > 1 ? partials : -1;
    // In 64 bits: a chunk's rounded-up end may pass INT32_MAX for a sequence near it.
    const std::int64_t chunk_tokens = std::int64_t(tiles_per_chunk) * tile;
    for (int s = 0; s < splits; ++s) {
      const int begin = static_cast<int>(std::min<std::int64_t>(len, s * chunk_tokens));
      const int end = static_cast<int>(std::min<std::int64_t>(len, (s + 1) * chunk_tokens));
      for (int h = 0; h < step.num_kv_heads; ++h) {
        plan.items[items++] = WorkItem{.seq = qt.seq,
                                       .kv_head = h,
                                       .kv_begin = begin,
                                       .kv_end = end,
                                       .split = s,
                                       .partial_slot = splits > 1 ? partials + s : -1,
                                       .q_begin = qt.q_begin,
                                       .q_count = qt.q_count,
                                       .tile = i};
      }
    }
    if (splits > 1) partials += splits;
  });
  plan.num_query_tiles = tiles;
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
  if (options.max_splits != 0) return options.max_splits;
  const int fill = max_splits_to_fill(options.workers, num_seqs, num_kv_heads);
  if (options.wave_workers <= 0) return fill;
  // A step of so few sequences that one wave of resident CTAs holds 16 chunks of each: cut it
  // into as many chunks as fit that wave. Larger steps plan several waves of `workers`.
  const std::int64_t pairs = std::int64_t(std::max(num_seqs, 1)) * num_kv_heads;
  const std::int64_t one_wave = options.wave_workers / pairs;
  return one_wave >= PlanOptions{}.max_splits ? int(std::min<std::int64_t>(one_wave, fill)) : fill;
}

}  // namespace mjolnir

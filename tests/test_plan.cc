// Plan invariants: every (sequence, KV head, token) covered exactly once, chunk bounds on tile
// multiples, splits capped, padding free, capacity enforced.
#include <gtest/gtest.h>

#include <array>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mjolnir/error.h"
#include "mjolnir/plan.h"
#include "test_seed.h"

namespace mjolnir {
namespace {

void expect_exact_cover(const Plan& plan, const std::vector<std::int32_t>& lens, int hk,
                        const PlanOptions& options) {
  std::vector<std::vector<int>> hits(lens.size() * hk);
  for (std::size_t b = 0; b < lens.size(); ++b) {
    for (int h = 0; h < hk; ++h) hits[b * hk + h].assign(lens[b], 0);
  }
  std::vector<int> items_per_seq_head(lens.size() * hk, 0);
  std::vector<int> slot_uses(plan.num_partials, 0);
  for (const WorkItem& item : plan.work()) {
    ASSERT_GE(item.seq, 0);
    ASSERT_LT(item.seq, int(lens.size()));
    ASSERT_GE(item.kv_head, 0);
    ASSERT_LT(item.kv_head, hk);
    ASSERT_LE(item.kv_begin, item.kv_end);
    ASSERT_LE(item.kv_end, lens[item.seq]);
    EXPECT_EQ(item.kv_begin % options.tile_tokens, 0) << "chunk starts off a tile boundary";
    const int splits = plan.num_splits[item.seq];
    EXPECT_GE(splits, 1);
    EXPECT_LE(splits, options.max_splits);
    EXPECT_LT(item.split, splits);
    if (splits == 1) {
      EXPECT_EQ(item.partial_slot, -1);
    } else {
      EXPECT_EQ(item.partial_slot, plan.first_partial[item.seq] + item.split);
      ASSERT_LT(item.partial_slot, plan.num_partials);
      ++slot_uses[item.partial_slot];
      EXPECT_LT(item.kv_begin, item.kv_end) << "a split chunk is empty";
    }
    ++items_per_seq_head[item.seq * hk + item.kv_head];
    for (int t = item.kv_begin; t < item.kv_end; ++t) ++hits[item.seq * hk + item.kv_head][t];
  }
  for (std::size_t b = 0; b < lens.size(); ++b) {
    for (int h = 0; h < hk; ++h) {
      EXPECT_EQ(items_per_seq_head[b * hk + h], plan.num_splits[b]) << "seq " << b << " head " << h;
      for (int t = 0; t < lens[b]; ++t) {
        ASSERT_EQ(hits[b * hk + h][t], 1) << "seq " << b << " head " << h << " token " << t;
      }
    }
  }
  for (int s = 0; s < plan.num_partials; ++s) EXPECT_EQ(slot_uses[s], hk) << "slot " << s;
}

TEST(Plan, CoversEveryTokenOnceOverRandomBatches) {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 300; ++trial) {
    const int num_seqs = 1 + rng() % 12;
    const int hk = 1 + rng() % 8;
    std::vector<std::int32_t> lens(num_seqs);
    for (auto& len : lens) len = rng() % 5 == 0 ? 0 : 1 + rng() % 5000;
    PlanOptions options;
    options.workers = 1 + rng() % 264;
    options.max_splits = 1 + rng() % 16;
    options.tile_tokens = 1 << (3 + rng() % 5);
    options.min_chunk_tokens = 1 + rng() % 512;
    options.fixed_splits = rng() % 3 == 0 ? 1 + rng() % 20 : 0;
    options.heads_together_min_tokens = rng() % 2 == 0 ? 0 : 1 + rng() % 2048;
    const int q_len = 1 + rng() % 8;
    Plan plan(PlanCapacity{num_seqs + int(rng() % 3), hk, 16});
    make_plan(plan, lens, q_len, hk, options);
    SCOPED_TRACE("trial " + std::to_string(trial));
    expect_exact_cover(plan, lens, hk, options);
    if (HasFatalFailure()) return;
  }
}

TEST(Plan, PaddingRequestsGetOneEmptyItemPerHead) {
  Plan plan(PlanCapacity{3, 2, 4});
  const std::vector<std::int32_t> lens{40, 0, 0};
  make_plan(plan, lens, 1, 2, PlanOptions{.workers = 2});
  int empty = 0;
  for (const WorkItem& item : plan.work()) {
    if (item.seq > 0) {
      EXPECT_EQ(item.kv_begin, 0);
      EXPECT_EQ(item.kv_end, 0);
      EXPECT_EQ(item.partial_slot, -1);
      ++empty;
    }
  }
  EXPECT_EQ(empty, 4);
}

TEST(Plan, SplitsOneLongSequenceToFillTheWorkers) {
  // Batch 1, one KV head, 8 workers: 8192 tokens should be cut into about 8 chunks.
  Plan plan(PlanCapacity{1, 1, 16});
  const std::vector<std::int32_t> lens{8192};
  make_plan(plan, lens, 1, 1, PlanOptions{.workers = 8, .max_splits = 16, .tile_tokens = 64});
  EXPECT_EQ(plan.num_splits[0], 8);
  EXPECT_EQ(plan.num_items, 8);
  EXPECT_EQ(plan.items[1].kv_begin, 1024);
  // Already one item per worker without splitting: nothing is split.
  Plan wide(PlanCapacity{8, 8, 16});
  const std::vector<std::int32_t> many(8, 8192);
  make_plan(wide, many, 1, 8, PlanOptions{.workers = 16, .max_splits = 16, .tile_tokens = 64});
  EXPECT_EQ(wide.num_partials, 0);
  EXPECT_EQ(wide.num_items, 64);
}

// A backend that runs a chunk's KV heads together (the CPU) counts only chunks as parallel
// work: one sequence is cut into a chunk per worker though its 8 KV heads alone would fill two,
// but not when it is at most heads_together_min_tokens long; a batch as long as the workers
// is not cut, and in a ragged batch only the long sequence is.
TEST(Plan, HeadsTogetherCutAFewSequencesIntoAChunkPerWorker) {
  const PlanOptions apart{.workers = 2, .max_splits = 16, .tile_tokens = 64};
  PlanOptions together = apart;
  together.heads_together_min_tokens = 1024;
  // Each sequence's chunks, as the token where each begins.
  const auto chunk_starts = [](const std::vector<std::int32_t>& lens, const PlanOptions& options) {
    Plan plan(PlanCapacity{int(lens.size()), 8, 16});
    make_plan(plan, lens, 1, 8, options);
    std::vector<std::vector<int>> starts(lens.size());
    for (const WorkItem& item : plan.work()) {
      if (item.kv_head == 0) starts[item.seq].push_back(item.kv_begin);
    }
    return starts;
  };
  using Starts = std::vector<std::vector<int>>;
  EXPECT_EQ(chunk_starts({32768}, apart), (Starts{{0}}));
  EXPECT_EQ(chunk_starts({32768}, together), (Starts{{0, 16384}}));
  EXPECT_EQ(chunk_starts({1024}, together), (Starts{{0}}));
  EXPECT_EQ(chunk_starts({1500}, together), (Starts{{0, 768}}));  // 24 tiles: 12 and 12
  EXPECT_EQ(chunk_starts({32768, 32768}, together), (Starts{{0}, {0}}));
  EXPECT_EQ(chunk_starts({32768, 256}, apart), (Starts{{0}, {0}}));
  EXPECT_EQ(chunk_starts({32768, 256}, together), (Starts{{0, 16384}, {0}}));
}

TEST(Plan, SplitsAreCapped) {
  Plan plan(PlanCapacity{1, 1, 4});
  const std::vector<std::int32_t> lens{100000};
  make_plan(plan, lens, 1, 1, PlanOptions{.workers = 132, .max_splits = 64});
  EXPECT_EQ(plan.num_splits[0], 4);
}

// Found by tests/fuzz/decode_step: a chunk's rounded-up end overflowed int for a sequence near
// INT32_MAX tokens (UBSan: signed integer overflow). The chunks still cover it, on tile bounds.
TEST(Plan, ChunksOfASequenceNearInt32MaxDoNotOverflow) {
  constexpr std::int32_t kLen = std::numeric_limits<std::int32_t>::max() - 5;
  Plan plan(PlanCapacity{1, 1, 3});
  const std::vector<std::int32_t> lens{kLen};
  make_plan(plan, lens, 1, 1, PlanOptions{.max_splits = 3, .tile_tokens = 64, .fixed_splits = 3});
  ASSERT_EQ(plan.num_items, 3);
  std::int64_t covered = 0;
  for (const WorkItem& item : plan.work()) {
    EXPECT_EQ(item.kv_begin, covered);
    EXPECT_EQ(item.kv_begin % 64, 0);
    EXPECT_LT(item.kv_begin, item.kv_end);
    covered = item.kv_end;
  }
  EXPECT_EQ(covered, kLen);
}

// The cap that lets one long sequence fill a GPU: 132 SMs x 8 planned CTAs (an H200) over 8 KV
// heads want 132 chunks; the default 16 would leave most SMs idle. Batches that fill the device
// on their own, and CPUs, keep the default.
TEST(Plan, MaxSplitsToFillOneWave) {
  EXPECT_EQ(max_splits_to_fill(132 * 8, 1, 8), 132);
  EXPECT_EQ(max_splits_to_fill(132 * 8, 4, 8), 33);
  EXPECT_EQ(max_splits_to_fill(132 * 8, 16, 8), 16);
  EXPECT_EQ(max_splits_to_fill(132 * 8, 64, 8), 16);
  EXPECT_EQ(max_splits_to_fill(2, 1, 8), 16);
  EXPECT_EQ(max_splits_to_fill(132 * 8, 0, 8), 132);  // an empty batch plans like one sequence

  const int workers = 132 * 8, hk = 8;
  const std::vector<std::int32_t> lens{32768};
  PlanOptions options;
  options.workers = workers;
  options.max_splits = max_splits_to_fill(workers, 1, hk);
  Plan plan(PlanCapacity{1, hk, options.max_splits});
  make_plan(plan, lens, 1, hk, options);
  expect_exact_cover(plan, lens, hk, options);
  // min_chunk_tokens (256) stops it at 128 chunks: 1024 CTAs, against 128 with the default cap.
  EXPECT_EQ(plan.num_splits[0], 128);
  EXPECT_EQ(plan.num_items, 1024);

  // PlanOptions::max_splits 0 asks make_plan for the same, within the plan's capacity.
  PlanOptions fill = options;
  fill.max_splits = 0;
  make_plan(plan, lens, 1, hk, fill);
  EXPECT_EQ(plan.num_splits[0], 128);
  Plan small(PlanCapacity{1, hk, 16});
  make_plan(small, lens, 1, hk, fill);
  EXPECT_EQ(small.num_splits[0], 16);
  EXPECT_EQ(effective_max_splits(fill, 1, hk), 132);
  EXPECT_EQ(effective_max_splits(options, 64, hk), 132);  // a cap that was given stays
  fill.max_splits = -1;
  EXPECT_THROW(make_plan(plan, lens, 1, hk, fill), Error);

  EXPECT_THROW(max_splits_to_fill(0, 1, 8), Error);
  EXPECT_THROW(max_splits_to_fill(8, -1, 8), Error);
  EXPECT_THROW(max_splits_to_fill(8, 1, 0), Error);
}

// A GPU's resident CTAs (wave_workers, 132 SMs x 3 on an H200) bound the chunks of a step of
// one to three sequences: they fit one wave (a second, partial wave cost as much as the first
// there); larger steps keep the fill rule of `workers`, which plans several waves.
TEST(Plan, WaveWorkersFitFewSequencesInOneWave) {
  const int hk = 8;
  PlanOptions options;
  options.workers = 132 * 8;
  options.wave_workers = 132 * 3;
  options.max_splits = 0;
  EXPECT_EQ(effective_max_splits(options, 1, hk), 49);  // floor(396 / 8)
  EXPECT_EQ(effective_max_splits(options, 2, hk), 24);
  EXPECT_EQ(effective_max_splits(options, 3, hk), 16);
  EXPECT_EQ(effective_max_splits(options, 4, hk), 33);  // 12 < 16: the fill rule, ceil(1056 / 32)
  EXPECT_EQ(effective_max_splits(options, 64, hk), 16);
  EXPECT_EQ(effective_max_splits(options, 0, hk), 49);  // an empty batch plans like one sequence
  PlanOptions no_wave = options;
  no_wave.wave_workers = 0;
  EXPECT_EQ(effective_max_splits(no_wave, 1, hk), 132);
  options.max_splits = 40;
  EXPECT_EQ(effective_max_splits(options, 1, hk), 40);  // a cap that was given stays
  options.max_splits = 0;

  const std::vector<std::int32_t> lens{32768};
  const StepShape shape{.seq_lens = lens, .q_len = 1, .num_kv_heads = hk};
  Plan plan(capacity_for(shape, options));
  make_plan(plan, shape, options);
  PlanOptions resolved = options;
  resolved.max_splits = effective_max_splits(options, 1, hk);
  expect_exact_cover(plan, lens, hk, resolved);
  EXPECT_LE(plan.num_items, options.wave_workers);
  EXPECT_GE(plan.num_items, options.wave_workers * 9 / 10);

  options.wave_workers = -1;
  EXPECT_THROW(make_plan(plan, shape, options), Error);
}

// A ragged step (prefill, chunked prefill and decodes in one batch): every query token of
// every sequence is in exactly one query tile of at most kQueryTileTokens tokens, in order, and
// each tile's items cover, once per KV head, exactly the KV tokens its last query token may see.
TEST(Plan, RaggedStepsCoverEveryQueryTokenAndWhatItSees) {
  std::mt19937_64 rng(testing::test_seed() + 11);
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int num_seqs = 1 + rng() % 6;
    const int hk = 1 + rng() % 4;
    const bool causal = rng() % 4 != 0;
    std::vector<std::int32_t> lens(num_seqs), query_start{0};
    for (auto& len : lens) {
      len = rng() % 6 == 0 ? 0 : 1 + rng() % 700;
      const int queries = len == 0 ? 0 : std::array{1, len, int(1 + rng() % len)}[rng() % 3];
      query_start.push_back(query_start.back() + queries);
    }
    PlanOptions options;
    options.workers = 1 + rng() % 64;
    options.max_splits = 1 + rng() % 8;
    options.tile_tokens = 1 << (3 + rng() % 4);
    options.min_chunk_tokens = 1 + rng() % 128;
    const StepShape step{lens, query_start, 0, hk, causal};
    const PlanCapacity exact = capacity_for(step, options);
    EXPECT_EQ(exact.max_query_tiles, query_tiles_needed(query_start));
    Plan plan(exact);
    make_plan(plan, step, options);
    EXPECT_TRUE(plan.ragged);
    EXPECT_EQ(plan.q_len, kQueryTileTokens);
    EXPECT_EQ(plan.num_query_tiles, exact.max_query_tiles);
    EXPECT_EQ(plan.num_partials, exact.max_partials) << "capacity_for is not the plan's own";

    std::vector<int> seen_queries(num_seqs, 0);
    for (int i = 0; i < plan.num_query_tiles; ++i) {
      const QueryTile& qt = plan.query_tiles[i];
      ASSERT_GE(qt.seq, 0);
      ASSERT_LT(qt.seq, num_seqs);
      EXPECT_EQ(qt.q_begin, seen_queries[qt.seq]) << "tile " << i << " out of order";
      EXPECT_GE(qt.q_count, 1);
      EXPECT_LE(qt.q_count, kQueryTileTokens);
      seen_queries[qt.seq] += qt.q_count;
      const int queries = query_start[qt.seq + 1] - query_start[qt.seq];
      // What the tile's last query token sees: the cache up to and including itself.
      EXPECT_EQ(qt.kv_len,
                causal ? lens[qt.seq] - queries + qt.q_begin + qt.q_count : lens[qt.seq]);
      std::vector<std::vector<int>> hits(hk, std::vector<int>(qt.kv_len, 0));
      for (const WorkItem& item : plan.work()) {
        if (item.tile != i) continue;
        EXPECT_EQ(item.seq, qt.seq);
        EXPECT_EQ(item.q_begin, qt.q_begin);
        EXPECT_EQ(item.q_count, qt.q_count);
        ASSERT_LE(item.kv_end, qt.kv_len);
        EXPECT_EQ(item.kv_begin % options.tile_tokens, 0);
        EXPECT_LT(item.split, plan.num_splits[i]);
        if (plan.num_splits[i] > 1) {
          EXPECT_EQ(item.partial_slot, plan.first_partial[i] + item.split);
          EXPECT_LT(item.partial_slot, plan.partial_slots());
        } else {
          EXPECT_EQ(item.partial_slot, -1);
        }
        for (int t = item.kv_begin; t < item.kv_end; ++t) ++hits[item.kv_head][t];
      }
      for (int h = 0; h < hk; ++h) {
        for (int t = 0; t < qt.kv_len; ++t)
          ASSERT_EQ(hits[h][t], 1) << "tile " << i << " head " << h;
      }
    }
    for (int b = 0; b < num_seqs; ++b) {
      EXPECT_EQ(seen_queries[b], query_start[b + 1] - query_start[b]) << "sequence " << b;
    }
    if (HasFatalFailure()) return;
  }
}

// A 6000-token prompt on two threads: 188 tiles of 32 query tokens (the last of 16), none split,
// and a capacity that reserves no partial slots (a default one would hold 188 x 16 of them).
TEST(Plan, APromptIsCutIntoQueryTilesWithoutSplits) {
  const std::vector<std::int32_t> lens{6000}, query_start{0, 6000};
  const StepShape step{lens, query_start, 0, 8, true};
  const PlanOptions options{.workers = 2};
  const PlanCapacity capacity = capacity_for(step, options);
  static_assert(kQueryTileTokens == 32, "the numbers below are for tiles of 32 tokens");
  EXPECT_EQ(capacity.max_query_tiles, 188);
  EXPECT_EQ(capacity.max_splits, 1);
  EXPECT_EQ(capacity.partial_slots(), 0);
  Plan plan(capacity);
  make_plan(plan, step, options);
  EXPECT_EQ(plan.num_items, 188 * 8);
  EXPECT_EQ(plan.query_tiles[0].kv_len, 32);
  EXPECT_EQ(plan.query_tiles[186].kv_len, 5984);
  EXPECT_EQ(plan.query_tiles[187].q_count, 16);
  EXPECT_EQ(plan.query_tiles[187].kv_len, 6000);
}

TEST(Plan, RejectsABadQueryStart) {
  const std::vector<std::int32_t> lens{10, 10};
  const auto rejects = [&](std::vector<std::int32_t> query_start, int q_len,
                           const std::string& names) {
    const StepShape step{lens, query_start, q_len, 2, true};
    try {
      Plan plan(PlanCapacity{2, 2, 4, 8});
      make_plan(plan, step, {});
      ADD_FAILURE() << "no error; expected one naming " << names;
    } catch (const Error& e) {
      EXPECT_TRUE(std::string(e.what()).starts_with(names)) << e.what();
    }
  };
  rejects({0, 3}, 0, "query_start:");        // one entry short
  rejects({1, 3, 5}, 0, "query_start[0]:");  // not from 0
  rejects({0, 4, 2}, 0, "query_start[2]:");  // decreasing
  rejects({0, 11, 12}, 0, "query_start:");   // more query tokens than the sequence holds
  rejects({0, 3, 5}, 2, "q_len:");           // a ragged step has q_len 0
  Plan small(PlanCapacity{2, 2, 4, 1});      // room for one query tile, the step needs 3
  const std::vector<std::int32_t> query_start{0, 9, 10};
  EXPECT_THROW(make_plan(small, StepShape{lens, query_start, 0, 2, true}, {}), Error);
  EXPECT_THROW(query_tiles_needed({}), Error);
}

TEST(Plan, RejectsWhatDoesNotFit) {
  Plan plan(PlanCapacity{2, 4, 4});
  const std::vector<std::int32_t> three{10, 10, 10};
  EXPECT_THROW(make_plan(plan, three, 1, 4, {}), Error);
  const std::vector<std::int32_t> two{10, 10};
  EXPECT_THROW(make_plan(plan, two, 1, 8, {}), Error);
  EXPECT_THROW(make_plan(plan, two, 0, 4, {}), Error);
  EXPECT_THROW(make_plan(plan, two, 9, 4, {}), Error);
  const std::vector<std::int32_t> negative{10, -1};
  try {
    make_plan(plan, negative, 1, 4, {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("seq_lens[1]"), std::string::npos) << e.what();
  }
  try {
    make_plan(plan, two, 1, 4, PlanOptions{.heads_together_min_tokens = -1});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("heads_together_min_tokens"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace mjolnir

// Grouping plan items into CPU work units (see work_units.h).
#include "cpu/work_units.h"

#include <algorithm>
#include <cstdint>

namespace mjolnir::cpu {

namespace {

bool same_chunk(const WorkItem& a, const WorkItem& b) {
  return a.tile == b.tile && a.kv_begin == b.kv_begin && a.kv_end == b.kv_end && a.split == b.split;
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace

int max_part_slots(int threads) { return 2 * threads; }

void make_units(const Plan& plan, int threads, bool may_cut_tokens, UnitSchedule& schedule) {
  schedule.units.clear();
  schedule.merges.clear();
  schedule.merge_tasks.clear();
  schedule.part_slots = 0;

  // Chunks: runs of consecutive items with the same sequence, range and split.
  std::vector<WorkUnit>& units = schedule.units;
  for (int i = 0; i < plan.num_items; ++i) {
    const WorkItem& item = plan.items[i];
    if (!units.empty() && same_chunk(plan.items[units.back().first_item], item)) {
      ++units.back().heads;
      continue;
    }
    units.push_back(WorkUnit{i, 1, item.kv_begin, item.kv_end, -1});
  }
  const int chunks = static_cast<int>(units.size());
  if (chunks == 0 || threads <= 1) return;

  int max_heads = 1, max_tokens = 0;
  for (const WorkUnit& u : units) {
    max_heads = std::max(max_heads, u.heads);
    max_tokens = std::max(max_tokens, u.kv_end - u.kv_begin);
  }
  // Short chunks go to groups of heads even where their tokens may be cut (see
  // kHeadGroupMaxTokens), when the heads are enough to give every thread work; chunks shorter
  // than a tile stay whole, as a tile cannot be cut into token parts either.
  const bool short_chunks_in_head_groups = max_tokens >= plan.tile_tokens &&
                                           max_tokens <= kHeadGroupMaxTokens &&
                                           chunks * max_heads >= threads;
  if (chunks < threads && may_cut_tokens && !short_chunks_in_head_groups) {
    // Fewer chunks than threads (batch 1, short batches): cut each chunk's tokens into whole
    // tiles, ceil(threads / chunks) parts, so every thread streams whole pages of its own.
    const int parts = ceil_div(threads, chunks);
    const int tile = plan.tile_tokens;
    std::vector<WorkUnit> cut;
    for (const WorkUnit& chunk : units) {
      const int tiles = ceil_div(chunk.kv_end - chunk.kv_begin, tile);
      const int p = std::min({parts, tiles, kMaxParts});
      if (p <= 1) {
        cut.push_back(chunk);
        continue;
      }
      schedule.merges.push_back(PartMerge{chunk.first_item, chunk.heads, schedule.part_slots, p});
      for (int k = 0; k < p; ++k) {
        const int b = chunk.kv_begin + tiles * k / p * tile;
        const int e = std::min(chunk.kv_end, chunk.kv_begin + tiles * (k + 1) / p * tile);
        cut.push_back(WorkUnit{chunk.first_item, chunk.heads, b, e, schedule.part_slots++});
      }
    }
    units.swap(cut);
    for (int m = 0; m < int(schedule.merges.size()); ++m) {
      for (int h = 0; h < schedule.merges[m].heads; ++h) schedule.merge_tasks.emplace_back(m, h);
    }
    return;
  }

  // Enough chunks, short ones, or P codes that must follow the plan's tiles: cut chunks into
  // groups of heads only as far as needed for even shares (every thread busy to the end).
  const auto balanced = [&](int p) {
    const std::int64_t n = std::int64_t(chunks) * p;
    return n >= threads && (n % threads == 0 || n >= 4 * threads);
  };
  int parts = 1;
  while (parts < max_heads && !balanced(parts)) ++parts;
  if (parts == 1) return;
  std::vector<WorkUnit> cut;
  for (const WorkUnit& chunk : units) {
    const int p = std::min(parts, chunk.heads);
    for (int k = 0; k < p; ++k) {
      const int h0 = chunk.heads * k / p, h1 = chunk.heads * (k + 1) / p;
      cut.push_back(WorkUnit{chunk.first_item + h0, h1 - h0, chunk.kv_begin, chunk.kv_end, -1});
    }
  }
  units.swap(cut);
}

void prepare_cpu_plan(const Plan& plan, int threads, CpuPlan& out) {
  out.threads = threads;
  make_units(plan, threads, /*may_cut_tokens=*/true, out.token_parts);
  make_units(plan, threads, /*may_cut_tokens=*/false, out.plan_tiles);
  out.tile_merges.clear();
  for (int i = 0; i < plan.num_query_tiles; ++i) {
    if (plan.num_splits[i] > 1) {
      for (int h = 0; h < plan.capacity.num_kv_heads; ++h) out.tile_merges.emplace_back(i, h);
    }
  }
}

}  // namespace mjolnir::cpu

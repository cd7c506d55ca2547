// How the CPU backend runs a plan: its work items grouped into units for the thread pool.
//
// The plan cuts a step into items of one KV head each (docs/design.md section 5). On the CPU the
// items of all KV heads of one chunk (same sequence, token range and split) run as one unit,
// tile by tile, so each tile reads whole pages of the cache: contiguous memory in every layout,
// which streams at the machine's read bandwidth, where one head's rows alone are scattered at
// the token stride and stream at half of it or less. The backend plans with
// PlanOptions::heads_together_min_tokens = kHeadGroupMaxTokens, so a step of fewer sequences than
// threads comes already cut into about a chunk per thread. A chunk is cut into smaller units only
// where that leaves a thread idle (short sequences, a plan of capped splits): into token parts
// when P is fp32 (their results merge by LSE, exact up to fp32 rounding, as the contract allows)
// unless the chunk is short (kHeadGroupMaxTokens), otherwise into groups of heads (bit-identical P
// codes need the plan's own tiles and split points).
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "mjolnir/decode.h"
#include "mjolnir/plan.h"

namespace mjolnir::cpu {

struct WorkUnit {
  int first_item = 0;  // plan.items[first_item, first_item + heads)
  int heads = 0;
  int kv_begin = 0;  // token range: the items' own, or one part of it
  int kv_end = 0;
  int part_slot = -1;  // -1: writes the items' outputs; else this unit's part slot
};

// A chunk cut into token parts: parts [first_slot, first_slot + parts) merge into the outputs of
// plan.items[first_item, first_item + heads).
struct PartMerge {
  int first_item = 0;
  int heads = 0;
  int first_slot = 0;
  int parts = 0;
};

struct UnitSchedule {
  std::vector<WorkUnit> units;
  std::vector<PartMerge> merges;
  // The merges' tasks, one per (merge, KV head of it).
  std::vector<std::pair<int, int>> merge_tasks;
  int part_slots = 0;
};

// The CPU backend's form of a step's plan (BackendPlan::Prepared), made once per step by
// Backend::plan() and read by every run() of the step: the units for either kind of P mode and
// the merges of the plan's split query tiles. A run() picks its units by its P mode, so a step
// planned once serves layers whose modes differ (the Python ops' "auto" modes are per layer).
struct CpuPlan final : BackendPlan::Prepared {
  int threads = 0;           // the workers the units were cut for
  UnitSchedule token_parts;  // P in fp32: chunks may be cut into token parts
  UnitSchedule plan_tiles;   // P in bf16 or fp8: the plan's own tiles and split points
  // (query tile, KV head) of every split query tile, whose chunks merge after the units.
  std::vector<std::pair<int, int>> tile_merges;

  const UnitSchedule& units_for(PMode p_mode) const {
    return p_mode == PMode::fp32 ? token_parts : plan_tiles;
  }
};

// Most token parts one chunk is cut into.
inline constexpr int kMaxParts = 64;

// Chunks of one tile (Plan::tile_tokens) to this many tokens are cut into groups of heads, not
// token parts, even where P is fp32, when the heads give every thread work; a chunk shorter than
// a tile stays one unit (a 16-token call after a matmul took 1.06-1.13x as long on two threads
// as on one: waking the second costs more than its share). At short contexts a token part's fixed
// costs weigh: every part prepares the queries of all the chunk's heads, keeps all their state, and
// its results go through a merge. On torch's threads (the vLLM plugin; Emerald Rapids, 2
// threads, Hq 32, Hk 8, D 128, BHN2D, 9 interleaved rounds) head groups took 0.73x the time of
// token parts at 128 tokens, 0.78-0.87x at 256, 0.85-0.93x at 512, 0.87-0.97x at 1024 (bf16 and
// nvfp4 caches); on mjolnir's own pool they were within the noise up to 4096 tokens, and
// 5-10% slower from 32k tokens in B2NHD, where a head group's rows are scattered.
inline constexpr int kHeadGroupMaxTokens = 1024;

// Units for `plan` on `threads` threads; token parts only when `may_cut_tokens`.
void make_units(const Plan& plan, int threads, bool may_cut_tokens, UnitSchedule& schedule);

// Everything the CPU backend runs `plan` with on `threads` threads, into `out` (its buffers
// reused).
void prepare_cpu_plan(const Plan& plan, int threads, CpuPlan& out);

// Most part slots make_units uses with `threads` threads (it cuts tokens only when a step has
// fewer chunks than threads), so workspaces can be sized up front.
int max_part_slots(int threads);

}  // namespace mjolnir::cpu

// One work item of decode attention on the CPU: the q_len * g query rows of a (sequence,
// KV head) against a token range, each KV tile decoded once for all rows.
#pragma once

#include <span>
#include <vector>

#include "mjolnir/decode.h"

namespace mjolnir::cpu {

// Per-thread buffers, sized on first use and reused across items.
struct ItemScratch {
  std::vector<float> q;                    // [rows, D] prepared Q
  std::vector<float> k_tile;               // [T, D] decoded K
  std::vector<float> v_tile;               // [T, D] decoded V
  std::vector<float> scores;               // [rows, T]
  std::vector<float> m, l;                 // [rows] running max (log2 units) and sum
  std::vector<float> acc;                  // [rows, D]
  std::vector<float> o;                    // [rows, D] normalized output of the item
  std::vector<float> lse;                  // [rows]
  std::vector<char> q_poisoned, poisoned;  // [rows] non-finite q; non-finite q or K seen
};

// Runs `item` and leaves its normalized O [rows, D] and LSE [rows] in scratch.o / scratch.lse
// (NaN rows where the non-finite policy says, core/non_finite.h).
void run_attention_item(const DecodeArgs& args, const Plan& plan, const WorkItem& item,
                        ItemScratch& scratch);

}  // namespace mjolnir::cpu

// The emulator: the numerics contract (docs/design.md section 4) in plain scalar code, following
// the same plan a kernel ran, so every rounding step (Q codes, P codes) is reproduced exactly and
// only the order of fp32 accumulation may differ from a backend. It is the oracle backends are
// tested against; it is written for clarity, not speed.
#pragma once

#include <span>
#include <vector>

#include "mjolnir/decode.h"

namespace mjolnir::reference {

// Q of one work item's query rows (a query tile of one KV head) as the QK product consumes it.
struct PreparedQuery {
  std::vector<float> values;  // [rows = q_count * g, D]: fp32, bf16-rounded or e4m3 codes
  float score_scale = 0;      // multiplies q . decode(k): sq * k_scale * softmax_scale * log2(e)
  // Rows whose q (times per-channel K scales) holds a NaN or an infinity: their values are zeros
  // here, so the fp8 scale and codes of the item's other rows are as if they were not there, and
  // run_item makes them NaN (core/non_finite.h).
  std::vector<char> poisoned;  // [rows]
};

// Step 1 and the scale of step 2 for the item's rows: per-channel K scales folded into Q, then
// Q rounded per mode (fp8: sq = amax / 448 over all rows of the item's query tile, codes
// e4m3(q / sq)).
PreparedQuery prepare_query(const DecodeArgs& args, const WorkItem& item);
// The same for all query tokens of sequence `seq` (a decode step's one query tile).
PreparedQuery prepare_query(const DecodeArgs& args, int seq, int kv_head);

// P as PV consumes it: fp32, bf16(p) or e4m3(p * 256) decoded.
float round_probability(float p, PMode mode);
// The factor folded into 1 / l for the P mode (256 for fp8, else 1).
float probability_scale(PMode mode);

// Steps 2-5 for one work item: online softmax over tiles of plan.tile_tokens starting at
// item.kv_begin. Writes normalized O (times V scales) and the natural-log LSE of every query
// row of the item to `o` [rows, D] and `lse` [rows]; rows that see no token get O = 0,
// LSE = -inf, and rows that meet a non-finite value O = LSE = NaN (core/non_finite.h).
void run_item(const DecodeArgs& args, const Plan& plan, const WorkItem& item,
              const PreparedQuery& query, std::span<float> o, std::span<float> lse);

// Step 6, the merge of a split query tile's chunks: merge_chunks (core/chunk_merge.h).

}  // namespace mjolnir::reference

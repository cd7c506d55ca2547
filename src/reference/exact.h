// The exact reference: attention in fp64 with no rounding but the KV values it is given. Fed the
// decoded cache (codes times scales) it measures a numerics mode's error; fed the original float
// K/V it measures the accuracy of the format and mode together.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "mjolnir/decode.h"

namespace mjolnir::reference {

// Writes the D values of K (kv = 0) or V (kv = 1) at `position` of (seq, kv_head), scales
// applied, into `out`.
using KvRowSource =
    std::function<void(int seq, int kv_head, int position, int kv, std::span<double> out)>;

// The decoded cache: decode(code) (times nvfp4 block scale) times the outer scale.
KvRowSource kv_rows_from_cache(const KvCacheView& cache, const PagedBatch& batch);

struct ExactResult {
  std::vector<double> o;    // [query rows (DecodeArgs::num_query_rows), Hq, D], dense
  std::vector<double> lse;  // [query rows, Hq], natural log; -inf for empty rows
};

// softmax(softmax_scale * q . k) . v over the positions each query token may see (the causal or
// non-causal mask of `args.params`). Reads q, batch and params from `args`; ignores modes.
ExactResult exact_attention(const DecodeArgs& args, const KvRowSource& kv_rows);

}  // namespace mjolnir::reference

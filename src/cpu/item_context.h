// The fixed quantities of one KV head's work item, shared by the pieces of the CPU kernel.
#pragma once

#include <cstddef>

#include "mjolnir/decode.h"

namespace mjolnir::cpu {

// Largest power of two folded into Q or P to bring raw decoded values back to a normal range
// (kv_decode-inl.h): big enough for every format, small enough that Q up to 2^25 and P up to 256
// stay finite.
inline constexpr int kMaxFoldExp = 100;

// The fixed quantities of one KV head's work item.
struct ItemContext {
  const DecodeArgs* args;
  const WorkItem* item;
  // q_len: the item's query tokens; seq_len: the KV tokens its last one sees (its query tile's
  // kv_len). Row r = t * g + j sees [0, seq_len - q_len + t] when causal, else [0, seq_len).
  int d, g, rows, q_len, tile, seq_len;
  bool causal;
  PMode p_mode;
  std::size_t row_bytes;
  // Floats between rows of kernel-ready Q and of the O accumulator: D plus a pad, so the four
  // rows a register block loads in one step do not share their address bits below 4 KiB
  // (loads that do conflict in L1 and run about 1.6x slower on Zen 3).
  std::size_t ld;
};

}  // namespace mjolnir::cpu

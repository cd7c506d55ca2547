// Cache writes: quantize new K/V tokens into their slots (docs/design.md section 3, "Cache write").
#pragma once

#include <cstdint>
#include <span>

#include "mjolnir/cache.h"
#include "mjolnir/rows.h"

namespace mjolnir {

// New tokens' K or V: [num_tokens, Hk, D], channels contiguous, element strides. bf16 rows (a
// bf16 model's K and V) widen to float32 exactly, so the cache bytes are those of their float32
// copy.
struct TokenRows {
  const void* data = nullptr;     // float, or bf16 bits (std::uint16_t) where type is bf16
  std::int64_t token_stride = 0;  // elements between tokens
  std::int64_t head_stride = 0;   // elements between heads
  RowType type = RowType::f32;    // bf16: the CPU backend's write_kv; the CUDA one takes f32
};

// Per-(KV head, channel) running max of |x| (before scaling), for calibration. Each span holds
// Hk * D floats; write_kv only raises entries.
struct AmaxRecorder {
  std::span<float> k_amax;
  std::span<float> v_amax;
};

// Quantizes token i of k and v into slot slot_mapping[i] = page * page_size + offset of `cache`
// (negative slots are skipped, as vLLM's reshape_and_cache_flash does). Everything is checked
// before any byte is written: slots inside the pool, the strides, and that every K/V value to be
// stored is finite ("k[5][2][17] is NaN"). Two tokens mapped to one slot: the later one wins,
// as in vLLM. With `amax`, records |x| maxima of the written tokens.
//
// Threads: writes the rows of the mapped slots and nothing else of the pool (distinct rows never
// share a byte), so calls that write distinct slots may run at once, and alongside decodes that
// do not read those rows. `amax` is raised without synchronization: one per concurrent call.
void write_kv(const KvCacheView& cache, const TokenRows& k, const TokenRows& v,
              std::span<const std::int64_t> slot_mapping, AmaxRecorder* amax = nullptr);

}  // namespace mjolnir

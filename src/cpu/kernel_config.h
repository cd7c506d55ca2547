// The CPU kernel's variants for one backend, and the work each of its paths ran.
//
// A backend resolves its CpuKernelOptions against what this CPU executes once, when it is made
// (cpu_backend.cc); the kernel, auto_modes and `mjolnir info` read the result, never the
// environment. Each backend counts the work items its paths ran, so a test can check which path
// a step took on the backend it made (kernel_path_counts in cpu_backend.h).
#pragma once

#include <cstdint>

#include "mjolnir/decode.h"

namespace mjolnir::cpu {

struct KernelConfig {
  bool bf16_dot = false;  // asked for, and the dispatched target and the CPU have them
  bool amx = false;       // asked for, with the dot products, and the CPU grants the tiles
  // Q . K on the dot products below the tiles' rows too (kAmxMinRows). Not where the tiles run:
  // on those cores (Intel's) a vdpbf16ps costs about four FMAs, and fp32 FMAs took 0.88-1.01 of
  // its time for steps of 4 query rows, 0.93 for bf16 (docs/cpu-experiments.md, "Variant
  // pairs").
  bool bf16_dot_below_tiles = false;
  // Decoders that never make an fp32 subnormal (word_decoders-inl.h, VisitKernelDecoder).
  bool avoid_fp32_subnormals = false;
  // The auto modes put P in bf16 from kDotValuesMinRows query rows where P . V then runs on the
  // dot products (no tiles here): on Zen 4 P in bf16 took 0.72-0.92x of P fp32's time resident,
  // 0.70-0.81x at 16 rows from memory and 0.78-0.97x for prompts (docs/cpu-experiments.md, "P .
  // V on bf16 dot products on Zen 4").
  bool bf16_dot_values = false;
  // Q . K in 16 x 16 blocks (16 query rows and more, no tiles) on fp32 FMAs over K widened once
  // per tile (ScoresFmaPairs) instead of the dot products (ScoresDotPairs): a vdpbf16ps costs
  // about four FMAs on Intel's cores and does the work of two.
  bool fma_pair_scores = false;
};

// Whether this CPU issues a vdpbf16ps at the rate of an fp32 FMA (AMD's cores: one a cycle on
// Zen 4, each with twice an FMA's multiply-adds), the default of CpuKernelOptions::bf16_dot_values.
// Intel's take about four FMAs' time for one (docs/cpu-experiments.md, "P . V on bf16 words at 4
// query rows").
bool bf16_dot_at_fma_rate();

// The variants of `options` this CPU runs.
KernelConfig resolve_kernel_config(const CpuKernelOptions& options);

// Work items (one KV head's rows against a token range) by the path they took.
struct KernelPathCounts {
  std::uint64_t bf16_dot = 0;     // Q . K on the bf16 dot products
  std::uint64_t amx_scores = 0;   // Q . K on AMX tiles
  std::uint64_t amx_values = 0;   // P . V on AMX tiles
  std::uint64_t dot_values = 0;   // P . V on the bf16 dot products
  std::uint64_t half_values = 0;  // P . V on fp16 FMAs
  std::uint64_t int8_dot = 0;     // Q . K in integers
  // Q . K in integers / P . V on FMAs over K / V rows decoded once per tile (units of many
  // query rows, kernel_paths-inl.h)
  std::uint64_t decoded_keys = 0;
  std::uint64_t decoded_values = 0;
  std::uint64_t pair_scores = 0;  // Q . K on the dot products in 16 x 16 blocks (ScoresDotPairs)
  std::uint64_t fma_pair_scores = 0;  // ... of which on fp32 FMAs (ScoresFmaPairs)

  KernelPathCounts& operator+=(const KernelPathCounts& other) {
    bf16_dot += other.bf16_dot;
    amx_scores += other.amx_scores;
    amx_values += other.amx_values;
    dot_values += other.dot_values;
    half_values += other.half_values;
    int8_dot += other.int8_dot;
    decoded_keys += other.decoded_keys;
    decoded_values += other.decoded_values;
    pair_scores += other.pair_scores;
    fma_pair_scores += other.fma_pair_scores;
    return *this;
  }
};

}  // namespace mjolnir::cpu

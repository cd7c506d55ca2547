// What the host hands the decode and merge kernels: the step buffer's layout on the device, the
// one parameter struct of the kernel family, and the shared-memory layout of a decode CTA. Plain
// structs, included by host code (the launch layer) and device code (the kernels) alike.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/minifloat.h"  // MJOLNIR_HOST_DEVICE
#include "mjolnir/format.h"
#include "mjolnir/plan.h"

namespace mjolnir::cuda {

// --- the step buffer: header | items[num_items] | seqs[num_seqs] | pages[...] -----------------
// Offsets are bytes from the start of the buffer; each region starts 16-byte aligned. Only the
// bytes in use are copied per step; the regions move with the counts, the header says where.
struct StepHeader {
  std::int32_t num_items = 0;
  std::int32_t num_seqs = 0;
  std::int32_t tile_tokens = 0;
  std::int32_t q_len = 0;
  std::int32_t items_offset = 0;  // WorkItem[num_items]
  std::int32_t seqs_offset = 0;   // SeqEntry[num_seqs]
  std::int32_t pages_offset = 0;  // int32 physical pages, each sequence's used pages in order
  std::int32_t reserved = 0;
};
inline constexpr std::size_t kStepHeaderBytes = 64;

struct SeqEntry {
  std::int32_t seq_len = 0;
  std::int32_t num_splits = 1;
  std::int32_t first_partial = -1;
  std::int32_t page_start = 0;  // index of its page 0 in the page list
};

MJOLNIR_HOST_DEVICE constexpr std::size_t align16(std::size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

// --- the decode kernel family's parameters ----------------------------------------------------
// One struct, passed whole by value. Shapes and pointers are fixed when a graph is captured;
// everything step-dependent is behind `step`.
struct DecodeKernelParams {
  // The pool (device), addressed by byte strides: row (page, head, token, kv).
  const std::uint8_t* pool = nullptr;
  std::int64_t page_stride = 0, head_stride = 0, token_stride = 0, kv_stride = 0;
  const float* k_scale = nullptr;  // device, per granularity
  const float* v_scale = nullptr;
  const std::uint8_t* step = nullptr;  // device step buffer (StepHeader first)
  // q [seqs * q_len, Hq, D] and o (same shape), element strides; lse [seqs * q_len, Hq] or null.
  const float* q = nullptr;
  std::int64_t q_token_stride = 0, q_head_stride = 0;
  float* o = nullptr;
  std::int64_t o_token_stride = 0, o_head_stride = 0;
  float* lse = nullptr;
  // Split partials (workspace), PartialLayout addressing.
  float* partial_o = nullptr;
  float* partial_lse = nullptr;
  float softmax_scale = 0;  // effective (1/sqrt(D) when 0 was given)
  int page_size = 0, page_shift = 0;
  int head_dim = 0, row_bytes = 0;
  int num_kv_heads = 0, num_q_heads = 0, group = 0, q_len = 0, rows = 0;  // rows = q_len * g
  int granularity = 0;                                                    // ScaleGranularity
  int causal = 1;
  int q_mode = 0;  // QMode
  int p_mode = 0;  // PMode
  // 1 where the emulator this build checks against fuses its Q . K multiply-adds (an aarch64
  // host: core/fused_dot.h); the exact-order body's scores then fuse too, so that P mode fp8's
  // codes are the emulator's.
  int fused_dot = 0;
  // Launch configuration, chosen by the host (decode_launch.cu).
  int pass_rows = 0;       // query rows a CTA holds at once; more rows take several passes
  int sub_tokens = 0;      // KV tokens staged and decoded at once (a multiple of 32)
  int score_stride = 0;    // floats per row of the score tile: the largest tile supported
  int raw_row_stride = 0;  // bytes per staged raw row (row_bytes rounded up to 16)
  int copy_bytes = 0;      // 16, 8, 4 (cp.async) or 1 (plain loads) per staged chunk
  int mma_layout = 0;      // MmaLayout of the tensor-core body (make_decode_config)
};

inline constexpr int kDecodeThreads = 256;
inline constexpr int kMergeThreads = 128;

// Shared memory of one decode CTA, byte offsets. Host and device compute it with this function,
// so the launch's dynamic size and the kernel's carving cannot drift.
struct DecodeSmem {
  std::size_t raw = 0;     // [2 stages][sub_tokens][raw_row_stride] bytes: staged rows
  std::size_t dec = 0;     // [sub_tokens][D + 1] floats: the decoded sub-tile (padded rows)
  std::size_t q = 0;       // [pass_rows][D] floats: prepared Q
  std::size_t acc = 0;     // [pass_rows][D] floats: O accumulators
  std::size_t scores = 0;  // [pass_rows][score_stride] floats: scores, then P, of one tile
  std::size_t m = 0, l = 0, alpha = 0;  // [pass_rows] floats each
  std::size_t poisoned = 0;             // [pass_rows] floats: 1 where the row is NaN
  std::size_t reduce = 0;               // [32] floats
  std::size_t bytes = 0;
};

MJOLNIR_HOST_DEVICE constexpr DecodeSmem decode_smem(int pass_rows, int head_dim, int sub_tokens,
                                                     int score_stride, int raw_row_stride) {
  DecodeSmem s;
  std::size_t at = 0;
  auto take = [&at](std::size_t bytes) {
    const std::size_t start = at;
    at += align16(bytes);
    return start;
  };
  s.raw = take(std::size_t(2) * sub_tokens * raw_row_stride);
  s.dec = take(std::size_t(sub_tokens) * (head_dim + 1) * sizeof(float));
  s.q = take(std::size_t(pass_rows) * head_dim * sizeof(float));
  s.acc = take(std::size_t(pass_rows) * head_dim * sizeof(float));
  s.scores = take(std::size_t(pass_rows) * score_stride * sizeof(float));
  s.m = take(std::size_t(pass_rows) * sizeof(float));
  s.l = take(std::size_t(pass_rows) * sizeof(float));
  s.alpha = take(std::size_t(pass_rows) * sizeof(float));
  s.poisoned = take(std::size_t(pass_rows) * sizeof(float));
  s.reduce = take(32 * sizeof(float));
  s.bytes = at;
  return s;
}

// --- the tensor-core CTA (decode_mma_kernel.cuh) ---------------------------------------------

inline constexpr int kMmaThreads = 128;    // four warps, each with its own softmax state
inline constexpr int kMmaRows = 16;        // query rows of the MMA's M dimension
inline constexpr int kMmaStepTokens = 16;  // KV tokens a warp takes per step
inline constexpr int kMmaMaxTerms = 3;     // operand terms of an fp32 value (bf16: 3, f16: 2)

// The (format, D) pairs the tensor-core body is instantiated for: every format (each converts
// exactly to an MMA operand in registers) at D 64, 128, 256, except fp6 at D 64 (a lane's V
// slice would be 6 bytes, not whole words).
MJOLNIR_HOST_DEVICE constexpr bool mma_shape(Format format, int head_dim) {
  const bool six_bit = format == Format::fp6_e2m3 || format == Format::fp6_e3m2;
  return head_dim == 128 || head_dim == 256 || (head_dim == 64 && !six_bit);
}

// The row alignment (bytes) the tensor-core body's loads need: nvfp4 and fp4 rows are read in
// 8-byte loads (nvfp4 rows of 72 bytes at D 128 are only 8-byte aligned), the others in 16.
MJOLNIR_HOST_DEVICE constexpr int mma_row_alignment(Format format) {
  return format == Format::fp4_e2m1 || format == Format::nvfp4 ? 8 : 16;
}

// How the tensor-core body lays a work item out on mma.sync m16n8k16 (decode_mma_kernel.cuh).
// With f16 operands (every format but bf16, whose three bf16 terms would not fit) and few query
// rows, the M rows that the plain layout leaves empty carry the second operand term instead:
enum class MmaLayout {
  plain,        // query rows on M (up to 16), tokens on N / K; one MMA per operand term
  stacked,      // <= 8 rows: row r's two terms on M rows r and r + 8 (consume_stacked_step)
  tokens_on_m,  // <= 4 rows: 16 tokens (QK) or channels (PV) on M, each row's two terms on N
};

MJOLNIR_HOST_DEVICE constexpr MmaLayout mma_layout(Format format, int rows) {
  if (format == Format::bf16 || rows > kMmaRows / 2) return MmaLayout::plain;
  return rows <= kMmaRows / 4 ? MmaLayout::tokens_on_m : MmaLayout::stacked;
}

// mma_layout(), or `limit` where that comes first in the order plain, stacked, tokens_on_m
// (every layout serves the rows of the ones after it).
MJOLNIR_HOST_DEVICE constexpr MmaLayout mma_layout(Format format, int rows, MmaLayout limit) {
  const MmaLayout best = mma_layout(format, rows);
  return static_cast<int>(limit) < static_cast<int>(best) ? limit : best;
}

// Shared memory of one tensor-core CTA, byte offsets. Q's prepared rows and fragments are read
// until the warps finish their walk; the merge buffers are written after it and alias them.
struct MmaSmem {
  std::size_t q_values = 0;    // [16][D] floats
  std::size_t q_frags = 0;     // [terms][D/16][32 lanes][4] words
  std::size_t merge_o = 0;     // [4 warps][16][D] floats
  std::size_t merge_m = 0;     // [4][16] floats
  std::size_t merge_l = 0;     // [4][16] floats
  std::size_t row_weight = 0;  // [4][16] floats
  std::size_t poisoned = 0;    // [16] floats: 1 where the row is NaN
  std::size_t reduce = 0;      // [32] floats
  std::size_t bytes = 0;
};

MJOLNIR_HOST_DEVICE constexpr MmaSmem mma_smem(int head_dim) {
  MmaSmem s;
  const std::size_t warps = kMmaThreads / 32;
  const std::size_t query_bytes =
      align16(std::size_t(kMmaRows) * head_dim * sizeof(float)) +
      align16(std::size_t(kMmaMaxTerms) * (head_dim / 16) * 32 * 4 * sizeof(std::uint32_t));
  const std::size_t merge_bytes = align16(warps * kMmaRows * head_dim * sizeof(float));
  s.q_values = 0;
  s.q_frags = align16(std::size_t(kMmaRows) * head_dim * sizeof(float));
  s.merge_o = 0;
  std::size_t at = query_bytes > merge_bytes ? query_bytes : merge_bytes;
  auto take = [&at](std::size_t bytes) {
    const std::size_t start = at;
    at += align16(bytes);
    return start;
  };
  s.merge_m = take(warps * kMmaRows * sizeof(float));
  s.merge_l = take(warps * kMmaRows * sizeof(float));
  s.row_weight = take(warps * kMmaRows * sizeof(float));
  s.poisoned = take(kMmaRows * sizeof(float));
  s.reduce = take(32 * sizeof(float));
  s.bytes = at;
  return s;
}

}  // namespace mjolnir::cuda

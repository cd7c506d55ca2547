// The decode launch configuration as plain host code: the kernel parameters and the shared
// memory a launch needs, from the step's arguments and the device's shared-memory limit. No CUDA
// headers, so the choice is testable without a device; decode_launch.cu launches what it returns.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/fused_dot.h"
#include "cuda/decode_params.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"

namespace mjolnir::cuda {

// What one launch covers, besides the arguments' pointers and shapes.
struct LaunchShape {
  int decode_ctas = 0;   // the grid: plan capacity (graphs) or the plan's item count
  int merge_ctas = 0;    // (sequence, KV head, query row) triples the merge grid covers
  int score_tokens = 0;  // largest tile the launch must hold (shared memory is sized by it)
  std::size_t partial_slots = 0;  // slots the workspace holds (PartialLayout)
};

// The grids of a launch that runs exactly `plan` (an eager call, enqueue_planned_decode): its
// items, one merge CTA per query row of its sequences, its own tile and partial slots. A
// captured graph launches its capacity's grids instead (enqueue_decode).
inline LaunchShape planned_launch_shape(const Plan& plan, int num_q_heads) {
  LaunchShape shape;
  shape.decode_ctas = plan.num_items;
  shape.merge_ctas = plan.num_seqs * plan.q_len * num_q_heads;
  shape.score_tokens = plan.tile_tokens;
  // The plan's own slots: capacity_for() reserves exactly the partials of the step's split
  // sequences, fewer than max_seqs x max_splits when some sequences are not split (the Python
  // ops failed on exactly that on an H200, 2026-12-04).
  shape.partial_slots = std::size_t(plan.partial_slots());
  return shape;
}

// Which CTA body runs the items (docs/cuda.md, "The kernels").
enum class DecodeBody {
  exact_order,  // decode_kernel.cuh: any shape and mode, the emulator's order of operations
  tensor_core,  // decode_mma_kernel.cuh: fp32 P, <= 16 query rows, D 64/128/256, aligned rows
};

struct DecodeConfig {
  DecodeKernelParams params;
  DecodeBody body = DecodeBody::exact_order;
  std::size_t smem_bytes = 0;
};

namespace config_detail {

// Decoded fp32 floats one sub-tile may hold (about 33 KB): 64 tokens at D = 128, 32 at D = 256.
inline constexpr int kDecodedFloats = 8448;
inline constexpr int kMaxSubTokens = 128;

}  // namespace config_detail

// KV tokens staged and decoded at once: a multiple of 32 (a warp's lanes take consecutive
// tokens when scoring), about kDecodedFloats floats of decoded rows.
inline int sub_tokens_for(int head_dim) {
  const int fit = config_detail::kDecodedFloats / (head_dim + 1) / 32 * 32;
  return std::clamp(fit, 32, config_detail::kMaxSubTokens);
}

// The widest chunk (16, 8, 4 bytes, or 1 for plain loads) that divides every row's address:
// the pool's base, every stride and the row size.
inline int copy_bytes_for(const KvCacheView& cache) {
  const auto base = reinterpret_cast<std::uintptr_t>(cache.data);
  const auto row = static_cast<std::int64_t>(cache.geometry.row_bytes());
  for (const int chunk : {16, 8, 4}) {
    const bool aligned = base % chunk == 0 && cache.strides.page % chunk == 0 &&
                         cache.strides.head % chunk == 0 && cache.strides.token % chunk == 0 &&
                         cache.strides.kv % chunk == 0 && row % chunk == 0;
    if (aligned) return chunk;
  }
  return 1;
}

// Why the tensor-core body cannot run this launch, or empty when it can: it needs fp32 P (the
// rounded P modes need the emulator's exact order), a format whose codes convert to an MMA operand
// in registers, D of 64, 128 or 256 (not fp6 at 64; 16-bit rows at most 128 channels), at most 16
// query rows, rows aligned for its loads (mma_row_alignment), and sm_80 (mma.sync; fp8 conversions
// in hardware from sm_89, emulated before). `compute_capability` is major * 10 + minor.
inline std::string tensor_core_unsupported(const KvCacheView& cache, const DecodeParams& params,
                                           int rows, int compute_capability,
                                           std::size_t max_smem_per_block) {
  const CacheGeometry& geo = cache.geometry;
  if (params.p_mode != PMode::fp32) return "P mode is not fp32";
  const int d = geo.head_dim;
  if (!mma_shape(geo.format, d)) return "no tensor-core body for this format and head_dim";
  if (d == 256 && geo.row_bytes() > 256) return "16-bit rows of 256 channels";
  if (rows > kMmaRows) return "more than 16 query rows (q_len * group)";
  if (copy_bytes_for(cache) < mma_row_alignment(geo.format)) return "rows are not aligned enough";
  if (compute_capability < 80) return "device older than sm_80";
  if (mma_smem(d).bytes > max_smem_per_block) return "shared memory";
  return {};
}

// Shared memory of one decode CTA holding `rows` query rows.
inline std::size_t decode_smem_bytes(const DecodeKernelParams& p, int rows) {
  return decode_smem(rows, p.head_dim, p.sub_tokens, p.score_stride, p.raw_row_stride).bytes;
}

// The most query rows per pass (at most `rows`) whose shared memory fits `limit`; 0 when not
// even one row fits.
inline int pass_rows_for(int rows, const DecodeKernelParams& p, std::size_t limit) {
  if (decode_smem_bytes(p, rows) <= limit) return rows;
  int fit = 0;
  for (int lo = 1, hi = rows; lo <= hi;) {  // the size grows with the row count
    const int mid = lo + (hi - lo) / 2;
    if (decode_smem_bytes(p, mid) <= limit) {
      fit = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return fit;
}

// The layout limit of a backend's options (CudaKernelOptions::max_mma_layout, the public name of
// the same order).
inline MmaLayout mma_layout_limit(const CudaKernelOptions& options) {
  static_assert(int(CudaMmaLayout::plain) == int(MmaLayout::plain) &&
                int(CudaMmaLayout::stacked) == int(MmaLayout::stacked) &&
                int(CudaMmaLayout::tokens_on_m) == int(MmaLayout::tokens_on_m));
  return static_cast<MmaLayout>(options.max_mma_layout);
}

// The kernel parameters of one launch: pointers and shapes from `args` (cache.data, q, o, lse
// as the kernels will dereference them), the device scales, the step buffer and the workspace;
// the configuration for a device allowing `max_smem_per_block` bytes of shared memory per CTA,
// of compute capability `compute_capability` (major * 10 + minor): the tensor-core body where
// tensor_core_unsupported() allows it, in mma_layout(format, rows, layout_limit), the
// exact-order body otherwise. Throws Error when the workspace is too small or not even one query
// row fits.
inline DecodeConfig make_decode_config(const DecodeArgs& args, const float* k_scale,
                                       const float* v_scale, const std::byte* step_device,
                                       std::span<std::byte> workspace, const LaunchShape& shape,
                                       std::size_t max_smem_per_block, int compute_capability,
                                       MmaLayout layout_limit = MmaLayout::tokens_on_m) {
  const KvCacheView& cache = args.cache;
  const CacheGeometry& geo = cache.geometry;
  const DecodeParams& params = args.params;
  const int g = params.num_q_heads / geo.num_kv_heads;

  DecodeConfig config;
  DecodeKernelParams& p = config.params;
  p.pool = reinterpret_cast<const std::uint8_t*>(cache.data);
  p.page_stride = cache.strides.page;
  p.head_stride = cache.strides.head;
  p.token_stride = cache.strides.token;
  p.kv_stride = cache.strides.kv;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.step = reinterpret_cast<const std::uint8_t*>(step_device);
  p.q = static_cast<const float*>(args.q.data);  // float32: the backend checks q.type
  p.q_token_stride = args.q.token_stride;
  p.q_head_stride = args.q.head_stride;
  p.o = static_cast<float*>(args.o.data);
  p.o_token_stride = args.o.token_stride;
  p.o_head_stride = args.o.head_stride;
  p.lse = args.lse.empty() ? nullptr : args.lse.data();
  p.softmax_scale = params.effective_softmax_scale(geo.head_dim);
  p.page_size = geo.page_size;
  p.page_shift = 0;
  while ((1 << p.page_shift) < geo.page_size) ++p.page_shift;
  p.head_dim = geo.head_dim;
  p.row_bytes = static_cast<int>(geo.row_bytes());
  p.num_kv_heads = geo.num_kv_heads;
  p.num_q_heads = params.num_q_heads;
  p.group = g;
  p.q_len = params.q_len;
  p.rows = params.q_len * g;
  p.granularity = static_cast<int>(cache.granularity);
  p.causal = params.causal ? 1 : 0;
  p.q_mode = static_cast<int>(params.q_mode);
  p.p_mode = static_cast<int>(params.p_mode);
  p.fused_dot = host_fuses_dot_products() ? 1 : 0;

  const PartialLayout layout{geo.num_kv_heads, p.rows, geo.head_dim};
  const int slots = static_cast<int>(shape.partial_slots);
  const std::size_t partial_floats = layout.o_floats(slots) + layout.lse_floats(slots);
  MJOLNIR_REQUIRE(workspace.size() >= partial_floats * sizeof(float),
                  "workspace: ", workspace.size(), " bytes, the split partials of ",
                  shape.partial_slots, " slots need ", partial_floats * sizeof(float));
  p.partial_o = reinterpret_cast<float*>(workspace.data());
  p.partial_lse = p.partial_o + layout.o_floats(slots);

  p.sub_tokens = sub_tokens_for(geo.head_dim);
  p.score_stride = shape.score_tokens;
  p.raw_row_stride = static_cast<int>(align16(geo.row_bytes()));
  p.copy_bytes = copy_bytes_for(cache);
  p.pass_rows = pass_rows_for(p.rows, p, max_smem_per_block);
  MJOLNIR_REQUIRE(p.pass_rows >= 1, "backend cuda: tile_tokens ", shape.score_tokens,
                  " with head_dim ", geo.head_dim, " needs more shared memory per CTA than the ",
                  max_smem_per_block, " bytes the device allows");
  config.smem_bytes = decode_smem_bytes(p, p.pass_rows);
  if (tensor_core_unsupported(cache, params, p.rows, compute_capability, max_smem_per_block)
          .empty()) {
    config.body = DecodeBody::tensor_core;
    config.smem_bytes = mma_smem(geo.head_dim).bytes;
    p.mma_layout = static_cast<int>(mma_layout(geo.format, p.rows, layout_limit));
  }
  return config;
}

}  // namespace mjolnir::cuda

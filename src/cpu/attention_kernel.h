// The CPU decode-attention kernel: one work item (the q_len * g query rows of a sequence's KV
// head against a token range) on the best SIMD target of this CPU, chosen at run time.
//
// SIMD targets (cpu/simd_targets.h) run the kernel of cpu/attention_kernel.cc: each K/V tile is
// decoded in registers once for all rows, fp32 accumulation, online softmax with a vectorized
// exp2. Highway's portable fallback target runs the scalar path of cpu/attention_item.h. Both
// follow the numerics contract; docs/cpu-performance.md explains the design.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/attention_item.h"
#include "cpu/kernel_config.h"
#include "hwy/aligned_allocator.h"
#include "mjolnir/decode.h"

namespace mjolnir::cpu {

// Where one work item's results go: for query row r (r = t * g + j), its normalized O row
// (D values of o_type: float32 partials, or the step's O in its own type) and its natural-log
// LSE (null: not wanted).
struct ItemOutput {
  void* const* o = nullptr;  // [rows]
  RowType o_type = RowType::f32;
  float* const* lse = nullptr;  // [rows]
  // Optional [rows]: the row's softmax state, {m (log2 units), l}, two floats. Token parts of a
  // chunk merge from it without the rounding of the float LSE (work_units.h).
  float* const* stats = nullptr;
};

// One worker thread's buffers, grown on first use and reused across items and calls.
class KernelScratch {
 public:
  // Buffer `slot` with room for at least `count` floats, 64-byte aligned. Contents are not kept
  // when it grows.
  float* floats(int slot, std::size_t count);
  std::int32_t* ints(std::size_t count);
  const std::uint8_t** row_pointers(std::size_t count);
  void* bytes(std::size_t count);  // untyped, for per-target structures

  ItemScratch portable;     // the scalar path's buffers
  KernelPathCounts counts;  // the work items this worker ran, by path

  static constexpr int kSlots = 15;  // the kernel's buffers (its Slot enum)

 private:
  hwy::AlignedFreeUniquePtr<float[]> floats_[kSlots];
  std::size_t capacity_[kSlots] = {};
  std::vector<std::int32_t> ints_;
  std::vector<const std::uint8_t*> rows_;
  hwy::AlignedFreeUniquePtr<std::uint8_t[]> bytes_;
  std::size_t bytes_capacity_ = 0;
};

// Runs the work items items[0 .. heads) of a validated step, which must share their sequence,
// token range and split (the plan's items for several KV heads of one chunk), and writes item
// h's rows to outs[h]. Their tiles are processed together, so each tile reads the K/V rows of
// all those heads at once: whole pages, contiguous in every layout, instead of one head's
// rows scattered at the token stride.
// `config`: the backend's kernel variants; the paths each item took are counted in
// scratch.counts.
void run_work_unit(const KernelConfig& config, const DecodeArgs& args, const Plan& plan,
                   const WorkItem* items, int heads, KernelScratch& scratch,
                   const ItemOutput* outs);

// Q . K on AVX-512 BF16 dot products (cpu/bf16_dot-inl.h), twice the multiply-adds per
// instruction of fp32 FMAs, in steps where it is exact: Q in bf16 or fp8 mode, P in fp32, K in
// bf16, fp8, fp6, fp4_e2m1 or nvfp4 (not fp16), D a multiple of 64, on a CPU with AVX512_BF16
// and AVX512_VBMI.
// Q in fp32 mode whose values are all bf16 values (a bf16 model's queries, with per-tensor or
// per-head K scales) is Q in bf16 mode, and takes them too. CpuKernelOptions::bf16_dot off keeps
// Q . K on fp32 FMAs (tests and benchmarks compare the two). On CPUs with AMX-BF16, steps of 8
// query rows or more take AMX tiles instead (cpu/amx.h, cpu/amx_scores-inl.h).
// Whether steps of this format, Q mode and head size run Q . K on the dot products under `config`
// (the backend takes them, and the step is one where they are exact), with P in fp32.
bool bf16_dot_applies(const KernelConfig& config, Format format, QMode q_mode, int head_dim);
// Whether the dispatched target has the dot products compiled and the CPU runs them.
bool cpu_has_bf16_dot();
// Whether the dispatched target has the integer dot products compiled and the CPU runs them.
bool cpu_has_int8_dot();
// Whether steps of this format and head size run Q . K in integers in Q mode int8 below the
// AMX tiles' rows: D a multiple of 128, and the dispatched target decodes the format into bytes
// (AVX-512 VNNI: fp4_e2m1, fp6_e2m3, nvfp4; AVX2: fp4_e2m1).
bool int8_dot_applies(Format format, int head_dim);
// Whether steps of this format and head size run P . V on fp16 FMAs in P mode fp16
// (cpu/half_values-inl.h): D a multiple of 128, and the dispatched target decodes the format into
// fp16 words on a CPU with AVX512-FP16 (AVX3_DL: fp4_e2m1, nvfp4, fp6, fp8). Elsewhere P mode
// fp16 sums its fp16 P on fp32 FMAs. Where it applies, the auto modes put P in fp16 for every step
// the AMX tiles do not take: kernel_rates, one thread, P fp16 against P fp32 at the auto Q mode
// (8-row blocks from 8 rows, V decoded into fp16 words once per tile from 16;
// docs/cpu-experiments.md, "P . V on AVX512-FP16 FMAs"), at 4 / 8 / 16 rows: fp4_e2m1 0.92x /
// 0.87x / 0.87x, nvfp4 0.91x / 0.85x / 0.91x, fp8_e4m3 0.83x / 0.86x / 0.90x, fp6_e2m3 0.83x /
// 0.79x / 0.86x, fp6_e3m2 0.88x / 0.90x / 0.91x; prompts (128 rows) 0.77-0.89x. fp8_e5m2 (added
// later, 5 repetitions): 0.89x / 0.87x / 0.90x, prompts 0.90x.
bool half_values_apply(Format format, int head_dim);
// Which rows a work unit of `rows` query rows (g x q_len) decodes once per KV tile on the
// dispatched target, with P in fp32 and no AMX tiles, instead of once per block of 4 or 8 query
// rows: K where Q . K runs in integers (x86) or, for Q in bf16, fp8 or int8, on the bf16 dot
// products (AVX512_BF16, the formats whose words take a decode: not bf16, fp16, nvfp4), V where P .
// V runs on FMAs and its decode costs more than a load (cpu/kernel_paths-inl.h). The results are
// the same either way.
struct DecodedOnce {
  bool keys = false, values = false;
};
DecodedOnce decoded_once(Format format, QMode q_mode, int rows, int head_dim);

// Whether a unit of `rows` query rows of this format and head size runs Q . K on AMX tiles under
// `config`: from kAmxMinRows, wherever the bf16 dot products apply.
bool amx_scores_apply(const KernelConfig& config, Format format, int rows, int head_dim);
// Whether such a unit's Q . K (for queries whose values are bf16 values) runs on the bf16 dot
// products at all, on the tiles or off them: wherever they apply, except below the tiles' rows
// where the tiles run (KernelConfig::bf16_dot_below_tiles), which takes fp32 FMAs there.
bool dot_scores_apply(const KernelConfig& config, Format format, int rows, int head_dim);
// Whether steps of this format, P mode and head size run P . V on AMX tiles (cpu/amx_values-inl.h):
// P mode bf16, the tiles taken under `config`, a format whose values are bf16 values (not fp16),
// D a multiple of 64; nvfp4 from kAmxMinRows query rows (kernel_paths-inl.h). Their P is rounded
// from the kernel's own scores (Backend::rounds_p_from_own_scores).
bool amx_values_apply(const KernelConfig& config, Format format, PMode p_mode, int head_dim);
// Whether steps of this format, P mode and head size run P . V on the bf16 dot products where
// the AMX tiles do not take it (cpu/dot_values-inl.h): P mode bf16, the dot products taken under
// `config`, a format whose values are bf16 values, D a multiple of 64; nvfp4 from kAmxMinRows
// query rows, as on the tiles.
bool dot_values_apply(const KernelConfig& config, Format format, PMode p_mode, int head_dim);
// Query rows (g x q_len) of a work unit from which Q . K goes on AMX tiles wherever the dot
// products apply (the auto modes put P . V there too, in P mode bf16). With 4 rows (g 4, q_len 1)
// the dot products were faster from memory (mjolnir bench, 32k tokens, Q bf16, interleaved: the
// tiles took bf16 10% longer, fp8 14%, nvfp4 10%, fp6 4%, fp4 0-5% less): the tiles' fixed cost per
// key (K stored, loaded as a tile, the sums gathered back) is then about the dot products' whole
// work. From 8 rows on the tiles win (fp4 32-35%, fp6 15-20%, nvfp4 15-18%, fp8 and bf16 about
// even) and at 16 by far (16-42%): docs/cpu-experiments.md.
inline constexpr int kAmxMinRows = 8;

// Query rows of a work unit from which the auto modes put P in bf16 for P . V on the bf16 dot
// products, on CPUs without tiles that issue them at an FMA's rate (KernelConfig::bf16_dot_values).
// On Zen 4, from memory: at 16 rows (g 4, q_len 4) a batch-8 step took 0.70-0.81x of its P-fp32
// time and a batch-1 step 0.8-1.1x; at 8 rows (g 8) batch 8 gained but batch 1 took up to 1.6x for
// fp4_e2m1, and at 4 rows batch 8 did not gain and batch 1 took up to 1.9x. A batch-1 step was
// then one plan chunk, which P in bf16 (rounded against the chunk's running maximum) cannot cut
// into token parts, so its units were groups of heads, whose rows interleave in B2NHD: there such
// a step took about twice as long (docs/cpu-experiments.md, "P . V on bf16 dot products on Zen
// 4"). The plan now gives each thread a chunk of its own (CpuBackend's heads_together_min_tokens);
// whether 4 and 8 rows pay on Zen 4 since is still to be measured there.
inline constexpr int kDotValuesMinRows = 16;

// Highway targets the kernel is compiled for, best first, and the one run() uses on this CPU
// (honouring hwy::DisableTargets / SetSupportedTargetsForTest).
std::vector<std::string> kernel_targets();
std::string kernel_target();

}  // namespace mjolnir::cpu

// Decode attention: the numerics modes, the arguments of one step, and the backend interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mjolnir/cache.h"
#include "mjolnir/plan.h"
#include "mjolnir/rows.h"

namespace mjolnir {

// How Q enters the QK product (docs/design.md section 4, step 1). fp8 and int8 quantize
// dynamically per (query tile, KV head) over the group's g * q_len rows: fp8 with sq = amax / 448,
// int8 with sq = amax / 127 to the integers -127..127 (round to nearest even), which multiply the
// fp6 / fp4 / nvfp4 codes exactly (docs/numerics.md).
enum class QMode : std::uint8_t { fp32, bf16, fp8, int8 };
// How P enters the PV product (step 4). fp8 is e4m3(p * 256), the 256 folded into 1 / l. fp16
// rounds p to fp16 and sums the products of each group of kHalfGroupKeys keys of a tile in fp16
// (each group's sums then added in fp32): the fp16 FMAs of CPUs with AVX512-FP16 do twice the
// fp32 FMAs' work per instruction. It takes the formats whose values fp16 holds with room to
// sum them (half_sums_take); docs/numerics.md.
enum class PMode : std::uint8_t { fp32, bf16, fp8, fp16 };
// Keys a group of P mode fp16 sums in fp16, counted from each tile's first.
inline constexpr int kHalfGroupKeys = 32;
// Whether P mode fp16 takes this format's values (fp8, fp6, fp4_e2m1, nvfp4: every value, nvfp4's
// at 2^-4 and e5m2's at 2^-8, is an fp16 whose kHalfGroupKeys-fold sum stays below fp16's 65504).
bool half_sums_take(Format format);
// The power of two P mode fp16 multiplies a format's values by before its fp16 sums (and divides
// each group's sum by after): 2^-4 for nvfp4, whose values reach 2688, 2^-8 for fp8_e5m2, whose
// values reach 57344, else 1.
float half_sum_scale(Format format);
std::string_view to_string(QMode mode);
std::string_view to_string(PMode mode);
QMode parse_q_mode(std::string_view name);
PMode parse_p_mode(std::string_view name);

// The numerics modes of a step (docs/numerics.md).
struct NumericsModes {
  QMode q_mode = QMode::fp32;
  PMode p_mode = PMode::fp32;
};

struct DecodeParams {
  // Query tokens per sequence, 1..kMaxQLen (1 + speculative tokens). 0: a ragged step, any
  // number per sequence, from batch.query_start (prefill, chunked prefill, mixed lengths).
  int q_len = 1;
  int num_q_heads = 0;  // Hq, a multiple of the cache's Hk
  // Query token t of a sequence with n query tokens sees KV [0, seq_len - n + t]; false: all of
  // [0, seq_len).
  bool causal = true;
  float softmax_scale = 0;  // 0: 1 / sqrt(D)
  QMode q_mode = QMode::fp32;
  PMode p_mode = PMode::fp32;

  float effective_softmax_scale(int head_dim) const;
  // Query tokens of one work item at most: q_len, or kQueryTileTokens for a ragged step.
  int item_q_len() const { return q_len > 0 ? q_len : kQueryTileTokens; }
};

// Query rows [query tokens, Hq, D], D contiguous, in float32 or bf16 (mjolnir/rows.h): row
// b * q_len + t holds token t of sequence b (query_start[b] + t in a ragged step;
// DecodeArgs::query_row). A bf16 Q is its float32 widening; the CPU and reference backends take
// it, the CUDA backend takes float32.
struct QueryTensor {
  const void* data = nullptr;     // float, or bf16 bits (std::uint16_t) where type is bf16
  std::int64_t token_stride = 0;  // elements
  std::int64_t head_stride = 0;   // elements
  RowType type = RowType::f32;
};
// Output rows, same shape and convention as QueryTensor. A bf16 O is the float32 O rounded to
// nearest even, bit for bit (a NaN row is 0x7FC0).
struct OutputTensor {
  void* data = nullptr;
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;
  RowType type = RowType::f32;
};

// Everything one decode step reads and writes.
struct DecodeArgs {
  KvCacheView cache;
  PagedBatch batch;
  DecodeParams params;
  QueryTensor q;
  OutputTensor o;
  // Optional [query tokens, Hq] natural-log LSE of the scaled scores (-inf for empty rows).
  std::span<float> lse;

  // What a plan is made from: the sequences' KV lengths and query tokens.
  StepShape step_shape() const {
    return StepShape{batch.seq_lens, batch.query_start, params.q_len, cache.geometry.num_kv_heads,
                     params.causal};
  }
  // Query tokens of sequence `seq`, and the row of q, o and lse that holds its token t.
  int query_len(int seq) const { return step_shape().query_len(seq); }
  std::int64_t query_row(int seq, int t) const {
    return (batch.query_start.empty() ? std::int64_t(seq) * params.q_len
                                      : std::int64_t(batch.query_start[seq])) +
           t;
  }
  // Rows of q, o and lse: num_seqs * q_len, or query_start[num_seqs].
  std::int64_t num_query_rows() const {
    return batch.query_start.empty() ? std::int64_t(batch.num_seqs()) * params.q_len
                                     : std::int64_t(batch.query_start.back());
  }
  // Query row r = t * g + j of `item` (token q_begin + t of its sequence, head j of its KV
  // head's group): its row of q and o (elements of q.type and o.type), and its LSE entry (null
  // when lse is not wanted).
  const void* q_row(const WorkItem& item, int r, int g) const {
    return static_cast<const std::byte*>(q.data) +
           element_bytes(q.type) *
               std::size_t(query_row(item.seq, item.q_begin + r / g) * q.token_stride +
                           std::int64_t(item.kv_head * g + r % g) * q.head_stride);
  }
  void* o_row(const WorkItem& item, int r, int g) const {
    return static_cast<std::byte*>(o.data) +
           element_bytes(o.type) *
               std::size_t(query_row(item.seq, item.q_begin + r / g) * o.token_stride +
                           std::int64_t(item.kv_head * g + r % g) * o.head_stride);
  }
  // That row's D values of q as float32 (widened from bf16), and D float32 values stored into
  // that row of o (rounded to bf16).
  void read_q_row(const WorkItem& item, int r, int g, float* out) const;
  void write_o_row(const WorkItem& item, int r, int g, const float* values) const;
  float* lse_at(const WorkItem& item, int r, int g) const {
    if (lse.empty()) return nullptr;
    return &lse[query_row(item.seq, item.q_begin + r / g) * params.num_q_heads + item.kv_head * g +
                r % g];
  }
};

// Where a backend keeps the split partials of a step with these parameters: rows of
// item_q_len() * g query rows per (slot, KV head).
PartialLayout partial_layout(const CacheGeometry& geometry, const DecodeParams& params);

// Checks every argument (cache, batch, q_len, heads, tensors) and throws Error naming the first
// bad one. Backends call it; it is public so callers can validate once up front.
void validate(const DecodeArgs& args);

// Checks that `plan` was made for this step: the same q_len, KV heads and sequences, every item
// inside its sequence's tokens and the plan's partial slots, and each sequence covered to its
// end. Throws Error naming the plan otherwise: a plan made for another step would read pages its
// items no longer own. O(items); Backend::run calls it on every step.
void check_plan(const Plan& plan, const DecodeArgs& args);

class Backend;

// One step planned for one backend, FlashInfer's plan / run split: the step's work items (Plan)
// and what the backend prepares from them once, for every run() of the step (one per layer of a
// model). The CPU backend prepares its work units and their merges (docs/cpu-performance.md);
// the reference and CUDA backends run the plan's items as they are. Made empty for a capacity,
// refilled by Backend::plan() for every step, read by run(): only a backend's plan() writes it,
// so the prepared part always matches the items.
class BackendPlan {
 public:
  // What a backend prepares from the items; each backend's run() knows its own type.
  class Prepared {
   public:
    virtual ~Prepared() = default;
  };

  explicit BackendPlan(PlanCapacity capacity = {}) : plan_(capacity) {}
  const Plan& plan() const { return plan_; }
  const PlanCapacity& capacity() const { return plan_.capacity; }
  // Null until a backend that prepares anything planned this step.
  const Prepared* prepared() const { return prepared_.get(); }
  // Name of the backend whose plan() filled it last; empty before the first.
  std::string_view planned_by() const { return planned_by_; }

 private:
  friend class Backend;
  Plan plan_;
  std::unique_ptr<Prepared> prepared_;
  std::string planned_by_;
};

// One implementation of the numerics contract.
//
// Threads: one backend serves concurrent calls on distinct workspaces. Every member function may
// be called from several threads at once; concurrent run() calls need a workspace and outputs
// (o, lse) each and may share the plan, the cache (pool and scales), the batch and the queries,
// which run() only reads. The "cpu" backend runs such calls one at a time: run() holds the
// backend's lock for the whole step (it reuses its workers' scratch between calls), so threads
// sharing it take turns on its worker threads. "cuda" also holds a lock across run();
// "reference" keeps no state and runs them side by side. For CPU steps that run in parallel,
// give each thread a backend of its own. plan() writes the plan: not while a run() reads it.
// tests/test_concurrency.cc checks this, under ThreadSanitizer too (scripts/test.sh --tsan);
// README.md "Threads" says the same for the whole API.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  // Empty when the backend can run on this machine; otherwise why not ("no CUDA device").
  virtual std::string unavailable_reason() const { return {}; }
  // Empty when the backend runs this configuration; otherwise what it does not support.
  virtual std::string unsupported_reason(const CacheGeometry& geometry,
                                         const DecodeParams& params) const = 0;
  // Whether this backend rounds P (P mode bf16 or fp8) from its own fp32 scores rather than the
  // emulator's (the contract allows it: docs/numerics.md), so that a P code can differ from the
  // emulator's by one unit. The CPU does in P mode bf16.
  virtual bool rounds_p_from_own_scores(const CacheGeometry& geometry,
                                        const DecodeParams& params) const {
    (void)geometry;
    (void)params;
    return false;
  }
  // The modes a step runs in when the caller leaves them to the backend ("auto" in the Python
  // ops and the vLLM plugin): the fastest whose error against the exact reference stays within
  // 1.25x of Q and P in fp32 for the format (docs/accuracy.md measures the ratios).
  // max_tile_rows: the most query rows one query tile of the step has (q_count x g);
  // bf16_queries: the queries are bf16 values (a bf16 model's). Default: fp32 and fp32.
  virtual NumericsModes auto_modes(const CacheGeometry& geometry, int max_tile_rows,
                                   bool bf16_queries) const {
    (void)geometry;
    (void)max_tile_rows;
    (void)bf16_queries;
    return {};
  }
  // Whether run() takes Q and O rows of this type (mjolnir/rows.h). Every backend takes
  // float32; the CPU and reference backends take bf16 too, the CUDA backend does not.
  virtual bool takes_rows(RowType type) const { return type == RowType::f32; }
  // Capacity to plan for (PlanOptions::workers).
  virtual int workers() const = 0;
  // Work items that run at once, when fewer than workers() (PlanOptions::wave_workers; 0: all
  // of them). A GPU plans several waves of CTAs at large batches but its resident CTAs bound
  // how many chunks one short batch should be cut into.
  virtual int wave_workers() const { return 0; }
  // PlanOptions::heads_together_min_tokens: 0 where each KV head's items run apart, else the
  // backend runs a chunk's KV heads as one unit and shares out the heads of a sequence of at
  // most this many tokens rather than cutting it.
  virtual int heads_together_min_tokens() const { return 0; }
  // `options` with this backend's device fields set: workers, wave_workers and
  // heads_together_min_tokens. Plan (and size a capacity_for) with what it returns.
  PlanOptions plan_options(PlanOptions options = {}) const;
  // Workspace run() needs for a plan of this capacity (split partials and scratch).
  virtual std::size_t workspace_bytes(const Plan& plan, const CacheGeometry& geometry,
                                      const DecodeParams& params) const;
  // Plans one step for this backend into `out` (within its capacity): make_plan(step, options),
  // then what this backend prepares from the items. Once per step; every layer's run() reads
  // it. Throws Error as make_plan does, leaving `out` unplanned (a run() on it is refused).
  void plan(BackendPlan& out, const StepShape& step, const PlanOptions& options) const;
  // Runs a validated step with a plan this backend's plan() made for it. Writes o (and lse) for
  // every row. Throws Error when the plan does not match the step (check_plan), was prepared by
  // another kind of backend, or the workspace is smaller than workspace_bytes().
  virtual void run(const DecodeArgs& args, const BackendPlan& plan,
                   std::span<std::byte> workspace) const = 0;

 protected:
  // What this backend prepares from a new plan's items for its run(), into `prepared` (which
  // holds what it prepared for an earlier step, to reuse, or null). Default: nothing.
  virtual void prepare(const Plan& plan, std::unique_ptr<BackendPlan::Prepared>& prepared) const {
    (void)plan;
    prepared.reset();
  }
  // What every run() checks first: a plan that a plan() filled, check_plan(), and a workspace
  // of workspace_bytes() at least.
  void check_run(const DecodeArgs& args, const BackendPlan& plan,
                 std::span<const std::byte> workspace) const;
};

// Most CPU worker threads a backend accepts (BackendOptions::threads).
inline constexpr int kMaxCpuThreads = 4096;
// The one check of a thread count, for every binding that takes one: throws Error naming
// `arg_name` unless 0 <= threads <= kMaxCpuThreads (0 = every core).
void check_cpu_threads(std::int64_t threads, std::string_view arg_name);

// Where the CPU backend runs its work: threads of its own by default, or a host program's
// (a serving engine's intra-op thread pool, so that the two do not fight over the cores).
// Several CPU backends may share one executor, whose parallel_for is then called from several
// threads at once; the backend's own pool (threads of its own) runs such calls one at a time.
class Executor {
 public:
  virtual ~Executor() = default;
  // Threads that may run at once: the worker indices fn sees are in [0, workers()).
  virtual int workers() const = 0;
  // Calls fn(index, worker) once for every index in [0, count) and returns when all are done;
  // two calls that run at the same time never share a worker index. Rethrows an exception that
  // fn threw.
  virtual void parallel_for(std::int64_t count,
                            const std::function<void(std::int64_t, int)>& fn) = 0;
};

// The CPU kernel's variants. Each runs where this CPU has it and the step is one it serves
// (docs/cpu-performance.md); turning one off here keeps those steps on the variant below it, for
// A/B measurements and tests. `mjolnir info` says which this machine takes.
struct CpuKernelOptions {
  bool bf16_dot = true;  // Q . K on AVX-512 BF16 dot products (else fp32 FMAs)
  bool amx =
      true;  // Q . K on AMX tiles from 8 query rows, P . V with P in bf16 (else dot products)
  // Decoders that never make an fp32 subnormal, whose FMAs take a microcode assist on Intel
  // cores. Unset: where this CPU's subnormal FMAs are slow.
  std::optional<bool> avoid_fp32_subnormals;
  // The auto modes round P to bf16 from 16 query rows where P . V then runs on the bf16 dot
  // products without AMX tiles. Unset: where a vdpbf16ps issues at an fp32 FMA's rate with twice
  // its multiply-adds (AMD's cores, Zen 4 and later); on Intel's it costs about four FMAs and P in
  // fp32 is faster.
  std::optional<bool> bf16_dot_values;
  // Q . K of 16 query rows and more (prompts, speculative steps) in 16 x 16 blocks on fp32 FMAs
  // over K widened to fp32 once per tile, rather than on the bf16 dot products, where no AMX
  // tiles take it. Unset: where a vdpbf16ps costs more than the two FMAs it replaces (Intel's
  // cores; on AMD's it issues at an FMA's rate).
  std::optional<bool> fma_pair_scores;
};

// What the environment asks for: MJOLNIR_CPU_BF16_DOT=0 and MJOLNIR_CPU_AMX=0 turn those off,
// MJOLNIR_CPU_AVOID_SUBNORMALS=1 or 0 sets the decoders, MJOLNIR_CPU_BF16_DOT_VALUES=1 or 0 the
// auto P mode over the dot products, MJOLNIR_CPU_FMA_PAIR_SCORES=1 or 0 the FMAs' 16 x 16 score
// blocks; anything else keeps the default. The
// library reads no environment of its own: the CLI and the Python package pass this to
// make_backend. Throws Error naming the variable for a value other than 0 or 1.
CpuKernelOptions cpu_kernel_options_from_environment();

// The CUDA tensor-core body's layouts of a work item on the MMAs, in the order each serves the
// query rows of the ones after it (docs/cuda.md): plain (up to 16 rows), stacked (up to 8),
// tokens on M (up to 4).
enum class CudaMmaLayout { plain, stacked, tokens_on_m };

// The CUDA kernel's variants. The tensor-core body takes the best layout its step's rows allow,
// up to max_mma_layout: plain keeps every step on the plain layout, for A/B measurements on a
// device and as the way back should another layout misbehave there.
struct CudaKernelOptions {
  CudaMmaLayout max_mma_layout = CudaMmaLayout::tokens_on_m;
};

// What the environment asks for: MJOLNIR_CUDA_MMA_LAYOUT = plain, stacked or tokens_on_m sets
// max_mma_layout (unset or empty: the default). Read by the CLI and the Python package, as
// cpu_kernel_options_from_environment(); throws Error naming the variable for another value.
CudaKernelOptions cuda_kernel_options_from_environment();

struct BackendOptions {
  int threads = 0;  // CPU: worker threads, 0 = all cores; at most kMaxCpuThreads
  // CPU: run on this executor instead of threads of its own (threads must then be 0).
  std::shared_ptr<Executor> executor;
  CpuKernelOptions cpu_kernels;    // CPU: the kernel variants it may take
  CudaKernelOptions cuda_kernels;  // CUDA: the kernel variants it may take
};

// "reference" (the emulator), "cpu", "cuda" (when compiled). Throws Error for unknown names, for
// options.threads outside [0, kMaxCpuThreads] and for threads given with an executor.
std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options = {});
// Names of the backends compiled into this build, in preference order.
std::vector<std::string> compiled_backends();

// Convenience for one-off calls: validates, plans with the backend's capacity, allocates the
// workspace and runs. options.max_splits 0 plans as many chunks as fill the backend's workers
// (effective_max_splits; a GPU at batch 1 as many as fit one wave of its resident CTAs). Serving
// loops keep a BackendPlan and a workspace, plan() once per step and run() each layer.
void decode(const Backend& backend, const DecodeArgs& args, PlanOptions options = {});

}  // namespace mjolnir

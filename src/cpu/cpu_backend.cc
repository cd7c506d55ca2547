// The CPU backend: plan() groups the plan's items into units once per step (work_units.h); run()
// runs them on a thread pool, then the merges of token parts (here) and of split query tiles
// (core/chunk_merge.h, the emulator's).
#include "cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <numbers>

#include "core/bf16_rows.h"
#include "core/chunk_merge.h"
#include "core/non_finite.h"
#include "cpu/attention_kernel.h"
#include "cpu/thread_pool.h"
#include "cpu/work_units.h"
#include "mjolnir/error.h"

namespace mjolnir::cpu {

namespace {

// Token parts of one chunk (work_units.h) into the chunk's result for one query row, from each
// part's normalized O and softmax state {m, l}: weights 2^(m_i - M) l_i, in double, so the merge
// adds no rounding beyond the final one. Writes O and the natural-log LSE of the whole chunk,
// (M + log2 sum_i 2^(m_i - M) l_i) ln 2, as an unsplit run computes it.
void merge_parts_row(const float* part_o, const float* part_stats, std::size_t o_stride,
                     std::size_t stats_stride, int parts, int d, float* o, float* lse) {
  for (int s = 0; s < parts; ++s) {  // a poisoned part's l is NaN
    if (std::isnan(part_stats[s * stats_stride + 1])) return poison_row(o, std::size_t(d), lse);
  }
  float max_m = -std::numeric_limits<float>::infinity();
  for (int s = 0; s < parts; ++s) {
    const float* st = part_stats + s * stats_stride;
    if (st[1] > 0.0f) max_m = std::max(max_m, st[0]);
  }
  if (max_m == -std::numeric_limits<float>::infinity()) {
    std::fill(o, o + d, 0.0f);
    if (lse) *lse = max_m;
    return;
  }
  double weights[kMaxParts];
  double total = 0;
  for (int s = 0; s < parts; ++s) {
    const float* st = part_stats + s * stats_stride;
    weights[s] = st[1] > 0.0f ? std::exp2(double(st[0]) - max_m) * st[1] : 0.0;
    total += weights[s];
  }
  // Each part's weight divided by the total once, not each channel's sum: a division per channel
  // cost a few microseconds of a 256-token step. The double rounding of the quotient stays far
  // below the fp32 result's.
  for (int s = 0; s < parts; ++s) weights[s] /= total;
  // Blocks of channels with the parts' loop outside, so the compiler vectorizes over channels: a
  // channel at a time, it took about 5% of the CPU time of a 256-token step on two threads, on the
  // calling thread after the others finish. Each channel's sum still adds the parts in order.
  constexpr int kBlock = 32;
  for (int c0 = 0; c0 < d; c0 += kBlock) {
    const int n = std::min(kBlock, d - c0);
    double sum[kBlock] = {};
    for (int s = 0; s < parts; ++s) {
      const float* src = part_o + s * o_stride + c0;
      for (int c = 0; c < n; ++c) sum[c] += weights[s] * src[c];
    }
    for (int c = 0; c < n; ++c) o[c0 + c] = static_cast<float>(sum[c]);
  }
  if (lse) {
    *lse = static_cast<float>((max_m + std::log2(total)) * std::numbers::ln2_v<double>);
  }
}

// Below this much merge work (floats of O rows), merging on the calling thread is faster than
// waking the others.
constexpr std::int64_t kParallelMergeFloats = 1 << 16;

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::shared_ptr<Executor> executor, const CpuKernelOptions& kernels)
      : executor_(std::move(executor)), config_(resolve_kernel_config(kernels)) {}

  std::string_view name() const override { return "cpu"; }
  bool takes_rows(RowType) const override { return true; }  // float32 and bf16
  std::string unsupported_reason(const CacheGeometry&, const DecodeParams&) const override {
    return {};
  }
  int workers() const override { return executor_->workers(); }
  // A chunk's KV heads run as one unit (work_units.h), so the plan gives each thread a chunk of
  // its own at batch 1: then every P mode shares the tokens, where P codes rounded from the
  // kernel's own scores could otherwise follow only the plan's chunks and share out heads.
  // A sequence of up to kHeadGroupMaxTokens tokens stays whole, its heads shared out.
  int heads_together_min_tokens() const override { return kHeadGroupMaxTokens; }
  // Q in bf16 for bf16 queries: their values, and per-channel K scales folded in and rounded,
  // which lets Q . K run on the dot products or AMX tiles (error 1.00x of fp32 Q's in
  // docs/accuracy.md). Q in int8 where Q . K then runs in integers (fp4_e2m1, fp6_e2m3, nvfp4 on
  // VNNI, AVX2 and Arm's sdot, below the AMX tiles' rows): 1.26-1.36x faster decode steps on
  // VNNI, error 1.00-1.06x of fp32 Q's (docs/cpu-experiments.md, docs/accuracy.md).
  // P in bf16 from 8 query rows where P . V then runs on AMX tiles (2-3x faster prefill), or from
  // 16 on the bf16 dot products of a CPU without tiles that issues them at the FMAs' rate
  // (KernelConfig::bf16_dot_values, AMD's; kDotValuesMinRows says why 16); its error is
  // 1.00-1.01x of fp32 P's for the 8-bit and smaller formats, 1.01-1.19x for bf16. Else P in
  // fp16 where P . V then runs on fp16 FMAs (AVX512-FP16: fp4_e2m1, nvfp4, fp6, fp8), where it
  // took 0.77-0.92x of P fp32's time (half_values_apply; docs/cpu-experiments.md). Elsewhere P in
  // fp32, which decodes 5-15% faster than bf16 P on the FMAs.
  NumericsModes auto_modes(const CacheGeometry& geometry, int max_tile_rows,
                           bool bf16_queries) const override {
    NumericsModes modes;
    if (bf16_queries) modes.q_mode = QMode::bf16;
    const bool amx_scores =
        amx_scores_apply(config_, geometry.format, max_tile_rows, geometry.head_dim);
    if (!amx_scores && int8_dot_applies(geometry.format, geometry.head_dim)) {
      modes.q_mode = QMode::int8;
    }
    const bool tiles_take_p =
        max_tile_rows >= kAmxMinRows &&
        amx_values_apply(config_, geometry.format, PMode::bf16, geometry.head_dim);
    const bool dots_take_p =
        max_tile_rows >= kDotValuesMinRows && config_.bf16_dot_values &&
        dot_values_apply(config_, geometry.format, PMode::bf16, geometry.head_dim);
    if (tiles_take_p || dots_take_p) {
      modes.p_mode = PMode::bf16;
    } else if (half_values_apply(geometry.format, geometry.head_dim)) {
      modes.p_mode = PMode::fp16;
    }
    return modes;
  }
  // P modes bf16 and fp16 round P from the kernel's own scores (attention_kernel.cc); fp8 P from
  // the emulator's.
  bool rounds_p_from_own_scores(const CacheGeometry&, const DecodeParams& params) const override {
    return params.p_mode == PMode::bf16 || params.p_mode == PMode::fp16;
  }

  // The plan's units: cut for today's workers.
  void prepare(const Plan& plan, std::unique_ptr<BackendPlan::Prepared>& prepared) const override {
    auto* cpu = dynamic_cast<CpuPlan*>(prepared.get());
    if (cpu == nullptr) {
      prepared = std::make_unique<CpuPlan>();
      cpu = static_cast<CpuPlan*>(prepared.get());
    }
    prepare_cpu_plan(plan, workers(), *cpu);
  }

  std::size_t workspace_bytes(const Plan& plan, const CacheGeometry& geometry,
                              const DecodeParams& params) const override {
    // The plan's split partials, then the token parts of chunks cut for the threads.
    const PartialLayout parts = partial_layout(geometry, params);
    return Backend::workspace_bytes(plan, geometry, params) +
           (parts.o_floats(max_part_slots(workers())) +
            2 * parts.lse_floats(max_part_slots(workers()))) *
               sizeof(float);
  }

  void run(const DecodeArgs& args, const BackendPlan& planned,
           std::span<std::byte> workspace) const override {
    check_run(args, planned, workspace);
    const auto* prepared = dynamic_cast<const CpuPlan*>(planned.prepared());
    MJOLNIR_REQUIRE(prepared != nullptr, "plan: planned by the '", planned.planned_by(),
                    "' backend, which did not cut it into cpu work units (plan the step with the "
                    "backend that runs it)");
    const Plan& plan = planned.plan();
    const UnitSchedule& schedule = prepared->units_for(args.params.p_mode);
    const int d = args.cache.geometry.head_dim;
    const int hk = args.cache.geometry.num_kv_heads;
    const int g = args.params.num_q_heads / hk;
    const PartialLayout layout = partial_layout(args.cache.geometry, args.params);
    const int slots = plan.partial_slots();
    // check_run measured the workspace against today's workers; the units were cut for the
    // plan's, which an executor resized since may exceed.
    const std::size_t parts_bytes =
        (layout.o_floats(schedule.part_slots) + 2 * layout.lse_floats(schedule.part_slots)) *
        sizeof(float);
    MJOLNIR_REQUIRE(
        workspace.size() >=
            Backend::workspace_bytes(plan, args.cache.geometry, args.params) + parts_bytes,
        "workspace: ", workspace.size(), " bytes do not hold the token parts of units cut for ",
        prepared->threads, " threads (size it after planning)");
    float* partial_o = reinterpret_cast<float*>(workspace.data());
    float* partial_lse = partial_o + layout.o_floats(slots);
    // Token parts: the same layout, slot = part slot, head = the item's KV head.
    float* part_o = partial_lse + layout.lse_floats(slots);
    float* part_stats = part_o + layout.o_floats(schedule.part_slots);  // {m, l} per row

    // The executor and scratch serve one call at a time; concurrent callers wait their turn.
    std::lock_guard lock(run_mutex_);
    // An executor's workers may change between calls (a host pool resized): every worker gets
    // scratch.
    const int threads = workers();
    if (scratch_.size() < std::size_t(threads)) scratch_.resize(threads);

    // Where item `i`'s row r goes: the output (of args.o.type), or its split partial slot
    // (float32).
    const auto destination = [&](const WorkItem& item, int r, void*& o, float*& lse) {
      if (item.partial_slot < 0) {
        o = args.o_row(item, r, g);
        lse = args.lse_at(item, r, g);
      } else {
        o = partial_o + layout.o_offset(item.partial_slot, item.kv_head, r);
        lse = partial_lse + layout.lse_offset(item.partial_slot, item.kv_head, r);
      }
    };

    executor_->parallel_for(
        std::int64_t(schedule.units.size()), [&](std::int64_t index, int worker) {
          const WorkUnit& unit = schedule.units[index];
          const int rows = plan.items[unit.first_item].q_count * g;
          WorkerScratch& s = scratch_[worker];
          s.items.assign(plan.items.begin() + unit.first_item,
                         plan.items.begin() + unit.first_item + unit.heads);
          s.o_rows.resize(std::size_t(rows) * unit.heads);
          s.lse_rows.resize(std::size_t(rows) * unit.heads);
          s.stats_rows.resize(std::size_t(rows) * unit.heads);
          s.outs.resize(unit.heads);
          for (int h = 0; h < unit.heads; ++h) {
            WorkItem& item = s.items[h];
            item.kv_begin = unit.kv_begin;
            item.kv_end = unit.kv_end;
            void** o_rows = &s.o_rows[std::size_t(h) * rows];
            float** lse_rows = &s.lse_rows[std::size_t(h) * rows];
            float** stats_rows = &s.stats_rows[std::size_t(h) * rows];
            for (int r = 0; r < rows; ++r) {
              if (unit.part_slot < 0) {
                destination(item, r, o_rows[r], lse_rows[r]);
              } else {
                o_rows[r] = part_o + layout.o_offset(unit.part_slot, item.kv_head, r);
                lse_rows[r] = nullptr;
                stats_rows[r] = part_stats + 2 * layout.lse_offset(unit.part_slot, item.kv_head, r);
              }
            }
            const bool to_output = unit.part_slot < 0 && item.partial_slot < 0;
            s.outs[h] = ItemOutput{o_rows, to_output ? args.o.type : RowType::f32, lse_rows,
                                   unit.part_slot < 0 ? nullptr : stats_rows};
          }
          run_work_unit(config_, args, plan, s.items.data(), unit.heads, s.kernel, s.outs.data());
        });

    // Merges are small: threads are woken for them only when there is enough to share.
    const std::int64_t merge_floats = std::int64_t(layout.rows) * (d + 1);
    const auto run_merges = [&](const std::vector<std::pair<int, int>>& tasks, const auto& merge) {
      if (std::int64_t(tasks.size()) * merge_floats < kParallelMergeFloats) {
        for (std::size_t i = 0; i < tasks.size(); ++i) merge(std::int64_t(i), 0);
      } else {
        executor_->parallel_for(std::int64_t(tasks.size()), merge);
      }
    };
    // A merged row goes to a float32 destination directly, or through the worker's row to O
    // of another type.
    const auto merged_row = [&](int worker, bool to_output, void* o) {
      return to_output && args.o.type != RowType::f32 ? scratch_[worker].merged_o.data()
                                                      : static_cast<float*>(o);
    };
    for (int w = 0; w < threads && args.o.type != RowType::f32; ++w) {
      scratch_[w].merged_o.resize(d);
    }
    // Token parts of cut chunks merge into their items' destinations: one task per KV head.
    run_merges(schedule.merge_tasks, [&](std::int64_t index, int worker) {
      const auto [m, h] = schedule.merge_tasks[index];
      const PartMerge& merge = schedule.merges[m];
      const WorkItem& item = plan.items[merge.first_item + h];
      for (int r = 0; r < item.q_count * g; ++r) {
        void* o;
        float* lse;
        destination(item, r, o, lse);
        float* merged = merged_row(worker, item.partial_slot < 0, o);
        merge_parts_row(part_o + layout.o_offset(merge.first_slot, item.kv_head, r),
                        part_stats + 2 * layout.lse_offset(merge.first_slot, item.kv_head, r),
                        layout.o_offset(1, 0, 0), 2 * layout.lse_offset(1, 0, 0), merge.parts, d,
                        merged, lse);
        if (merged != o) narrow_row(merged, args.o.type, o, std::size_t(d));
      }
    });

    // The plan's split query tiles: one task per (query tile, KV head).
    run_merges(prepared->tile_merges, [&](std::int64_t index, int worker) {
      const auto [i, h] = prepared->tile_merges[index];
      const QueryTile& qt = plan.query_tiles[i];
      const WorkItem rows_of{
          .seq = qt.seq, .kv_head = h, .q_begin = qt.q_begin, .q_count = qt.q_count};
      const int first = plan.first_partial[i];
      for (int r = 0; r < qt.q_count * g; ++r) {
        void* o = args.o_row(rows_of, r, g);
        float* merged = merged_row(worker, true, o);
        merge_chunks(partial_o + layout.o_offset(first, h, r), layout.o_offset(1, 0, 0),
                     partial_lse + layout.lse_offset(first, h, r), layout.lse_offset(1, 0, 0),
                     plan.num_splits[i], d, merged, args.lse_at(rows_of, r, g));
        if (merged != o) narrow_row(merged, args.o.type, o, std::size_t(d));
      }
    });
  }

  const KernelConfig& config() const { return config_; }
  KernelPathCounts path_counts() const {
    std::lock_guard lock(run_mutex_);
    KernelPathCounts total;
    for (const WorkerScratch& s : scratch_) total += s.kernel.counts;
    return total;
  }

 private:
  struct WorkerScratch {
    KernelScratch kernel;
    std::vector<WorkItem> items;  // the unit's items, with the unit's token range
    std::vector<void*> o_rows;
    std::vector<float*> lse_rows, stats_rows;
    std::vector<ItemOutput> outs;
    std::vector<float> merged_o;  // a merged row on its way to a bf16 O
  };
  std::shared_ptr<Executor> executor_;
  const KernelConfig config_;
  mutable std::vector<WorkerScratch> scratch_;
  mutable std::mutex run_mutex_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& options) {
  std::shared_ptr<Executor> executor = options.executor;
  if (!executor) {
    executor =
        std::make_shared<ThreadPool>(options.threads > 0 ? options.threads : hardware_threads());
  }
  return std::make_unique<CpuBackend>(std::move(executor), options.cpu_kernels);
}

namespace {
const CpuBackend& as_cpu_backend(const Backend& backend) {
  const auto* cpu = dynamic_cast<const CpuBackend*>(&backend);
  MJOLNIR_REQUIRE(cpu != nullptr, "backend: '", backend.name(), "' is not the cpu backend");
  return *cpu;
}
}  // namespace

KernelConfig kernel_config(const Backend& backend) { return as_cpu_backend(backend).config(); }

KernelPathCounts kernel_path_counts(const Backend& backend) {
  return as_cpu_backend(backend).path_counts();
}

}  // namespace mjolnir::cpu

// How fast one core runs the CPU decode kernel when the cache is resident in the last-level
// cache, against the fp32 FMA peak of the same core: if the resident rate is no better than the
// rate `mjolnir bench` measures from memory, the kernel is bound by its arithmetic, not by
// bandwidth. Times are the thread's CPU time, so other processes sharing the cores inflate them
// less than wall time.
//
//   build/bench/micro/kernel_rates --benchmark_filter=Decode [--target=AVX2]
//
// Each shape runs with Q in fp32 and in bf16 (".../qbf16"): with Q in bf16, CPUs with AVX512_BF16
// run Q . K on bf16 dot products (cpu/bf16_dot-inl.h; MJOLNIR_CPU_BF16_DOT=0 turns them off).
//
// --target=NAME runs the kernel compiled for Highway target NAME (one of cpu::kernel_targets())
// rather than the best this CPU supports, e.g. AVX2 on an AVX-512 machine.
//
// Counters: ns_per_token_head (one KV token of one KV head: K and V rows, all g x q_len query
// rows), fma_floor_ns (the same work's 2 x g x q_len x D multiply-adds at the measured fp32 FMA
// peak, Q . K's at twice it where they run on bf16 dot products), and GB_per_cpu_s (KV bytes per
// CPU second).
//
// Pair/... benchmarks run two variants of one step in the same process, one call of each in turn
// (which goes first alternates), and report ns_a and ns_b (medians, ns per token-head) and b_over_a
// (the median of the ratio call by call): on a shared host, where the same binary's rate moves by
// up to 2x from one second to the next, that ratio is what the noise affects least.
//   pfp32_vs_pbf16  P in fp32 against P in bf16 (P . V on AMX tiles, or the bf16 dot products
//                   where there are no tiles: the question for Zen 4 / 5), Q as the backend's
//                   auto modes take it for bf16 queries (int8 where it runs, else bf16)
//   pfp32_vs_pfp16  P in fp32 against P in fp16 (P . V on fp16 FMAs with AVX512-FP16, else the
//                   same fp32 FMAs over P rounded to fp16; the formats P fp16 takes), Q as above
//   pfp16_vs_pbf16  8 and 16 rows: P in fp16 against P in bf16, the two P modes that round P
//                   from the kernel's own scores (the question for CPUs with AVX512-FP16 and no
//                   tiles; run with MJOLNIR_CPU_BF16_DOT_VALUES=1 to put bf16 P on the dot
//                   products where the auto modes would not)
//   fma_vs_dot      Q . K on fp32 FMAs (CpuKernelOptions::bf16_dot off) against the dot products
//                   (the tiles off, so that they take the 4 rows where there are tiles)
//   noamx_vs_amx    q_len 4 (16 rows): the tiles off against on
//   qbf16_vs_qint8  Q . K with Q in bf16 against Q in int8 (integer dot products; fp4_e2m1,
//                   fp6_e2m3 and nvfp4 on CPUs that have them), P fp32
//   dot_vs_fma_pairs  16 rows (q_len 4), Q bf16: the 16 x 16 score blocks on the bf16 dot
//                   products against fp32 FMAs over K widened once per tile (fma_pair_scores);
//                   PrefillPair/... the same for a prompt (ns per row and key)
// PlanPair/... runs one batch-1 step on two threads (wall time) planned with every KV head apart
// (a, the CPU's plan before 2026-12-07) and as the CPU backend plans it (b, a chunk per thread).
//   avoid_vs_make_subnormals  the decoders for CPUs whose FMAs take fp32 subnormals slowly
//                   (CpuKernelOptions::avoid_fp32_subnormals on) against those for CPUs that take
//                   them at full speed (off; low-bit formats only)
#include <benchmark/benchmark.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// First, so HWY_TARGETS below lists the targets the kernel is compiled for (AVX3_DL among them).
#include "cpu/simd_targets.h"

#include "hwy/targets.h"

#include "bench/compute_peak.h"
#include "cpu/attention_kernel.h"
#include "cpu/cpu_backend.h"
#include "mjolnir/decode.h"
#include "mjolnir/plan.h"
#include "verify/problem.h"

namespace mjolnir {
namespace {

constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kContext = 2048;  // 8 heads x 2048 tokens: 4 MiB of bf16, resident in L3

// One worker, with the kernel variants the environment asks for (MJOLNIR_CPU_BF16_DOT=0 and the
// like, as for the CLI).
BackendOptions OneThread() {
  return BackendOptions{.threads = 1, .cpu_kernels = cpu_kernel_options_from_environment()};
}

double fma_peak_flops_one_thread() {
  static const double flops = cpu::measure_fma_peak_gflops(1, 0.3) * 1e9;
  return flops;
}

// One sequence of kContext tokens over kKvHeads heads of kHeadDim channels: the decode step both
// Decode and Pair time.
verify::ProblemSpec DecodeSpec(Format format, int group, int q_len) {
  verify::ProblemSpec spec;
  spec.format = format;
  spec.num_kv_heads = kKvHeads;
  spec.group = group;
  spec.head_dim = kHeadDim;
  spec.params.q_len = q_len;
  spec.seq_lens = {kContext};
  spec.keep_original_kv = false;
  return spec;
}

void Decode(benchmark::State& state, Format format, int group, int q_len, QMode q_mode,
            PMode p_mode) {
  verify::ProblemSpec spec = DecodeSpec(format, group, q_len);
  spec.params.q_mode = q_mode;
  spec.params.p_mode = p_mode;
  verify::Problem problem(spec);
  const DecodeArgs args = problem.args();
  const auto backend = make_backend("cpu", OneThread());
  PlanOptions options;
  options.workers = 1;
  BackendPlan plan(PlanCapacity{1, kKvHeads, 16});
  backend->plan(plan, args.step_shape(), options);
  std::vector<std::byte> workspace(
      backend->workspace_bytes(plan.plan(), args.cache.geometry, args.params));
  for (auto _ : state) backend->run(args, plan, workspace);

  const double token_heads = double(kContext) * kKvHeads * state.iterations();
  // QK and PV, 2 flops per multiply-add; QK's at twice the rate where it runs on bf16 dot
  // products (2 multiply-adds per lane and instruction), 4 times in integers (4).
  const bool int8 = q_mode == QMode::int8 && cpu::int8_dot_applies(format, kHeadDim);
  const cpu::KernelConfig config = cpu::kernel_config(*backend);
  // From 16 rows Q . K goes to 16 x 16 blocks, on fp32 FMAs where fma_pair_scores (not nvfp4's,
  // whose K the blocks do not take).
  const bool fma_pairs = config.fma_pair_scores && group * q_len >= 16 && format != Format::nvfp4;
  const bool dot = cpu::bf16_dot_applies(config, format, q_mode, kHeadDim) &&
                   cpu::dot_scores_apply(config, format, group * q_len, kHeadDim) && !fma_pairs;
  const double qk_share = int8 ? 0.25 : dot ? 0.5 : 1.0;
  const double flops_per_token_head = 2.0 * group * q_len * kHeadDim * (1.0 + qk_share);
  state.counters["ns_per_token_head"] = benchmark::Counter(
      token_heads / 1e9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["fma_floor_ns"] = flops_per_token_head / fma_peak_flops_one_thread() * 1e9;
  state.counters["GB_per_cpu_s"] = benchmark::Counter(
      double(problem.kv_bytes_read()) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}

// One side of a Pair benchmark: the kernel variants and the modes of its step.
struct Variant {
  std::optional<QMode> q_mode;  // unset: the backend's auto mode for bf16 queries
  PMode p_mode = PMode::fp32;
  bool bf16_dot = true;  // false: turned off (else as the environment has it)
  bool amx = true;
  std::optional<bool> avoid_subnormals;  // unset: as this CPU's kernel config has it
  std::optional<bool> fma_pair_scores;   // unset: as this CPU's kernel config has it
};

// The calling thread's CPU time in nanoseconds.
double thread_ns() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e9 + double(t.tv_nsec);
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Calls call(0) and call(1) in turn, which goes first alternating, each returning its time, and
// sets the counters ns_a and ns_b (medians) and b_over_a (the median of the ratio call by call).
template <class Call>
void AlternateCalls(benchmark::State& state, Call&& call) {
  std::vector<double> ns[2], ratios;
  std::int64_t calls = 0;
  for (auto _ : state) {
    double took[2];
    for (int k = 0; k < 2; ++k) {
      const int side = int((calls + k) % 2);
      took[side] = call(side);
      ns[side].push_back(took[side]);
    }
    ratios.push_back(took[1] / took[0]);
    ++calls;
  }
  state.counters["ns_a"] = median(ns[0]);
  state.counters["ns_b"] = median(ns[1]);
  state.counters["b_over_a"] = median(ratios);
}

void Pair(benchmark::State& state, Format format, int group, int q_len, Variant a, Variant b) {
  verify::Problem problem(DecodeSpec(format, group, q_len));
  struct Side {
    std::unique_ptr<Backend> backend;
    DecodeArgs args;
    BackendPlan plan{PlanCapacity{1, kKvHeads, 16}};
    std::vector<std::byte> workspace;
  };
  Side sides[2];
  const Variant* variants[2] = {&a, &b};
  for (int i = 0; i < 2; ++i) {
    Side& side = sides[i];
    BackendOptions options = OneThread();
    options.cpu_kernels.bf16_dot &= variants[i]->bf16_dot;
    options.cpu_kernels.amx &= variants[i]->amx;
    if (variants[i]->avoid_subnormals) {
      options.cpu_kernels.avoid_fp32_subnormals = variants[i]->avoid_subnormals;
    }
    if (variants[i]->fma_pair_scores) {
      options.cpu_kernels.fma_pair_scores = variants[i]->fma_pair_scores;
    }
    side.backend = make_backend("cpu", options);
    side.args = problem.args();
    side.args.params.q_mode = variants[i]->q_mode.value_or(
        side.backend->auto_modes(side.args.cache.geometry, group * q_len, true).q_mode);
    side.args.params.p_mode = variants[i]->p_mode;
    side.backend->plan(side.plan, side.args.step_shape(), PlanOptions{.workers = 1});
    side.workspace.resize(side.backend->workspace_bytes(side.plan.plan(), side.args.cache.geometry,
                                                        side.args.params));
    side.backend->run(side.args, side.plan, side.workspace);  // warm-up
  }
  const double token_heads = double(kContext) * kKvHeads;
  AlternateCalls(state, [&](int i) {
    Side& side = sides[i];
    const double begin = thread_ns();
    side.backend->run(side.args, side.plan, side.workspace);
    return (thread_ns() - begin) / token_heads;
  });
}

// Two threads, one batch-1 step (B2NHD) planned two ways, one call of each in turn (wall time,
// ns per token-head as in Pair): the plan counting every KV head as work that runs apart
// (PlanOptions::heads_together_min_tokens 0, how the CPU was planned before: one chunk, which P
// modes that round P from scores run as two groups of heads) against the CPU backend's own plan
// (a chunk per thread). Q as the auto modes take it for bf16 queries.
void PlanPair(benchmark::State& state, Format format, int group, PMode p_mode) {
  verify::Problem problem(DecodeSpec(format, group, 1));
  const auto backend = make_backend(
      "cpu", BackendOptions{.threads = 2, .cpu_kernels = cpu_kernel_options_from_environment()});
  DecodeArgs args = problem.args();
  args.params.q_mode = backend->auto_modes(args.cache.geometry, group, true).q_mode;
  args.params.p_mode = p_mode;
  PlanOptions apart = backend->plan_options();
  apart.heads_together_min_tokens = 0;
  const PlanOptions sides_options[2] = {apart, backend->plan_options()};
  struct Side {
    BackendPlan plan{PlanCapacity{1, kKvHeads, 16}};
    std::vector<std::byte> workspace;
  };
  Side sides[2];
  for (int i = 0; i < 2; ++i) {
    backend->plan(sides[i].plan, args.step_shape(), sides_options[i]);
    sides[i].workspace.resize(
        backend->workspace_bytes(sides[i].plan.plan(), args.cache.geometry, args.params));
    backend->run(args, sides[i].plan, sides[i].workspace);  // warm-up
  }
  const double token_heads = double(kContext) * kKvHeads;
  AlternateCalls(state, [&](int i) {
    const auto begin = std::chrono::steady_clock::now();
    backend->run(args, sides[i].plan, sides[i].workspace);
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - begin;
    return took.count() / token_heads;
  });
  state.counters["splits_b"] = sides[1].plan.plan().num_splits[0];
}

// A prompt's prefill on one core: one sequence of kPrefillTokens tokens, all of them query tokens
// (a ragged step, causal), Q in bf16 (or int8, as the auto modes pick for the formats whose codes
// are small integers), resident. ns_per_row_key: per query row (token x query head) and KV token
// it sees, the unit flash attention kernels are compared in.
constexpr int kPrefillTokens = 1024;

// The prompt Prefill and PrefillPair time.
verify::ProblemSpec PrefillSpec(Format format, QMode q_mode, PMode p_mode) {
  verify::ProblemSpec spec;
  spec.format = format;
  spec.num_kv_heads = kKvHeads;
  spec.group = 4;
  spec.head_dim = kHeadDim;
  spec.params.q_len = 0;
  spec.params.q_mode = q_mode;
  spec.params.p_mode = p_mode;
  spec.seq_lens = {kPrefillTokens};
  spec.query_lens = {kPrefillTokens};
  spec.keep_original_kv = false;
  return spec;
}

void Prefill(benchmark::State& state, Format format, QMode q_mode, PMode p_mode) {
  const verify::ProblemSpec spec = PrefillSpec(format, q_mode, p_mode);
  verify::Problem problem(spec);
  const DecodeArgs args = problem.args();
  const auto backend = make_backend("cpu", OneThread());
  PlanOptions options;
  options.workers = 1;
  const StepShape step = args.step_shape();
  BackendPlan plan(capacity_for(step, options));
  backend->plan(plan, step, options);
  std::vector<std::byte> workspace(
      backend->workspace_bytes(plan.plan(), args.cache.geometry, args.params));
  for (auto _ : state) backend->run(args, plan, workspace);
  const double row_keys = double(kPrefillTokens) * (kPrefillTokens + 1) / 2 * kKvHeads *
                          spec.group * double(state.iterations());
  state.counters["ns_per_row_key"] =
      benchmark::Counter(row_keys / 1e9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// Prefill with the 16 x 16 score blocks on the dot products (a) against fp32 FMAs (b), one call
// of each in turn, as Pair does (thread CPU time; ns per row and key).
void PrefillPair(benchmark::State& state, Format format, PMode p_mode) {
  const verify::ProblemSpec spec = PrefillSpec(format, QMode::bf16, p_mode);
  verify::Problem problem(spec);
  const DecodeArgs args = problem.args();
  std::unique_ptr<Backend> backends[2];
  for (int i = 0; i < 2; ++i) {
    BackendOptions options = OneThread();
    options.cpu_kernels.fma_pair_scores = i == 1;
    backends[i] = make_backend("cpu", options);
  }
  PlanOptions options;
  options.workers = 1;
  const StepShape step = args.step_shape();
  BackendPlan plans[2] = {BackendPlan(capacity_for(step, options)),
                          BackendPlan(capacity_for(step, options))};
  std::vector<std::byte> workspace;
  for (int i = 0; i < 2; ++i) {
    backends[i]->plan(plans[i], step, options);
    workspace.resize(
        std::max(workspace.size(),
                 backends[i]->workspace_bytes(plans[i].plan(), args.cache.geometry, args.params)));
  }
  const double row_keys = double(kPrefillTokens) * (kPrefillTokens + 1) / 2 * kKvHeads * spec.group;
  AlternateCalls(state, [&](int i) {
    const double begin = thread_ns();
    backends[i]->run(args, plans[i], workspace);
    return (thread_ns() - begin) / row_keys;
  });
}

void FmaPeak(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(fma_peak_flops_one_thread());
  state.counters["gflops"] = fma_peak_flops_one_thread() / 1e9;
}

const int registered = [] {
  // Q in fp32 (the default) and in bf16, where CPUs with AVX512_BF16 run Q . K on dot products;
  // in int8 for the formats whose codes are small integers (in integer dot products with VNNI).
  // P in fp32, and in bf16 (a "/pbf16" suffix) with Q in bf16 or int8, where P . V runs on AMX
  // tiles or the bf16 dot products; in fp16 ("/pfp16") for the formats it takes, where P . V runs
  // on fp16 FMAs (CPUs with AVX512-FP16).
  for (const PMode p_mode : {PMode::fp32, PMode::bf16, PMode::fp16}) {
    for (const QMode q_mode : {QMode::fp32, QMode::bf16, QMode::int8}) {
      if (p_mode != PMode::fp32 && q_mode == QMode::fp32) continue;
      for (const Format format : kAllFormats) {
        if (p_mode == PMode::fp16 && !half_sums_take(format)) continue;
        if (q_mode == QMode::int8 && format != Format::fp4_e2m1 && format != Format::fp6_e2m3 &&
            format != Format::nvfp4) {
          continue;
        }
        for (const auto [group, q_len] : {std::pair{4, 1}, std::pair{4, 4}, std::pair{8, 1}}) {
          const std::string name =
              "Decode/" + std::string(to_string(format)) + "/g" + std::to_string(group) + "/q_len" +
              std::to_string(q_len) + "/q" + std::string(to_string(q_mode)) +
              (p_mode == PMode::fp32 ? "" : "/p" + std::string(to_string(p_mode)));
          benchmark::RegisterBenchmark(name.c_str(), Decode, format, group, q_len, q_mode, p_mode)
              ->Unit(benchmark::kMicrosecond);
        }
      }
    }
  }
  for (const PMode p_mode : {PMode::fp32, PMode::bf16, PMode::fp16}) {
    for (const Format format : kAllFormats) {
      if (p_mode == PMode::fp16 && !half_sums_take(format)) continue;
      const std::string name =
          "Prefill/" + std::string(to_string(format)) + "/p" + std::string(to_string(p_mode));
      benchmark::RegisterBenchmark(name.c_str(), Prefill, format, QMode::bf16, p_mode)
          ->Unit(benchmark::kMillisecond);
      if (format == Format::fp4_e2m1 || format == Format::fp6_e2m3 || format == Format::nvfp4) {
        benchmark::RegisterBenchmark((name + "/qint8").c_str(), Prefill, format, QMode::int8,
                                     p_mode)
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  // Pairs, g 4 (and g 8 for P): what the auto modes would choose between, on this CPU.
  for (const Format format : kAllFormats) {
    const std::string shape = "/" + std::string(to_string(format)) + "/g4/";
    benchmark::RegisterBenchmark(("Pair" + shape + "q_len1/pfp32_vs_pbf16").c_str(), Pair, format,
                                 4, 1, Variant{std::nullopt, PMode::fp32},
                                 Variant{std::nullopt, PMode::bf16})
        ->Unit(benchmark::kMicrosecond);
    // P in bf16 at 8 and 16 rows too: the rows from which the auto modes choose it, on the tiles
    // (8) or on the dot products (16, where KernelConfig::bf16_dot_values).
    const std::string g8 = "Pair/" + std::string(to_string(format)) + "/g8/";
    benchmark::RegisterBenchmark((g8 + "q_len1/pfp32_vs_pbf16").c_str(), Pair, format, 8, 1,
                                 Variant{std::nullopt, PMode::fp32},
                                 Variant{std::nullopt, PMode::bf16})
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("Pair" + shape + "q_len4/pfp32_vs_pbf16").c_str(), Pair, format,
                                 4, 4, Variant{std::nullopt, PMode::fp32},
                                 Variant{std::nullopt, PMode::bf16})
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("Pair" + shape + "q_len1/fma_vs_dot").c_str(), Pair, format, 4, 1,
                                 Variant{QMode::bf16, PMode::fp32, /*bf16_dot=*/false},
                                 Variant{QMode::bf16, PMode::fp32, true, /*amx=*/false})
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("Pair" + shape + "q_len4/noamx_vs_amx").c_str(), Pair, format, 4,
                                 4, Variant{QMode::bf16, PMode::bf16, true, /*amx=*/false},
                                 Variant{QMode::bf16, PMode::bf16})
        ->Unit(benchmark::kMicrosecond);
    if (cpu::cpu_has_int8_dot() &&
        (format == Format::fp4_e2m1 || format == Format::fp6_e2m3 || format == Format::nvfp4)) {
      benchmark::RegisterBenchmark(("Pair" + shape + "q_len1/qbf16_vs_qint8").c_str(), Pair, format,
                                   4, 1, Variant{QMode::bf16, PMode::fp32},
                                   Variant{QMode::int8, PMode::fp32})
          ->Unit(benchmark::kMicrosecond);
    }
    if (format != Format::bf16 && format != Format::fp16) {
      benchmark::RegisterBenchmark(("Pair" + shape + "q_len1/pfp32_vs_pfp16").c_str(), Pair, format,
                                   4, 1, Variant{std::nullopt, PMode::fp32},
                                   Variant{std::nullopt, PMode::fp16})
          ->Unit(benchmark::kMicrosecond);
      for (const auto [group, q_len] : {std::pair{8, 1}, std::pair{4, 4}}) {
        benchmark::RegisterBenchmark(
            ("Pair/" + std::string(to_string(format)) + "/g" + std::to_string(group) + "/q_len" +
             std::to_string(q_len) + "/pfp16_vs_pbf16")
                .c_str(),
            Pair, format, group, q_len, Variant{std::nullopt, PMode::fp16},
            Variant{std::nullopt, PMode::bf16})
            ->Unit(benchmark::kMicrosecond);
      }
      Variant avoid, make;
      avoid.avoid_subnormals = true;
      make.avoid_subnormals = false;
      benchmark::RegisterBenchmark(("Pair" + shape + "q_len1/avoid_vs_make_subnormals").c_str(),
                                   Pair, format, 4, 1, avoid, make)
          ->Unit(benchmark::kMicrosecond);
    }
  }
  // The 16 x 16 score blocks on the dot products against fp32 FMAs, where Q . K runs in them
  // (Q bf16; 16 rows and more): the formats whose K rows are bf16 words or decode into them.
  for (const Format format : {Format::bf16, Format::fp8_e4m3, Format::fp8_e5m2, Format::fp6_e2m3,
                              Format::fp6_e3m2, Format::fp4_e2m1}) {
    benchmark::RegisterBenchmark(
        ("Pair/" + std::string(to_string(format)) + "/g4/q_len4/dot_vs_fma_pairs").c_str(), Pair,
        format, 4, 4, Variant{QMode::bf16, PMode::fp32, true, true, std::nullopt, false},
        Variant{QMode::bf16, PMode::fp32, true, true, std::nullopt, true})
        ->Unit(benchmark::kMicrosecond);
    for (const PMode p_mode : {PMode::fp32, PMode::fp16}) {
      if (p_mode == PMode::fp16 && !half_sums_take(format)) continue;
      benchmark::RegisterBenchmark(("PrefillPair/" + std::string(to_string(format)) + "/p" +
                                    std::string(to_string(p_mode)) + "/dot_vs_fma_pairs")
                                       .c_str(),
                                   PrefillPair, format, p_mode)
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (const Format format : kAllFormats) {
    for (const PMode p_mode : {PMode::fp32, PMode::bf16, PMode::fp16}) {
      if (p_mode == PMode::fp16 && !half_sums_take(format)) continue;
      for (const int group : {4, 8}) {
        benchmark::RegisterBenchmark(
            ("PlanPair/" + std::string(to_string(format)) + "/g" + std::to_string(group) + "/p" +
             std::string(to_string(p_mode)) + "/heads_apart_vs_together")
                .c_str(),
            PlanPair, format, group, p_mode)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
    }
  }
  benchmark::RegisterBenchmark("FmaPeak/1thread", FmaPeak)->Iterations(1);
  return 0;
}();

// Disables every target better than `name`; false if no compiled target has that name.
bool limit_to_target(const std::string& name) {
  for (std::int64_t targets = HWY_TARGETS; targets != 0; targets &= targets - 1) {
    const std::int64_t target = targets & -targets;
    if (name == hwy::TargetName(target)) {
      hwy::DisableTargets(target - 1);  // lower bits are the better targets
      return true;
    }
  }
  return false;
}

}  // namespace
}  // namespace mjolnir

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--target=", 9) != 0) {
      args.push_back(argv[i]);
    } else if (!mjolnir::limit_to_target(argv[i] + 9)) {
      std::string known;
      for (const std::string& name : mjolnir::cpu::kernel_targets()) known += " " + name;
      std::fprintf(stderr, "kernel_rates: --target: no compiled target named '%s' (compiled:%s)\n",
                   argv[i] + 9, known.c_str());
      return 2;
    }
  }
  int count = int(args.size());
  benchmark::Initialize(&count, args.data());
  if (benchmark::ReportUnrecognizedArguments(count, args.data())) return 1;
  benchmark::AddCustomContext("kernel_target", mjolnir::cpu::kernel_target());
  benchmark::AddCustomContext(
      "bf16_dot_products",
      mjolnir::cpu::resolve_kernel_config(mjolnir::OneThread().cpu_kernels).bf16_dot ? "yes"
                                                                                     : "no");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

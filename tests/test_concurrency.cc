// The thread-safety contract (README.md "Threads", docs/c-api.md "Threads."), exercised with
// kThreads threads at once, each running many steps:
//  - one CPU backend, one plan and one cache view shared by every thread, each with its own
//    workspace, queries and modes; and one CPU backend serving threads with plans of their own;
//  - a backend per thread (CPU backends and the reference emulator), and CPU backends sharing one
//    executor (a host program's pool);
//  - write_kv from several threads into disjoint slots of one pool, and into pages no sequence
//    holds while the others are decoded from the same pool;
//  - the C API: a backend handle and workspace per thread sharing one cache and one plan handle,
//    with mjolnir_last_error() and the backend's message staying each thread's own.
// Every concurrent result must equal, bit for bit, the same step run alone beforehand (the
// backends are deterministic for a given plan; checked first).
//
// `scripts/test.sh --tsan` runs this file under ThreadSanitizer, which also catches races that
// happen to give the right bits. It does not see everything: GCC does not instrument masked SIMD
// loads and stores (intrinsics such as _mm512_maskz_loadu_epi8, which the kernels use for rows
// that are not a whole vector), so races on the pool or the outputs through them show only in
// the bit-for-bit comparisons here.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <latch>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "capi_handles.h"
#include "cpu/thread_pool.h"
#include "mjolnir/cache.h"
#include "mjolnir/decode.h"
#include "mjolnir/mjolnir.h"
#include "mjolnir/plan.h"
#include "mjolnir/write_kv.h"
#include "test_seed.h"
#include "verify/problem.h"

namespace mjolnir {
namespace {

using testing::test_seed;  // fresh per run, printed; MJOLNIR_TEST_SEED replays one

// Threads that run at once in every test, and decode steps each. Under ThreadSanitizer (5-15x
// slower; GCC defines __SANITIZE_THREAD__, clang has __has_feature) fewer steps, and fewer still
// with MJOLNIR_TEST_QUICK=1 (the ASan suite, and the Arm check under qemu, where 200 steps took
// over 5 minutes a test).
#if defined(__SANITIZE_THREAD__)
#define MJOLNIR_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MJOLNIR_TEST_TSAN 1
#endif
#endif
constexpr int kThreads = 4;
int steps() {
  static const int count = [] {
    const char* quick = std::getenv("MJOLNIR_TEST_QUICK");
    if (quick != nullptr && std::string_view(quick) == "1") return 8;
#ifdef MJOLNIR_TEST_TSAN
    return 40;
#else
    return 200;
#endif
  }();
  return count;
}

// A generator per test: the run's seed mixed with the test's name, so tests are independent.
std::mt19937_64 make_rng() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  return std::mt19937_64(test_seed() ^ std::hash<std::string>{}(name));
}

std::string seed_note() { return "MJOLNIR_TEST_SEED=" + std::to_string(test_seed()); }

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Random N(0, 1) queries of a step: never all zero.
std::vector<float> random_queries(std::mt19937_64& rng, std::size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(n);
  for (float& x : q) x = normal(rng);
  return q;
}

// O and LSE of one step, poisoned with NaN before each run so a row left unwritten shows.
struct Outputs {
  std::vector<float> o, lse;
  explicit Outputs(const DecodeArgs& args)
      : o(std::size_t(args.num_query_rows()) * args.params.num_q_heads *
          args.cache.geometry.head_dim),
        lse(std::size_t(args.num_query_rows()) * args.params.num_q_heads) {}
  void poison() {
    std::fill(o.begin(), o.end(), std::numeric_limits<float>::quiet_NaN());
    std::fill(lse.begin(), lse.end(), std::numeric_limits<float>::quiet_NaN());
  }
  // `args` with q from `q` and o, lse pointing here (dense rows, as Problem lays them out).
  DecodeArgs bind(DecodeArgs args, const std::vector<float>& q) {
    const std::int64_t d = args.cache.geometry.head_dim;
    args.q = QueryTensor{q.data(), args.params.num_q_heads * d, d};
    args.o = OutputTensor{o.data(), args.params.num_q_heads * d, d};
    args.lse = lse;
    return args;
  }
  bool operator==(const Outputs& other) const {
    return same_bits(o, other.o) && same_bits(lse, other.lse);
  }
};

// What one thread saw go wrong in its steps: the first failure, and how many there were.
struct ThreadReport {
  int failures = 0;
  std::string first;
  void fail(const std::string& what) {
    if (failures++ == 0) first = what;
  }
};

// Starts `body(t)` on kThreads threads at once (they wait for each other first) and joins them.
// An exception that ends a thread's body is a failure of the test.
void run_threads(const std::function<void(int)>& body) {
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      try {
        body(t);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << t << " threw: " << e.what() << " (" << seed_note() << ")";
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

void expect_clean(const std::vector<ThreadReport>& reports) {
  for (std::size_t t = 0; t < reports.size(); ++t) {
    EXPECT_EQ(reports[t].failures, 0)
        << "thread " << t << ": " << reports[t].failures << " failures in " << steps()
        << " steps (a result that differs from the single-threaded run's, or a message that is "
           "not the thread's own); first: "
        << reports[t].first << " (" << seed_note() << ")";
  }
}

constexpr NumericsModes kModes[] = {
    {QMode::fp32, PMode::fp32}, {QMode::bf16, PMode::bf16}, {QMode::fp8, PMode::fp8},
    {QMode::bf16, PMode::fp32}, {QMode::fp32, PMode::bf16}, {QMode::fp8, PMode::bf16},
};

// Several query variants per thread, each with its numerics modes, and their outputs from a run
// alone on the calling thread.
struct Variant {
  std::vector<float> q;
  DecodeParams params;
  std::unique_ptr<Outputs> expected;
};

// ---- a. one CPU backend, one plan, one cache view, shared by every thread -----------------------

TEST(Concurrency, SharedCpuBackendPlanAndCacheGiveTheSingleThreadedBits) {
  auto rng = make_rng();
  verify::ProblemSpec spec;
  spec.format = Format::fp8_e4m3;
  spec.layout = Layout::B2HND;
  spec.granularity = ScaleGranularity::channel;
  spec.head_dim = 64;
  spec.num_kv_heads = 2;
  spec.group = 4;
  spec.params.q_len = 2;  // 8 query rows a tile: AMX tiles where the CPU has them
  spec.seq_lens = {700, 37, 0, 300, 129};
  spec.keep_original_kv = false;
  spec.seed = rng();
  verify::Problem problem(spec);
  const DecodeArgs base = problem.args();

  const auto backend = make_backend("cpu", {.threads = 2});
  BackendPlan plan(PlanCapacity{base.batch.num_seqs(), spec.num_kv_heads, 16});
  // Planned for more workers than the backend has, so the long sequences are split and the
  // split merges run as well as the token-part merges of chunks cut for the threads.
  backend->plan(plan, base.step_shape(), PlanOptions{.workers = 16});
  ASSERT_GT(plan.plan().num_partials, 0) << "the step should split a sequence (merges run too)";

  // Each thread's queries and modes differ, so a thread handed another's result is caught.
  constexpr int kVariants = 3;
  std::vector<std::vector<Variant>> variants(kThreads);
  std::size_t workspace_bytes = 0;
  for (int t = 0; t < kThreads; ++t) {
    for (int v = 0; v < kVariants; ++v) {
      Variant& variant = variants[t].emplace_back();
      variant.q = random_queries(rng, problem.query().size());
      variant.params = base.params;
      const NumericsModes modes = kModes[(t * kVariants + v) % std::size(kModes)];
      variant.params.q_mode = modes.q_mode;
      variant.params.p_mode = modes.p_mode;
      workspace_bytes =
          std::max(workspace_bytes,
                   backend->workspace_bytes(plan.plan(), base.cache.geometry, variant.params));
    }
  }

  // The single-threaded results, each run twice: the CPU backend is deterministic for a given
  // plan (units go to whichever worker is free, but each is computed alone and the merges add
  // in a fixed order), which is what lets the concurrent runs be held to the same bits.
  {
    std::vector<std::byte> workspace(workspace_bytes);
    for (auto& thread_variants : variants) {
      for (Variant& variant : thread_variants) {
        DecodeArgs args = base;
        args.params = variant.params;
        variant.expected = std::make_unique<Outputs>(args);
        Outputs again(args);
        variant.expected->poison();
        backend->run(variant.expected->bind(args, variant.q), plan, workspace);
        again.poison();
        backend->run(again.bind(args, variant.q), plan, workspace);
        ASSERT_TRUE(again == *variant.expected)
            << "the CPU backend is not deterministic for a plan (" << seed_note() << ")";
        ASSERT_TRUE(
            std::all_of(again.o.begin(), again.o.end(), [](float x) { return std::isfinite(x); }));
      }
    }
  }

  std::vector<ThreadReport> reports(kThreads);
  run_threads([&](int t) {
    std::vector<std::byte> workspace(workspace_bytes);  // each thread its own
    DecodeArgs args = base;
    Outputs out(args);
    for (int step = 0; step < steps(); ++step) {
      const Variant& variant = variants[t][step % kVariants];
      args.params = variant.params;
      out.poison();
      backend->run(out.bind(args, variant.q), plan, workspace);
      if (!(out == *variant.expected)) reports[t].fail("step " + std::to_string(step));
    }
  });
  expect_clean(reports);
}

// ---- b. a backend per thread: CPU backends and the emulator, each on its own problem ------------

// A random small problem: format, layout, granularity, lengths, q_len and modes drawn.
verify::ProblemSpec random_spec(std::mt19937_64& rng, int max_len) {
  constexpr Format kFormats[] = {Format::fp8_e4m3, Format::fp8_e5m2, Format::fp6_e2m3,
                                 Format::fp4_e2m1, Format::nvfp4,    Format::bf16};
  auto pick = [&](auto& values) {
    return values[std::uniform_int_distribution<std::size_t>(0, std::size(values) - 1)(rng)];
  };
  constexpr ScaleGranularity kGranularities[] = {ScaleGranularity::tensor, ScaleGranularity::head,
                                                 ScaleGranularity::channel};
  verify::ProblemSpec spec;
  spec.format = pick(kFormats);
  spec.layout = pick(kAllLayouts);
  spec.granularity = pick(kGranularities);
  spec.head_dim = 64;
  spec.num_kv_heads = std::uniform_int_distribution<int>(1, 2)(rng);
  spec.group = std::uniform_int_distribution<int>(1, 4)(rng);
  spec.params.q_len = std::uniform_int_distribution<int>(1, 3)(rng);
  const NumericsModes modes = pick(kModes);
  spec.params.q_mode = modes.q_mode;
  spec.params.p_mode = modes.p_mode;
  const int num_seqs = std::uniform_int_distribution<int>(1, 3)(rng);
  std::uniform_int_distribution<int> len(spec.params.q_len, max_len);
  for (int b = 0; b < num_seqs; ++b) spec.seq_lens.push_back(len(rng));
  spec.keep_original_kv = false;
  spec.seed = rng();
  return spec;
}

std::string describe(const verify::ProblemSpec& spec) {
  std::ostringstream os;
  os << to_string(spec.format) << "/" << to_string(spec.layout) << "/"
     << to_string(spec.granularity) << " Hk " << spec.num_kv_heads << " g " << spec.group
     << " q_len " << spec.params.q_len << " Q " << to_string(spec.params.q_mode) << " P "
     << to_string(spec.params.p_mode) << " seq_lens";
  for (int len : spec.seq_lens) os << " " << len;
  return os.str();
}

// One thread's serving loop: its own backend, problem, plan and workspace; the plan is remade
// every step, as a serving loop does.
struct Lane {
  std::shared_ptr<const Backend> backend;
  std::unique_ptr<verify::Problem> problem;
  std::unique_ptr<Outputs> expected;

  void step(BackendPlan& plan, std::vector<std::byte>& workspace, Outputs& out) const {
    const DecodeArgs args = problem->args();
    PlanOptions options{.workers = backend->workers()};
    backend->plan(plan, args.step_shape(), options);
    workspace.resize(backend->workspace_bytes(plan.plan(), args.cache.geometry, args.params));
    out.poison();
    backend->run(out.bind(args, problem->query()), plan, workspace);
  }
  BackendPlan new_plan() const {
    const DecodeArgs args = problem->args();
    return BackendPlan(PlanCapacity{args.batch.num_seqs(), args.cache.geometry.num_kv_heads, 16});
  }
};

// Runs each lane alone, then all at once for steps() steps each; every result must be the alone
// result's bits.
void check_lanes(std::vector<Lane>& lanes) {
  for (Lane& lane : lanes) {
    SCOPED_TRACE(describe(lane.problem->spec()));
    BackendPlan plan = lane.new_plan();
    std::vector<std::byte> workspace;
    lane.expected = std::make_unique<Outputs>(lane.problem->args());
    lane.step(plan, workspace, *lane.expected);
    Outputs again(lane.problem->args());
    lane.step(plan, workspace, again);
    ASSERT_TRUE(again == *lane.expected)
        << "backend " << lane.backend->name() << " is not deterministic (" << seed_note() << ")";
  }
  std::vector<ThreadReport> reports(lanes.size());
  run_threads([&](int t) {
    const Lane& lane = lanes[t];
    BackendPlan plan = lane.new_plan();
    std::vector<std::byte> workspace;
    Outputs out(lane.problem->args());
    for (int step = 0; step < steps(); ++step) {
      lane.step(plan, workspace, out);
      if (!(out == *lane.expected)) {
        reports[t].fail(std::string(lane.backend->name()) + " " + describe(lane.problem->spec()) +
                        ", step " + std::to_string(step));
      }
    }
  });
  expect_clean(reports);
}

TEST(Concurrency, ABackendPerThreadGivesTheSingleThreadedBits) {
  auto rng = make_rng();
  std::vector<Lane> lanes(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    // Two CPU backends of two threads, one of one thread, and the emulator.
    lanes[t].backend = t == kThreads - 1 ? make_backend("reference")
                                         : make_backend("cpu", {.threads = t == 2 ? 1 : 2});
    // The emulator is bit-faithful and slow: shorter sequences for it.
    lanes[t].problem =
        std::make_unique<verify::Problem>(random_spec(rng, t == kThreads - 1 ? 200 : 900));
  }
  check_lanes(lanes);
}

// One CPU backend serving every thread, each with its own problem and plan: the backend's
// per-call state (its schedule of units, the workers' scratch) must not leak between calls.
TEST(Concurrency, OneCpuBackendServesThreadsWithPlansOfTheirOwn) {
  auto rng = make_rng();
  const std::shared_ptr<const Backend> backend = make_backend("cpu", {.threads = 2});
  std::vector<Lane> lanes(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    lanes[t].backend = backend;
    lanes[t].problem = std::make_unique<verify::Problem>(random_spec(rng, 900));
  }
  check_lanes(lanes);
}

// CPU backends handed one executor (a serving engine's pool, BackendOptions::executor): the pool
// runs one parallel_for at a time, so their calls take turns on it.
TEST(Concurrency, CpuBackendsSharingOneExecutorGiveTheSingleThreadedBits) {
  auto rng = make_rng();
  const auto pool = std::make_shared<cpu::ThreadPool>(2);
  std::vector<Lane> lanes(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    lanes[t].backend = make_backend("cpu", {.executor = pool});
    lanes[t].problem = std::make_unique<verify::Problem>(random_spec(rng, 900));
  }
  check_lanes(lanes);
}

// ---- c. concurrent write_kv into disjoint slots of one pool -------------------------------------

// One write_kv call: its tokens' K and V ([tokens, Hk, D] dense) and their slots.
struct WriteCall {
  std::vector<float> k, v;
  std::vector<std::int64_t> slots;

  void run(const KvCacheView& view, AmaxRecorder* amax = nullptr) const {
    const std::int64_t d = view.geometry.head_dim;
    const std::int64_t token = view.geometry.num_kv_heads * d;
    write_kv(view, TokenRows{k.data(), token, d}, TokenRows{v.data(), token, d}, slots, amax);
  }
};

// `slots` in random order dealt to the threads in turn, so neighbouring rows of a page (sub-byte
// rows packed next to each other) belong to different threads; each thread's share cut into
// calls of a few N(0, 1) tokens, each call with a skipped (negative) slot somewhere.
std::vector<std::vector<WriteCall>> deal_writes(std::mt19937_64& rng, const CacheGeometry& geometry,
                                                std::vector<std::int64_t> slots) {
  constexpr std::size_t kTokensPerCall = 3;
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<std::vector<std::int64_t>> thread_slots(kThreads);
  for (std::size_t i = 0; i < slots.size(); ++i) thread_slots[i % kThreads].push_back(slots[i]);
  const std::size_t token_floats = std::size_t(geometry.num_kv_heads) * geometry.head_dim;
  std::vector<std::vector<WriteCall>> calls(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (std::size_t i = 0; i < thread_slots[t].size(); i += kTokensPerCall) {
      WriteCall& call = calls[t].emplace_back();
      const std::size_t end = std::min(thread_slots[t].size(), i + kTokensPerCall);
      call.slots.assign(thread_slots[t].begin() + i, thread_slots[t].begin() + end);
      call.slots.insert(call.slots.begin() + (i / kTokensPerCall) % (call.slots.size() + 1), -1);
      call.k = random_queries(rng, call.slots.size() * token_floats);
      call.v = random_queries(rng, call.slots.size() * token_floats);
    }
  }
  return calls;
}

TEST(Concurrency, WriteKvIntoDisjointSlotsEqualsTheSequentialWrites) {
  auto rng = make_rng();
  constexpr Format kFormats[] = {Format::fp8_e4m3, Format::fp6_e3m2, Format::fp4_e2m1,
                                 Format::nvfp4, Format::bf16};
  for (std::size_t f = 0; f < std::size(kFormats); ++f) {
    CacheGeometry geometry;
    geometry.format = kFormats[f];
    geometry.num_pages = 12;
    geometry.page_size = 16;
    geometry.num_kv_heads = 2;
    geometry.head_dim = 64;
    const Layout layout = kAllLayouts[f % std::size(kAllLayouts)];
    SCOPED_TRACE(std::string(to_string(geometry.format)) + "/" + std::string(to_string(layout)) +
                 " " + seed_note());
    // Scales that fit N(0, 1) values to the format's range (the unquantized ones store values
    // as they are).
    const std::size_t scales = scale_count(ScaleGranularity::channel, 2, 64);
    const float base = is_quantized(geometry.format) ? 4.0f / format_max(geometry.format) : 1.0f;
    std::uniform_real_distribution<float> scale(base * 0.8f, base * 1.25f);
    std::vector<float> k_scale(scales), v_scale(scales);
    for (float& s : k_scale) s = scale(rng);
    for (float& s : v_scale) s = scale(rng);
    // Random bytes in the pool first: rows nobody writes must come out the same too.
    std::vector<std::byte> initial(pool_bytes(geometry));
    for (std::byte& b : initial) b = std::byte(rng() & 0xff);
    const auto view_of = [&](std::vector<std::byte>& pool) {
      KvCacheView view;
      view.geometry = geometry;
      view.strides = layout_strides(geometry, layout);
      view.data = pool.data();
      view.bytes = pool.size();
      view.granularity = ScaleGranularity::channel;
      view.k_scale = k_scale;
      view.v_scale = v_scale;
      return view;
    };

    // Every slot but a few.
    std::vector<std::int64_t> slots(geometry.num_pages * geometry.page_size - 7);
    for (std::size_t i = 0; i < slots.size(); ++i) slots[i] = std::int64_t(i) + 3;
    const auto calls = deal_writes(rng, geometry, slots);

    // Sequential: thread 0's calls, then thread 1's, ...
    const std::size_t amax_floats = std::size_t(geometry.num_kv_heads) * geometry.head_dim;
    std::vector<std::byte> sequential = initial;
    std::vector<float> seq_k_amax(amax_floats, 0.0f), seq_v_amax(amax_floats, 0.0f);
    AmaxRecorder seq_amax{seq_k_amax, seq_v_amax};
    for (const auto& thread_calls : calls) {
      for (const WriteCall& call : thread_calls) call.run(view_of(sequential), &seq_amax);
    }
    ASSERT_NE(sequential, initial);

    // Concurrent: every thread its own calls into the one pool, and its own amax recorder (a
    // call raises the recorder's entries: two calls at once must not share one).
    std::vector<std::byte> shared = initial;
    const KvCacheView shared_view = view_of(shared);
    std::vector<std::vector<float>> k_amax(kThreads, std::vector<float>(amax_floats, 0.0f));
    std::vector<std::vector<float>> v_amax = k_amax;
    run_threads([&](int t) {
      AmaxRecorder amax{k_amax[t], v_amax[t]};
      for (const WriteCall& call : calls[t]) call.run(shared_view, &amax);
    });
    EXPECT_TRUE(shared == sequential) << "the pool differs from the sequential writes'";
    for (std::size_t i = 0; i < amax_floats; ++i) {
      float k = 0, v = 0;
      for (int t = 0; t < kThreads; ++t) {
        k = std::max(k, k_amax[t][i]);
        v = std::max(v, v_amax[t][i]);
      }
      ASSERT_EQ(k, seq_k_amax[i]) << "k amax " << i;
      ASSERT_EQ(v, seq_v_amax[i]) << "v amax " << i;
    }
  }
}

// write_kv into pages no sequence of a step holds, while that step is decoded from the same pool
// (a new request's prompt written while the running ones decode): the decodes give their
// single-threaded bits, the pool ends as the same writes done alone leave it.
TEST(Concurrency, WriteKvIntoFreePagesWhileDecodingTheOthers) {
  auto rng = make_rng();
  verify::ProblemSpec spec;
  spec.format = Format::fp6_e2m3;
  spec.layout = Layout::B2NHD;
  spec.granularity = ScaleGranularity::channel;
  spec.head_dim = 64;
  spec.num_kv_heads = 2;
  spec.group = 4;
  spec.seq_lens = {300, 45, 170};
  spec.extra_pages = 6;  // pages of the pool no sequence holds
  spec.keep_original_kv = false;
  spec.seed = rng();
  verify::Problem problem(spec);
  const DecodeArgs base = problem.args();
  const CacheGeometry& geometry = base.cache.geometry;

  std::vector<bool> held(geometry.num_pages, false);
  for (std::int32_t page : base.batch.block_table) {
    if (page >= 0) held[page] = true;
  }
  std::vector<std::int64_t> free_slots;
  for (int page = 0; page < geometry.num_pages; ++page) {
    if (held[page]) continue;
    for (int i = 0; i < geometry.page_size; ++i)
      free_slots.push_back(page * geometry.page_size + i);
  }
  ASSERT_EQ(free_slots.size(), std::size_t(spec.extra_pages) * geometry.page_size);
  // Threads 0 and 1 write (each its own slots), 2 and 3 decode.
  auto calls = deal_writes(rng, geometry, free_slots);
  calls[0].insert(calls[0].end(), calls[2].begin(), calls[2].end());
  calls[1].insert(calls[1].end(), calls[3].begin(), calls[3].end());

  const std::span<const std::byte> pool(base.cache.data, base.cache.bytes);
  std::vector<std::byte> expected_pool(pool.begin(), pool.end());
  {
    KvCacheView view = base.cache;
    view.data = expected_pool.data();
    for (int t = 0; t < 2; ++t) {
      for (const WriteCall& call : calls[t]) call.run(view);
    }
  }

  const auto backend = make_backend("cpu", {.threads = 2});
  BackendPlan plan(PlanCapacity{base.batch.num_seqs(), spec.num_kv_heads, 16});
  backend->plan(plan, base.step_shape(), PlanOptions{.workers = backend->workers()});
  const std::size_t workspace_bytes = backend->workspace_bytes(plan.plan(), geometry, base.params);
  Outputs expected(base);
  {
    std::vector<std::byte> workspace(workspace_bytes);
    expected.poison();
    backend->run(expected.bind(base, problem.query()), plan, workspace);
  }

  // The writers repeat their calls (the same bytes each time) until both decoders are done, so
  // the two overlap for the whole test.
  std::atomic<int> decoders_running{2};
  std::vector<ThreadReport> reports(kThreads);
  run_threads([&](int t) {
    if (t < 2) {
      do {
        for (const WriteCall& call : calls[t]) call.run(base.cache);
      } while (decoders_running.load() > 0);
      return;
    }
    std::vector<std::byte> workspace(workspace_bytes);
    Outputs out(base);
    for (int step = 0; step < steps(); ++step) {
      out.poison();
      backend->run(out.bind(base, problem.query()), plan, workspace);
      if (!(out == expected)) reports[t].fail("step " + std::to_string(step));
    }
    decoders_running.fetch_sub(1);
  });
  expect_clean(reports);
  EXPECT_TRUE(std::equal(pool.begin(), pool.end(), expected_pool.begin()))
      << "the pool differs from the same writes done alone (" << seed_note() << ")";
}

// ---- d. the C API: a backend handle per thread, one cache and one plan handle shared ------------

using testing::BackendPtr;
using testing::CachePtr;
using testing::PlanPtr;

// The C enum value whose name is `name` (the C values are pinned, the C++ enums need not be).
template <typename Names>
std::int32_t c_value(Names names, std::string_view name) {
  for (std::int32_t i = 0; names(i) != nullptr; ++i) {
    if (name == names(i)) return i;
  }
  ADD_FAILURE() << name << " has no C value";
  return -1;
}

// A cache handle over a Problem's pool, with its strides given explicitly.
CachePtr c_cache(const KvCacheView& view) {
  mjolnir_cache_desc desc;
  mjolnir_cache_desc_init(&desc);
  desc.format = c_value(mjolnir_format_name, to_string(view.geometry.format));
  desc.page_size = view.geometry.page_size;
  desc.num_kv_heads = view.geometry.num_kv_heads;
  desc.head_dim = view.geometry.head_dim;
  desc.num_pages = view.geometry.num_pages;
  desc.layout = MJOLNIR_LAYOUT_STRIDES;
  desc.page_stride = view.strides.page;
  desc.head_stride = view.strides.head;
  desc.token_stride = view.strides.token;
  desc.kv_stride = view.strides.kv;
  desc.granularity = c_value(mjolnir_granularity_name, to_string(view.granularity));
  desc.k_scale = view.k_scale.data();
  desc.k_scale_count = std::int64_t(view.k_scale.size());
  desc.v_scale = view.v_scale.data();
  desc.v_scale_count = std::int64_t(view.v_scale.size());
  desc.pool = view.data;
  desc.pool_bytes = view.bytes;
  mjolnir_cache* cache = nullptr;
  EXPECT_EQ(mjolnir_cache_create(&desc, &cache), MJOLNIR_OK) << mjolnir_last_error();
  return CachePtr(cache);
}

TEST(Concurrency, CapiBackendPerThreadSharingCacheAndPlanGivesTheSingleThreadedBits) {
  auto rng = make_rng();
  verify::ProblemSpec spec;
  spec.format = Format::nvfp4;
  spec.layout = Layout::BNH2D;
  spec.granularity = ScaleGranularity::head;
  spec.head_dim = 64;
  spec.num_kv_heads = 2;
  spec.group = 2;
  spec.params.q_len = 3;
  spec.seq_lens = {40, 600, 0, 130};
  spec.keep_original_kv = false;
  spec.seed = rng();
  verify::Problem problem(spec);
  const DecodeArgs base = problem.args();
  const auto cache = c_cache(base.cache);
  ASSERT_NE(cache, nullptr);

  // Three CPU backends (two and one threads) and the emulator, one handle per thread.
  std::vector<BackendPtr> backends;
  for (int t = 0; t < kThreads; ++t) {
    mjolnir_backend* b = nullptr;
    ASSERT_EQ(mjolnir_backend_create(t == kThreads - 1 ? "reference" : "cpu", t == 2 ? 1 : 2, &b),
              MJOLNIR_OK)
        << mjolnir_last_error();
    backends.emplace_back(b);
  }
  const int num_seqs = base.batch.num_seqs();
  mjolnir_plan* raw_plan = nullptr;
  ASSERT_EQ(mjolnir_plan_create(num_seqs, spec.num_kv_heads, 16, &raw_plan), MJOLNIR_OK);
  const PlanPtr plan(raw_plan);
  ASSERT_EQ(mjolnir_plan_update(plan.get(), base.batch.seq_lens.data(), num_seqs, spec.params.q_len,
                                backends[0].get()),
            MJOLNIR_OK)
      << mjolnir_plan_last_error(plan.get());

  const auto c_params = [&](const DecodeParams& p) {
    mjolnir_decode_params c;
    mjolnir_decode_params_init(&c);
    c.q_len = p.q_len;
    c.num_q_heads = p.num_q_heads;
    c.causal = p.causal;
    c.q_mode = std::int32_t(p.q_mode);  // the C values are the C++ enums' order
    c.p_mode = std::int32_t(p.p_mode);
    return c;
  };
  const auto c_args = [&](const std::vector<float>& q, Outputs& out) {
    mjolnir_decode_args a;
    mjolnir_decode_args_init(&a);
    const std::int64_t d = spec.head_dim, hq = base.params.num_q_heads;
    a.seq_lens = base.batch.seq_lens.data();
    a.num_seqs = num_seqs;
    a.block_table = base.batch.block_table.data();
    a.max_pages_per_seq = base.batch.max_pages_per_seq;
    a.q = q.data();
    a.q_token_stride = hq * d;
    a.q_head_stride = d;
    a.o = out.o.data();
    a.o_token_stride = hq * d;
    a.o_head_stride = d;
    a.lse = out.lse.data();
    return a;
  };
  // Workspace of each backend, for the largest step it runs (the modes do not change it).
  std::vector<std::size_t> workspace_bytes(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    const mjolnir_decode_params p = c_params(base.params);
    ASSERT_EQ(
        mjolnir_workspace_size(backends[t].get(), plan.get(), cache.get(), &p, &workspace_bytes[t]),
        MJOLNIR_OK)
        << mjolnir_backend_last_error(backends[t].get());
  }
  // Malloc-aligned workspaces (MJOLNIR_WORKSPACE_ALIGNMENT).
  const auto workspace_for = [&](int t) {
    return std::vector<float>(workspace_bytes[t] / sizeof(float) + 1);
  };

  constexpr int kVariants = 2;
  std::vector<std::vector<Variant>> variants(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    std::vector<float> workspace = workspace_for(t);
    for (int v = 0; v < kVariants; ++v) {
      Variant& variant = variants[t].emplace_back();
      variant.q = random_queries(rng, problem.query().size());
      variant.params = base.params;
      const NumericsModes modes = kModes[(t * kVariants + v) % std::size(kModes)];
      variant.params.q_mode = modes.q_mode;
      variant.params.p_mode = modes.p_mode;
      variant.expected = std::make_unique<Outputs>(base);
      variant.expected->poison();
      const mjolnir_decode_params p = c_params(variant.params);
      const mjolnir_decode_args a = c_args(variant.q, *variant.expected);
      ASSERT_EQ(mjolnir_decode(backends[t].get(), plan.get(), cache.get(), &p, &a, workspace.data(),
                               workspace_bytes[t]),
                MJOLNIR_OK)
          << mjolnir_backend_last_error(backends[t].get());
    }
  }

  // Every fourth step a thread also makes two calls fail on purpose, with a number that is its
  // own in each message: one before any handle exists (mjolnir_last_error only) and one on its
  // backend handle. The thread's message must stay its own while the others succeed and fail.
  std::vector<ThreadReport> reports(kThreads);
  run_threads([&](int t) {
    mjolnir_backend* backend = backends[t].get();
    std::vector<float> workspace = workspace_for(t);
    Outputs out(base);
    for (int step = 0; step < steps(); ++step) {
      const Variant& variant = variants[t][step % kVariants];
      const mjolnir_decode_params p = c_params(variant.params);
      out.poison();
      const mjolnir_decode_args a = c_args(variant.q, out);
      const mjolnir_status status = mjolnir_decode(backend, plan.get(), cache.get(), &p, &a,
                                                   workspace.data(), workspace_bytes[t]);
      if (status != MJOLNIR_OK) {
        reports[t].fail("step " + std::to_string(step) + ": " + mjolnir_last_error());
        continue;
      }
      if (std::string_view(mjolnir_last_error()) != "" ||
          std::string_view(mjolnir_backend_last_error(backend)) != "") {
        reports[t].fail("step " + std::to_string(step) + ": a success left a message: '" +
                        mjolnir_last_error() + "'");
      }
      if (!(out == *variant.expected)) reports[t].fail("step " + std::to_string(step));
      if (step % 4 != t % 4) continue;

      const std::int32_t max_seqs = -(1000 * (t + 1) + step);
      mjolnir_plan* never = nullptr;
      if (mjolnir_plan_create(max_seqs, 1, 1, &never) != MJOLNIR_ERROR_INVALID_ARGUMENT) {
        reports[t].fail("mjolnir_plan_create(" + std::to_string(max_seqs) + ") did not fail");
      }
      const std::string create_message = mjolnir_last_error();
      if (create_message.find(std::to_string(max_seqs)) == std::string::npos) {
        reports[t].fail("step " + std::to_string(step) + ": the message of mjolnir_plan_create(" +
                        std::to_string(max_seqs) + ") is '" + create_message + "'");
      }
      std::this_thread::yield();  // the other threads' calls in between
      if (mjolnir_last_error() != create_message) {
        reports[t].fail("step " + std::to_string(step) + ": this thread's message became '" +
                        mjolnir_last_error() + "', was '" + create_message + "'");
      }
      // A workspace a few bytes short, by a count of this thread's own.
      const std::size_t short_bytes = workspace_bytes[t] - 1 - t;
      if (mjolnir_decode(backend, plan.get(), cache.get(), &p, &a, workspace.data(), short_bytes) !=
          MJOLNIR_ERROR_BUFFER_TOO_SMALL) {
        reports[t].fail("a short workspace was accepted");
      }
      const std::string decode_message = mjolnir_last_error();
      std::this_thread::yield();
      if (decode_message.find(std::to_string(short_bytes) + " bytes") == std::string::npos ||
          mjolnir_last_error() != decode_message ||
          mjolnir_backend_last_error(backend) != decode_message) {
        reports[t].fail("step " + std::to_string(step) + ": thread message '" +
                        mjolnir_last_error() + "', backend message '" +
                        mjolnir_backend_last_error(backend) + "', the call's '" + decode_message +
                        "'");
      }
    }
  });
  expect_clean(reports);
}

// mjolnir_write_kv from several threads into distinct slots of one pool, each thread through a
// cache handle of its own over that pool (a call writes the message of the handle it names):
// the pool ends as the same calls made one after another leave it.
TEST(Concurrency, CapiWriteKvThroughACacheHandleEachEqualsTheSequentialWrites) {
  auto rng = make_rng();
  verify::ProblemSpec spec;  // only its geometry, scales and pool are used
  spec.format = Format::fp4_e2m1;
  spec.layout = Layout::_2BNHD;
  spec.granularity = ScaleGranularity::channel;
  spec.head_dim = 64;
  spec.num_kv_heads = 2;
  spec.seq_lens = {100, 60};
  spec.extra_pages = 4;
  spec.keep_original_kv = false;
  spec.seed = rng();
  verify::Problem problem(spec);
  const KvCacheView view = problem.cache();
  const std::span<const std::byte> pool(view.data, view.bytes);
  const std::vector<std::byte> initial(pool.begin(), pool.end());

  std::vector<std::int64_t> slots(std::size_t(view.geometry.num_pages) * view.geometry.page_size);
  for (std::size_t i = 0; i < slots.size(); ++i) slots[i] = std::int64_t(i);
  const auto calls = deal_writes(rng, view.geometry, slots);
  const auto write = [&](mjolnir_cache* cache, const WriteCall& call) {
    const std::int64_t d = view.geometry.head_dim, token = view.geometry.num_kv_heads * d;
    return mjolnir_write_kv(cache, call.k.data(), token, d, call.v.data(), token, d,
                            call.slots.data(), std::int64_t(call.slots.size()), nullptr, nullptr);
  };

  std::vector<CachePtr> caches;
  for (int t = 0; t < kThreads; ++t) caches.push_back(c_cache(view));
  ASSERT_NE(caches.back(), nullptr);
  for (const auto& thread_calls : calls) {
    for (const WriteCall& call : thread_calls) {
      ASSERT_EQ(write(caches[0].get(), call), MJOLNIR_OK) << mjolnir_last_error();
    }
  }
  const std::vector<std::byte> sequential(pool.begin(), pool.end());
  ASSERT_NE(sequential, initial);

  std::copy(initial.begin(), initial.end(), view.data);
  std::vector<ThreadReport> reports(kThreads);
  run_threads([&](int t) {
    for (const WriteCall& call : calls[t]) {
      if (write(caches[t].get(), call) != MJOLNIR_OK) reports[t].fail(mjolnir_last_error());
    }
  });
  expect_clean(reports);
  EXPECT_TRUE(std::equal(pool.begin(), pool.end(), sequential.begin()))
      << "the pool differs from the sequential writes' (" << seed_note() << ")";
}

}  // namespace
}  // namespace mjolnir

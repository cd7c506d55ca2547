// Bad input to decode(): every class gets an Error that names the argument, never a crash or
// an out-of-bounds read (docs/design.md section 7).
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "bad_input_table.h"
#include "expect_error.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "test_seed.h"
#include "verify/problem.h"

namespace mjolnir {
namespace {

verify::ProblemSpec small_spec() {
  verify::ProblemSpec spec;
  spec.format = Format::fp8_e4m3;
  spec.page_size = 16;
  spec.head_dim = 64;
  spec.num_kv_heads = 2;
  spec.group = 2;
  spec.params.q_len = 2;
  spec.seq_lens = {37, 5};
  spec.seed = testing::test_seed();
  return spec;
}

// Runs decode() on a valid problem after `corrupt` changes its arguments, expecting an Error
// whose message contains `names`.
void expect_rejected(const std::function<void(DecodeArgs&)>& corrupt, const std::string& names) {
  verify::Problem problem(small_spec());
  DecodeArgs args = problem.args();
  corrupt(args);
  for (const char* backend : {"cpu", "reference"}) {
    try {
      decode(*make_backend(backend), args);
      ADD_FAILURE() << backend << ": no error; expected one naming '" << names << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos)
          << backend << ": message '" << e.what() << "' does not name '" << names << "'";
    }
  }
}

// The shared bad-input table (tests/bad_inputs.json, bad_input_table.h) through the C++ API:
// decode() on the cpu and reference backends, each case's change made where DecodeArgs (or, for
// the thread count, BackendOptions) holds that argument.
TEST(BadInputTable, EveryCaseThroughTheCppApi) {
  const testing::BadInputTable table = testing::bad_input_table();
  const nlohmann::json& step = table.step;
  verify::ProblemSpec spec;
  spec.format = parse_format(step.at("format").get<std::string>());
  spec.granularity = parse_granularity(step.at("granularity").get<std::string>());
  spec.page_size = step.at("page_size");
  spec.head_dim = step.at("head_dim");
  spec.num_kv_heads = step.at("num_kv_heads");
  spec.group = step.at("num_q_heads").get<int>() / spec.num_kv_heads;
  spec.params.q_len = step.at("q_len");
  spec.seq_lens = step.at("seq_lens").get<std::vector<std::int32_t>>();
  spec.seed = testing::test_seed();
  verify::Problem problem(spec);
  ASSERT_NO_THROW(decode(*make_backend("cpu"), problem.args()));  // the step itself is good

  ASSERT_FALSE(table.cases.empty());
  for (const testing::BadInputCase& bad : table.cases) {
    SCOPED_TRACE(bad.name);
    DecodeArgs a = problem.args();
    testing::StepArguments changed{
        .q_len = a.params.q_len,
        .num_q_heads = a.params.num_q_heads,
        .softmax_scale = a.params.softmax_scale,
        .seq_lens = {a.batch.seq_lens.begin(), a.batch.seq_lens.end()},
        .block_table = {a.batch.block_table.begin(), a.batch.block_table.end()},
        .max_pages_per_seq = a.batch.max_pages_per_seq,
        .num_pages = a.cache.geometry.num_pages,
        .page_size = a.cache.geometry.page_size,
        .k_scale = {a.cache.k_scale.begin(), a.cache.k_scale.end()},
        .v_scale = {a.cache.v_scale.begin(), a.cache.v_scale.end()},
    };
    ASSERT_NO_THROW(changed.apply(bad.change));
    a.params.q_len = changed.q_len;
    a.params.num_q_heads = changed.num_q_heads;
    a.params.softmax_scale = changed.softmax_scale;
    a.batch.seq_lens = changed.seq_lens;
    a.batch.block_table = changed.block_table;
    a.cache.k_scale = changed.k_scale;
    a.cache.v_scale = changed.v_scale;
    const BackendOptions options{.threads = changed.threads};
    for (const char* backend : {"cpu", "reference"}) {
      try {
        decode(*make_backend(backend, options), a);
        ADD_FAILURE() << backend << ": no error; expected one naming '" << bad.names.front() << "'";
      } catch (const Error& e) {
        EXPECT_TRUE(testing::names_all(e.what(), bad.names))
            << backend << ": message '" << e.what() << "' does not say '"
            << nlohmann::json(bad.names).dump() << "'";
      }
    }
  }
}

TEST(DecodeValidation, ValidProblemRuns) {
  verify::Problem problem(small_spec());
  EXPECT_NO_THROW(decode(*make_backend("cpu"), problem.args()));
}

TEST(DecodeValidation, RaggedQueryStart) {
  static std::vector<std::int32_t> query_start;
  // The problem's q, o and lse hold its decode step's 2 x 2 query rows.
  const auto ragged = [](DecodeArgs& a, std::vector<std::int32_t> starts) {
    query_start = std::move(starts);
    a.batch.query_start = query_start;
    a.params.q_len = 0;
  };
  expect_rejected([&](DecodeArgs& a) { ragged(a, {0, 3}); }, "query_start: 2 entries");
  expect_rejected([&](DecodeArgs& a) { ragged(a, {1, 3, 4}); }, "query_start[0]");
  expect_rejected([&](DecodeArgs& a) { ragged(a, {0, 3, 2}); }, "query_start[2]");
  // Sequence 1 holds 5 tokens: 6 query tokens cannot all be in its cache.
  expect_rejected([&](DecodeArgs& a) { ragged(a, {0, 1, 7}); }, "query_start: sequence 1");
  expect_rejected(
      [&](DecodeArgs& a) {
        ragged(a, {0, 1, 3});
        a.params.q_len = 2;
      },
      "q_len: 2 with batch.query_start");
  // More rows than the lse span holds (2 x 2 rows x 4 heads).
  expect_rejected([&](DecodeArgs& a) { ragged(a, {0, 3, 5}); }, "lse:");
}

TEST(DecodeValidation, UnsupportedHeadDimAndPageSize) {
  expect_rejected([](DecodeArgs& a) { a.cache.geometry.head_dim = 80; }, "head_dim");
  expect_rejected([](DecodeArgs& a) { a.cache.geometry.page_size = 12; }, "page_size");
  expect_rejected([](DecodeArgs& a) { a.cache.geometry.page_size = 512; }, "page_size");
}

TEST(DecodeValidation, MissingOrWrongSizedScales) {
  expect_rejected([](DecodeArgs& a) { a.cache.k_scale = {}; }, "k_scale");
  expect_rejected([](DecodeArgs& a) { a.cache.v_scale = a.cache.v_scale.first(1); }, "v_scale");
  static std::vector<float> bad{1.0f, -2.0f};
  expect_rejected([](DecodeArgs& a) { a.cache.v_scale = bad; }, "v_scale");
}

TEST(DecodeValidation, StridesOutsideThePool) {
  expect_rejected([](DecodeArgs& a) { a.cache.bytes -= 1; }, "cache");
  expect_rejected([](DecodeArgs& a) { a.cache.strides.page *= 2; }, "cache");
}

TEST(DecodeValidation, QueryAndOutputTensors) {
  expect_rejected([](DecodeArgs& a) { a.q.data = nullptr; }, "q.data");
  expect_rejected([](DecodeArgs& a) { a.o.head_stride = 10; }, "o.head_stride");
  expect_rejected([](DecodeArgs& a) { a.q.token_stride = 64; }, "q.token_stride");
  expect_rejected([](DecodeArgs& a) { a.lse = a.lse.first(3); }, "lse");
  expect_rejected([](DecodeArgs& a) { a.q.type = RowType(7); }, "q.type");
  expect_rejected([](DecodeArgs& a) { a.o.type = RowType(2); }, "o.type");
}

// Enums that arrive by cast from a C++ caller are checked like any option (the C API and the
// bindings parse names; a cast skips that).
TEST(DecodeValidation, ModesOutOfRange) {
  expect_rejected([](DecodeArgs& a) { a.params.q_mode = static_cast<QMode>(7); }, "q_mode");
  expect_rejected([](DecodeArgs& a) { a.params.p_mode = static_cast<PMode>(4); }, "p_mode");
  expect_rejected([](DecodeArgs& a) { a.cache.granularity = static_cast<ScaleGranularity>(9); },
                  "granularity");
  expect_rejected([](DecodeArgs& a) { a.cache.geometry.format = static_cast<Format>(200); },
                  "format");
}

// decode()'s plan options follow make_plan's rules: a negative cap on chunks is an error naming
// it, not a cap of one.
TEST(DecodeValidation, NegativeMaxSplits) {
  verify::Problem problem(small_spec());
  for (const char* backend : {"cpu", "reference"}) {
    SCOPED_TRACE(backend);
    PlanOptions options;
    options.max_splits = -1;
    testing::expect_error([&] { decode(*make_backend(backend), problem.args(), options); },
                          "plan options.max_splits", "negative");
  }
}

// The step a plan is made for, which the tests below change from the one that runs.
struct PlannedStep {
  std::vector<std::int32_t> seq_lens;
  int q_len = 1;
  int kv_heads = 1;
};

// Backend::run with a plan made for another step, or too small a workspace: an Error naming the
// plan (or the workspace) before any page is read.
void expect_run_rejected(const std::function<void(PlannedStep&)>& change,
                         std::size_t workspace_shortfall, const std::string& argument,
                         const std::string& detail) {
  verify::Problem problem(small_spec());
  const DecodeArgs args = problem.args();
  for (const char* name : {"cpu", "reference"}) {
    SCOPED_TRACE(name);
    const auto backend = make_backend(name);
    PlannedStep step{{args.batch.seq_lens.begin(), args.batch.seq_lens.end()},
                     args.params.q_len,
                     args.cache.geometry.num_kv_heads};
    change(step);
    BackendPlan plan(PlanCapacity{4, step.kv_heads, 4});
    PlanOptions options;
    options.workers = backend->workers();
    options.fixed_splits = 2;  // split partials and merges in play
    options.tile_tokens = 16;
    backend->plan(
        plan,
        StepShape{.seq_lens = step.seq_lens, .q_len = step.q_len, .num_kv_heads = step.kv_heads},
        options);
    std::vector<std::byte> workspace(
        backend->workspace_bytes(plan.plan(), args.cache.geometry, args.params) -
        workspace_shortfall);
    testing::expect_error([&] { backend->run(args, plan, workspace); }, argument, detail);
  }
}

TEST(DecodeValidation, PlanMadeForAnotherStep) {
  // Longer sequences than the step's: items would read past a sequence's pages.
  expect_run_rejected([](PlannedStep& s) { s.seq_lens[0] += 16; }, 0, "plan.items[",
                      "outside sequence 0");
  // Shorter: the sequence's last tokens would be skipped.
  expect_run_rejected([](PlannedStep& s) { s.seq_lens[1] -= 1; }, 0, "plan.items[",
                      "ends at token 4");
  expect_run_rejected([](PlannedStep& s) { s.seq_lens.pop_back(); }, 0, "plan.num_seqs", "differs");
  expect_run_rejected([](PlannedStep& s) { s.q_len = 1; }, 0, "plan.q_len", "differs");
  expect_run_rejected([](PlannedStep& s) { s.kv_heads = 1; }, 0, "plan.capacity.num_kv_heads",
                      "differs");
}

// A plan edited after make_plan (a BackendPlan is only ever filled by Backend::plan, so these
// reach check_plan, which every run() calls first, through a hand-made Plan).
TEST(DecodeValidation, PlanItemsOutsideTheStep) {
  verify::Problem problem(small_spec());
  const DecodeArgs args = problem.args();
  Plan plan(PlanCapacity{2, args.cache.geometry.num_kv_heads, 4});
  PlanOptions options;
  make_plan(plan, args.batch.seq_lens, args.params.q_len, args.cache.geometry.num_kv_heads,
            options);
  EXPECT_NO_THROW(check_plan(plan, args));
  Plan bad = plan;
  bad.items[0].kv_head = 7;
  testing::expect_error([&] { check_plan(bad, args); }, "plan.items[0]", "KV head 7");
  bad = plan;
  bad.items[1].partial_slot = 1000;
  testing::expect_error([&] { check_plan(bad, args); }, "plan.items[1]", "partial slot 1000");
  bad = plan;
  bad.num_splits[0] = 9;
  testing::expect_error([&] { check_plan(bad, args); }, "plan.num_splits[0]");
  bad = plan;
  bad.num_items = int(plan.items.size()) + 1;
  testing::expect_error([&] { check_plan(bad, args); }, "plan.num_items");
}

// run() takes only a plan that a plan() filled, and the cpu backend only one it prepared: its
// work units are part of the plan.
TEST(DecodeValidation, PlanNotMadeByTheBackend) {
  verify::Problem problem(small_spec());
  const DecodeArgs args = problem.args();
  const auto cpu = make_backend("cpu");
  const auto reference = make_backend("reference");
  BackendPlan plan(PlanCapacity{2, args.cache.geometry.num_kv_heads, 4});
  std::vector<std::byte> workspace(
      cpu->workspace_bytes(plan.plan(), args.cache.geometry, args.params));
  for (const auto* backend : {cpu.get(), reference.get()}) {
    SCOPED_TRACE(backend->name());
    testing::expect_error([&] { backend->run(args, plan, workspace); }, "plan:", "was not planned");
  }
  reference->plan(plan, args.step_shape(), PlanOptions{});
  EXPECT_EQ(plan.planned_by(), "reference");
  EXPECT_EQ(plan.prepared(), nullptr);
  testing::expect_error([&] { cpu->run(args, plan, workspace); },
                        "plan:", "planned by the 'reference' backend");
  // A plan() that throws leaves the plan unplanned, though it held a step before.
  cpu->plan(plan, args.step_shape(), PlanOptions{});
  EXPECT_NE(plan.prepared(), nullptr);
  EXPECT_NO_THROW(cpu->run(args, plan, workspace));
  StepShape too_many = args.step_shape();
  const std::vector<std::int32_t> lens = {5, 5, 5};
  too_many.seq_lens = lens;
  EXPECT_THROW(cpu->plan(plan, too_many, PlanOptions{}), Error);
  testing::expect_error([&] { cpu->run(args, plan, workspace); }, "plan:", "was not planned");
}

TEST(DecodeValidation, WorkspaceTooSmall) {
  expect_run_rejected([](PlannedStep&) {}, 4, "workspace:", "workspace_bytes()");
}

// MJOLNIR_CUDA_MMA_LAYOUT as the CLI and the Python package read it: each layout by name, unset
// or empty the default, anything else an error naming the variable. (Whether a CUDA backend's
// launches keep to the limit is test_cuda_emulated.cc's EveryLayoutOnTheSameCases.)
TEST(DecodeValidation, CudaKernelOptionsFromTheEnvironment) {
  unsetenv("MJOLNIR_CUDA_MMA_LAYOUT");
  EXPECT_EQ(cuda_kernel_options_from_environment().max_mma_layout, CudaMmaLayout::tokens_on_m);
  const std::pair<const char*, CudaMmaLayout> names[] = {
      {"plain", CudaMmaLayout::plain},
      {"stacked", CudaMmaLayout::stacked},
      {"tokens_on_m", CudaMmaLayout::tokens_on_m},
      {"", CudaMmaLayout::tokens_on_m}};
  for (const auto& [name, layout] : names) {
    setenv("MJOLNIR_CUDA_MMA_LAYOUT", name, 1);
    EXPECT_EQ(cuda_kernel_options_from_environment().max_mma_layout, layout) << name;
  }
  setenv("MJOLNIR_CUDA_MMA_LAYOUT", "Plain", 1);
  testing::expect_error([] { cuda_kernel_options_from_environment(); },
                        "MJOLNIR_CUDA_MMA_LAYOUT: 'Plain' is not plain, stacked or tokens_on_m");
  unsetenv("MJOLNIR_CUDA_MMA_LAYOUT");
}

}  // namespace
}  // namespace mjolnir

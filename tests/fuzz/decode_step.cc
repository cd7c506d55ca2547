// Fuzz target: one decode step through the C API. A small valid cache of fuzzed bytes (any
// code, NaN codes included), then a plan and a step whose every field may be wrong: plan
// options, seq_lens, q_len, heads, modes, softmax scale, block table entries and width, q / o
// strides, lse, workspace size and alignment, a step that differs from the plan's. Each call
// either succeeds or fails with a known status and a message; ASan and UBSan watch every byte
// the kernels touch, since every buffer is a heap block of exactly the size the call is told.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "capi_handles.h"
#include "fuzz_check.h"

namespace {

using mjolnir_fuzz::check_failure_explained;
using mjolnir_fuzz::tensor_extent;

// Backends live for the whole run: creating a CPU backend per input would dominate its time.
mjolnir_backend* backend(int which) {
  static mjolnir_backend* const backends[2] = {
      [] {
        mjolnir_backend* b = nullptr;
        FUZZ_CHECK(mjolnir_backend_create("reference", 0, &b) == MJOLNIR_OK);
        return b;
      }(),
      [] {
        mjolnir_backend* b = nullptr;
        FUZZ_CHECK(mjolnir_backend_create("cpu", 1, &b) == MJOLNIR_OK);
        return b;
      }()};
  return backends[which];
}

using mjolnir::testing::CachePtr;
using mjolnir::testing::PlanPtr;

void expect_ok_or_explained(mjolnir_status status) {
  if (status != MJOLNIR_OK) check_failure_explained(status);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);

  // ---- the cache: valid, small, its bytes from the input -------------------------------------
  mjolnir_cache_desc desc;
  mjolnir_cache_desc_init(&desc);
  desc.format = in.ConsumeIntegralInRange(0, 7);
  desc.page_size = 8 << in.ConsumeIntegralInRange(0, 2);
  desc.num_kv_heads = in.ConsumeIntegralInRange(1, 3);
  desc.head_dim = 32 * in.ConsumeIntegralInRange(1, 4);
  desc.num_pages = in.ConsumeIntegralInRange(1, 12);
  desc.layout = in.ConsumeIntegralInRange(1, 6);
  desc.granularity = in.ConsumeIntegralInRange(0, 2);
  const std::int64_t scale_count = desc.granularity == MJOLNIR_GRANULARITY_TENSOR ? 1
                                   : desc.granularity == MJOLNIR_GRANULARITY_HEAD
                                       ? desc.num_kv_heads
                                       : std::int64_t(desc.num_kv_heads) * desc.head_dim;
  std::vector<float> scales(static_cast<std::size_t>(scale_count));
  for (float& s : scales) s = in.ConsumeFloatingPointInRange(0.01f, 4.0f);
  desc.k_scale = desc.v_scale = scales.data();
  desc.k_scale_count = desc.v_scale_count = scale_count;
  std::size_t pool_bytes = 0;
  FUZZ_CHECK(mjolnir_pool_bytes(&desc, &pool_bytes) == MJOLNIR_OK);
  std::vector<std::uint8_t> pool(pool_bytes);
  const std::vector<std::uint8_t> codes = in.ConsumeBytes<std::uint8_t>(64);
  for (std::size_t i = 0; i < pool.size(); ++i) {
    pool[i] = codes.empty() ? std::uint8_t(i * 37 + 11) : std::uint8_t(codes[i % codes.size()] + i);
  }
  desc.pool = pool.data();
  desc.pool_bytes = pool.size();
  mjolnir_cache* raw_cache = nullptr;
  FUZZ_CHECK(mjolnir_cache_create(&desc, &raw_cache) == MJOLNIR_OK);
  const CachePtr cache(raw_cache);
  const std::int32_t hk = desc.num_kv_heads, d = desc.head_dim;
  const std::int32_t pool_tokens = desc.num_pages * desc.page_size;

  // ---- the plan --------------------------------------------------------------------------------
  mjolnir_backend* const be = backend(in.ConsumeIntegralInRange(0, 1));
  const std::int32_t max_seqs = in.ConsumeIntegralInRange(-1, 6);
  const std::int32_t plan_heads =
      in.ConsumeProbability<float>() < 0.9f ? hk : in.ConsumeIntegralInRange(-1, 4);
  const std::int32_t max_splits = in.ConsumeIntegralInRange(-1, 8);
  mjolnir_plan* raw_plan = nullptr;
  const mjolnir_status made = mjolnir_plan_create(max_seqs, plan_heads, max_splits, &raw_plan);
  if (made != MJOLNIR_OK) {
    check_failure_explained(made);
    FUZZ_CHECK(raw_plan == nullptr);
    return 0;
  }
  const PlanPtr plan(raw_plan);
  for (int i = in.ConsumeIntegralInRange(0, 3); i > 0; --i) {
    expect_ok_or_explained(mjolnir_plan_set_option(plan.get(), in.ConsumeIntegralInRange(-1, 5),
                                                   in.ConsumeIntegralInRange(-2, 300)));
  }
  const std::int32_t num_seqs = in.ConsumeIntegralInRange(0, std::max(max_seqs, 0) + 1);
  const std::int32_t q_len = in.ConsumeProbability<float>() < 0.9f
                                 ? in.ConsumeIntegralInRange(1, 8)
                                 : in.ConsumeIntegralInRange(-1, 10);
  std::vector<std::int32_t> seq_lens(static_cast<std::size_t>(std::max(num_seqs, 1)));
  for (auto& len : seq_lens) {
    len = in.ConsumeProbability<float>() < 0.9f ? in.ConsumeIntegralInRange(0, pool_tokens + 8)
                                                : in.ConsumeIntegral<std::int32_t>();
  }
  const mjolnir_status updated =
      mjolnir_plan_update(plan.get(), seq_lens.data(), num_seqs, q_len, be);
  expect_ok_or_explained(updated);
  std::int32_t counts[3];
  expect_ok_or_explained(mjolnir_plan_counts(plan.get(), &counts[0], &counts[1], &counts[2]));

  // ---- the step: usually the planned one, sometimes not ----------------------------------------
  mjolnir_decode_params params;
  mjolnir_decode_params_init(&params);
  params.q_len = in.ConsumeProbability<float>() < 0.9f ? q_len : in.ConsumeIntegralInRange(-1, 10);
  params.num_q_heads = in.ConsumeProbability<float>() < 0.9f ? hk * in.ConsumeIntegralInRange(1, 4)
                                                             : in.ConsumeIntegralInRange(-1, 9);
  params.causal = in.ConsumeIntegralInRange(-1, 2);
  params.softmax_scale = in.ConsumeBool() ? 0.0f : in.ConsumeFloatingPoint<float>();
  params.q_mode = in.ConsumeProbability<float>() < 0.9f ? in.ConsumeIntegralInRange(0, 2)
                                                        : in.ConsumeIntegral<std::int32_t>();
  params.p_mode = in.ConsumeProbability<float>() < 0.9f ? in.ConsumeIntegralInRange(0, 2)
                                                        : in.ConsumeIntegral<std::int32_t>();
  const bool replanned = num_seqs > 0 && in.ConsumeProbability<float>() < 0.1f;
  if (replanned) {  // the step's lengths differ from the plan's
    std::int32_t& len = seq_lens[in.ConsumeIntegralInRange<std::size_t>(0, seq_lens.size() - 1)];
    len = len == INT32_MAX ? 0 : len + 1;
  }

  const std::int32_t needed_pages = (pool_tokens + 8 + desc.page_size - 1) / desc.page_size;
  const std::int32_t width = in.ConsumeIntegralInRange(0, needed_pages);
  std::vector<std::int32_t> block_table(static_cast<std::size_t>(std::max(num_seqs * width, 1)));
  for (auto& page : block_table) {
    page = in.ConsumeProbability<float>() < 0.95f ? in.ConsumeIntegralInRange(0, desc.num_pages - 1)
                                                  : in.ConsumeIntegral<std::int32_t>();
  }

  const std::int64_t heads = std::max(params.num_q_heads, 1);
  const std::int64_t rows = std::int64_t(num_seqs) * std::max(params.q_len, 0);
  std::int64_t strides[2][2];  // q, o: token, head
  for (auto& s : strides) {
    if (in.ConsumeProbability<float>() < 0.8f) {
      s[1] = d + 32 * in.ConsumeIntegralInRange(0, 1);
      s[0] = heads * s[1] + in.ConsumeIntegralInRange(0, 8);
    } else {
      s[0] = in.ConsumeIntegralInRange<std::int64_t>(-1, 4 * heads * d);
      s[1] = in.ConsumeIntegralInRange<std::int64_t>(-1, 2 * d);
    }
  }
  const long long q_extent = tensor_extent(rows, heads, d, strides[0][0], strides[0][1]);
  const long long o_extent = tensor_extent(rows, heads, d, strides[1][0], strides[1][1]);
  if (q_extent < 0 || o_extent < 0) return 0;
  std::vector<float> q(static_cast<std::size_t>(std::max(q_extent, 1LL)));
  for (float& x : q) x = in.ConsumeFloatingPointInRange(-4.0f, 4.0f);
  std::vector<float> o(static_cast<std::size_t>(std::max(o_extent, 1LL)));
  std::vector<float> lse;
  if (in.ConsumeBool()) lse.resize(std::size_t(std::max<std::int64_t>(rows * heads, 1)));

  mjolnir_decode_args args;
  mjolnir_decode_args_init(&args);
  args.seq_lens = seq_lens.data();
  args.num_seqs = num_seqs;
  args.block_table = block_table.data();
  args.max_pages_per_seq = width;
  args.q = q.data();
  args.q_token_stride = strides[0][0];
  args.q_head_stride = strides[0][1];
  args.o = o.data();
  args.o_token_stride = strides[1][0];
  args.o_head_stride = strides[1][1];
  args.lse = lse.empty() ? nullptr : lse.data();

  // ---- the workspace: the size the library asks for, or less, or misaligned -------------------
  std::size_t workspace_bytes = 0;
  const mjolnir_status sized =
      mjolnir_workspace_size(be, plan.get(), cache.get(), &params, &workspace_bytes);
  if (sized != MJOLNIR_OK) {
    check_failure_explained(sized);
    workspace_bytes = in.ConsumeIntegralInRange<std::size_t>(0, 4096);
  } else if (in.ConsumeProbability<float>() < 0.1f) {
    workspace_bytes = in.ConsumeIntegralInRange<std::size_t>(0, workspace_bytes);
  }
  if (workspace_bytes > std::size_t(64) << 20) return 0;
  // operator new's blocks are aligned to 16 bytes (MJOLNIR_WORKSPACE_ALIGNMENT); an offset of 4
  // misaligns it, which the call must refuse.
  const std::size_t offset = in.ConsumeProbability<float>() < 0.05f ? 4 : 0;
  std::vector<std::uint8_t> workspace_storage(workspace_bytes + offset);
  FUZZ_CHECK(reinterpret_cast<std::uintptr_t>(workspace_storage.data()) %
                 MJOLNIR_WORKSPACE_ALIGNMENT ==
             0);
  std::uint8_t* const workspace =
      workspace_storage.empty() ? nullptr : workspace_storage.data() + offset;

  const mjolnir_status status =
      mjolnir_decode(be, plan.get(), cache.get(), &params, &args, workspace, workspace_bytes);
  if (status != MJOLNIR_OK) {
    check_failure_explained(status);
    return 0;
  }
  // A step that ran was the planned one, with heads the cache has, on an aligned workspace.
  FUZZ_CHECK(updated == MJOLNIR_OK && counts[0] == num_seqs && !replanned && offset == 0);
  FUZZ_CHECK(params.q_len == q_len && params.num_q_heads % hk == 0);
  return 0;
}

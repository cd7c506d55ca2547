// C API: backends, plans and the decode step. The hot path (mjolnir_plan_update, mjolnir_decode)
// allocates nothing here: the plan's buffers are sized at creation and the caller owns the
// workspace.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

#include "capi/capi_internal.h"

namespace mjolnir::capi {
namespace {

// The first published structs end with these fields. Never change these numbers.
constexpr std::size_t kDecodeParamsV1 =
    offsetof(mjolnir_decode_params, p_mode) + sizeof(mjolnir_decode_params::p_mode);
constexpr std::size_t kDecodeArgsV1 =
    offsetof(mjolnir_decode_args, lse) + sizeof(mjolnir_decode_args::lse);

constexpr std::int32_t kNumPlanOptions = 5;

struct OptionInfo {
  const char* name;
  std::int32_t lower;
  std::int32_t upper;
};

// Bounds of each mjolnir_plan_option, indexed by its value. MAX_SPLITS above the plan's
// capacity is capped at the capacity when the plan is made (as make_plan does).
constexpr OptionInfo kPlanOptions[kNumPlanOptions] = {
    {"MJOLNIR_PLAN_WORKERS", 0, 1 << 20},
    {"MJOLNIR_PLAN_MAX_SPLITS", 1, std::numeric_limits<std::int32_t>::max()},
    {"MJOLNIR_PLAN_TILE_TOKENS", 1, 1024},
    {"MJOLNIR_PLAN_MIN_CHUNK_TOKENS", 1, std::numeric_limits<std::int32_t>::max()},
    {"MJOLNIR_PLAN_FIXED_SPLITS", 0, std::numeric_limits<std::int32_t>::max()},
};

const OptionInfo& option_info(std::int32_t option) {
  if (option < 0 || option >= kNumPlanOptions) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "option: ", option, " is not a mjolnir_plan_option (0..",
         kNumPlanOptions - 1, ")");
  }
  return kPlanOptions[option];
}

QMode to_q_mode(std::int32_t value) {
  switch (value) {
    case MJOLNIR_Q_FP32:
      return QMode::fp32;
    case MJOLNIR_Q_BF16:
      return QMode::bf16;
    case MJOLNIR_Q_FP8:
      return QMode::fp8;
    case MJOLNIR_Q_INT8:
      return QMode::int8;
  }
  fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "params->q_mode: ", value,
       " is not a mjolnir_q_mode (0 = fp32, 1 = bf16, 2 = fp8, 3 = int8)");
}

PMode to_p_mode(std::int32_t value) {
  switch (value) {
    case MJOLNIR_P_FP32:
      return PMode::fp32;
    case MJOLNIR_P_BF16:
      return PMode::bf16;
    case MJOLNIR_P_FP8:
      return PMode::fp8;
    case MJOLNIR_P_FP16:
      return PMode::fp16;
  }
  fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "params->p_mode: ", value,
       " is not a mjolnir_p_mode (0 = fp32, 1 = bf16, 2 = fp8, 3 = fp16)");
}

DecodeParams to_params(const mjolnir_decode_params* in) {
  const mjolnir_decode_params c =
      read_struct(in, kDecodeParamsV1, "params", "mjolnir_decode_params");
  DecodeParams params;
  params.q_len = c.q_len;
  params.num_q_heads = c.num_q_heads;
  params.causal = c.causal != 0;
  params.softmax_scale = c.softmax_scale;
  params.q_mode = to_q_mode(c.q_mode);
  params.p_mode = to_p_mode(c.p_mode);
  return params;
}

// The step shape checks the workspace size depends on, done before anything is multiplied.
void check_step_shape(const DecodeParams& params, const CacheGeometry& geometry) {
  if (params.q_len < 1 || params.q_len > kMaxQLen) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "params->q_len: ", params.q_len, " is outside [1, ",
         kMaxQLen, "]");
  }
  if (params.num_q_heads < 1 || params.num_q_heads % geometry.num_kv_heads != 0) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "params->num_q_heads: ", params.num_q_heads,
         " is not a positive multiple of the cache's num_kv_heads ", geometry.num_kv_heads);
  }
}

void check_plan_heads(const mjolnir_plan& plan, const CacheGeometry& geometry) {
  if (plan.plan.capacity().num_kv_heads != geometry.num_kv_heads) {
    fail(MJOLNIR_ERROR_PLAN_MISMATCH, "plan: was created for ", plan.plan.capacity().num_kv_heads,
         " KV heads, the cache has ", geometry.num_kv_heads);
  }
}

// Workspace bytes of the C++ backend, after checking that its formula cannot overflow:
// slots x Hk x rows x (D + 1) floats, computed here in 128 bits first.
std::size_t workspace_bytes(const Backend& backend, const mjolnir_plan& plan,
                            const CacheGeometry& geometry, const DecodeParams& params) {
  check_step_shape(params, geometry);
  check_plan_heads(plan, geometry);
  const __int128 slots = __int128(plan.plan.capacity().max_seqs) * plan.plan.capacity().max_splits;
  const __int128 rows = __int128(params.q_len) * (params.num_q_heads / geometry.num_kv_heads);
  const __int128 bytes =
      slots * geometry.num_kv_heads * rows * (geometry.head_dim + 1) * __int128(sizeof(float));
  if (bytes > __int128(std::numeric_limits<std::ptrdiff_t>::max())) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "params->num_q_heads: ", params.num_q_heads,
         " with the plan's capacity needs a workspace beyond the address space");
  }
  return backend.workspace_bytes(plan.plan.plan(), geometry, params);
}

// The plan must have been updated for exactly this step: its items index these sequences and
// token ranges, so a stale plan would read outside them.
void check_plan_matches(const mjolnir_plan& plan, const DecodeParams& params,
                        std::span<const std::int32_t> seq_lens) {
  const Plan& p = plan.plan.plan();
  if (!plan.filled) {
    fail(MJOLNIR_ERROR_PLAN_MISMATCH,
         "plan: holds no step (call mjolnir_plan_update first; its last update failed or there "
         "was none)");
  }
  if (p.q_len != params.q_len) {
    fail(MJOLNIR_ERROR_PLAN_MISMATCH, "plan: was updated for q_len ", p.q_len,
         ", params->q_len is ", params.q_len);
  }
  if (std::size_t(p.num_seqs) != seq_lens.size()) {
    fail(MJOLNIR_ERROR_PLAN_MISMATCH, "plan: was updated for ", p.num_seqs,
         " sequences, args->num_seqs is ", seq_lens.size());
  }
  for (std::size_t b = 0; b < seq_lens.size(); ++b) {
    if (plan.seq_lens[b] != seq_lens[b]) {
      fail(MJOLNIR_ERROR_PLAN_MISMATCH, "plan: was updated for seq_lens[", b,
           "] = ", plan.seq_lens[b], ", args->seq_lens[", b, "] is ", seq_lens[b],
           " (call mjolnir_plan_update for this step)");
    }
  }
}

}  // namespace
}  // namespace mjolnir::capi

using namespace mjolnir;
using namespace mjolnir::capi;

extern "C" {

// ---- backends ----------------------------------------------------------------------------------

MJOLNIR_API mjolnir_status mjolnir_backend_create(const char* name, int32_t threads,
                                                  mjolnir_backend** out) {
  if (out != nullptr) *out = nullptr;
  return call("mjolnir_backend_create", nullptr, [&] {
    require_pointer(out, "out");
    require_pointer(name, "name");
    check_cpu_threads(threads, "threads");
    const std::string_view wanted(name);
    bool compiled = false;
    std::string known_names;
    for (const std::string& known : compiled_backends()) {
      compiled = compiled || known == wanted;
      known_names += (known_names.empty() ? "" : ", ") + known;
    }
    if (!compiled) {
      fail(wanted == "cuda" ? MJOLNIR_ERROR_UNSUPPORTED : MJOLNIR_ERROR_INVALID_ARGUMENT, "name: '",
           wanted, "' is not a backend of this build (", known_names, ")");
    }
    auto backend = std::make_unique<mjolnir_backend>();
    backend->impl = make_backend(wanted, BackendOptions{threads});
    const std::string why = backend->impl->unavailable_reason();
    if (!why.empty()) fail(MJOLNIR_ERROR_UNSUPPORTED, "name: '", wanted, "': ", why);
    backend->name = wanted;
    *out = backend.release();
  });
}

MJOLNIR_API void mjolnir_backend_destroy(mjolnir_backend* backend) { delete backend; }

MJOLNIR_API const char* mjolnir_backend_last_error(const mjolnir_backend* backend) {
  return backend != nullptr ? backend->error.c_str() : "backend: is NULL";
}

MJOLNIR_API const char* mjolnir_backend_name(const mjolnir_backend* backend) {
  return backend != nullptr ? backend->name.c_str() : nullptr;
}

// ---- plans -------------------------------------------------------------------------------------

MJOLNIR_API mjolnir_status mjolnir_plan_option_bounds(int32_t option, int32_t* lower,
                                                      int32_t* upper) {
  return call("mjolnir_plan_option_bounds", nullptr, [&] {
    require_pointer(lower, "lower");
    require_pointer(upper, "upper");
    const OptionInfo& info = option_info(option);
    *lower = info.lower;
    *upper = info.upper;
  });
}

MJOLNIR_API mjolnir_status mjolnir_plan_create(int32_t max_seqs, int32_t num_kv_heads,
                                               int32_t max_splits, mjolnir_plan** out) {
  if (out != nullptr) *out = nullptr;
  return call("mjolnir_plan_create", nullptr, [&] {
    require_pointer(out, "out");
    if (max_seqs < 1)
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "max_seqs: ", max_seqs, " is less than 1");
    if (num_kv_heads < 1) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "num_kv_heads: ", num_kv_heads, " is less than 1");
    }
    if (max_splits < 1) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "max_splits: ", max_splits, " is less than 1");
    }
    // Item indices and counts are int in the plan.
    const std::int64_t items = std::int64_t(max_seqs) * num_kv_heads * max_splits;
    if (items > std::numeric_limits<std::int32_t>::max()) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "max_splits: max_seqs ", max_seqs, " x num_kv_heads ",
           num_kv_heads, " x max_splits ", max_splits, " = ", items,
           " work items exceeds 2^31 - 1");
    }
    *out = new mjolnir_plan(PlanCapacity{max_seqs, num_kv_heads, max_splits});
  });
}

MJOLNIR_API void mjolnir_plan_destroy(mjolnir_plan* plan) { delete plan; }

MJOLNIR_API const char* mjolnir_plan_last_error(const mjolnir_plan* plan) {
  return plan != nullptr ? plan->error.c_str() : "plan: is NULL";
}

MJOLNIR_API mjolnir_status mjolnir_plan_set_option(mjolnir_plan* plan, int32_t option,
                                                   int32_t value) {
  return call("mjolnir_plan_set_option", plan != nullptr ? &plan->error : nullptr, [&] {
    mjolnir_plan& p = require_handle(plan, "plan");
    const OptionInfo& info = option_info(option);
    if (value < info.lower || value > info.upper) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "value: ", value, " is outside [", info.lower, ", ",
           info.upper, "] for ", info.name);
    }
    p.options[option] = value;
  });
}

MJOLNIR_API mjolnir_status mjolnir_plan_get_option(mjolnir_plan* plan, int32_t option,
                                                   int32_t* value) {
  return call("mjolnir_plan_get_option", plan != nullptr ? &plan->error : nullptr, [&] {
    const mjolnir_plan& p = require_handle(plan, "plan");
    require_pointer(value, "value");
    option_info(option);
    *value = p.options[option];
  });
}

MJOLNIR_API mjolnir_status mjolnir_plan_update(mjolnir_plan* plan, const int32_t* seq_lens,
                                               int32_t num_seqs, int32_t q_len,
                                               const mjolnir_backend* backend) {
  return call("mjolnir_plan_update", plan != nullptr ? &plan->error : nullptr, [&] {
    mjolnir_plan& p = require_handle(plan, "plan");
    p.filled = false;
    const mjolnir_backend& b = require_handle(backend, "backend");
    if (num_seqs < 0) fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "num_seqs: ", num_seqs, " is negative");
    if (num_seqs > p.plan.capacity().max_seqs) {
      fail(MJOLNIR_ERROR_CAPACITY_EXCEEDED, "num_seqs: ", num_seqs,
           " sequences exceed the plan's capacity of ", p.plan.capacity().max_seqs,
           " (create a larger plan)");
    }
    if (num_seqs > 0) require_pointer(seq_lens, "seq_lens");
    const std::span<const std::int32_t> lens(seq_lens, std::size_t(num_seqs));

    PlanOptions options = b.impl->plan_options();
    if (p.options[MJOLNIR_PLAN_WORKERS] > 0) {  // the caller's capacity, not the backend's
      options.workers = p.options[MJOLNIR_PLAN_WORKERS];
      options.wave_workers = 0;
    }
    options.max_splits = p.options[MJOLNIR_PLAN_MAX_SPLITS];
    options.tile_tokens = p.options[MJOLNIR_PLAN_TILE_TOKENS];
    options.min_chunk_tokens = p.options[MJOLNIR_PLAN_MIN_CHUNK_TOKENS];
    options.fixed_splits = p.options[MJOLNIR_PLAN_FIXED_SPLITS];
    b.impl->plan(
        p.plan,
        StepShape{.seq_lens = lens, .q_len = q_len, .num_kv_heads = p.plan.capacity().num_kv_heads},
        options);
    std::copy(lens.begin(), lens.end(), p.seq_lens.begin());  // sized at creation
    p.filled = true;
  });
}

MJOLNIR_API mjolnir_status mjolnir_plan_counts(mjolnir_plan* plan, int32_t* num_seqs,
                                               int32_t* num_items, int32_t* num_partials) {
  return call("mjolnir_plan_counts", plan != nullptr ? &plan->error : nullptr, [&] {
    const mjolnir_plan& p = require_handle(plan, "plan");
    require_pointer(num_seqs, "num_seqs");
    require_pointer(num_items, "num_items");
    require_pointer(num_partials, "num_partials");
    *num_seqs = p.filled ? p.plan.plan().num_seqs : 0;
    *num_items = p.filled ? p.plan.plan().num_items : 0;
    *num_partials = p.filled ? p.plan.plan().num_partials : 0;
  });
}

// ---- decode ------------------------------------------------------------------------------------

MJOLNIR_API mjolnir_status mjolnir_workspace_size(mjolnir_backend* backend,
                                                  const mjolnir_plan* plan,
                                                  const mjolnir_cache* cache,
                                                  const mjolnir_decode_params* params,
                                                  size_t* bytes) {
  return call("mjolnir_workspace_size", backend != nullptr ? &backend->error : nullptr, [&] {
    const mjolnir_backend& b = require_handle(backend, "backend");
    const mjolnir_plan& p = require_handle(plan, "plan");
    const mjolnir_cache& c = require_handle(cache, "cache");
    require_pointer(bytes, "bytes");
    *bytes = 0;
    const DecodeParams decode_params = to_params(params);
    *bytes = workspace_bytes(*b.impl, p, c.view.geometry, decode_params);
  });
}

MJOLNIR_API mjolnir_status mjolnir_decode(mjolnir_backend* backend, const mjolnir_plan* plan,
                                          const mjolnir_cache* cache,
                                          const mjolnir_decode_params* params,
                                          const mjolnir_decode_args* in, void* workspace,
                                          size_t workspace_size) {
  return call("mjolnir_decode", backend != nullptr ? &backend->error : nullptr, [&] {
    const mjolnir_backend& b = require_handle(backend, "backend");
    const mjolnir_plan& p = require_handle(plan, "plan");
    const mjolnir_cache& c = require_handle(cache, "cache");
    const DecodeParams decode_params = to_params(params);
    const mjolnir_decode_args a = read_struct(in, kDecodeArgsV1, "args", "mjolnir_decode_args");
    const CacheGeometry& geometry = c.view.geometry;
    check_step_shape(decode_params, geometry);

    if (a.num_seqs < 0) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "args->num_seqs: ", a.num_seqs, " is negative");
    }
    if (a.max_pages_per_seq < 0) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "args->max_pages_per_seq: ", a.max_pages_per_seq,
           " is negative");
    }
    const auto table_entries = std::size_t(a.num_seqs) * std::size_t(a.max_pages_per_seq);
    if (a.num_seqs > 0) require_pointer(a.seq_lens, "args->seq_lens");
    if (table_entries > 0) require_pointer(a.block_table, "args->block_table");

    DecodeArgs args;
    args.cache = c.view;
    args.batch.block_table = {a.block_table, table_entries};
    args.batch.max_pages_per_seq = a.max_pages_per_seq;
    args.batch.seq_lens = {a.seq_lens, std::size_t(a.num_seqs)};
    args.params = decode_params;
    args.q = QueryTensor{a.q, a.q_token_stride, a.q_head_stride,
                         require_row_type(a.q_type, "args->q_type")};
    args.o = OutputTensor{a.o, a.o_token_stride, a.o_head_stride,
                          require_row_type(a.o_type, "args->o_type")};
    // [num_seqs * q_len, Hq]: at most 2^31 x 8 x 2^31 floats, so 128 bits before the check.
    const __int128 lse_floats =
        __int128(a.num_seqs) * decode_params.q_len * decode_params.num_q_heads;
    if (a.lse != nullptr && lse_floats > 0) {
      if (lse_floats > __int128(std::numeric_limits<std::ptrdiff_t>::max() / 4)) {
        fail(MJOLNIR_ERROR_INVALID_ARGUMENT,
             "args->lse: num_seqs x q_len x num_q_heads floats "
             "exceed the address space");
      }
      args.lse = {a.lse, static_cast<std::size_t>(lse_floats)};
    }
    validate(args);

    const std::string why = b.impl->unsupported_reason(geometry, decode_params);
    if (!why.empty()) fail(MJOLNIR_ERROR_UNSUPPORTED, "backend ", b.name, ": ", why);
    check_plan_heads(p, geometry);
    check_plan_matches(p, decode_params, args.batch.seq_lens);

    const std::size_t needed = workspace_bytes(*b.impl, p, geometry, decode_params);
    if (workspace_size < needed) {
      fail(MJOLNIR_ERROR_BUFFER_TOO_SMALL, "workspace_size: ", workspace_size,
           " bytes, this step needs ", needed, " (mjolnir_workspace_size)");
    }
    if (needed > 0) require_pointer(workspace, "workspace");
    if (reinterpret_cast<std::uintptr_t>(workspace) % MJOLNIR_WORKSPACE_ALIGNMENT != 0) {
      fail(MJOLNIR_ERROR_INVALID_ARGUMENT, "workspace: ", workspace, " is not aligned to ",
           MJOLNIR_WORKSPACE_ALIGNMENT, " bytes");
    }
    b.impl->run(args, p.plan, {static_cast<std::byte*>(workspace), needed});
  });
}

}  // extern "C"

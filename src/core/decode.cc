// Decode entry points shared by every backend: mode names, argument validation and the one-off
// decode() convenience. The backend registry is above the backends, in src/backends.cc: core
// knows no backend.
#include "mjolnir/decode.h"

#include <cmath>
#include <cstring>

#include "core/batch_checks.h"
#include "core/bf16_rows.h"
#include "mjolnir/error.h"

namespace mjolnir {

std::string_view to_string(QMode mode) {
  switch (mode) {
    case QMode::fp32:
      return "fp32";
    case QMode::bf16:
      return "bf16";
    case QMode::fp8:
      return "fp8";
    case QMode::int8:
      return "int8";
  }
  return "?";
}

std::string_view to_string(PMode mode) {
  switch (mode) {
    case PMode::fp32:
      return "fp32";
    case PMode::bf16:
      return "bf16";
    case PMode::fp8:
      return "fp8";
    case PMode::fp16:
      return "fp16";
  }
  return "?";
}

bool half_sums_take(Format format) {
  switch (format) {
    case Format::fp8_e4m3:
    case Format::fp8_e5m2:  // at half_sum_scale 2^-8
    case Format::fp6_e2m3:
    case Format::fp6_e3m2:
    case Format::fp4_e2m1:
    case Format::nvfp4:
      return true;
    case Format::bf16:  // values fp16 cannot hold (range, or 8-bit exponent)
    case Format::fp16:  // values up to 65504: a sum of two can overflow, and a smaller scale
                        // would push its subnormals below fp16's
      return false;
  }
  return false;
}

float half_sum_scale(Format format) {
  // nvfp4's values reach 2688 and e5m2's 57344: scaled, 32 keys' sums stay far below fp16's
  // 65504, and every scaled value is still an fp16 (e5m2's smallest, 2^-16, becomes fp16's
  // smallest subnormal, 2^-24).
  if (format == Format::nvfp4) return 0x1p-4f;
  if (format == Format::fp8_e5m2) return 0x1p-8f;
  return 1.0f;
}

QMode parse_q_mode(std::string_view name) {
  for (QMode m : {QMode::fp32, QMode::bf16, QMode::fp8, QMode::int8}) {
    if (to_string(m) == name) return m;
  }
  detail::throw_error("q_mode: '", name, "' is not one of fp32, bf16, fp8, int8");
}

PMode parse_p_mode(std::string_view name) {
  for (PMode m : {PMode::fp32, PMode::bf16, PMode::fp8, PMode::fp16}) {
    if (to_string(m) == name) return m;
  }
  detail::throw_error("p_mode: '", name, "' is not one of fp32, bf16, fp8, fp16");
}

float DecodeParams::effective_softmax_scale(int head_dim) const {
  return softmax_scale > 0 ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

void DecodeArgs::read_q_row(const WorkItem& item, int r, int g, float* out) const {
  widen_row(q_row(item, r, g), q.type, out, std::size_t(cache.geometry.head_dim));
}

void DecodeArgs::write_o_row(const WorkItem& item, int r, int g, const float* values) const {
  narrow_row(values, o.type, o_row(item, r, g), std::size_t(cache.geometry.head_dim));
}

PartialLayout partial_layout(const CacheGeometry& geometry, const DecodeParams& params) {
  const int g = params.num_q_heads / geometry.num_kv_heads;
  return PartialLayout{geometry.num_kv_heads, params.item_q_len() * g, geometry.head_dim};
}

void validate(const DecodeArgs& args) {
  validate(args.cache);
  const CacheGeometry& geo = args.cache.geometry;
  const DecodeParams& p = args.params;
  MJOLNIR_REQUIRE(p.num_q_heads >= 1 && p.num_q_heads % geo.num_kv_heads == 0,
                  "num_q_heads: ", p.num_q_heads, " is not a positive multiple of num_kv_heads ",
                  geo.num_kv_heads);
  // Enums that arrive by cast (a C++ caller's, or a binding's) are checked like every option.
  MJOLNIR_REQUIRE(static_cast<int>(p.q_mode) <= static_cast<int>(QMode::int8),
                  "params.q_mode: ", static_cast<int>(p.q_mode),
                  " is not a Q mode (fp32 0, bf16 1, fp8 2, int8 3)");
  MJOLNIR_REQUIRE(static_cast<int>(p.p_mode) <= static_cast<int>(PMode::fp16),
                  "params.p_mode: ", static_cast<int>(p.p_mode),
                  " is not a P mode (fp32 0, bf16 1, fp8 2, fp16 3)");
  MJOLNIR_REQUIRE(p.p_mode != PMode::fp16 || half_sums_take(geo.format),
                  "p_mode: fp16 sums values in fp16, which takes fp8_e4m3, fp8_e5m2, fp6_e2m3, "
                  "fp6_e3m2, fp4_e2m1 and nvfp4 caches, not ",
                  to_string(geo.format), " (use fp32 or bf16)");
  MJOLNIR_REQUIRE(std::isfinite(p.softmax_scale) && p.softmax_scale >= 0,
                  "softmax_scale: ", p.softmax_scale, " must be finite and >= 0 (0 = 1/sqrt(D))");
  // q_len, and query_start for a ragged step (the geometry was checked with the cache view)
  detail::check_batch(args.batch, geo, p.q_len);

  const std::int64_t rows = args.num_query_rows();
  const std::int64_t d = geo.head_dim;
  // [num_seqs * q_len, Hq, D] with D contiguous: heads inside a token row, token rows apart.
  auto check_tensor = [&](const void* data, std::int64_t token_stride, std::int64_t head_stride,
                          RowType type, const char* name) {
    MJOLNIR_REQUIRE(type == RowType::f32 || type == RowType::bf16, name, ".type: ", int(type),
                    " is not a RowType");
    if (rows == 0) return;
    MJOLNIR_REQUIRE(data != nullptr, name, ".data: is null");
    MJOLNIR_REQUIRE(head_stride >= d, name, ".head_stride: ", head_stride,
                    " is less than head_dim ", d, " (head rows would overlap)");
    const std::int64_t token_span = head_stride * (p.num_q_heads - 1) + d;
    MJOLNIR_REQUIRE(rows == 1 || token_stride >= token_span, name, ".token_stride: ", token_stride,
                    " is less than the ", token_span,
                    " elements one token's heads span (rows would overlap)");
  };
  check_tensor(args.q.data, args.q.token_stride, args.q.head_stride, args.q.type, "q");
  check_tensor(args.o.data, args.o.token_stride, args.o.head_stride, args.o.type, "o");
  MJOLNIR_REQUIRE(args.lse.empty() || args.lse.size() == std::size_t(rows * p.num_q_heads),
                  "lse: ", args.lse.size(), " floats, expected ", rows * p.num_q_heads,
                  " ([num_seqs * q_len, Hq]) or none");
}

void check_plan(const Plan& plan, const DecodeArgs& args) {
  const StepShape step = args.step_shape();
  const int num_seqs = step.num_seqs();
  const int hk = step.num_kv_heads;
  MJOLNIR_REQUIRE(plan.ragged == !step.query_start.empty(), "plan: made for a ",
                  plan.ragged ? "ragged" : "decode", " step, but this step is ",
                  plan.ragged ? "a decode step (no query_start)" : "ragged (query_start given)",
                  " (make the plan for this step)");
  MJOLNIR_REQUIRE(plan.ragged ? plan.q_len == kQueryTileTokens : plan.q_len == step.q_len,
                  "plan.q_len: ", plan.q_len, " differs from params.q_len ", step.q_len,
                  " (make the plan for this step)");
  MJOLNIR_REQUIRE(plan.capacity.num_kv_heads == hk,
                  "plan.capacity.num_kv_heads: ", plan.capacity.num_kv_heads,
                  " differs from the cache's ", hk);
  MJOLNIR_REQUIRE(plan.num_seqs == num_seqs, "plan.num_seqs: ", plan.num_seqs,
                  " differs from the batch's ", num_seqs,
                  " sequences (make the plan for this step)");
  MJOLNIR_REQUIRE(plan.tile_tokens >= 1 && plan.tile_tokens <= 1024,
                  "plan.tile_tokens: ", plan.tile_tokens, " is outside [1, 1024]");
  MJOLNIR_REQUIRE(plan.num_items >= 0 && std::size_t(plan.num_items) <= plan.items.size(),
                  "plan.num_items: ", plan.num_items, " is outside the plan's ", plan.items.size(),
                  " items");
  const std::size_t tiles = std::size_t(std::max(plan.num_query_tiles, 0));
  MJOLNIR_REQUIRE(plan.num_query_tiles >= 0 && tiles <= plan.query_tiles.size() &&
                      tiles <= plan.num_splits.size() && tiles <= plan.first_partial.size(),
                  "plan.num_query_tiles: ", plan.num_query_tiles,
                  " exceeds the plan's capacity of ", plan.query_tiles.size());
  // Items first, against the step itself: what they would read and write.
  const std::int64_t slots = plan.partial_slots();
  for (int i = 0; i < plan.num_items; ++i) {
    const WorkItem& item = plan.items[i];
    MJOLNIR_REQUIRE(item.seq >= 0 && item.seq < num_seqs && item.kv_head >= 0 && item.kv_head < hk,
                    "plan.items[", i, "]: sequence ", item.seq, ", KV head ", item.kv_head,
                    " is outside the step's ", num_seqs, " sequences and ", hk, " KV heads");
    const int queries = step.query_len(item.seq);
    MJOLNIR_REQUIRE(item.q_begin >= 0 && item.q_count >= 1 && item.q_count <= plan.q_len &&
                        item.q_begin + item.q_count <= queries,
                    "plan.items[", i, "]: query tokens [", item.q_begin, ", ",
                    item.q_begin + item.q_count, ") are outside sequence ", item.seq, "'s ",
                    queries, " (make the plan for this step)");
    MJOLNIR_REQUIRE(item.tile >= 0 && std::size_t(item.tile) < tiles, "plan.items[", i,
                    "]: query tile ", item.tile, " is outside the plan's ", tiles);
    const int seq_len = step.seq_lens[item.seq];
    // The KV tokens the item's last query token may see.
    const int len = step.causal ? seq_len - queries + item.q_begin + item.q_count : seq_len;
    MJOLNIR_REQUIRE(item.kv_begin >= 0 && item.kv_begin <= item.kv_end && item.kv_end <= len,
                    "plan.items[", i, "]: tokens [", item.kv_begin, ", ", item.kv_end,
                    ") are outside sequence ", item.seq, "'s ", len,
                    " (the plan was made for other seq_lens; make it for this step)");
    MJOLNIR_REQUIRE(item.partial_slot >= -1 && item.partial_slot < slots, "plan.items[", i,
                    "]: partial slot ", item.partial_slot, " is outside the plan's ", slots);
    // make_plan lists a tile's chunks in order: its last item ends at the tile's KV length.
    const bool last_of_tile = i + 1 == plan.num_items || plan.items[i + 1].tile != item.tile;
    MJOLNIR_REQUIRE(!last_of_tile || item.kv_end == len, "plan.items[", i, "]: sequence ", item.seq,
                    " ends at token ", item.kv_end, ", its seq_len is ", len,
                    " (the plan was made for other seq_lens; make it for this step)");
    const QueryTile& qt = plan.query_tiles[item.tile];
    MJOLNIR_REQUIRE(item.seq == qt.seq && item.q_begin == qt.q_begin && item.q_count == qt.q_count,
                    "plan.items[", i, "]: sequence ", item.seq, " query tokens [", item.q_begin,
                    ", ", item.q_begin + item.q_count, ") differ from its query tile's");
  }
  // The query tiles are the step's, in order: make_plan's cut of each sequence's query tokens,
  // each seeing what causality lets its last token see.
  std::size_t i = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const int queries = step.query_len(b);
    const int count = plan.ragged ? (queries + kQueryTileTokens - 1) / kQueryTileTokens : 1;
    for (int k = 0; k < count; ++k, ++i) {
      MJOLNIR_REQUIRE(i < tiles, "plan.num_query_tiles: ", tiles,
                      " tiles do not cover the step's query tokens (make the plan for this step)");
      const int q_begin = k * kQueryTileTokens;
      const int q_count = plan.ragged ? std::min(kQueryTileTokens, queries - q_begin) : queries;
      const int len = step.seq_lens[b];
      const int kv_len = step.causal ? len - queries + q_begin + q_count : len;
      const QueryTile& qt = plan.query_tiles[i];
      MJOLNIR_REQUIRE(
          qt.seq == b && qt.q_begin == q_begin && qt.q_count == q_count && qt.kv_len == kv_len,
          "plan.query_tiles[", i, "]: sequence ", qt.seq, ", query tokens [", qt.q_begin, ", ",
          qt.q_begin + qt.q_count, "), ", qt.kv_len, " KV tokens, where the step has sequence ", b,
          ", [", q_begin, ", ", q_begin + q_count, "), ", kv_len,
          " (the plan was made for other seq_lens; make it for this step)");
      const std::int64_t first = plan.first_partial[i], splits = plan.num_splits[i];
      MJOLNIR_REQUIRE(splits >= 1 && splits <= plan.capacity.max_splits &&
                          (splits == 1 || (first >= 0 && first + splits <= slots)),
                      "plan.num_splits[", i, "]: ", splits, " chunks from partial slot ", first,
                      " do not fit the plan's ", slots, " slots");
    }
  }
  MJOLNIR_REQUIRE(i == tiles, "plan.num_query_tiles: ", tiles, " tiles, the step has ", i,
                  " (make the plan for this step)");
}

void Backend::plan(BackendPlan& out, const StepShape& step, const PlanOptions& options) const {
  // Unplanned until both parts are made: a make_plan that throws leaves nothing run() accepts.
  out.planned_by_.clear();
  make_plan(out.plan_, step, options);
  prepare(out.plan_, out.prepared_);
  out.planned_by_ = name();
}

void Backend::check_run(const DecodeArgs& args, const BackendPlan& plan,
                        std::span<const std::byte> workspace) const {
  MJOLNIR_REQUIRE(!plan.planned_by().empty(),
                  "plan: was not planned (Backend::plan() made no plan for this step)");
  check_plan(plan.plan(), args);
  const std::size_t needed = workspace_bytes(plan.plan(), args.cache.geometry, args.params);
  MJOLNIR_REQUIRE(workspace.size() >= needed, "workspace: ", workspace.size(),
                  " bytes, workspace_bytes() is ", needed);
}

PlanOptions Backend::plan_options(PlanOptions options) const {
  options.workers = workers();
  options.wave_workers = wave_workers();
  options.heads_together_min_tokens = heads_together_min_tokens();
  return options;
}

std::size_t Backend::workspace_bytes(const Plan& plan, const CacheGeometry& geometry,
                                     const DecodeParams& params) const {
  const PartialLayout layout = partial_layout(geometry, params);
  const int slots = plan.partial_slots();
  return (layout.o_floats(slots) + layout.lse_floats(slots)) * sizeof(float);
}

void decode(const Backend& backend, const DecodeArgs& args, PlanOptions options) {
  validate(args);
  const std::string why = backend.unsupported_reason(args.cache.geometry, args.params);
  MJOLNIR_REQUIRE(why.empty(), "backend ", backend.name(), ": ", why);
  options = backend.plan_options(options);
  const StepShape step = args.step_shape();
  // One call, one workspace sized for this plan alone: a max_splits of 0 gets as many chunks as
  // fill the device, and fixed_splits beyond max_splits get their way.
  const int max_splits = effective_max_splits(options, step.num_seqs(), step.num_kv_heads);
  if (max_splits >= 0) options.max_splits = std::max(max_splits, options.fixed_splits);
  BackendPlan plan(capacity_for(step, options));
  backend.plan(plan, step, options);
  std::vector<std::byte> workspace(
      backend.workspace_bytes(plan.plan(), args.cache.geometry, args.params));
  backend.run(args, plan, workspace);
}

}  // namespace mjolnir

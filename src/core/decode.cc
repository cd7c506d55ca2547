// Decode entry points shared by every backend: mode names, argument validation, the backend
// registry and the one-off decode() convenience.
#include "mjolnir/decode.h"

#include <cmath>
#include <cstring>

#include "cpu/cpu_backend.h"
#if MJOLNIR_HAS_CUDA
#include "cuda/cuda_backend.h"
#endif
#include "mjolnir/error.h"
#include "reference/emulator_backend.h"

namespace mjolnir {

std::string_view to_string(QMode mode) {
  switch (mode) {
    case QMode::fp32:
      return "fp32";
    case QMode::bf16:
      return "bf16";
    case QMode::fp8:
      return "fp8";
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
  }
  return "?";
}

QMode parse_q_mode(std::string_view name) {
  for (QMode m : {QMode::fp32, QMode::bf16, QMode::fp8}) {
    if (to_string(m) == name) return m;
  }
  detail::throw_error("q_mode: '", name, "' is not one of fp32, bf16, fp8");
}

PMode parse_p_mode(std::string_view name) {
  for (PMode m : {PMode::fp32, PMode::bf16, PMode::fp8}) {
    if (to_string(m) == name) return m;
  }
  detail::throw_error("p_mode: '", name, "' is not one of fp32, bf16, fp8");
}

float DecodeParams::effective_softmax_scale(int head_dim) const {
  return softmax_scale > 0 ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

void validate(const DecodeArgs& args) {
  validate(args.cache);
  const CacheGeometry& geo = args.cache.geometry;
  const DecodeParams& p = args.params;
  MJOLNIR_REQUIRE(p.q_len >= 1 && p.q_len <= kMaxQLen, "q_len: ", p.q_len, " is outside [1, ",
                  kMaxQLen, "]");
  MJOLNIR_REQUIRE(p.num_q_heads >= 1 && p.num_q_heads % geo.num_kv_heads == 0,
                  "num_q_heads: ", p.num_q_heads, " is not a positive multiple of num_kv_heads ",
                  geo.num_kv_heads);
  MJOLNIR_REQUIRE(std::isfinite(p.softmax_scale) && p.softmax_scale >= 0,
                  "softmax_scale: ", p.softmax_scale, " must be finite and >= 0 (0 = 1/sqrt(D))");
  validate(args.batch, geo, p.q_len);

  const std::int64_t rows = std::int64_t(args.batch.num_seqs()) * p.q_len;
  const std::int64_t d = geo.head_dim;
  // [num_seqs * q_len, Hq, D] with D contiguous: heads inside a token row, token rows apart.
  auto check_tensor = [&](const void* data, std::int64_t token_stride, std::int64_t head_stride,
                          const char* name) {
    if (rows == 0) return;
    MJOLNIR_REQUIRE(data != nullptr, name, ".data: is null");
    MJOLNIR_REQUIRE(head_stride >= d, name, ".head_stride: ", head_stride,
                    " is less than head_dim ", d, " (head rows would overlap)");
    const std::int64_t token_span = head_stride * (p.num_q_heads - 1) + d;
    MJOLNIR_REQUIRE(rows == 1 || token_stride >= token_span, name, ".token_stride: ", token_stride,
                    " is less than the ", token_span,
                    " floats one token's heads span (rows would overlap)");
  };
  check_tensor(args.q.data, args.q.token_stride, args.q.head_stride, "q");
  check_tensor(args.o.data, args.o.token_stride, args.o.head_stride, "o");
  MJOLNIR_REQUIRE(args.lse.empty() || args.lse.size() == std::size_t(rows * p.num_q_heads),
                  "lse: ", args.lse.size(), " floats, expected ", rows * p.num_q_heads,
                  " ([num_seqs * q_len, Hq]) or none");
}

std::size_t Backend::workspace_bytes(const Plan& plan, const CacheGeometry& geometry,
                                     const DecodeParams& params) const {
  const int g = params.num_q_heads / geometry.num_kv_heads;
  const PartialLayout layout{geometry.num_kv_heads, params.q_len * g, geometry.head_dim};
  const int slots = plan.capacity.max_seqs * plan.capacity.max_splits;
  return (layout.o_floats(slots) + layout.lse_floats(slots)) * sizeof(float);
}

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names{"cpu", "reference"};
#if MJOLNIR_HAS_CUDA
  names.insert(names.begin(), "cuda");  // device arguments: see src/cuda/cuda_backend.h
#endif
  return names;
}

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  if (name == "cpu") return cpu::make_cpu_backend(options);
  if (name == "reference") return reference::make_emulator_backend();
#if MJOLNIR_HAS_CUDA
  if (name == "cuda") return cuda::make_cuda_backend(options);
  detail::throw_error("backend: '", name, "' is not one of cuda, cpu, reference");
#else
  if (name == "cuda") {
    detail::throw_error(
        "backend: 'cuda' is not in this build (configure with nvcc found and "
        "MJOLNIR_CUDA=ON)");
  }
  detail::throw_error("backend: '", name, "' is not one of cpu, reference");
#endif
}

void decode(const Backend& backend, const DecodeArgs& args, PlanOptions options) {
  validate(args);
  const std::string why = backend.unsupported_reason(args.cache.geometry, args.params);
  MJOLNIR_REQUIRE(why.empty(), "backend ", backend.name(), ": ", why);
  options.workers = backend.workers();
  Plan plan(PlanCapacity{args.batch.num_seqs(), args.cache.geometry.num_kv_heads,
                         std::max(1, std::max(options.max_splits, options.fixed_splits))});
  options.max_splits = plan.capacity.max_splits;
  make_plan(plan, args.batch.seq_lens, args.params.q_len, args.cache.geometry.num_kv_heads,
            options);
  std::vector<std::byte> workspace(backend.workspace_bytes(plan, args.cache.geometry, args.params));
  backend.run(args, plan, workspace);
}

}  // namespace mjolnir

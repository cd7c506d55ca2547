// mjolnir._ext: the extension module under the Python package. Loading it registers the torch
// operators of csrc/torch_ops.cpp (torch.ops.mjolnir.*); this file binds, with nanobind, what
// is not an operator: format facts, the row codecs, the planner's items. mjolnir::Error becomes
// ValueError (its message names the argument).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "mjolnir/cache.h"
#include "mjolnir/calibrate.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "mjolnir/format.h"
#include "mjolnir/plan.h"
#include "mjolnir/write_kv.h"

#include "csrc/tensor_views.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mjolnir::python {
namespace {

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// The plan as rows (seq, kv_head, kv_begin, kv_end, split, partial_slot).
std::vector<std::int32_t> plan_items(std::uintptr_t seq_lens, int num_seqs, int q_len,
                                     int num_kv_heads, int workers, int max_splits, int tile_tokens,
                                     int min_chunk_tokens, int fixed_splits) {
  Plan plan(PlanCapacity{num_seqs, num_kv_heads, std::max(1, std::max(max_splits, fixed_splits))});
  PlanOptions options;
  options.workers = workers;
  options.max_splits = plan.capacity.max_splits;
  options.tile_tokens = tile_tokens;
  options.min_chunk_tokens = min_chunk_tokens;
  options.fixed_splits = fixed_splits;
  make_plan(plan, {as_ptr<const std::int32_t>(seq_lens), std::size_t(num_seqs)}, q_len,
            num_kv_heads, options);
  std::vector<std::int32_t> rows;
  rows.reserve(std::size_t(plan.num_items) * 6);
  for (const WorkItem& item : plan.work()) {
    rows.insert(rows.end(), {item.seq, item.kv_head, item.kv_begin, item.kv_end, item.split,
                             item.partial_slot});
  }
  return rows;
}

// --- calibration files: the C++ reader and writer, so Python and the CLI agree on every rule --

using AmaxLayer = std::tuple<std::string, std::vector<float>, std::vector<float>>;

void write_amax(const std::string& path, int num_kv_heads, int head_dim,
                const std::vector<AmaxLayer>& layers) {
  AmaxFile amax;
  amax.num_kv_heads = num_kv_heads;
  amax.head_dim = head_dim;
  for (const auto& [name, k, v] : layers) amax.layers.push_back({name, k, v});
  write_amax_file(amax, path);
}

nb::dict scales_dict(const ScalesFile& scales) {
  nb::dict out;
  out["format"] = std::string(to_string(scales.format));
  out["granularity"] = std::string(to_string(scales.granularity));
  out["num_kv_heads"] = scales.num_kv_heads;
  out["head_dim"] = scales.head_dim;
  out["headroom"] = scales.headroom;
  nb::list layers;
  for (const ScalesFile::Layer& layer : scales.layers) {
    layers.append(nb::make_tuple(layer.k_scale, layer.v_scale));
  }
  out["layers"] = layers;
  return out;
}

// amax file -> scales file (granularity "": the format's recommended one); returns the scales
// written.
nb::dict calibrate_file(const std::string& amax_path, const std::string& format,
                        const std::string& granularity, double headroom,
                        const std::string& out_path) {
  const ScalesFile scales =
      scales_from_amax_file(read_amax_file(amax_path), parse_format(format, "format"),
                            granularity.empty() ? recommended_granularity(parse_format(format))
                                                : parse_granularity(granularity, "granularity"),
                            headroom);
  write_scales_file(scales, out_path);
  return scales_dict(scales);
}

// Backend::auto_modes of a backend ("cpu" or "reference"), as (q_mode, p_mode) names.
std::tuple<std::string, std::string> auto_modes(const std::string& backend,
                                                const std::string& format, int head_dim,
                                                int max_tile_rows, bool bf16_queries) {
  MJOLNIR_REQUIRE(backend == "cpu" || backend == "reference", "backend: '", backend,
                  "' is not one of cpu, reference");
  // With the kernel variants the environment asks for, as the ops' backends (tensor_views.cpp).
  static const std::unique_ptr<Backend> cpu =
      make_backend("cpu", {.threads = 1, .cpu_kernels = cpu_kernel_options_from_environment()});
  static const std::unique_ptr<Backend> reference = make_backend("reference");
  const Backend& b = backend == "reference" ? *reference : *cpu;
  CacheGeometry geometry;
  geometry.format = parse_format(format, "kv_format");
  geometry.head_dim = head_dim;
  const NumericsModes modes = b.auto_modes(geometry, max_tile_rows, bf16_queries);
  return {std::string(to_string(modes.q_mode)), std::string(to_string(modes.p_mode))};
}

std::vector<std::string> names_of(auto&& all) {
  std::vector<std::string> names;
  for (auto value : all) names.emplace_back(to_string(value));
  return names;
}

// decode_row / encode_row on bytes, for users and for tests that check them independently.
std::vector<float> decode_row_bytes(const std::string& format, nb::bytes row, int head_dim) {
  const Format f = parse_format(format, "kv_format");
  MJOLNIR_REQUIRE(row.size() == row_bytes(f, head_dim), "row: ", row.size(),
                  " bytes, but a row of ", head_dim, " channels of ", format, " is ",
                  row_bytes(f, head_dim), " bytes");
  std::vector<float> out(static_cast<std::size_t>(head_dim));
  decode_row(f, {static_cast<const std::byte*>(row.data()), row.size()}, out);
  return out;
}

nb::bytes encode_row_values(const std::string& format, const std::vector<float>& values) {
  const Format f = parse_format(format, "kv_format");
  std::vector<std::byte> row(row_bytes(f, static_cast<int>(values.size())));
  encode_row(f, values, row);
  return nb::bytes(reinterpret_cast<const char*>(row.data()), row.size());
}

}  // namespace
}  // namespace mjolnir::python

NB_MODULE(_ext, m) {
  using namespace mjolnir;
  using namespace mjolnir::python;
  m.doc() = "mjolnir C++ library binding (the operators: torch.ops.mjolnir)";
  m.attr("__version__") = MJOLNIR_VERSION_STRING;
  m.attr("has_cuda") = bool(MJOLNIR_PY_CUDA);
  // Query tokens of a ragged step's query tile (plan.h): Step.num_query_tiles() counts them.
  m.attr("QUERY_TILE_TOKENS") = kQueryTileTokens;

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mjolnir::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("formats", [] { return names_of(kAllFormats); });
  m.def("layouts", [] { return names_of(kAllLayouts); });
  m.def("compiled_backends", &compiled_backends);
  m.def("auto_modes", &auto_modes, "backend"_a, "kv_format"_a, "head_dim"_a, "max_tile_rows"_a,
        "bf16_queries"_a,
        "The (q_mode, p_mode) a backend picks for 'auto' (Backend::auto_modes in decode.h)");
  m.def(
      "row_bytes",
      [](const std::string& format, int head_dim) {
        const Format f = parse_format(format, "kv_format");
        MJOLNIR_REQUIRE(head_dim > 0 && head_dim % 32 == 0, "head_dim: ", head_dim,
                        " is not a positive multiple of 32");
        return row_bytes(f, head_dim);
      },
      "kv_format"_a, "head_dim"_a);
  m.def(
      "format_max",
      [](const std::string& format) { return format_max(parse_format(format, "kv_format")); },
      "kv_format"_a);
  m.def(
      "is_quantized",
      [](const std::string& format) { return is_quantized(parse_format(format, "kv_format")); },
      "kv_format"_a);
  m.def(
      "parse_layout",
      [](const std::string& name) { return std::string(to_string(parse_layout(name, "layout"))); },
      "layout"_a);
  m.def(
      "check_mode",
      [](const std::string& q_mode, const std::string& p_mode) {
        parse_q_mode(q_mode);
        parse_p_mode(p_mode);
      },
      "q_mode"_a, "p_mode"_a);
  m.def(
      "workers",
      [](const std::string& backend, int threads) {
        return backend_for(c10::Device(c10::kCPU), backend, threads).workers();
      },
      "backend"_a, "threads"_a = 0);
  m.def("decode_row", &decode_row_bytes, "kv_format"_a, "row"_a, "head_dim"_a);
  m.def("encode_row", &encode_row_values, "kv_format"_a, "values"_a);
  m.def("write_amax_file", &write_amax, "path"_a, "num_kv_heads"_a, "head_dim"_a, "layers"_a);
  m.def(
      "read_scales_file",
      [](const std::string& path) { return scales_dict(read_scales_file(path)); }, "path"_a);
  m.def("calibrate", &calibrate_file, "amax_path"_a, "format"_a, "granularity"_a, "headroom"_a,
        "out_path"_a);
  m.def("plan", &plan_items, "seq_lens"_a, "num_seqs"_a, "q_len"_a, "num_kv_heads"_a, "workers"_a,
        "max_splits"_a, "tile_tokens"_a, "min_chunk_tokens"_a, "fixed_splits"_a);
}

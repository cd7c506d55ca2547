// mjolnir._ext: the nanobind binding under the Python package. It takes raw addresses (torch's
// data_ptr()) plus shapes and strides that python/mjolnir/ops.py has already checked against the
// tensors, fills the C++ API's views and calls it. mjolnir::Error becomes ValueError (its message
// names the argument); the GIL is released while kernels run.
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
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "mjolnir/format.h"
#include "mjolnir/plan.h"
#include "mjolnir/write_kv.h"

#if MJOLNIR_PY_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_decode.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace mjolnir::python {
namespace {

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// Backends own thread pools (CPU) or device state (CUDA): keep one per (name, threads).
const Backend& backend_for(const std::string& name, int threads) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int>, std::unique_ptr<Backend>> backends;
  std::lock_guard lock(mutex);
  auto& slot = backends[{name, threads}];
  if (!slot) {
    slot = make_backend(name, BackendOptions{.threads = threads});
    const std::string why = slot->unavailable_reason();
    if (!why.empty()) {
      slot.reset();
      detail::throw_error("backend: '", name, "' is not usable here: ", why);
    }
  }
  return *slot;
}

KvCacheView make_cache(const std::string& format, int num_pages, int page_size, int num_kv_heads,
                       int head_dim,
                       std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t> strides,
                       std::uintptr_t data, std::size_t bytes, const std::string& granularity,
                       std::uintptr_t k_scale, std::uintptr_t v_scale, std::size_t scale_count) {
  KvCacheView cache;
  cache.geometry = CacheGeometry{.format = parse_format(format, "kv_format"),
                                 .num_pages = num_pages,
                                 .page_size = page_size,
                                 .num_kv_heads = num_kv_heads,
                                 .head_dim = head_dim};
  cache.strides = CacheStrides{std::get<0>(strides), std::get<1>(strides), std::get<2>(strides),
                               std::get<3>(strides)};
  cache.data = as_ptr<std::byte>(data);
  cache.bytes = bytes;
  cache.granularity = parse_granularity(granularity, "k_scale");
  cache.k_scale = {as_ptr<const float>(k_scale), scale_count};
  cache.v_scale = {as_ptr<const float>(v_scale), scale_count};
  return cache;
}

using Strides4 = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>;

void decode_step(const std::string& backend_name, int threads, const std::string& format,
                 int num_pages, int page_size, int num_kv_heads, int head_dim, Strides4 strides,
                 std::uintptr_t cache_data, std::size_t cache_bytes, const std::string& granularity,
                 std::uintptr_t k_scale, std::uintptr_t v_scale, std::size_t scale_count,
                 std::uintptr_t block_table, int num_seqs, int max_pages_per_seq,
                 std::uintptr_t seq_lens, std::uintptr_t q, std::int64_t q_token_stride,
                 std::int64_t q_head_stride, std::uintptr_t o, std::int64_t o_token_stride,
                 std::int64_t o_head_stride, std::uintptr_t lse, int q_len, int num_q_heads,
                 bool causal, float softmax_scale, const std::string& q_mode,
                 const std::string& p_mode, int max_splits) {
  DecodeArgs args;
  args.cache = make_cache(format, num_pages, page_size, num_kv_heads, head_dim, strides, cache_data,
                          cache_bytes, granularity, k_scale, v_scale, scale_count);
  args.batch.block_table = {as_ptr<const std::int32_t>(block_table),
                            std::size_t(num_seqs) * std::size_t(max_pages_per_seq)};
  args.batch.max_pages_per_seq = max_pages_per_seq;
  args.batch.seq_lens = {as_ptr<const std::int32_t>(seq_lens), std::size_t(num_seqs)};
  args.params.q_len = q_len;
  args.params.num_q_heads = num_q_heads;
  args.params.causal = causal;
  args.params.softmax_scale = softmax_scale;
  args.params.q_mode = parse_q_mode(q_mode);
  args.params.p_mode = parse_p_mode(p_mode);
  args.q = {as_ptr<const float>(q), q_token_stride, q_head_stride};
  args.o = {as_ptr<float>(o), o_token_stride, o_head_stride};
  if (lse != 0) args.lse = {as_ptr<float>(lse), std::size_t(num_seqs) * q_len * num_q_heads};

  const Backend& backend = backend_for(backend_name, threads);
  nb::gil_scoped_release release;
  PlanOptions options;
  options.max_splits = max_splits;
  if (backend_name != "cuda") {
    decode(backend, args, options);
    return;
  }
#if MJOLNIR_PY_CUDA
  validate(args);
  const std::string why = backend.unsupported_reason(args.cache.geometry, args.params);
  MJOLNIR_REQUIRE(why.empty(), "backend cuda: ", why);
  options.workers = backend.workers();
  options.max_splits = effective_max_splits(options, num_seqs, num_kv_heads);
  Plan plan(PlanCapacity{num_seqs, num_kv_heads, std::max(1, options.max_splits)});
  make_plan(plan, args.batch.seq_lens, q_len, num_kv_heads, options);
  const std::size_t bytes = backend.workspace_bytes(plan, args.cache.geometry, args.params);
  void* workspace = nullptr;
  if (bytes > 0 && cudaMalloc(&workspace, bytes) != cudaSuccess) {
    detail::throw_error("workspace: cudaMalloc of ", bytes, " bytes failed");
  }
  try {
    backend.run(args, plan, {static_cast<std::byte*>(workspace), bytes});
  } catch (...) {
    cudaFree(workspace);
    throw;
  }
  cudaFree(workspace);
#else
  detail::throw_error("backend: this build of mjolnir has no CUDA backend");
#endif
}

void write_kv_rows(const std::string& device, const std::string& format, int num_pages,
                   int page_size, int num_kv_heads, int head_dim, Strides4 strides,
                   std::uintptr_t cache_data, std::size_t cache_bytes,
                   const std::string& granularity, std::uintptr_t k_scale, std::uintptr_t v_scale,
                   std::size_t scale_count, std::uintptr_t k, std::int64_t k_token_stride,
                   std::int64_t k_head_stride, std::uintptr_t v, std::int64_t v_token_stride,
                   std::int64_t v_head_stride, std::uintptr_t slot_mapping, int num_tokens,
                   std::uintptr_t stream) {
  const KvCacheView cache =
      make_cache(format, num_pages, page_size, num_kv_heads, head_dim, strides, cache_data,
                 cache_bytes, granularity, k_scale, v_scale, scale_count);
  const TokenRows k_rows{as_ptr<const float>(k), k_token_stride, k_head_stride};
  const TokenRows v_rows{as_ptr<const float>(v), v_token_stride, v_head_stride};
  nb::gil_scoped_release release;
  if (device == "cpu") {
    write_kv(cache, k_rows, v_rows,
             {as_ptr<const std::int64_t>(slot_mapping), std::size_t(num_tokens)});
    return;
  }
#if MJOLNIR_PY_CUDA
  cuda::write_kv(cache, k_rows, v_rows, as_ptr<const std::int64_t>(slot_mapping), num_tokens,
                 reinterpret_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::throw_error("kv_cache: on device '", device, "', but this build has no CUDA backend");
#endif
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
  m.doc() = "mjolnir C++ library binding (raw addresses; use mjolnir.ops / torch.ops.mjolnir)";
  m.attr("__version__") = MJOLNIR_VERSION_STRING;
  m.attr("has_cuda") = bool(MJOLNIR_PY_CUDA);

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
        return backend_for(backend, threads).workers();
      },
      "backend"_a, "threads"_a = 0);
  m.def("decode_row", &decode_row_bytes, "kv_format"_a, "row"_a, "head_dim"_a);
  m.def("encode_row", &encode_row_values, "kv_format"_a, "values"_a);
  m.def("decode", &decode_step, "backend"_a, "threads"_a, "kv_format"_a, "num_pages"_a,
        "page_size"_a, "num_kv_heads"_a, "head_dim"_a, "strides"_a, "cache_data"_a, "cache_bytes"_a,
        "granularity"_a, "k_scale"_a, "v_scale"_a, "scale_count"_a, "block_table"_a, "num_seqs"_a,
        "max_pages_per_seq"_a, "seq_lens"_a, "q"_a, "q_token_stride"_a, "q_head_stride"_a, "o"_a,
        "o_token_stride"_a, "o_head_stride"_a, "lse"_a, "q_len"_a, "num_q_heads"_a, "causal"_a,
        "softmax_scale"_a, "q_mode"_a, "p_mode"_a, "max_splits"_a);
  m.def("write_kv", &write_kv_rows, "device"_a, "kv_format"_a, "num_pages"_a, "page_size"_a,
        "num_kv_heads"_a, "head_dim"_a, "strides"_a, "cache_data"_a, "cache_bytes"_a,
        "granularity"_a, "k_scale"_a, "v_scale"_a, "scale_count"_a, "k"_a, "k_token_stride"_a,
        "k_head_stride"_a, "v"_a, "v_token_stride"_a, "v_head_stride"_a, "slot_mapping"_a,
        "num_tokens"_a, "stream"_a);
  m.def("plan", &plan_items, "seq_lens"_a, "num_seqs"_a, "q_len"_a, "num_kv_heads"_a, "workers"_a,
        "max_splits"_a, "tile_tokens"_a, "min_chunk_tokens"_a, "fixed_splits"_a);
}

// Torch tensors as the library's views (see tensor_views.h).
#include "tensor_views.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>

#include "core/bf16_rows.h"
#include "mjolnir/error.h"
#include "mjolnir/format.h"
#include "torch_executor.h"

namespace mjolnir::python {

namespace {

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  raise_value_error(os.str());
}

// The format a cache tensor's own dtype implies, or none for the byte dtypes that hold any.
const char* implied_format(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::BFloat16:
      return "bf16";
    case c10::ScalarType::Half:
      return "fp16";
    case c10::ScalarType::Float8_e4m3fn:
      return "fp8_e4m3";
    case c10::ScalarType::Float8_e5m2:
      return "fp8_e5m2";
    default:
      return nullptr;
  }
}

// Bytes from the first to one past the last element.
std::size_t byte_extent(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  std::int64_t elements = 1;
  for (std::int64_t i = 0; i < t.dim(); ++i) elements += (t.size(i) - 1) * t.stride(i);
  return std::size_t(elements) * t.element_size();
}

// One row's channels to float32 and back, for the rows the library does not take as they are
// (fp16, a bf16 tensor for the CUDA backend). bf16 goes through its bits, branch-free, so the
// loops vectorize (c10::BFloat16's conversion from float tests for NaN with a branch), with the
// library's rounding (core/bf16_rows.h), which is c10's: to nearest even, NaN as 0x7FC0
// (test_ops.py's test_half_rows_convert_as_torch_does).
template <class T>
void row_to_float(const T* __restrict s, float* __restrict o, std::int64_t d) {
  for (std::int64_t c = 0; c < d; ++c) o[c] = static_cast<float>(s[c]);
}
inline void row_to_float(const c10::BFloat16* __restrict s, float* __restrict o, std::int64_t d) {
  for (std::int64_t c = 0; c < d; ++c) o[c] = bf16_to_float(s[c].x);
}
template <class T>
void row_from_float(const float* __restrict s, T* __restrict o, std::int64_t d) {
  for (std::int64_t c = 0; c < d; ++c) o[c] = T(s[c]);
}
inline void row_from_float(const float* __restrict s, c10::BFloat16* __restrict o, std::int64_t d) {
  for (std::int64_t c = 0; c < d; ++c) o[c].x = bf16_from_float(s[c]);
}

// Rows per task of a conversion: about 16K values, so that a decode step's few rows (8 sequences
// of 32 heads) are shared by the threads too.
std::int64_t rows_per_task(std::int64_t heads, std::int64_t d) {
  return std::max<std::int64_t>(1, (std::int64_t(1) << 14) / std::max<std::int64_t>(1, heads * d));
}

template <class T>
void convert_rows(const T* src, std::int64_t src_token, std::int64_t src_head, float* dst,
                  std::int64_t rows, std::int64_t heads, std::int64_t d) {
  at::parallel_for(0, rows, rows_per_task(heads, d), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      for (std::int64_t h = 0; h < heads; ++h) {
        row_to_float(src + r * src_token + h * src_head, dst + (r * heads + h) * d, d);
      }
    }
  });
}

template <class T>
void store_rows(const float* src, T* dst, std::int64_t dst_token, std::int64_t dst_head,
                std::int64_t rows, std::int64_t heads, std::int64_t d) {
  at::parallel_for(0, rows, rows_per_task(heads, d), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      for (std::int64_t h = 0; h < heads; ++h) {
        row_from_float(src + (r * heads + h) * d, dst + r * dst_token + h * dst_head, d);
      }
    }
  });
}

bool direct_float_rows(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && (t.numel() == 0 || t.stride(-1) == 1);
}

// Scratch of more than this many floats (64 MiB) is let go after the call, so that an unusually
// long prompt does not keep its buffers for the rest of the process.
constexpr std::size_t kKeptScratchFloats = std::size_t(16) << 20;

float* scratch_rows(FloatScratch& scratch, std::size_t floats) {
  if (scratch.size < floats) {
    scratch.data.reset(new float[floats]);  // default-initialized: not zero-filled
    scratch.size = floats;
  }
  return scratch.data.get();
}

// A scale tensor holds floats (read on the host, or left on the device).
void require_floats(const at::Tensor& t, std::string_view name) {
  if (!at::isFloatingType(t.scalar_type())) {
    fail(name, ": expected a float tensor, got ", dtype_name(t.scalar_type()));
  }
}

}  // namespace

std::span<const float> host_floats(const at::Tensor& t, std::string_view name, at::Tensor& keep) {
  require_floats(t, name);
  if (t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous()) {
    return {t.const_data_ptr<float>(), std::size_t(t.numel())};
  }
  keep = t.detach().to(at::kCPU, at::kFloat).contiguous();
  return {keep.const_data_ptr<float>(), std::size_t(keep.numel())};
}

// t's own rows, when the library reads or writes them as they are.
bool own_rows(const at::Tensor& t, bool bf16_ok, LibraryRows& rows) {
  const bool bf16 = bf16_ok && t.device().is_cpu() && t.scalar_type() == at::kBFloat16 &&
                    (t.numel() == 0 || t.stride(-1) == 1);
  if (!bf16 && !direct_float_rows(t)) return false;
  rows.data = t.data_ptr();
  rows.token_stride = t.stride(0);
  rows.head_stride = t.stride(1);
  rows.type = bf16 ? RowType::bf16 : RowType::f32;
  return true;
}

LibraryRows rows_in(const at::Tensor& t, std::int64_t rows, FloatScratch& scratch, bool bf16_ok) {
  LibraryRows out;
  if (own_rows(t, bf16_ok, out)) return out;
  const std::int64_t heads = t.size(1), d = t.size(2);
  out.converted = true;
  out.token_stride = heads * d;
  out.head_stride = d;
  if (!t.device().is_cpu()) {
    out.device_copy = t.narrow(0, 0, rows).to(at::kFloat).contiguous();
    out.data = out.device_copy.data_ptr<float>();
    return out;
  }
  float* const dst = scratch_rows(scratch, std::size_t(rows * heads * d));
  out.data = dst;
  if (t.scalar_type() == at::kBFloat16) {
    convert_rows(t.const_data_ptr<c10::BFloat16>(), t.stride(0), t.stride(1), dst, rows, heads, d);
  } else if (t.scalar_type() == at::kHalf) {
    convert_rows(t.const_data_ptr<c10::Half>(), t.stride(0), t.stride(1), dst, rows, heads, d);
  } else {  // float32 whose channels are not contiguous
    const at::Tensor copy = t.narrow(0, 0, rows).contiguous();
    convert_rows(copy.const_data_ptr<float>(), copy.stride(0), copy.stride(1), dst, rows, heads, d);
  }
  return out;
}

LibraryRows rows_out(const at::Tensor& out, std::int64_t rows, FloatScratch& scratch,
                     bool bf16_ok) {
  LibraryRows r;
  if (own_rows(out, bf16_ok, r)) return r;
  const std::int64_t heads = out.size(1), d = out.size(2);
  r.converted = true;
  r.token_stride = heads * d;
  r.head_stride = d;
  if (!out.device().is_cpu()) {
    r.device_copy = at::empty({rows, heads, d}, out.options().dtype(at::kFloat));
    r.data = r.device_copy.data_ptr<float>();
    return r;
  }
  r.data = scratch_rows(scratch, std::size_t(rows * heads * d));
  return r;
}

void finish_rows_out(const at::Tensor& out, std::int64_t count, const LibraryRows& rows) {
  if (!rows.converted) return;
  if (rows.device_copy.defined()) {
    out.narrow(0, 0, count).copy_(rows.device_copy);
    return;
  }
  const std::int64_t heads = out.size(1), d = out.size(2);
  const float* src = static_cast<const float*>(rows.data);
  if (out.scalar_type() == at::kBFloat16) {
    store_rows(src, out.data_ptr<c10::BFloat16>(), out.stride(0), out.stride(1), count, heads, d);
  } else if (out.scalar_type() == at::kHalf) {
    store_rows(src, out.data_ptr<c10::Half>(), out.stride(0), out.stride(1), count, heads, d);
  } else {
    store_rows(src, out.data_ptr<float>(), out.stride(0), out.stride(1), count, heads, d);
  }
}

void release_scratch(FloatScratch& scratch) {
  if (scratch.size > kKeptScratchFloats) scratch = FloatScratch();
}

std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return "torch.float32";
    case c10::ScalarType::Double:
      return "torch.float64";
    case c10::ScalarType::Half:
      return "torch.float16";
    case c10::ScalarType::BFloat16:
      return "torch.bfloat16";
    case c10::ScalarType::Byte:
      return "torch.uint8";
    case c10::ScalarType::Char:
      return "torch.int8";
    case c10::ScalarType::Short:
      return "torch.int16";
    case c10::ScalarType::Int:
      return "torch.int32";
    case c10::ScalarType::Long:
      return "torch.int64";
    case c10::ScalarType::Bool:
      return "torch.bool";
    case c10::ScalarType::Float8_e4m3fn:
      return "torch.float8_e4m3fn";
    case c10::ScalarType::Float8_e5m2:
      return "torch.float8_e5m2";
    default:
      return std::string("torch.") + c10::toString(type);
  }
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << "(";
  for (std::int64_t i = 0; i < t.dim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << (t.dim() == 1 ? ",)" : ")");
  return os.str();
}

void raise_value_error(const std::string& message) { TORCH_CHECK_VALUE(false, message); }

std::string op_argument_names(std::string message) {
  // The library names its own fields; the ops' callers know their arguments.
  static const std::pair<std::string_view, std::string_view> kRenames[] = {
      {"cache.k_scale", "k_scale"},
      {"cache.v_scale", "v_scale"},
      {"cache.", "kv_cache."},
      {"o.", "output."}};
  for (const auto& [from, to] : kRenames) {
    if (message.starts_with(from)) return std::string(to) + message.substr(from.size());
  }
  return message;
}

void check_head_dim(std::int64_t head_dim, std::string_view name) {
  if (head_dim <= 0 || head_dim % 32 != 0 || head_dim > 256) {
    fail(name, ": head size (last dimension) ", head_dim, " is not a multiple of 32 in [32, 256]");
  }
}

void check_rows(const at::Tensor& t, std::string_view name, std::int64_t expect_heads) {
  if (t.dim() != 3) {
    fail(name, ": expected 3 dimensions [num_tokens, heads, head_size], got shape ", shape_of(t));
  }
  const auto type = t.scalar_type();
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf) {
    fail(name, ": expected float32, bfloat16 or float16, got ", dtype_name(type));
  }
  if (expect_heads > 0 && t.size(1) != expect_heads) {
    fail(name, ": ", t.size(1), " heads, but the cache has ", expect_heads, " KV heads");
  }
}

at::Tensor host_int32(const at::Tensor& t, std::string_view name, int dims) {
  if (t.scalar_type() != at::kInt) {
    fail(name, ": expected dtype torch.int32, got ", dtype_name(t.scalar_type()));
  }
  if (t.dim() != dims) fail(name, ": expected ", dims, " dimensions, got shape ", shape_of(t));
  return t.device().is_cpu() && t.is_contiguous() ? t : t.detach().to(at::kCPU).contiguous();
}

void check_same_device(const at::Tensor& t, std::string_view name, const at::Tensor& first,
                       std::string_view first_name) {
  if (t.device() != first.device()) {
    fail(name, ": on ", t.device().str(), ", but ", first_name, " is on ", first.device().str());
  }
}

CacheTensor cache_tensor(const at::Tensor& kv_cache, std::string_view kv_format,
                         std::string_view layout, int head_dim, const at::Tensor& k_scale,
                         const at::Tensor& v_scale, bool leave_device_scales) {
  const Format format = with_op_errors([&] { return parse_format(kv_format, "kv_format"); });
  const std::string dims =
      with_op_errors([&] { return std::string(to_string(parse_layout(layout, "layout"))); });
  if (kv_cache.dim() != 5) {
    std::string listed;
    for (char c : dims) listed += std::string(listed.empty() ? "" : ", ") + c;
    fail("kv_cache: expected 5 dimensions [", listed, "] for layout ", dims, ", got shape ",
         shape_of(kv_cache));
  }
  const auto type = kv_cache.scalar_type();
  const char* implied = implied_format(type);
  if (implied == nullptr && type != at::kByte && type != at::kChar) {
    fail("kv_cache: dtype ", dtype_name(type), " cannot hold a ", kv_format,
         " cache (use uint8, or the format's own torch dtype)");
  }
  if (implied != nullptr && kv_format != implied) {
    fail("kv_format: '", kv_format, "' does not match the cache dtype ", dtype_name(type),
         " (which holds ", implied, ")");
  }
  const std::int64_t item = kv_cache.element_size();
  const std::size_t row = row_bytes(format, head_dim);
  if (std::size_t(kv_cache.size(4) * item) != row) {
    fail("kv_cache: the last dimension holds ", kv_cache.size(4) * item,
         " bytes per token row, but ", head_dim, " channels of ", kv_format, " take ", row,
         " bytes");
  }
  if (kv_cache.stride(4) != 1) {
    fail("kv_cache: the last dimension (a token's row) must be contiguous, got stride ",
         kv_cache.stride(4));
  }
  std::int64_t size[128] = {}, stride[128] = {};
  for (int i = 0; i < 5; ++i) {
    size[int(dims[i])] = kv_cache.size(i);
    stride[int(dims[i])] = kv_cache.stride(i) * item;
  }
  if (size[int('B')] < 1) {
    fail("kv_cache: dimension ", dims.find('B'), " (pages) of layout ", dims,
         " has size 0: a cache needs at least one page; shape ", shape_of(kv_cache));
  }
  if (size[int('2')] != 2) {
    fail("kv_cache: dimension ", dims.find('2'), " (K/V) of layout ", dims, " has size ",
         size[int('2')], ", expected 2; shape ", shape_of(kv_cache));
  }

  CacheTensor out;
  std::span<const float> ks, vs;
  if (leave_device_scales && k_scale.is_cuda() && v_scale.is_cuda()) {
    require_floats(k_scale, "k_scale");
    require_floats(v_scale, "v_scale");
    out.unread_scales.assign(std::size_t(std::max(k_scale.numel(), v_scale.numel())), 1.0f);
    ks = {out.unread_scales.data(), std::size_t(k_scale.numel())};
    vs = {out.unread_scales.data(), std::size_t(v_scale.numel())};
  } else {
    ks = host_floats(k_scale, "k_scale", out.k_scale);
    vs = host_floats(v_scale, "v_scale", out.v_scale);
  }
  const std::int64_t hk = size[int('H')];
  const std::int64_t count = std::int64_t(ks.size());
  // Later entries win where counts coincide (Hk = 1), as the Python ops decided it.
  ScaleGranularity granularity = ScaleGranularity::tensor;
  if (count == hk * head_dim) {
    granularity = ScaleGranularity::channel;
  } else if (count == hk) {
    granularity = ScaleGranularity::head;
  } else if (count != 1) {
    fail("k_scale: ", count, " values; expected 1 (per tensor), ", hk, " (per KV head) or ",
         hk * head_dim, " (per KV head and channel)");
  }
  if (std::int64_t(vs.size()) != count) {
    fail("v_scale: ", vs.size(), " values, but k_scale has ", count,
         "; both must have the same granularity");
  }
  KvCacheView& view = out.view;
  view.geometry = CacheGeometry{.format = format,
                                .num_pages = int(size[int('B')]),
                                .page_size = int(size[int('N')]),
                                .num_kv_heads = int(hk),
                                .head_dim = head_dim};
  view.strides =
      CacheStrides{stride[int('B')], stride[int('H')], stride[int('N')], stride[int('2')]};
  view.data = static_cast<std::byte*>(kv_cache.data_ptr());
  view.bytes = byte_extent(kv_cache);
  view.granularity = granularity;
  view.k_scale = ks;
  view.v_scale = vs;
  return out;
}

const Backend& backend_for(const at::Device& device, std::string_view backend,
                           std::int64_t threads) {
  with_op_errors([&] { check_cpu_threads(threads, "threads"); });
  std::string name(backend);
  if (name.empty()) {
    if (device.is_cpu()) {
      name = "cpu";
    } else if (device.is_cuda()) {
#if !MJOLNIR_PY_CUDA
      fail("q: on ", device.str(),
           ", but this build of mjolnir has no CUDA backend (reinstall with "
           "MJOLNIR_PYTHON_CUDA=ON)");
#endif
      name = "cuda";
    } else {
      fail("q: device ", device.str(), " is not supported (cpu, or cuda when built with CUDA)");
    }
  }
  static std::mutex mutex;
  static std::map<std::pair<std::string, std::int64_t>, std::unique_ptr<Backend>> backends;
  std::lock_guard lock(mutex);
  std::unique_ptr<Backend>& slot = backends[{name, threads}];
  if (!slot) {
    BackendOptions options;
    if (name == "cpu" && threads == 0) {
      options.executor = std::make_shared<TorchExecutor>();
    } else {
      options.threads = int(threads);
    }
    try {
      // MJOLNIR_CPU_BF16_DOT / _AMX / _AVOID_SUBNORMALS and MJOLNIR_CUDA_MMA_LAYOUT, as for
      // the CLI (docs/python.md).
      options.cpu_kernels = cpu_kernel_options_from_environment();
      options.cuda_kernels = cuda_kernel_options_from_environment();
      slot = make_backend(name, options);
    } catch (const Error& e) {
      backends.erase({name, threads});
      raise_value_error(e.what());
    }
    const std::string why = slot->unavailable_reason();
    if (!why.empty()) {
      backends.erase({name, threads});
      fail("backend: '", name, "' is not usable here: ", why);
    }
  }
  return *slot;
}

const CudaKernelOptions& cuda_kernels_from_environment() {
  static const CudaKernelOptions kernels =
      with_op_errors([] { return cuda_kernel_options_from_environment(); });
  return kernels;
}

}  // namespace mjolnir::python

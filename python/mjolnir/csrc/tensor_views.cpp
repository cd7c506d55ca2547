// Torch tensors as the library's views (see tensor_views.h).
#include "tensor_views.h"

#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>

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

at::Tensor host_scales(const at::Tensor& s, std::string_view name) {
  if (!at::isFloatingType(s.scalar_type())) {
    fail(name, ": expected a float tensor, got ", dtype_name(s.scalar_type()));
  }
  return s.detach().to(at::kCPU, at::kFloat).contiguous().reshape(-1);
}

}  // namespace

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

at::Tensor as_float32_rows(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat && (t.numel() == 0 || t.stride(-1) == 1)) return t;
  return t.to(at::kFloat).contiguous();
}

void check_same_device(const at::Tensor& t, std::string_view name, const at::Tensor& first,
                       std::string_view first_name) {
  if (t.device() != first.device()) {
    fail(name, ": on ", t.device().str(), ", but ", first_name, " is on ", first.device().str());
  }
}

CacheTensor cache_tensor(const at::Tensor& kv_cache, std::string_view kv_format,
                         std::string_view layout, int head_dim, const at::Tensor& k_scale,
                         const at::Tensor& v_scale) {
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
  if (size[int('2')] != 2) {
    fail("kv_cache: dimension ", dims.find('2'), " (K/V) of layout ", dims, " has size ",
         size[int('2')], ", expected 2; shape ", shape_of(kv_cache));
  }

  CacheTensor out;
  out.k_scale = host_scales(k_scale, "k_scale");
  out.v_scale = host_scales(v_scale, "v_scale");
  const std::int64_t hk = size[int('H')];
  const std::int64_t count = out.k_scale.numel();
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
  if (out.v_scale.numel() != count) {
    fail("v_scale: ", out.v_scale.numel(), " values, but k_scale has ", count,
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
  view.k_scale = {out.k_scale.data_ptr<float>(), std::size_t(count)};
  view.v_scale = {out.v_scale.data_ptr<float>(), std::size_t(count)};
  return out;
}

const Backend& backend_for(const at::Device& device, std::string_view backend,
                           std::int64_t threads) {
  if (threads < 0 || threads > kMaxCpuThreads) {
    fail("threads: ", threads, " is outside [0, ", kMaxCpuThreads, "] (0 = every core)");
  }
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

}  // namespace mjolnir::python

// Torch tensors as the C++ library's views: the checks every torch.ops.mjolnir op makes of its
// tensors, written once. A bad tensor raises ValueError whose message starts with the op's
// argument name ("kv_cache: ...", "block_table: ..."), as the library's own checks do.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mjolnir/cache.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "mjolnir/write_kv.h"

namespace mjolnir::python {

// Raises the ValueError Python sees (c10::ValueError), `message` as it is.
[[noreturn]] void raise_value_error(const std::string& message);

// As Python prints them: "torch.float32", "(2, 12, 16)".
std::string dtype_name(c10::ScalarType type);
std::string shape_of(const at::Tensor& t);

// Runs fn; a mjolnir::Error it throws becomes a ValueError, its message naming the op's
// arguments instead of the library's fields ("cache.k_scale[0]" -> "k_scale[0]").
template <class F>
decltype(auto) with_op_errors(F&& fn);

// The paged cache: a 5-D tensor whose dimensions follow `layout` ("2BNHD" = [2, blocks,
// block_size, Hk, row]), the last holding one token's packed row of head_dim channels, with the
// scales [1], [Hk] or [Hk * D] (float, any device: they are read on the host). With
// `leave_device_scales`, scales on a CUDA device are not read (reading them would wait for the
// device): their count gives the granularity, the view's spans hold ones in their place (for
// the checks that need values), and the device kernels read the tensors themselves, so their
// values are not checked.
struct CacheTensor {
  KvCacheView view;
  at::Tensor k_scale, v_scale;       // host float32 copies the view's spans point into, if made
  std::vector<float> unread_scales;  // the ones standing in for device scales left unread
};
CacheTensor cache_tensor(const at::Tensor& kv_cache, std::string_view kv_format,
                         std::string_view layout, int head_dim, const at::Tensor& k_scale,
                         const at::Tensor& v_scale, bool leave_device_scales = false);

// Q / O / K / V rows [num_tokens, heads, head_size] in float32, bfloat16 or float16 with the
// head size contiguous; `expect_heads` > 0 also checks the head count.
void check_rows(const at::Tensor& t, std::string_view name, std::int64_t expect_heads = 0);
// A head size the kernels take: a multiple of 32 in [32, 256].
void check_head_dim(std::int64_t head_dim, std::string_view name);
// An int32 tensor of `dims` dimensions, contiguous on the host (copied when it is not).
at::Tensor host_int32(const at::Tensor& t, std::string_view name, int dims);
// Rows [0, rows) of a [tokens, heads, D] tensor as the rows the library reads or writes: the
// tensor's own memory when it is float32 with D contiguous, or bf16 with D contiguous on the host
// when the backend takes bf16 rows (`bf16_ok`: Backend::takes_rows); else float32 rows in
// `scratch` (host tensors convert by a loop, bf16 and fp16 rounding to nearest even; device
// tensors through torch). No torch operator on the host path: at a decode step of a short
// context each costs about what the kernel does.
// Host float32 rows for conversions: grown as needed, never zero-filled (every float is written
// before it is read), kept between calls up to a prompt's size.
struct FloatScratch {
  std::unique_ptr<float[]> data;
  std::size_t size = 0;
};
struct LibraryRows {
  void* data = nullptr;  // float, or bf16 bits where type is bf16
  std::int64_t token_stride = 0, head_stride = 0;
  RowType type = RowType::f32;
  bool converted = false;  // float32 rows in scratch or device_copy, not the tensor's own
  at::Tensor device_copy;  // device tensors: the float32 copy that holds the rows
};
LibraryRows rows_in(const at::Tensor& t, std::int64_t rows, FloatScratch& scratch, bool bf16_ok);
LibraryRows rows_out(const at::Tensor& out, std::int64_t rows, FloatScratch& scratch, bool bf16_ok);
// Stores what the library wrote into `rows` back into `out`, when it went to scratch.
void finish_rows_out(const at::Tensor& out, std::int64_t count, const LibraryRows& rows);
// Lets scratch larger than a long prompt's rows go after its call (a prefill of 16k tokens of 8
// heads x 128 channels stays: a serving engine runs one every step of a prompt, and a fresh
// allocation costs its page faults each time).
void release_scratch(FloatScratch& scratch);
// Per-tensor scales etc.: float32 host values without a copy when they already are, else a
// float32 host copy in `keep`.
std::span<const float> host_floats(const at::Tensor& t, std::string_view name, at::Tensor& keep);
// Every tensor on `device` (the first argument's), naming the first that is not.
void check_same_device(const at::Tensor& t, std::string_view name, const at::Tensor& first,
                       std::string_view first_name);

// The CUDA kernel variants the environment asks for (MJOLNIR_CUDA_MMA_LAYOUT,
// cuda_kernel_options_from_environment), read once per process: what the ops' own device launches
// take (torch_ops.cpp, graph_buffers.cpp), as backend_for's backends do.
const CudaKernelOptions& cuda_kernels_from_environment();

// The library's backend for a device ("" picks cpu or cuda from it) and a thread count:
// threads 0 runs the CPU backend on torch's intra-op threads (at::parallel_for), so it shares
// the cores with torch instead of competing with them; threads N > 0 runs it on N of its own.
// One backend per (name, threads) per process.
const Backend& backend_for(const at::Device& device, std::string_view backend,
                           std::int64_t threads);

// --- implementation of with_op_errors ---------------------------------------------------------

std::string op_argument_names(std::string message);

template <class F>
decltype(auto) with_op_errors(F&& fn) {
  try {
    return fn();
  } catch (const Error& e) {
    raise_value_error(op_argument_names(e.what()));
  }
}

}  // namespace mjolnir::python

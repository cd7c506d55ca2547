// The write_kv kernels (cuda_decode.h): a check that records the first bad input, and the write,
// which quantizes every token's rows with the encoders of kv_codec.cuh. Included by write_kv.cu.
#pragma once

#if defined(MJOLNIR_CUDA_EMULATION)
#include "cuda/cpu_emulation.h"  // the kernels on CPU threads, for tests without a GPU
#else
#include <cuda_runtime.h>
#endif

#include <cstdint>

#include "cuda/kv_codec.cuh"

namespace mjolnir::cuda::write_detail {

constexpr unsigned long long kNoError = ~0ull;
constexpr int kWriteThreads = 128;

// The first bad input, as the host checks them: all slots, then every K value, then every V
// value, each in (token, head, channel) order. Packed so atomicMin keeps the first:
// category (8 bits) | token (32) | head (13) | channel (9) | kind (2).
enum Category : unsigned { kBadSlot = 0, kBadK = 1, kBadV = 2 };
enum Kind : unsigned { kNaN = 0, kPlusInf = 1, kMinusInf = 2 };
constexpr int kMaxHeads = 1 << 13;

__device__ inline unsigned long long error_key(unsigned category, long long token, int head,
                                               int channel, unsigned kind) {
  return static_cast<unsigned long long>(category) << 56 |
         static_cast<unsigned long long>(token) << 24 |
         static_cast<unsigned long long>(head) << 11 |
         static_cast<unsigned long long>(channel) << 2 | kind;
}

struct WriteParams {
  std::uint8_t* pool = nullptr;
  std::int64_t page_stride = 0, head_stride = 0, token_stride = 0, kv_stride = 0;
  std::int64_t num_slots = 0;
  int page_size = 0, head_dim = 0, num_kv_heads = 0, granularity = 0;
  const float* k = nullptr;
  std::int64_t k_token_stride = 0, k_head_stride = 0;
  const float* v = nullptr;
  std::int64_t v_token_stride = 0, v_head_stride = 0;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  const std::int64_t* slots = nullptr;
  unsigned long long* status = nullptr;
};

__device__ inline const float* input_row(const WriteParams& p, int kv, std::int64_t token,
                                         int head) {
  return kv == 0 ? p.k + token * p.k_token_stride + head * p.k_head_stride
                 : p.v + token * p.v_token_stride + head * p.v_head_stride;
}

__device__ inline float outer_scale(const WriteParams& p, int kv, int head, int c) {
  const float* scales = kv == 0 ? p.k_scale : p.v_scale;
  switch (static_cast<ScaleGranularity>(p.granularity)) {
    case ScaleGranularity::tensor:
      return scales[0];
    case ScaleGranularity::head:
      return scales[head];
    case ScaleGranularity::channel:
      return scales[head * p.head_dim + c];
  }
  return 1.0f;
}

// One CTA per token: its slot inside the pool, and (when written) every K and V value finite.
static __global__ void __launch_bounds__(kWriteThreads) check_kernel(const WriteParams p) {
  const std::int64_t token = blockIdx.x;
  const std::int64_t slot = p.slots[token];
  if (slot >= p.num_slots) {
    if (threadIdx.x == 0) atomicMin(p.status, error_key(kBadSlot, token, 0, 0, 0));
    return;
  }
  if (slot < 0) return;
  const int per_kv = p.num_kv_heads * p.head_dim;
  for (int e = threadIdx.x; e < 2 * per_kv; e += blockDim.x) {
    const int kv = e / per_kv, rest = e - kv * per_kv;
    const int head = rest / p.head_dim, c = rest - head * p.head_dim;
    const float x = input_row(p, kv, token, head)[c];
    if (isfinite(x)) continue;
    const unsigned kind = isnan(x) ? kNaN : (x > 0 ? kPlusInf : kMinusInf);
    atomicMin(p.status, error_key(kv == 0 ? kBadK : kBadV, token, head, c, kind));
  }
}

// One CTA per token: each thread encodes whole units (encode_unit) of the token's 2 * Hk rows.
template <Format kFormat>
__global__ void __launch_bounds__(kWriteThreads) write_kernel(const WriteParams p) {
  if (*p.status != kNoError) return;  // the check found bad input: write nothing
  const std::int64_t token = blockIdx.x;
  const std::int64_t slot = p.slots[token];
  if (slot < 0) return;  // skipped (padding)
  const std::int64_t page = slot / p.page_size;
  const std::int64_t offset = slot - page * p.page_size;
  const int units = p.head_dim / kChannelsPerUnit<kFormat>;
  const int per_kv = p.num_kv_heads * units;
  for (int e = threadIdx.x; e < 2 * per_kv; e += blockDim.x) {
    const int kv = e / per_kv, rest = e - kv * per_kv;
    const int head = rest / units, u = rest - head * units;
    const float* x = input_row(p, kv, token, head);
    std::uint8_t* row = p.pool + page * p.page_stride + head * p.head_stride +
                        offset * p.token_stride + kv * p.kv_stride;
    encode_unit<kFormat>(row, u, p.head_dim,
                         [&](int c) { return __fdiv_rn(x[c], outer_scale(p, kv, head, c)); });
  }
}

}  // namespace mjolnir::cuda::write_detail

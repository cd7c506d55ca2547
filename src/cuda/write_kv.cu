// write_kv on device tensors (cuda_decode.h): a check kernel that records the first bad input,
// then a write kernel that quantizes every token's rows with the scalar encoders of
// core/minifloat.h, so the pool bytes equal the host write_kv's bit for bit.
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_decode.h"
#include "cuda/format_dispatch.h"
#include "cuda/write_kv_kernel.cuh"
#include "mjolnir/error.h"

namespace mjolnir::cuda {

using namespace write_detail;

namespace {

void launch_write(Format format, const WriteParams& p, int num_tokens, cudaStream_t stream) {
  with_format(format, [&]<Format kFormat>() {
    write_kernel<kFormat><<<num_tokens, kWriteThreads, 0, stream>>>(p);
  });
  MJOLNIR_CUDA_CHECK(cudaGetLastError());
}

// Host-side shape checks of one input, as the host write_kv makes them (write_kv.cc).
void check_token_rows(const TokenRows& rows, const char* name, int num_tokens, int num_kv_heads,
                      int head_dim) {
  if (num_tokens == 0) return;
  MJOLNIR_REQUIRE(rows.data != nullptr, name, ".data: is null");
  MJOLNIR_REQUIRE(rows.type == RowType::f32, name,
                  ".type: the CUDA write_kv takes float32 rows (bf16 rows are the CPU "
                  "backend's)");
  MJOLNIR_REQUIRE(num_kv_heads == 1 || rows.head_stride >= head_dim, name,
                  ".head_stride: ", rows.head_stride, " is less than head_dim ", head_dim,
                  " (head rows would overlap)");
  const __int128 head_span = __int128(rows.head_stride) * (num_kv_heads - 1) + head_dim;
  MJOLNIR_REQUIRE(head_span <= INT64_MAX, name, ".head_stride: ", rows.head_stride,
                  " overflows 64-bit offsets");
  if (num_tokens == 1) return;
  MJOLNIR_REQUIRE(rows.token_stride >= static_cast<std::int64_t>(head_span), name,
                  ".token_stride: ", rows.token_stride, " is less than the ",
                  static_cast<std::int64_t>(head_span),
                  " floats one token's heads span (token rows would overlap)");
  const __int128 last = __int128(rows.token_stride) * (num_tokens - 1) + head_span;
  MJOLNIR_REQUIRE(last <= INT64_MAX, name, ".token_stride: ", rows.token_stride,
                  " overflows 64-bit offsets");
}

}  // namespace

WriteKvStatus::WriteKvStatus() {
  MJOLNIR_CUDA_CHECK(cudaMalloc(&word_, sizeof(*word_)));
  MJOLNIR_CUDA_CHECK(cudaMemset(word_, 0xFF, sizeof(*word_)));
}

WriteKvStatus::~WriteKvStatus() { cudaFree(word_); }

void WriteKvStatus::check(cudaStream_t stream) const {
  MJOLNIR_CUDA_CHECK(cudaStreamSynchronize(stream));
  unsigned long long key = kNoError;
  MJOLNIR_CUDA_CHECK(cudaMemcpy(&key, word_, sizeof(key), cudaMemcpyDeviceToHost));
  if (key == kNoError) return;
  const unsigned category = static_cast<unsigned>(key >> 56);
  const auto token = static_cast<std::int64_t>((key >> 24) & 0xFFFFFFFFull);
  if (category == kBadSlot) {
    std::int64_t slot = 0;
    MJOLNIR_CUDA_CHECK(
        cudaMemcpy(&slot, slot_mapping + token, sizeof(slot), cudaMemcpyDeviceToHost));
    const std::int64_t num_slots = std::int64_t(geometry.num_pages) * geometry.page_size;
    detail::throw_error("slot_mapping[", token, "]: slot ", slot, " is outside the pool of ",
                        geometry.num_pages, " pages x ", geometry.page_size,
                        " tokens = ", num_slots, " slots");
  }
  const int head = static_cast<int>((key >> 11) & 0x1FFF);
  const int channel = static_cast<int>((key >> 2) & 0x1FF);
  const unsigned kind = static_cast<unsigned>(key & 3);
  detail::throw_error(category == kBadK ? "k" : "v", "[", token, "][", head, "][", channel, "] is ",
                      kind == kNaN ? "NaN" : (kind == kPlusInf ? "Inf" : "-Inf"));
}

void enqueue_write_kv(const KvCacheView& cache, const DeviceScales& scales, const TokenRows& k,
                      const TokenRows& v, const std::int64_t* slot_mapping, int num_tokens,
                      WriteKvStatus& status, cudaStream_t stream) {
  const CacheGeometry& geo = cache.geometry;
  // Geometry and strides are checked with host stand-ins for the scales (on the device here).
  KvCacheView check = cache;
  const std::vector<float> ones(scale_count(cache.granularity, geo.num_kv_heads, geo.head_dim),
                                1.0f);
  check.k_scale = ones;
  check.v_scale = ones;
  validate(check);
  MJOLNIR_REQUIRE(num_tokens >= 0, "num_tokens: ", num_tokens, " is negative");
  MJOLNIR_REQUIRE(geo.num_kv_heads < kMaxHeads, "cache.geometry.num_kv_heads: ", geo.num_kv_heads,
                  " exceeds the ", kMaxHeads - 1, " write_kv supports");
  MJOLNIR_REQUIRE(scales.k != nullptr && scales.v != nullptr, "scales: null device pointer");
  check_token_rows(k, "k", num_tokens, geo.num_kv_heads, geo.head_dim);
  check_token_rows(v, "v", num_tokens, geo.num_kv_heads, geo.head_dim);
  MJOLNIR_REQUIRE(num_tokens == 0 || slot_mapping != nullptr, "slot_mapping: is null");

  status.slot_mapping = slot_mapping;
  status.geometry = geo;
  MJOLNIR_CUDA_CHECK(
      cudaMemsetAsync(status.device_word(), 0xFF, sizeof(unsigned long long), stream));
  if (num_tokens == 0) return;

  WriteParams p;
  p.pool = reinterpret_cast<std::uint8_t*>(cache.data);
  p.page_stride = cache.strides.page;
  p.head_stride = cache.strides.head;
  p.token_stride = cache.strides.token;
  p.kv_stride = cache.strides.kv;
  p.num_slots = std::int64_t(geo.num_pages) * geo.page_size;
  p.page_size = geo.page_size;
  p.head_dim = geo.head_dim;
  p.num_kv_heads = geo.num_kv_heads;
  p.granularity = static_cast<int>(cache.granularity);
  p.k = static_cast<const float*>(k.data);
  p.k_token_stride = k.token_stride;
  p.k_head_stride = k.head_stride;
  p.v = static_cast<const float*>(v.data);
  p.v_token_stride = v.token_stride;
  p.v_head_stride = v.head_stride;
  p.k_scale = scales.k;
  p.v_scale = scales.v;
  p.slots = slot_mapping;
  p.status = status.device_word();
  check_kernel<<<num_tokens, kWriteThreads, 0, stream>>>(p);
  MJOLNIR_CUDA_CHECK(cudaGetLastError());
  launch_write(geo.format, p, num_tokens, stream);
}

void write_kv(const KvCacheView& cache, const TokenRows& k, const TokenRows& v,
              const std::int64_t* slot_mapping, int num_tokens, cudaStream_t stream) {
  validate(cache);  // the host scales' values too
  require_device_pointer(cache.data, "cache.data");
  require_device_pointer(k.data, "k.data");
  require_device_pointer(v.data, "v.data");
  require_device_pointer(slot_mapping, "slot_mapping");
  const ScaleBuffers scales(cache);
  WriteKvStatus status;
  enqueue_write_kv(cache, scales.device(), k, v, slot_mapping, num_tokens, status, stream);
  status.check(stream);
}

}  // namespace mjolnir::cuda

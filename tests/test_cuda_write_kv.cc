// write_kv on the device (label "gpu"): for every format x layout x granularity the device pool
// must equal, byte for byte, the pool the host write_kv writes from the same sentinel-filled
// start and the same inputs (skipped slots and untouched rows included); bad inputs are reported
// with the host's messages and write nothing. Without a GPU the tests skip, saying why.
#include <gtest/gtest.h>

#include <string>

#include "core/gpu_devices.h"
#include "gpu_skip.h"

#if MJOLNIR_HAS_CUDA
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/cuda_decode.h"
#include "mjolnir/cache.h"
#include "mjolnir/error.h"
#include "mjolnir/write_kv.h"
#include "test_seed.h"
#endif

namespace mjolnir {
namespace {

#if MJOLNIR_HAS_CUDA

constexpr std::byte kSentinel{0xA5};

struct DeviceBuffer {
  explicit DeviceBuffer(std::size_t bytes) : bytes(bytes) {
    EXPECT_EQ(cudaMalloc(&data, std::max<std::size_t>(bytes, 1)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data); }
  void* data = nullptr;
  std::size_t bytes;
};

// One write of `num_tokens` tokens, on the host and on the device from identical inputs.
struct WriteCase {
  CacheGeometry geometry;
  Layout layout;
  ScaleGranularity granularity;
  std::vector<float> k_scale, v_scale;
  std::vector<float> k, v;  // [tokens, Hk, D] with padded strides
  std::int64_t head_stride = 0, token_stride = 0;
  std::vector<std::int64_t> slots;

  KvCacheView view(std::byte* data) const {
    KvCacheView view;
    view.geometry = geometry;
    view.strides = layout_strides(geometry, layout);
    view.data = data;
    view.bytes = pool_bytes(geometry);
    view.granularity = granularity;
    view.k_scale = k_scale;
    view.v_scale = v_scale;
    return view;
  }
};

// Values over many binades (tiny, subnormal for the format, huge and saturating, exact zeros and
// -0, all-zero nvfp4 blocks) so every encoder path is taken.
WriteCase make_case(Format format, Layout layout, ScaleGranularity granularity,
                    std::mt19937_64& rng) {
  WriteCase c;
  c.geometry = CacheGeometry{format, 5, 8, 2, 64};
  c.layout = layout;
  c.granularity = granularity;
  std::uniform_real_distribution<float> scale_dist(0.25f, 2.0f);
  const std::size_t count = scale_count(granularity, 2, 64);
  for (std::size_t i = 0; i < count; ++i) c.k_scale.push_back(scale_dist(rng));
  for (std::size_t i = 0; i < count; ++i) c.v_scale.push_back(scale_dist(rng));
  c.slots = {0, 7, -1, 8, 21, 39, 30, -5, 15, 16, -1, 33};
  c.head_stride = 64 + 3;
  c.token_stride = 2 * c.head_stride + 5;
  const std::size_t floats = c.slots.size() * c.token_stride;
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-20, 12);
  std::uniform_int_distribution<int> special(0, 15);
  for (std::vector<float>* values : {&c.k, &c.v}) {
    values->resize(floats);
    for (std::size_t i = 0; i < floats; ++i) {
      float x = std::ldexp(mantissa(rng), exponent(rng));
      if (rng() & 1) x = -x;
      switch (special(rng)) {
        case 0:
          x = 0.0f;
          break;
        case 1:
          x = -0.0f;
          break;
        case 2:
          x = 1e30f;
          break;
        default:
          break;
      }
      (*values)[i] = x;
    }
  }
  // One whole nvfp4 block of zeros (token 1, head 0, K channels 16..31).
  for (int ch = 16; ch < 32; ++ch) c.k[1 * c.token_stride + ch] = 0.0f;
  return c;
}

// Host write_kv into a sentinel pool; device write_kv into a device copy of the same sentinel
// pool; returns both pools.
void write_both(const WriteCase& c, std::vector<std::byte>& host_pool,
                std::vector<std::byte>& device_pool) {
  const std::size_t bytes = pool_bytes(c.geometry);
  host_pool.assign(bytes, kSentinel);
  write_kv(c.view(host_pool.data()), TokenRows{c.k.data(), c.token_stride, c.head_stride},
           TokenRows{c.v.data(), c.token_stride, c.head_stride}, c.slots);

  DeviceBuffer pool(bytes), k(c.k.size() * 4), v(c.v.size() * 4), slots(c.slots.size() * 8);
  ASSERT_EQ(cudaMemset(pool.data, int(kSentinel), bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(k.data, c.k.data(), k.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(v.data, c.v.data(), v.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(slots.data, c.slots.data(), slots.bytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  cuda::write_kv(c.view(static_cast<std::byte*>(pool.data)),
                 TokenRows{static_cast<const float*>(k.data), c.token_stride, c.head_stride},
                 TokenRows{static_cast<const float*>(v.data), c.token_stride, c.head_stride},
                 static_cast<const std::int64_t*>(slots.data), int(c.slots.size()), nullptr);
  device_pool.resize(bytes);
  ASSERT_EQ(cudaMemcpy(device_pool.data(), pool.data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

TEST(CudaWriteKv, EveryFormatLayoutGranularityMatchesTheHostBitForBit) {
  MJOLNIR_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(testing::test_seed());
  for (Format format : kAllFormats) {
    for (Layout layout : kAllLayouts) {
      for (auto granularity :
           {ScaleGranularity::tensor, ScaleGranularity::head, ScaleGranularity::channel}) {
        SCOPED_TRACE(std::string(to_string(format)) + "/" + std::string(to_string(layout)) + "/" +
                     std::string(to_string(granularity)));
        const WriteCase c = make_case(format, layout, granularity, rng);
        std::vector<std::byte> host, device;
        write_both(c, host, device);
        ASSERT_EQ(host.size(), device.size());
        for (std::size_t i = 0; i < host.size(); ++i) {
          ASSERT_EQ(int(device[i]), int(host[i])) << "pool byte " << i;
        }
      }
    }
  }
}

// Bad input: the host's message, and not one byte written.
TEST(CudaWriteKv, BadInputIsReportedAndWritesNothing) {
  MJOLNIR_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(testing::test_seed() + 1);
  struct Bad {
    const char* what;
    std::string expected_start;
    void (*spoil)(WriteCase&);
  };
  const Bad bads[] = {
      {"NaN in V", "v[3][1][5] is NaN",
       [](WriteCase& c) {
         c.v[3 * c.token_stride + 1 * c.head_stride + 5] = std::numeric_limits<float>::quiet_NaN();
       }},
      {"-Inf in K after a NaN in V", "k[4][0][9] is -Inf",
       [](WriteCase& c) {
         c.v[3 * c.token_stride + 5] = std::numeric_limits<float>::quiet_NaN();
         c.k[4 * c.token_stride + 9] = -std::numeric_limits<float>::infinity();
       }},
      {"a skipped token's NaN is fine, a slot past the pool is not", "slot_mapping[5]: slot 40",
       [](WriteCase& c) {
         c.k[2 * c.token_stride] = std::numeric_limits<float>::quiet_NaN();  // slot -1: ignored
         c.slots[5] = 40;
       }},
  };
  for (const Bad& bad : bads) {
    SCOPED_TRACE(bad.what);
    WriteCase c = make_case(Format::fp6_e3m2, Layout::BHN2D, ScaleGranularity::head, rng);
    bad.spoil(c);
    const std::size_t bytes = pool_bytes(c.geometry);
    DeviceBuffer pool(bytes), k(c.k.size() * 4), v(c.v.size() * 4), slots(c.slots.size() * 8);
    ASSERT_EQ(cudaMemset(pool.data, int(kSentinel), bytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(k.data, c.k.data(), k.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(v.data, c.v.data(), v.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(slots.data, c.slots.data(), slots.bytes, cudaMemcpyHostToDevice),
              cudaSuccess);
    try {
      cuda::write_kv(c.view(static_cast<std::byte*>(pool.data)),
                     TokenRows{static_cast<const float*>(k.data), c.token_stride, c.head_stride},
                     TokenRows{static_cast<const float*>(v.data), c.token_stride, c.head_stride},
                     static_cast<const std::int64_t*>(slots.data), int(c.slots.size()), nullptr);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_TRUE(std::string(e.what()).starts_with(bad.expected_start)) << e.what();
    }
    std::vector<std::byte> after(bytes);
    ASSERT_EQ(cudaMemcpy(after.data(), pool.data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(after[i], kSentinel) << "byte " << i;
  }
}

// Host pointers are refused by name, not dereferenced on the device.
TEST(CudaWriteKv, RefusesHostMemory) {
  MJOLNIR_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(testing::test_seed() + 2);
  const WriteCase c = make_case(Format::fp8_e4m3, Layout::B2NHD, ScaleGranularity::tensor, rng);
  std::vector<std::byte> host_pool(pool_bytes(c.geometry), kSentinel);
  try {
    cuda::write_kv(c.view(host_pool.data()), TokenRows{c.k.data(), c.token_stride, c.head_stride},
                   TokenRows{c.v.data(), c.token_stride, c.head_stride}, c.slots.data(),
                   int(c.slots.size()), nullptr);
    ADD_FAILURE() << "host memory accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(std::string(e.what()).starts_with("cache.data")) << e.what();
  }
}

#else  // !MJOLNIR_HAS_CUDA

MJOLNIR_GPU_TESTS_NOT_COMPILED(CudaWriteKv)

#endif

}  // namespace
}  // namespace mjolnir

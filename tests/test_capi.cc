// The C API (mjolnir.h): every function, every status a caller can reach, messages that name the
// argument, destroy(NULL), versioned structs, results equal to the C++ API's on the same inputs,
// and concurrent decode on separate handles equal to sequential decode.
//
// MJOLNIR_ERROR_OUT_OF_MEMORY and MJOLNIR_ERROR_INTERNAL are not reached here: no input makes an
// allocation fail deterministically on every machine (overcommit) or under ASan, and INTERNAL
// would take a bug. Both come from the one exception mapping every call goes through.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bad_input_table.h"
#include "capi_handles.h"
#include "core/bf16_rows.h"
#include "mjolnir/cache.h"
#include "mjolnir/calibrate.h"
#include "mjolnir/decode.h"
#include "mjolnir/mjolnir.h"
#include "mjolnir/plan.h"
#include "mjolnir/write_kv.h"
#include "test_seed.h"

// Counts operator new calls made by this thread while counting is on, to check that the hot
// path allocates nothing.
namespace {
thread_local bool g_count_allocations = false;
thread_local long g_allocations = 0;
}  // namespace

// Every replaceable form is replaced, so that each allocation and its release go through the
// same allocator (the sanitizers check that).
void* operator new(std::size_t size) {
  if (g_count_allocations) ++g_allocations;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return operator new(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  if (g_count_allocations) ++g_allocations;
  return std::malloc(size == 0 ? 1 : size);
}
void* operator new[](std::size_t size, const std::nothrow_t& tag) noexcept {
  return operator new(size, tag);
}
void* operator new(std::size_t size, std::align_val_t align) {
  if (g_count_allocations) ++g_allocations;
  const std::size_t a = std::max(static_cast<std::size_t>(align), sizeof(void*));
  if (void* p = std::aligned_alloc(a, (std::max<std::size_t>(size, 1) + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t align) { return operator new(size, align); }
void* operator new(std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  try {
    return operator new(size, align);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, std::align_val_t align, const std::nothrow_t& t) noexcept {
  return operator new(size, align, t);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

using mjolnir::testing::test_seed;

// Allocations this thread makes while `body` runs.
template <typename Body>
long allocations_during(Body&& body) {
  g_allocations = 0;
  g_count_allocations = true;
  body();
  g_count_allocations = false;
  return g_allocations;
}

// A generator per test: the run's seed mixed with the test's name, so tests are independent.
std::mt19937_64 make_rng() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  return std::mt19937_64(test_seed() ^ std::hash<std::string>{}(name));
}

std::vector<float> random_floats(std::mt19937_64& rng, std::size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(n);
  for (float& x : values) x = dist(rng);
  return values;
}

// Checks a failed call: its status, and that the message (the thread's, and the handle's when
// `handle_message` is given; it is read after the call) starts with the function and names the
// argument.
void expect_failure(mjolnir_status status, mjolnir_status expected, std::string_view function,
                    std::string_view argument,
                    const std::function<const char*()>& handle_message = {}) {
  EXPECT_EQ(status, expected) << "got " << mjolnir_status_string(status) << ", expected "
                              << mjolnir_status_string(expected)
                              << "; message: " << mjolnir_last_error();
  const std::string message = mjolnir_last_error();
  EXPECT_TRUE(message.starts_with(std::string(function) + ": "))
      << "message \"" << message << "\" does not start with \"" << function << ": \"";
  EXPECT_NE(message.find(argument), std::string::npos)
      << "message \"" << message << "\" does not name \"" << argument << "\"";
  if (handle_message) EXPECT_EQ(message, handle_message()) << "the handle's message differs";
}

// The message of a handle, read when called.
template <typename Handle>
std::function<const char*()> message_of(const char* (*last_error)(const Handle*),
                                        const Handle* handle) {
  return [=] { return last_error(handle); };
}

#define ASSERT_OK(call)                                                                     \
  do {                                                                                      \
    const mjolnir_status status_ = (call);                                                  \
    ASSERT_EQ(status_, MJOLNIR_OK)                                                          \
        << #call << ": " << mjolnir_status_string(status_) << ": " << mjolnir_last_error(); \
  } while (0)

using mjolnir::testing::BackendPtr;
using mjolnir::testing::CachePtr;
using mjolnir::testing::PlanPtr;
using mjolnir::testing::ScalesPtr;

BackendPtr make_backend(const char* name, int threads = 2) {
  mjolnir_backend* backend = nullptr;
  EXPECT_EQ(mjolnir_backend_create(name, threads, &backend), MJOLNIR_OK) << mjolnir_last_error();
  return BackendPtr(backend);
}

// C enum values and the C++ enums they stand for.
constexpr mjolnir::Format kFormats[] = {mjolnir::Format::bf16,     mjolnir::Format::fp16,
                                        mjolnir::Format::fp8_e4m3, mjolnir::Format::fp8_e5m2,
                                        mjolnir::Format::fp6_e2m3, mjolnir::Format::fp6_e3m2,
                                        mjolnir::Format::fp4_e2m1, mjolnir::Format::nvfp4};
constexpr mjolnir::Layout kLayouts[] = {mjolnir::Layout::BHN2D,  mjolnir::Layout::BNH2D,
                                        mjolnir::Layout::B2NHD,  mjolnir::Layout::B2HND,
                                        mjolnir::Layout::_2BNHD, mjolnir::Layout::_2BHND};
constexpr mjolnir::ScaleGranularity kGranularities[] = {mjolnir::ScaleGranularity::tensor,
                                                        mjolnir::ScaleGranularity::head,
                                                        mjolnir::ScaleGranularity::channel};

// A cache made through the C API, its pool, and the equivalent C++ view over the same pool.
struct TestCache {
  std::int32_t format = MJOLNIR_FORMAT_FP8_E4M3;
  std::int32_t layout = MJOLNIR_LAYOUT_B2NHD;
  std::int32_t granularity = MJOLNIR_GRANULARITY_HEAD;
  int page_size = 16, num_kv_heads = 2, head_dim = 64, num_pages = 24;
  std::vector<float> k_scale, v_scale;
  std::vector<std::byte> pool;
  CachePtr handle;

  mjolnir_cache_desc desc() {
    mjolnir_cache_desc d;
    mjolnir_cache_desc_init(&d);
    d.format = format;
    d.page_size = page_size;
    d.num_kv_heads = num_kv_heads;
    d.head_dim = head_dim;
    d.num_pages = num_pages;
    d.layout = layout;
    d.granularity = granularity;
    d.k_scale = k_scale.data();
    d.k_scale_count = std::int64_t(k_scale.size());
    d.v_scale = v_scale.data();
    d.v_scale_count = std::int64_t(v_scale.size());
    d.pool = pool.data();
    d.pool_bytes = pool.size();
    return d;
  }

  // Scales sized for the input range [-amplitude, amplitude] and the format's maximum.
  void create(std::mt19937_64& rng, float amplitude = 2.0f) {
    const auto g = kGranularities[granularity];
    const std::size_t n = mjolnir::scale_count(g, num_kv_heads, head_dim);
    // Unquantized formats store values as they are (scale about 1).
    const float base = mjolnir::is_quantized(kFormats[format])
                           ? amplitude / mjolnir::format_max(kFormats[format])
                           : 1.0f;
    k_scale = random_floats(rng, n, base * 0.8f, base * 1.25f);
    v_scale = random_floats(rng, n, base * 0.8f, base * 1.25f);
    mjolnir_cache_desc d = desc();
    size_t bytes = 0;
    ASSERT_OK(mjolnir_pool_bytes(&d, &bytes));
    pool.assign(bytes, std::byte{0});
    d = desc();
    mjolnir_cache* c = nullptr;
    ASSERT_OK(mjolnir_cache_create(&d, &c));
    handle.reset(c);
  }

  mjolnir::KvCacheView view() const {
    mjolnir::KvCacheView v;
    v.geometry = geometry();
    v.strides = mjolnir::layout_strides(v.geometry, kLayouts[layout - 1]);
    v.data = const_cast<std::byte*>(pool.data());
    v.bytes = pool.size();
    v.granularity = kGranularities[granularity];
    v.k_scale = k_scale;
    v.v_scale = v_scale;
    return v;
  }
  mjolnir::CacheGeometry geometry() const {
    mjolnir::CacheGeometry g;
    g.format = kFormats[format];
    g.num_pages = num_pages;
    g.page_size = page_size;
    g.num_kv_heads = num_kv_heads;
    g.head_dim = head_dim;
    return g;
  }
};

// ---- status, version, names -----------------------------------------------------------------

TEST(CapiBasics, StatusStringsArePinnedAndDistinct) {
  const std::vector<std::pair<int, std::string>> expected = {
      {MJOLNIR_OK, "MJOLNIR_OK"},
      {MJOLNIR_ERROR_INVALID_ARGUMENT, "MJOLNIR_ERROR_INVALID_ARGUMENT"},
      {MJOLNIR_ERROR_NULL_HANDLE, "MJOLNIR_ERROR_NULL_HANDLE"},
      {MJOLNIR_ERROR_STRUCT_SIZE, "MJOLNIR_ERROR_STRUCT_SIZE"},
      {MJOLNIR_ERROR_BUFFER_TOO_SMALL, "MJOLNIR_ERROR_BUFFER_TOO_SMALL"},
      {MJOLNIR_ERROR_UNSUPPORTED, "MJOLNIR_ERROR_UNSUPPORTED"},
      {MJOLNIR_ERROR_CAPACITY_EXCEEDED, "MJOLNIR_ERROR_CAPACITY_EXCEEDED"},
      {MJOLNIR_ERROR_PLAN_MISMATCH, "MJOLNIR_ERROR_PLAN_MISMATCH"},
      {MJOLNIR_ERROR_FILE, "MJOLNIR_ERROR_FILE"},
      {MJOLNIR_ERROR_OUT_OF_MEMORY, "MJOLNIR_ERROR_OUT_OF_MEMORY"},
      {MJOLNIR_ERROR_INTERNAL, "MJOLNIR_ERROR_INTERNAL"},
  };
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(expected[i].first, int(i)) << "status values are pinned: 0, 1, 2, ...";
    EXPECT_EQ(mjolnir_status_string(expected[i].first), expected[i].second);
  }
  EXPECT_STREQ(mjolnir_status_string(-1), "unknown status");
  EXPECT_STREQ(mjolnir_status_string(11), "unknown status");
}

TEST(CapiBasics, Version) {
  EXPECT_EQ(mjolnir_version(), unsigned(MJOLNIR_VERSION_NUMBER));
  const std::string expected = std::to_string(MJOLNIR_VERSION_MAJOR) + "." +
                               std::to_string(MJOLNIR_VERSION_MINOR) + "." +
                               std::to_string(MJOLNIR_VERSION_PATCH);
  EXPECT_EQ(mjolnir_version_string(), expected);
}

TEST(CapiBasics, NamesMatchTheCppApi) {
  for (std::int32_t i = 0; i < 8; ++i) {
    ASSERT_NE(mjolnir_format_name(i), nullptr);
    EXPECT_EQ(mjolnir_format_name(i), mjolnir::to_string(kFormats[i]));
  }
  EXPECT_STREQ(mjolnir_layout_name(MJOLNIR_LAYOUT_STRIDES), "strides");
  for (std::int32_t i = 1; i <= 6; ++i) {
    ASSERT_NE(mjolnir_layout_name(i), nullptr);
    EXPECT_EQ(mjolnir_layout_name(i), mjolnir::to_string(kLayouts[i - 1]));
  }
  for (std::int32_t i = 0; i < 3; ++i) {
    ASSERT_NE(mjolnir_granularity_name(i), nullptr);
    EXPECT_EQ(mjolnir_granularity_name(i), mjolnir::to_string(kGranularities[i]));
  }
  EXPECT_EQ(mjolnir_format_name(8), nullptr);
  EXPECT_EQ(mjolnir_format_name(-1), nullptr);
  EXPECT_EQ(mjolnir_layout_name(7), nullptr);
  EXPECT_EQ(mjolnir_granularity_name(3), nullptr);
}

TEST(CapiBasics, DestroyNullIsFine) {
  mjolnir_cache_destroy(nullptr);
  mjolnir_backend_destroy(nullptr);
  mjolnir_plan_destroy(nullptr);
  mjolnir_scales_destroy(nullptr);
  EXPECT_EQ(mjolnir_backend_name(nullptr), nullptr);
  // last_error of a NULL handle says so rather than crashing.
  EXPECT_STREQ(mjolnir_cache_last_error(nullptr), "cache: is NULL");
  EXPECT_STREQ(mjolnir_backend_last_error(nullptr), "backend: is NULL");
  EXPECT_STREQ(mjolnir_plan_last_error(nullptr), "plan: is NULL");
  EXPECT_STREQ(mjolnir_scales_last_error(nullptr), "scales: is NULL");
}

TEST(CapiBasics, LastErrorIsPerThreadAndClearedBySuccess) {
  mjolnir_plan* plan = reinterpret_cast<mjolnir_plan*>(0x1);  // must be reset to NULL
  expect_failure(mjolnir_plan_create(0, 1, 1, &plan), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_plan_create", "max_seqs");
  EXPECT_EQ(plan, nullptr) << "a failed create leaves *out NULL";
  std::string other_thread_message = "unset";
  std::thread([&] { other_thread_message = mjolnir_last_error(); }).join();
  EXPECT_EQ(other_thread_message, "") << "another thread's message is its own";
  EXPECT_NE(std::string(mjolnir_last_error()), "");
  ASSERT_OK(mjolnir_plan_create(1, 1, 1, &plan));
  EXPECT_STREQ(mjolnir_last_error(), "");
  mjolnir_plan_destroy(plan);
}

// ---- cache ------------------------------------------------------------------------------------

TEST(CapiCache, PoolBytesAndStridesMatchTheCppApi) {
  auto rng = make_rng();
  for (std::int32_t format = 0; format < 8; ++format) {
    for (std::int32_t layout = 1; layout <= 6; ++layout) {
      TestCache cache;
      cache.format = format;
      cache.layout = layout;
      cache.granularity = MJOLNIR_GRANULARITY_CHANNEL;
      cache.head_dim = 96;
      cache.num_kv_heads = 3;
      cache.create(rng);
      ASSERT_TRUE(cache.handle);
      EXPECT_EQ(cache.pool.size(), mjolnir::pool_bytes(cache.geometry()));
      std::int64_t strides[4];
      ASSERT_OK(mjolnir_cache_strides(cache.handle.get(), strides));
      const mjolnir::CacheStrides expected = cache.view().strides;
      EXPECT_EQ(strides[0], expected.page);
      EXPECT_EQ(strides[1], expected.head);
      EXPECT_EQ(strides[2], expected.token);
      EXPECT_EQ(strides[3], expected.kv);
      EXPECT_STREQ(mjolnir_cache_last_error(cache.handle.get()), "");
    }
  }
}

TEST(CapiCache, ExplicitStridesWithPadding) {
  auto rng = make_rng();
  TestCache cache;
  cache.create(rng);  // dense B2NHD, to borrow its scales
  // Padded B2NHD: 32 bytes of gap after every token's heads and 256 after every page.
  const std::int64_t row = 64;  // fp8, D 64
  mjolnir_cache_desc desc = cache.desc();
  desc.layout = MJOLNIR_LAYOUT_STRIDES;
  desc.head_stride = row;
  desc.token_stride = 2 * row + 32;
  desc.kv_stride = 16 * desc.token_stride;
  desc.page_stride = 2 * desc.kv_stride + 256;
  std::vector<std::byte> pool(std::size_t(desc.page_stride) * cache.num_pages);
  desc.pool = pool.data();
  desc.pool_bytes = pool.size();
  mjolnir_cache* handle = nullptr;
  ASSERT_OK(mjolnir_cache_create(&desc, &handle));
  std::int64_t strides[4];
  ASSERT_OK(mjolnir_cache_strides(handle, strides));
  EXPECT_EQ(strides[0], desc.page_stride);
  EXPECT_EQ(strides[1], desc.head_stride);
  EXPECT_EQ(strides[2], desc.token_stride);
  EXPECT_EQ(strides[3], desc.kv_stride);
  mjolnir_cache_destroy(handle);

  desc.token_stride = row;  // heads of one token would overlap the next token
  expect_failure(mjolnir_cache_create(&desc, &handle), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_cache_create", "cache.strides.");
}

TEST(CapiCache, CreateRejectsBadDescriptions) {
  auto rng = make_rng();
  TestCache cache;
  cache.create(rng);
  mjolnir_cache* out = nullptr;
  const char* fn = "mjolnir_cache_create";
  auto with = [&](auto change) {
    mjolnir_cache_desc d = cache.desc();
    change(d);
    return mjolnir_cache_create(&d, &out);
  };
  expect_failure(mjolnir_cache_create(nullptr, &out), MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "desc");
  mjolnir_cache_desc d = cache.desc();
  expect_failure(mjolnir_cache_create(&d, nullptr), MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "out");
  expect_failure(with([](auto& d) { d.size = 0; }), MJOLNIR_ERROR_STRUCT_SIZE, fn, "desc->size");
  expect_failure(with([](auto& d) { d.size = sizeof(d) - 8; }), MJOLNIR_ERROR_STRUCT_SIZE, fn,
                 "desc->size");
  expect_failure(with([](auto& d) { d.format = 8; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "desc->format");
  expect_failure(with([](auto& d) { d.format = -1; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "desc->format");
  expect_failure(with([](auto& d) { d.layout = 7; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "desc->layout");
  expect_failure(with([](auto& d) { d.granularity = 3; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "desc->granularity");
  expect_failure(with([](auto& d) { d.page_size = 12; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "page_size");
  expect_failure(with([](auto& d) { d.head_dim = 48; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "head_dim");
  expect_failure(with([](auto& d) { d.num_kv_heads = 0; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "num_kv_heads");
  expect_failure(with([](auto& d) { d.num_pages = 0; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "num_pages");
  expect_failure(with([](auto& d) { d.k_scale_count = 1; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "desc->k_scale_count");
  expect_failure(with([](auto& d) { d.v_scale = nullptr; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "desc->v_scale");
  std::vector<float> bad_scales = cache.k_scale;
  bad_scales[1] = -0.5f;
  expect_failure(with([&](auto& d) { d.k_scale = bad_scales.data(); }),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "k_scale[1]");
  bad_scales[1] = NAN;
  expect_failure(with([&](auto& d) { d.v_scale = bad_scales.data(); }),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "v_scale[1]");
  expect_failure(with([](auto& d) { d.pool = nullptr; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "cache.data");
  expect_failure(with([](auto& d) { d.pool_bytes -= 1; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "cache.strides");
  EXPECT_EQ(out, nullptr);
}

TEST(CapiCache, LargerStructFromANewerCallerIsAcceptedWhenItsTailIsZero) {
  auto rng = make_rng();
  TestCache cache;
  cache.create(rng);
  // A caller built against a header whose mjolnir_cache_desc has 16 more bytes.
  struct Newer {
    mjolnir_cache_desc v1;
    std::int64_t future[2];
  } newer{};
  newer.v1 = cache.desc();
  newer.v1.size = sizeof(Newer);
  mjolnir_cache* out = nullptr;
  ASSERT_OK(mjolnir_cache_create(&newer.v1, &out));
  mjolnir_cache_destroy(out);
  newer.future[1] = 7;  // a field this library does not know
  expect_failure(mjolnir_cache_create(&newer.v1, &out), MJOLNIR_ERROR_STRUCT_SIZE,
                 "mjolnir_cache_create", "desc->size");
}

TEST(CapiCache, PoolBytesRejectsBadArguments) {
  mjolnir_cache_desc d;
  mjolnir_cache_desc_init(&d);
  size_t bytes = 1;
  expect_failure(mjolnir_pool_bytes(&d, &bytes), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_pool_bytes", "num_kv_heads");
  EXPECT_EQ(bytes, 0u);
  expect_failure(mjolnir_pool_bytes(nullptr, &bytes), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_pool_bytes", "desc");
  expect_failure(mjolnir_pool_bytes(&d, nullptr), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_pool_bytes", "bytes");
  d.num_kv_heads = 8;
  d.num_pages = 100;
  ASSERT_OK(mjolnir_pool_bytes(&d, &bytes));
  EXPECT_EQ(bytes, 100u * 8 * 16 * 2 * 128);
}

TEST(CapiCache, StridesRejectsNullArguments) {
  std::int64_t strides[4];
  expect_failure(mjolnir_cache_strides(nullptr, strides), MJOLNIR_ERROR_NULL_HANDLE,
                 "mjolnir_cache_strides", "cache");
  auto rng = make_rng();
  TestCache cache;
  cache.create(rng);
  expect_failure(mjolnir_cache_strides(cache.handle.get(), nullptr), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_cache_strides", "strides",
                 message_of(mjolnir_cache_last_error, cache.handle.get()));
}

// ---- write_kv ---------------------------------------------------------------------------------

// The C++ write_kv of float32 k and v through the same cache description, into a pool of its
// own: its bytes and amax must be what the C call left in `cache` and in k_amax / v_amax.
void expect_cpp_write_equals(const TestCache& cache, const float* k, const float* v,
                             std::int64_t token_stride, std::int64_t head_stride,
                             std::span<const std::int64_t> slots, const std::vector<float>& k_amax,
                             const std::vector<float>& v_amax) {
  std::vector<std::byte> cpp_pool(cache.pool.size(), std::byte{0});
  mjolnir::KvCacheView view = cache.view();
  view.data = cpp_pool.data();
  std::vector<float> cpp_k_amax(k_amax.size(), 0.0f), cpp_v_amax(v_amax.size(), 0.0f);
  mjolnir::AmaxRecorder recorder{cpp_k_amax, cpp_v_amax};
  mjolnir::write_kv(view, {k, token_stride, head_stride}, {v, token_stride, head_stride}, slots,
                    &recorder);
  EXPECT_TRUE(cache.pool == cpp_pool) << "pools differ";
  EXPECT_EQ(k_amax, cpp_k_amax);
  EXPECT_EQ(v_amax, cpp_v_amax);
}

TEST(CapiWriteKv, EqualsTheCppApiForEveryFormatAndLayout) {
  auto rng = make_rng();
  for (std::int32_t format = 0; format < 8; ++format) {
    for (std::int32_t layout : {MJOLNIR_LAYOUT_BHN2D, MJOLNIR_LAYOUT_B2HND, MJOLNIR_LAYOUT_2BNHD}) {
      SCOPED_TRACE(std::string(mjolnir_format_name(format)) + " " + mjolnir_layout_name(layout));
      TestCache cache;
      cache.format = format;
      cache.layout = layout;
      cache.granularity = MJOLNIR_GRANULARITY_CHANNEL;
      cache.create(rng);
      const int hk = cache.num_kv_heads, d = cache.head_dim;
      // 40 tokens with padded strides: [40, Hk, D] inside rows of (Hk * D + 8) floats.
      const int num_tokens = 40;
      const std::int64_t head_stride = d + 4, token_stride = hk * head_stride + 8;
      const auto k = random_floats(rng, std::size_t(num_tokens) * token_stride, -2, 2);
      const auto v = random_floats(rng, std::size_t(num_tokens) * token_stride, -2, 2);
      std::vector<std::int64_t> slots(num_tokens);
      std::vector<std::int64_t> all_slots(std::size_t(cache.num_pages) * cache.page_size);
      for (std::size_t i = 0; i < all_slots.size(); ++i) all_slots[i] = std::int64_t(i);
      std::shuffle(all_slots.begin(), all_slots.end(), rng);
      std::copy_n(all_slots.begin(), num_tokens, slots.begin());
      slots[3] = -1;  // skipped

      std::vector<float> k_amax(std::size_t(hk) * d, 0.0f), v_amax(k_amax);
      ASSERT_OK(mjolnir_write_kv(cache.handle.get(), k.data(), token_stride, head_stride, v.data(),
                                 token_stride, head_stride, slots.data(), num_tokens, k_amax.data(),
                                 v_amax.data()));

      expect_cpp_write_equals(cache, k.data(), v.data(), token_stride, head_stride, slots, k_amax,
                              v_amax);
      EXPECT_TRUE(std::any_of(cache.pool.begin(), cache.pool.end(),
                              [](std::byte b) { return b != std::byte{0}; }));
    }
  }
}

// bf16 K and V (mjolnir_write_kv_rows, MJOLNIR_ROWS_BF16) write the bytes and maxima of their
// float32 widening through mjolnir_write_kv, for every format; a row_type outside the enum is
// refused by name with nothing written.
TEST(CapiWriteKv, Bf16RowsWriteAsTheirFloat32Widening) {
  auto rng = make_rng();
  for (std::int32_t format = 0; format < 8; ++format) {
    SCOPED_TRACE(mjolnir_format_name(format));
    TestCache as_bf16;
    as_bf16.format = format;
    as_bf16.granularity = MJOLNIR_GRANULARITY_CHANNEL;
    as_bf16.create(rng);
    const int hk = as_bf16.num_kv_heads, d = as_bf16.head_dim, num_tokens = 24;
    const std::int64_t head_stride = d + 2, token_stride = hk * head_stride + 6;
    std::vector<std::uint16_t> k16(std::size_t(num_tokens) * token_stride),
        v16(std::size_t(num_tokens) * token_stride);
    std::vector<float> k32(k16.size()), v32(v16.size());
    const auto k_src = random_floats(rng, k16.size(), -2, 2);
    const auto v_src = random_floats(rng, v16.size(), -2, 2);
    for (std::size_t i = 0; i < k16.size(); ++i) {
      k16[i] = mjolnir::bf16_from_float(k_src[i]);
      v16[i] = mjolnir::bf16_from_float(v_src[i]);
      k32[i] = mjolnir::bf16_to_float(k16[i]);
      v32[i] = mjolnir::bf16_to_float(v16[i]);
    }
    std::vector<std::int64_t> slots(num_tokens);
    for (int i = 0; i < num_tokens; ++i) slots[i] = 3 * i + 1;
    std::vector<float> k_amax16(std::size_t(hk) * d, 0.0f), v_amax16(k_amax16);
    ASSERT_OK(mjolnir_write_kv_rows(
        as_bf16.handle.get(), MJOLNIR_ROWS_BF16, k16.data(), token_stride, head_stride, v16.data(),
        token_stride, head_stride, slots.data(), num_tokens, k_amax16.data(), v_amax16.data()));
    expect_cpp_write_equals(as_bf16, k32.data(), v32.data(), token_stride, head_stride, slots,
                            k_amax16, v_amax16);

    const std::vector<std::byte> before = as_bf16.pool;
    expect_failure(mjolnir_write_kv_rows(as_bf16.handle.get(), 2, k16.data(), token_stride,
                                         head_stride, v16.data(), token_stride, head_stride,
                                         slots.data(), num_tokens, nullptr, nullptr),
                   MJOLNIR_ERROR_INVALID_ARGUMENT, "mjolnir_write_kv_rows", "row_type",
                   message_of(mjolnir_cache_last_error, as_bf16.handle.get()));
    EXPECT_TRUE(as_bf16.pool == before) << "a rejected write changed the pool";
  }
}

TEST(CapiWriteKv, RejectsBadArgumentsAndWritesNothing) {
  auto rng = make_rng();
  TestCache cache;
  cache.create(rng);
  const int hk = cache.num_kv_heads, d = cache.head_dim;
  auto k = random_floats(rng, std::size_t(4) * hk * d, -1, 1);
  auto v = random_floats(rng, std::size_t(4) * hk * d, -1, 1);
  std::vector<std::int64_t> slots = {0, 5, 17, 40};
  std::vector<float> amax(std::size_t(hk) * d, 0.0f);
  mjolnir_cache* c = cache.handle.get();
  const char* fn = "mjolnir_write_kv";
  const std::int64_t ts = hk * d;

  expect_failure(mjolnir_write_kv(nullptr, k.data(), ts, d, v.data(), ts, d, slots.data(), 4,
                                  nullptr, nullptr),
                 MJOLNIR_ERROR_NULL_HANDLE, fn, "cache");
  expect_failure(
      mjolnir_write_kv(c, k.data(), ts, d, v.data(), ts, d, slots.data(), -1, nullptr, nullptr),
      MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "num_tokens", message_of(mjolnir_cache_last_error, c));
  expect_failure(
      mjolnir_write_kv(c, k.data(), ts, d, v.data(), ts, d, nullptr, 4, nullptr, nullptr),
      MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "slot_mapping", message_of(mjolnir_cache_last_error, c));
  expect_failure(
      mjolnir_write_kv(c, k.data(), ts, d, v.data(), ts, d, slots.data(), 4, amax.data(), nullptr),
      MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "v_amax", message_of(mjolnir_cache_last_error, c));
  expect_failure(
      mjolnir_write_kv(c, nullptr, ts, d, v.data(), ts, d, slots.data(), 4, nullptr, nullptr),
      MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "k.data", message_of(mjolnir_cache_last_error, c));
  expect_failure(
      mjolnir_write_kv(c, k.data(), ts, d, v.data(), ts, d - 1, slots.data(), 4, nullptr, nullptr),
      MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "v.head_stride", message_of(mjolnir_cache_last_error, c));
  slots[2] = std::int64_t(cache.num_pages) * cache.page_size;
  expect_failure(
      mjolnir_write_kv(c, k.data(), ts, d, v.data(), ts, d, slots.data(), 4, nullptr, nullptr),
      MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "slot_mapping[2]",
      message_of(mjolnir_cache_last_error, c));
  slots[2] = 17;
  v[std::size_t(2) * ts + 1 * d + 9] = NAN;
  expect_failure(
      mjolnir_write_kv(c, k.data(), ts, d, v.data(), ts, d, slots.data(), 4, nullptr, nullptr),
      MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "v[2][1][9] is NaN",
      message_of(mjolnir_cache_last_error, c));
  EXPECT_TRUE(std::all_of(cache.pool.begin(), cache.pool.end(), [](std::byte b) {
    return b == std::byte{0};
  })) << "a rejected write changed the pool";
  // Zero tokens: nothing to read, NULL pointers are fine.
  ASSERT_OK(mjolnir_write_kv(c, nullptr, 0, 0, nullptr, 0, 0, nullptr, 0, nullptr, nullptr));
  EXPECT_STREQ(mjolnir_cache_last_error(c), "");
}

// ---- backends ---------------------------------------------------------------------------------

TEST(CapiBackend, CreateAndName) {
  for (const char* name : {"cpu", "reference"}) {
    mjolnir_backend* backend = nullptr;
    ASSERT_OK(mjolnir_backend_create(name, 0, &backend));
    EXPECT_STREQ(mjolnir_backend_name(backend), name);
    EXPECT_STREQ(mjolnir_backend_last_error(backend), "");
    mjolnir_backend_destroy(backend);
  }
}

TEST(CapiBackend, CreateRejectsBadArguments) {
  mjolnir_backend* backend = nullptr;
  const char* fn = "mjolnir_backend_create";
  expect_failure(mjolnir_backend_create("gpu", 0, &backend), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "name: 'gpu'");
  // "cuda" is unsupported unless this build has it and the machine has a device.
  const mjolnir_status cuda = mjolnir_backend_create("cuda", 0, &backend);
  if (cuda == MJOLNIR_OK) {
    mjolnir_backend_destroy(backend);
    backend = nullptr;
  } else {
    expect_failure(cuda, MJOLNIR_ERROR_UNSUPPORTED, fn, "name: 'cuda'");
  }
  expect_failure(mjolnir_backend_create(nullptr, 0, &backend), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "name");
  expect_failure(mjolnir_backend_create("cpu", 1, nullptr), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "out");
  EXPECT_EQ(backend, nullptr);
}

// ---- plans ------------------------------------------------------------------------------------

TEST(CapiPlan, CreateRejectsBadCapacity) {
  mjolnir_plan* plan = nullptr;
  const char* fn = "mjolnir_plan_create";
  expect_failure(mjolnir_plan_create(0, 1, 1, &plan), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "max_seqs");
  expect_failure(mjolnir_plan_create(1, 0, 1, &plan), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "num_kv_heads");
  expect_failure(mjolnir_plan_create(1, 1, 0, &plan), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "max_splits");
  expect_failure(mjolnir_plan_create(1 << 16, 1 << 10, 1 << 10, &plan),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "max_splits");
  expect_failure(mjolnir_plan_create(1, 1, 1, nullptr), MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "out");
  EXPECT_EQ(plan, nullptr);
}

TEST(CapiPlan, OptionsBoundsSetAndGet) {
  mjolnir_plan* raw = nullptr;
  ASSERT_OK(mjolnir_plan_create(4, 2, 8, &raw));
  PlanPtr plan(raw);
  const mjolnir::PlanOptions defaults;
  const std::int32_t expected_defaults[] = {0, 8, defaults.tile_tokens, defaults.min_chunk_tokens,
                                            defaults.fixed_splits};
  for (std::int32_t option = 0; option < 5; ++option) {
    std::int32_t lower = -7, upper = -7, value = -7;
    ASSERT_OK(mjolnir_plan_option_bounds(option, &lower, &upper));
    EXPECT_LE(lower, upper);
    ASSERT_OK(mjolnir_plan_get_option(plan.get(), option, &value));
    EXPECT_EQ(value, expected_defaults[option]) << "option " << option;
    ASSERT_OK(mjolnir_plan_set_option(plan.get(), option, upper));
    ASSERT_OK(mjolnir_plan_get_option(plan.get(), option, &value));
    EXPECT_EQ(value, upper);
    if (lower > std::numeric_limits<std::int32_t>::min()) {
      expect_failure(mjolnir_plan_set_option(plan.get(), option, lower - 1),
                     MJOLNIR_ERROR_INVALID_ARGUMENT, "mjolnir_plan_set_option", "value",
                     message_of(mjolnir_plan_last_error, plan.get()));
    }
    if (upper < std::numeric_limits<std::int32_t>::max()) {
      expect_failure(mjolnir_plan_set_option(plan.get(), option, upper + 1),
                     MJOLNIR_ERROR_INVALID_ARGUMENT, "mjolnir_plan_set_option", "value");
    }
  }
  std::int32_t lower, upper, value;
  expect_failure(mjolnir_plan_option_bounds(5, &lower, &upper), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_plan_option_bounds", "option");
  expect_failure(mjolnir_plan_option_bounds(0, nullptr, &upper), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_plan_option_bounds", "lower");
  expect_failure(mjolnir_plan_set_option(plan.get(), -1, 0), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_plan_set_option", "option");
  expect_failure(mjolnir_plan_get_option(plan.get(), 9, &value), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_plan_get_option", "option");
  expect_failure(mjolnir_plan_get_option(plan.get(), 0, nullptr), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_plan_get_option", "value");
  expect_failure(mjolnir_plan_set_option(nullptr, 0, 0), MJOLNIR_ERROR_NULL_HANDLE,
                 "mjolnir_plan_set_option", "plan");
  expect_failure(mjolnir_plan_get_option(nullptr, 0, &value), MJOLNIR_ERROR_NULL_HANDLE,
                 "mjolnir_plan_get_option", "plan");
}

TEST(CapiPlan, UpdateEqualsTheCppPlan) {
  auto rng = make_rng();
  BackendPtr cpu = make_backend("cpu", 3);
  std::uniform_int_distribution<int> len(0, 3000);
  for (int trial = 0; trial < 20; ++trial) {
    const int num_seqs = 1 + trial % 7, hk = 1 + trial % 3, q_len = 1 + trial % 4;
    std::vector<std::int32_t> seq_lens(num_seqs);
    for (auto& n : seq_lens) n = std::max(len(rng), q_len);
    if (trial % 5 == 0) seq_lens.back() = 0;  // padding request
    mjolnir_plan* raw = nullptr;
    ASSERT_OK(mjolnir_plan_create(8, hk, 6, &raw));
    PlanPtr plan(raw);
    // The C++ plan the cpu backend makes: its own way of sharing a step (a chunk per thread).
    mjolnir::PlanOptions options = mjolnir::make_backend("cpu", {.threads = 3})->plan_options();
    ASSERT_EQ(options.workers, 3);
    ASSERT_GT(options.heads_together_min_tokens, 0);
    options.max_splits = 6;
    if (trial % 2 == 1) {
      ASSERT_OK(mjolnir_plan_set_option(plan.get(), MJOLNIR_PLAN_TILE_TOKENS, 32));
      ASSERT_OK(mjolnir_plan_set_option(plan.get(), MJOLNIR_PLAN_MIN_CHUNK_TOKENS, 100));
      options.tile_tokens = 32;
      options.min_chunk_tokens = 100;
    }
    if (trial % 4 == 3) {
      ASSERT_OK(mjolnir_plan_set_option(plan.get(), MJOLNIR_PLAN_FIXED_SPLITS, 3));
      options.fixed_splits = 3;
    }
    ASSERT_OK(mjolnir_plan_update(plan.get(), seq_lens.data(), num_seqs, q_len, cpu.get()));
    mjolnir::Plan expected(mjolnir::PlanCapacity{8, hk, 6});
    mjolnir::make_plan(expected, seq_lens, q_len, hk, options);
    std::int32_t seqs = -1, items = -1, partials = -1;
    ASSERT_OK(mjolnir_plan_counts(plan.get(), &seqs, &items, &partials));
    EXPECT_EQ(seqs, num_seqs);
    EXPECT_EQ(items, expected.num_items);
    EXPECT_EQ(partials, expected.num_partials);
  }
}

TEST(CapiPlan, UpdateRejectsBadArguments) {
  BackendPtr cpu = make_backend("cpu", 1);
  mjolnir_plan* raw = nullptr;
  ASSERT_OK(mjolnir_plan_create(2, 2, 4, &raw));
  PlanPtr plan(raw);
  mjolnir_plan* p = plan.get();
  const std::int32_t lens[3] = {40, 50, 60};
  const char* fn = "mjolnir_plan_update";
  expect_failure(mjolnir_plan_update(nullptr, lens, 2, 1, cpu.get()), MJOLNIR_ERROR_NULL_HANDLE, fn,
                 "plan");
  expect_failure(mjolnir_plan_update(p, lens, 2, 1, nullptr), MJOLNIR_ERROR_NULL_HANDLE, fn,
                 "backend", message_of(mjolnir_plan_last_error, p));
  expect_failure(mjolnir_plan_update(p, lens, -1, 1, cpu.get()), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "num_seqs", message_of(mjolnir_plan_last_error, p));
  expect_failure(mjolnir_plan_update(p, lens, 3, 1, cpu.get()), MJOLNIR_ERROR_CAPACITY_EXCEEDED, fn,
                 "num_seqs", message_of(mjolnir_plan_last_error, p));
  expect_failure(mjolnir_plan_update(p, nullptr, 2, 1, cpu.get()), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 fn, "seq_lens", message_of(mjolnir_plan_last_error, p));
  expect_failure(mjolnir_plan_update(p, lens, 2, 9, cpu.get()), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "q_len", message_of(mjolnir_plan_last_error, p));
  const std::int32_t negative[2] = {5, -3};
  expect_failure(mjolnir_plan_update(p, negative, 2, 1, cpu.get()), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 fn, "seq_lens[1]", message_of(mjolnir_plan_last_error, p));
  std::int32_t seqs, items, partials;
  ASSERT_OK(mjolnir_plan_counts(p, &seqs, &items, &partials));
  EXPECT_EQ(items, 0) << "a failed update leaves the plan empty";
  expect_failure(mjolnir_plan_counts(nullptr, &seqs, &items, &partials), MJOLNIR_ERROR_NULL_HANDLE,
                 "mjolnir_plan_counts", "plan");
  expect_failure(mjolnir_plan_counts(p, &seqs, nullptr, &partials), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_plan_counts", "num_items");
  // An empty step is a valid plan.
  ASSERT_OK(mjolnir_plan_update(p, nullptr, 0, 1, cpu.get()));
  ASSERT_OK(mjolnir_plan_counts(p, &seqs, &items, &partials));
  EXPECT_EQ(seqs, 0);
  EXPECT_EQ(items, 0);
  EXPECT_STREQ(mjolnir_plan_last_error(p), "");
}

// ---- decode -----------------------------------------------------------------------------------

// One decode step: cache contents, batch, queries; run through the C API and the C++ API.
struct StepSpec {
  std::int32_t format = MJOLNIR_FORMAT_FP8_E4M3;
  std::int32_t layout = MJOLNIR_LAYOUT_B2NHD;
  std::int32_t granularity = MJOLNIR_GRANULARITY_HEAD;
  int page_size = 16, num_kv_heads = 2, head_dim = 64, group = 4;
  int q_len = 1;
  bool causal = true;
  std::int32_t q_mode = MJOLNIR_Q_FP32, p_mode = MJOLNIR_P_FP32;
  float softmax_scale = 0.0f;
  std::vector<std::int32_t> seq_lens = {37, 300, 1, 0};
  int fixed_splits = 0, tile_tokens = 64;
  const char* backend = "cpu";
  bool with_lse = true;

  std::string name() const {
    return std::string(mjolnir_format_name(format)) + "/" + mjolnir_layout_name(layout) + "/" +
           mjolnir_granularity_name(granularity) + "/q_len" + std::to_string(q_len) +
           (causal ? "" : "/noncausal") + "/q" + std::to_string(q_mode) + "p" +
           std::to_string(p_mode) + "/splits" + std::to_string(fixed_splits) + "/" + backend;
  }
};

constexpr std::size_t kGuard = 32;  // floats of sentinel around every output
constexpr float kSentinel = 1234.5f;

struct Step {
  StepSpec spec;
  TestCache cache;
  int num_q_heads = 0, max_pages = 0;
  std::vector<std::int32_t> block_table;
  std::vector<float> q;
  std::int64_t q_token_stride = 0, q_head_stride = 0;

  Step(const StepSpec& s, std::mt19937_64& rng) : spec(s) {
    cache.format = s.format;
    cache.layout = s.layout;
    cache.granularity = s.granularity;
    cache.page_size = s.page_size;
    cache.num_kv_heads = s.num_kv_heads;
    cache.head_dim = s.head_dim;
    num_q_heads = s.num_kv_heads * s.group;
    for (std::int32_t n : s.seq_lens)
      max_pages = std::max(max_pages, (n + s.page_size - 1) / s.page_size);
    max_pages = std::max(max_pages, 1) + 1;  // a slack entry per row
    cache.num_pages = int(s.seq_lens.size()) * max_pages;
    cache.create(rng);
    // Pages shuffled across sequences; slack entries point anywhere valid.
    std::vector<std::int32_t> pages(cache.num_pages);
    for (int i = 0; i < cache.num_pages; ++i) pages[i] = i;
    std::shuffle(pages.begin(), pages.end(), rng);
    block_table = pages;
    // K and V of every token, written through the C API.
    const int hk = s.num_kv_heads, d = s.head_dim;
    std::vector<std::int64_t> slots;
    for (std::size_t b = 0; b < s.seq_lens.size(); ++b) {
      for (int t = 0; t < s.seq_lens[b]; ++t) {
        slots.push_back(std::int64_t(block_table[b * max_pages + t / s.page_size]) * s.page_size +
                        t % s.page_size);
      }
    }
    const auto k = random_floats(rng, slots.size() * hk * d, -2, 2);
    const auto v = random_floats(rng, slots.size() * hk * d, -2, 2);
    EXPECT_EQ(mjolnir_write_kv(cache.handle.get(), k.data(), hk * d, d, v.data(), hk * d, d,
                               slots.data(), std::int64_t(slots.size()), nullptr, nullptr),
              MJOLNIR_OK)
        << mjolnir_last_error();
    // Q with padded strides.
    q_head_stride = d + 8;
    q_token_stride = num_q_heads * q_head_stride + 16;
    q = random_floats(rng, rows() * std::size_t(q_token_stride), -1.5f, 1.5f);
  }

  std::size_t rows() const { return spec.seq_lens.size() * std::size_t(spec.q_len); }
  std::size_t o_floats() const { return rows() * num_q_heads * spec.head_dim; }

  mjolnir_decode_params params() const {
    mjolnir_decode_params p;
    mjolnir_decode_params_init(&p);
    p.q_len = spec.q_len;
    p.num_q_heads = num_q_heads;
    p.causal = spec.causal ? 1 : 0;
    p.softmax_scale = spec.softmax_scale;
    p.q_mode = spec.q_mode;
    p.p_mode = spec.p_mode;
    return p;
  }

  // Output buffers with sentinel guards on both sides; o dense [rows, Hq, D].
  struct Outputs {
    std::vector<float> o, lse;
    explicit Outputs(const Step& step)
        : o(step.o_floats() + 2 * kGuard, kSentinel),
          lse(step.rows() * step.num_q_heads + 2 * kGuard, kSentinel) {}
    float* o_data() { return o.data() + kGuard; }
    float* lse_data() { return lse.data() + kGuard; }
    std::vector<float> o_values() const { return {o.begin() + kGuard, o.end() - kGuard}; }
    std::vector<float> lse_values() const { return {lse.begin() + kGuard, lse.end() - kGuard}; }
    bool guards_intact() const {
      auto intact = [](const std::vector<float>& v) {
        for (std::size_t i = 0; i < kGuard; ++i) {
          if (v[i] != kSentinel || v[v.size() - 1 - i] != kSentinel) return false;
        }
        return true;
      };
      return intact(o) && intact(lse);
    }
  };

  mjolnir_decode_args args(Outputs& out) const {
    mjolnir_decode_args a;
    mjolnir_decode_args_init(&a);
    a.seq_lens = spec.seq_lens.data();
    a.num_seqs = std::int32_t(spec.seq_lens.size());
    a.block_table = block_table.data();
    a.max_pages_per_seq = max_pages;
    a.q = q.data();
    a.q_token_stride = q_token_stride;
    a.q_head_stride = q_head_stride;
    a.o = out.o_data();
    a.o_token_stride = std::int64_t(num_q_heads) * spec.head_dim;
    a.o_head_stride = spec.head_dim;
    a.lse = spec.with_lse ? out.lse_data() : nullptr;
    return a;
  }

  PlanPtr make_plan(mjolnir_backend* backend) const {
    mjolnir_plan* raw = nullptr;
    EXPECT_EQ(mjolnir_plan_create(std::int32_t(spec.seq_lens.size()), spec.num_kv_heads, 8, &raw),
              MJOLNIR_OK)
        << mjolnir_last_error();
    PlanPtr plan(raw);
    EXPECT_EQ(mjolnir_plan_set_option(raw, MJOLNIR_PLAN_FIXED_SPLITS, spec.fixed_splits),
              MJOLNIR_OK);
    EXPECT_EQ(mjolnir_plan_set_option(raw, MJOLNIR_PLAN_TILE_TOKENS, spec.tile_tokens), MJOLNIR_OK);
    EXPECT_EQ(mjolnir_plan_update(raw, spec.seq_lens.data(), std::int32_t(spec.seq_lens.size()),
                                  spec.q_len, backend),
              MJOLNIR_OK)
        << mjolnir_last_error();
    return plan;
  }

  // The whole C sequence: plan, workspace size, workspace (with a guard), decode.
  // `edit` changes the arguments first (another q or o).
  void run_c(mjolnir_backend* backend, Outputs& out,
             const std::function<void(mjolnir_decode_args&)>& edit = {}) const {
    PlanPtr plan = make_plan(backend);
    const mjolnir_decode_params p = params();
    size_t bytes = 0;
    ASSERT_OK(mjolnir_workspace_size(backend, plan.get(), cache.handle.get(), &p, &bytes));
    std::vector<float> workspace(bytes / sizeof(float) + kGuard, kSentinel);
    mjolnir_decode_args a = args(out);
    if (edit) edit(a);
    ASSERT_OK(
        mjolnir_decode(backend, plan.get(), cache.handle.get(), &p, &a, workspace.data(), bytes));
    EXPECT_STREQ(mjolnir_backend_last_error(backend), "");
    for (std::size_t i = workspace.size() - kGuard; i < workspace.size(); ++i) {
      ASSERT_EQ(workspace[i], kSentinel) << "decode wrote past its workspace";
    }
  }

  // The same step through the C++ API with the same plan options.
  void run_cpp(const mjolnir::Backend& backend, Outputs& out) const {
    mjolnir::DecodeArgs a;
    a.cache = cache.view();
    a.batch.block_table = block_table;
    a.batch.max_pages_per_seq = max_pages;
    a.batch.seq_lens = spec.seq_lens;
    a.params.q_len = spec.q_len;
    a.params.num_q_heads = num_q_heads;
    a.params.causal = spec.causal;
    a.params.softmax_scale = spec.softmax_scale;
    a.params.q_mode = mjolnir::QMode(spec.q_mode);
    a.params.p_mode = mjolnir::PMode(spec.p_mode);
    a.q = {q.data(), q_token_stride, q_head_stride};
    a.o = {out.o_data(), std::int64_t(num_q_heads) * spec.head_dim, spec.head_dim};
    if (spec.with_lse) a.lse = {out.lse_data(), rows() * num_q_heads};
    mjolnir::validate(a);
    mjolnir::BackendPlan plan(
        mjolnir::PlanCapacity{int(spec.seq_lens.size()), spec.num_kv_heads, 8});
    mjolnir::PlanOptions options;
    options.workers = backend.workers();
    options.max_splits = 8;
    options.fixed_splits = spec.fixed_splits;
    options.tile_tokens = spec.tile_tokens;
    backend.plan(plan, a.step_shape(), options);
    std::vector<std::byte> workspace(
        backend.workspace_bytes(plan.plan(), a.cache.geometry, a.params));
    backend.run(a, plan, workspace);
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CapiDecode, EqualsTheCppApi) {
  auto rng = make_rng();
  std::vector<StepSpec> specs;
  for (std::int32_t format : {MJOLNIR_FORMAT_FP8_E4M3, MJOLNIR_FORMAT_FP8_E5M2,
                              MJOLNIR_FORMAT_NVFP4, MJOLNIR_FORMAT_FP6_E2M3, MJOLNIR_FORMAT_BF16}) {
    StepSpec s;
    s.format = format;
    specs.push_back(s);
  }
  {
    StepSpec s;  // split sequences, q_len 3, channel scales, fp8 Q and P, another layout
    s.layout = MJOLNIR_LAYOUT_2BHND;
    s.granularity = MJOLNIR_GRANULARITY_CHANNEL;
    s.q_len = 3;
    s.seq_lens = {37, 300, 3, 0};
    s.q_mode = MJOLNIR_Q_FP8;
    s.p_mode = MJOLNIR_P_FP8;
    s.fixed_splits = 3;
    s.tile_tokens = 32;
    specs.push_back(s);
  }
  {
    StepSpec s;  // non-causal drafter block, bf16 Q and P, a softmax scale, no LSE
    s.layout = MJOLNIR_LAYOUT_BHN2D;
    s.q_len = 4;
    s.seq_lens = {37, 300, 4, 0};
    s.causal = false;
    s.q_mode = MJOLNIR_Q_BF16;
    s.p_mode = MJOLNIR_P_BF16;
    s.softmax_scale = 0.3f;
    s.with_lse = false;
    s.head_dim = 128;
    s.page_size = 32;
    specs.push_back(s);
  }
  const std::size_t base = specs.size();
  for (std::size_t i = 0; i < base; ++i) {
    StepSpec s = specs[i];
    s.backend = "reference";
    specs.push_back(s);
  }

  for (const StepSpec& spec : specs) {
    SCOPED_TRACE(spec.name());
    Step step(spec, rng);
    BackendPtr backend = make_backend(spec.backend, 2);
    Step::Outputs c_out(step), cpp_out(step);
    step.run_c(backend.get(), c_out);
    step.run_cpp(*mjolnir::make_backend(spec.backend, mjolnir::BackendOptions{2}), cpp_out);
    EXPECT_TRUE(same_bits(c_out.o_values(), cpp_out.o_values())) << "outputs differ";
    EXPECT_TRUE(same_bits(c_out.lse_values(), cpp_out.lse_values())) << "LSE differs";
    EXPECT_TRUE(c_out.guards_intact()) << "decode wrote outside o or lse";
    const auto o = c_out.o_values();
    EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return std::isfinite(x); }));
    EXPECT_TRUE(std::any_of(o.begin(), o.end(), [](float x) { return x != 0.0f; }));
  }
}

// bf16 q and o (args->q_type, o_type): the float32 step's O rounded to nearest even, bit for bit,
// on both backends, split and not; a q_type outside the enum is refused by name.
TEST(CapiDecode, Bf16RowsAreTheFloat32StepRounded) {
  auto rng = make_rng();
  for (const char* backend_name : {"cpu", "reference"}) {
    for (int splits : {0, 3}) {
      StepSpec spec;
      spec.backend = backend_name;
      spec.fixed_splits = splits;
      spec.q_len = 2;
      spec.seq_lens = {37, 300, 2, 0};
      SCOPED_TRACE(spec.name());
      Step step(spec, rng);
      for (float& x : step.q) x = mjolnir::bf16_to_float(mjolnir::bf16_from_float(x));
      std::vector<std::uint16_t> q16(step.q.size());
      for (std::size_t i = 0; i < q16.size(); ++i) q16[i] = mjolnir::bf16_from_float(step.q[i]);
      BackendPtr backend = make_backend(backend_name, 2);
      Step::Outputs out32(step), out16(step);
      step.run_c(backend.get(), out32);
      std::vector<std::uint16_t> o16(step.o_floats() + 2 * kGuard, 0xDEAD);
      step.run_c(backend.get(), out16, [&](mjolnir_decode_args& a) {
        a.q = q16.data();
        a.q_type = MJOLNIR_ROWS_BF16;
        a.o = o16.data() + kGuard;
        a.o_type = MJOLNIR_ROWS_BF16;
      });
      const std::vector<float> o32 = out32.o_values();
      for (std::size_t i = 0; i < o32.size(); ++i) {
        ASSERT_EQ(o16[kGuard + i], mjolnir::bf16_from_float(o32[i])) << "O value " << i;
      }
      for (std::size_t i = 0; i < kGuard; ++i) {
        ASSERT_EQ(o16[i], 0xDEAD) << "wrote before o";
        ASSERT_EQ(o16[o16.size() - 1 - i], 0xDEAD) << "wrote after o";
      }
      EXPECT_TRUE(same_bits(out16.lse_values(), out32.lse_values())) << "LSE differs";
    }
  }
  StepSpec spec;
  Step step(spec, rng);
  BackendPtr backend = make_backend("cpu", 2);
  PlanPtr plan = step.make_plan(backend.get());
  const mjolnir_decode_params p = step.params();
  size_t bytes = 0;
  ASSERT_OK(mjolnir_workspace_size(backend.get(), plan.get(), step.cache.handle.get(), &p, &bytes));
  std::vector<std::byte> workspace(bytes);
  Step::Outputs out(step);
  mjolnir_decode_args a = step.args(out);
  a.q_type = 7;
  EXPECT_EQ(mjolnir_decode(backend.get(), plan.get(), step.cache.handle.get(), &p, &a,
                           workspace.data(), bytes),
            MJOLNIR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(mjolnir_backend_last_error(backend.get()))
                .find("mjolnir_decode: args->q_type: 7"),
            0u)
      << mjolnir_backend_last_error(backend.get());
}

TEST(CapiDecode, ConcurrentDecodeOnTwoHandlesEqualsSequential) {
  auto rng = make_rng();
  StepSpec a_spec, b_spec;
  a_spec.seq_lens = {700, 33, 129};
  a_spec.q_len = 2;
  b_spec.format = MJOLNIR_FORMAT_NVFP4;
  b_spec.seq_lens = {1000, 5};
  b_spec.fixed_splits = 2;
  const Step a(a_spec, rng), b(b_spec, rng);

  // Sequential results, each on its own backend.
  BackendPtr backend_a = make_backend("cpu", 2), backend_b = make_backend("cpu", 2);
  Step::Outputs a_seq(a), b_seq(b);
  a.run_c(backend_a.get(), a_seq);
  b.run_c(backend_b.get(), b_seq);

  // Two threads, each with its own backend, plan and workspace, sharing nothing else; a few
  // rounds so the calls overlap. The same cache handle is also read by both in a third phase.
  for (int round = 0; round < 4; ++round) {
    Step::Outputs a_par(a), b_par(b);
    std::thread ta([&] { a.run_c(backend_a.get(), a_par); });
    std::thread tb([&] { b.run_c(backend_b.get(), b_par); });
    ta.join();
    tb.join();
    EXPECT_TRUE(same_bits(a_par.o_values(), a_seq.o_values())) << "round " << round;
    EXPECT_TRUE(same_bits(a_par.lse_values(), a_seq.lse_values())) << "round " << round;
    EXPECT_TRUE(same_bits(b_par.o_values(), b_seq.o_values())) << "round " << round;
    EXPECT_TRUE(same_bits(b_par.lse_values(), b_seq.lse_values())) << "round " << round;
  }
  Step::Outputs a1(a), a2(a);
  std::thread t1([&] { a.run_c(backend_a.get(), a1); });
  std::thread t2([&] { a.run_c(backend_b.get(), a2); });  // same cache handle, other backend
  t1.join();
  t2.join();
  EXPECT_TRUE(same_bits(a1.o_values(), a_seq.o_values()));
  EXPECT_TRUE(same_bits(a2.o_values(), a_seq.o_values()));
}

TEST(CapiDecode, WorkspaceSizeEqualsTheBackendsAndRejectsBadArguments) {
  auto rng = make_rng();
  StepSpec spec;
  spec.q_len = 2;
  Step step(spec, rng);
  BackendPtr cpu = make_backend("cpu", 2);
  PlanPtr plan = step.make_plan(cpu.get());
  const mjolnir_decode_params p = step.params();
  size_t bytes = 0;
  ASSERT_OK(mjolnir_workspace_size(cpu.get(), plan.get(), step.cache.handle.get(), &p, &bytes));
  mjolnir::Plan cpp_plan(mjolnir::PlanCapacity{int(spec.seq_lens.size()), spec.num_kv_heads, 8});
  mjolnir::DecodeParams cpp_params;
  cpp_params.q_len = 2;
  cpp_params.num_q_heads = step.num_q_heads;
  EXPECT_EQ(bytes, mjolnir::make_backend("cpu")->workspace_bytes(cpp_plan, step.cache.geometry(),
                                                                 cpp_params));
  EXPECT_GT(bytes, 0u);

  const char* fn = "mjolnir_workspace_size";
  mjolnir_cache* c = step.cache.handle.get();
  expect_failure(mjolnir_workspace_size(nullptr, plan.get(), c, &p, &bytes),
                 MJOLNIR_ERROR_NULL_HANDLE, fn, "backend");
  expect_failure(mjolnir_workspace_size(cpu.get(), nullptr, c, &p, &bytes),
                 MJOLNIR_ERROR_NULL_HANDLE, fn, "plan",
                 message_of(mjolnir_backend_last_error, cpu.get()));
  expect_failure(mjolnir_workspace_size(cpu.get(), plan.get(), nullptr, &p, &bytes),
                 MJOLNIR_ERROR_NULL_HANDLE, fn, "cache");
  expect_failure(mjolnir_workspace_size(cpu.get(), plan.get(), c, nullptr, &bytes),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "params");
  expect_failure(mjolnir_workspace_size(cpu.get(), plan.get(), c, &p, nullptr),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "bytes");
  mjolnir_decode_params bad = p;
  bad.size = 4;
  expect_failure(mjolnir_workspace_size(cpu.get(), plan.get(), c, &bad, &bytes),
                 MJOLNIR_ERROR_STRUCT_SIZE, fn, "params->size");
  bad = p;
  bad.q_len = 0;
  expect_failure(mjolnir_workspace_size(cpu.get(), plan.get(), c, &bad, &bytes),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "params->q_len");
  bad = p;
  bad.num_q_heads = 3;
  expect_failure(mjolnir_workspace_size(cpu.get(), plan.get(), c, &bad, &bytes),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "params->num_q_heads");
  bad = p;
  bad.q_mode = 4;
  expect_failure(mjolnir_workspace_size(cpu.get(), plan.get(), c, &bad, &bytes),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "params->q_mode");
  bad = p;
  bad.p_mode = -1;
  expect_failure(mjolnir_workspace_size(cpu.get(), plan.get(), c, &bad, &bytes),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "params->p_mode");
  mjolnir_plan* other = nullptr;
  ASSERT_OK(mjolnir_plan_create(4, 3, 8, &other));  // 3 KV heads, the cache has 2
  expect_failure(mjolnir_workspace_size(cpu.get(), other, c, &p, &bytes),
                 MJOLNIR_ERROR_PLAN_MISMATCH, fn, "plan");
  mjolnir_plan_destroy(other);
}

TEST(CapiDecode, RejectsBadArguments) {
  auto rng = make_rng();
  StepSpec spec;
  spec.seq_lens = {37, 300};
  Step step(spec, rng);
  BackendPtr cpu = make_backend("cpu", 2);
  PlanPtr plan = step.make_plan(cpu.get());
  mjolnir_backend* be = cpu.get();
  mjolnir_cache* c = step.cache.handle.get();
  const mjolnir_decode_params p = step.params();
  size_t bytes = 0;
  ASSERT_OK(mjolnir_workspace_size(be, plan.get(), c, &p, &bytes));
  std::vector<float> workspace_floats(bytes / sizeof(float) + 8);
  void* ws = workspace_floats.data();
  Step::Outputs out(step);
  const mjolnir_decode_args good = step.args(out);
  ASSERT_OK(mjolnir_decode(be, plan.get(), c, &p, &good, ws, bytes));
  const char* fn = "mjolnir_decode";

  // Each case changes one thing; every failure is recorded on the backend and the thread.
  auto with_args = [&](auto change) {
    mjolnir_decode_args a = good;
    change(a);
    return mjolnir_decode(be, plan.get(), c, &p, &a, ws, bytes);
  };
  auto with_params = [&](auto change) {
    mjolnir_decode_params q = p;
    change(q);
    return mjolnir_decode(be, plan.get(), c, &q, &good, ws, bytes);
  };
  auto check = [&](mjolnir_status status, mjolnir_status expected, std::string_view argument) {
    expect_failure(status, expected, fn, argument, message_of(mjolnir_backend_last_error, be));
  };

  expect_failure(mjolnir_decode(nullptr, plan.get(), c, &p, &good, ws, bytes),
                 MJOLNIR_ERROR_NULL_HANDLE, fn, "backend");
  check(mjolnir_decode(be, nullptr, c, &p, &good, ws, bytes), MJOLNIR_ERROR_NULL_HANDLE, "plan");
  check(mjolnir_decode(be, plan.get(), nullptr, &p, &good, ws, bytes), MJOLNIR_ERROR_NULL_HANDLE,
        "cache");
  check(mjolnir_decode(be, plan.get(), c, nullptr, &good, ws, bytes),
        MJOLNIR_ERROR_INVALID_ARGUMENT, "params");
  check(mjolnir_decode(be, plan.get(), c, &p, nullptr, ws, bytes), MJOLNIR_ERROR_INVALID_ARGUMENT,
        "args");
  check(with_args([](auto& a) { a.size = 8; }), MJOLNIR_ERROR_STRUCT_SIZE, "args->size");
  check(with_params([](auto& q) { q.size = 0; }), MJOLNIR_ERROR_STRUCT_SIZE, "params->size");
  check(with_params([](auto& q) { q.q_len = 9; }), MJOLNIR_ERROR_INVALID_ARGUMENT, "params->q_len");
  check(with_params([](auto& q) { q.softmax_scale = -1.0f; }), MJOLNIR_ERROR_INVALID_ARGUMENT,
        "softmax_scale");
  check(with_args([](auto& a) { a.num_seqs = -1; }), MJOLNIR_ERROR_INVALID_ARGUMENT,
        "args->num_seqs");
  check(with_args([](auto& a) { a.max_pages_per_seq = -1; }), MJOLNIR_ERROR_INVALID_ARGUMENT,
        "args->max_pages_per_seq");
  check(with_args([](auto& a) { a.seq_lens = nullptr; }), MJOLNIR_ERROR_INVALID_ARGUMENT,
        "args->seq_lens");
  check(with_args([](auto& a) { a.block_table = nullptr; }), MJOLNIR_ERROR_INVALID_ARGUMENT,
        "args->block_table");
  check(with_args([](auto& a) { a.q = nullptr; }), MJOLNIR_ERROR_INVALID_ARGUMENT, "q.data");
  check(with_args([](auto& a) { a.o = nullptr; }), MJOLNIR_ERROR_INVALID_ARGUMENT, "o.data");
  check(with_args([&](auto& a) { a.q_head_stride = spec.head_dim - 1; }),
        MJOLNIR_ERROR_INVALID_ARGUMENT, "q.head_stride");
  check(with_args([&](auto& a) { a.o_token_stride = spec.head_dim; }),
        MJOLNIR_ERROR_INVALID_ARGUMENT, "o.token_stride");
  std::vector<std::int32_t> table = step.block_table;
  table[std::size_t(1) * step.max_pages + 2] = step.cache.num_pages;  // page outside the pool
  check(with_args([&](auto& a) { a.block_table = table.data(); }), MJOLNIR_ERROR_INVALID_ARGUMENT,
        "block_table[1][2]");
  const std::vector<std::int32_t> too_long = {37, step.max_pages * spec.page_size + 1};
  check(with_args([&](auto& a) { a.seq_lens = too_long.data(); }), MJOLNIR_ERROR_INVALID_ARGUMENT,
        "seq_lens[1]");

  // The plan must be the one made for this step.
  const std::vector<std::int32_t> other_lens = {37, 299};
  check(with_args([&](auto& a) { a.seq_lens = other_lens.data(); }), MJOLNIR_ERROR_PLAN_MISMATCH,
        "seq_lens[1]");
  check(with_args([&](auto& a) { a.num_seqs = 1; }), MJOLNIR_ERROR_PLAN_MISMATCH, "plan");
  check(with_params([](auto& q) { q.q_len = 2; }), MJOLNIR_ERROR_PLAN_MISMATCH, "q_len");
  mjolnir_plan* empty = nullptr;
  ASSERT_OK(mjolnir_plan_create(2, spec.num_kv_heads, 8, &empty));
  check(mjolnir_decode(be, empty, c, &p, &good, ws, bytes), MJOLNIR_ERROR_PLAN_MISMATCH,
        "mjolnir_plan_update");
  mjolnir_plan_destroy(empty);
  ASSERT_OK(mjolnir_plan_create(2, spec.num_kv_heads + 1, 8, &empty));
  check(mjolnir_decode(be, empty, c, &p, &good, ws, bytes), MJOLNIR_ERROR_PLAN_MISMATCH,
        "KV heads");
  mjolnir_plan_destroy(empty);

  // The workspace.
  check(mjolnir_decode(be, plan.get(), c, &p, &good, ws, bytes - 1), MJOLNIR_ERROR_BUFFER_TOO_SMALL,
        "workspace_size");
  check(mjolnir_decode(be, plan.get(), c, &p, &good, nullptr, bytes),
        MJOLNIR_ERROR_INVALID_ARGUMENT, "workspace");
  check(mjolnir_decode(be, plan.get(), c, &p, &good, static_cast<char*>(ws) + 4, bytes),
        MJOLNIR_ERROR_INVALID_ARGUMENT, "aligned");

  // Still works after all that, and the messages clear.
  ASSERT_OK(mjolnir_decode(be, plan.get(), c, &p, &good, ws, bytes));
  EXPECT_STREQ(mjolnir_backend_last_error(be), "");
  EXPECT_STREQ(mjolnir_last_error(), "");
}

// The shared bad-input table (tests/bad_inputs.json, bad_input_table.h) through the C API: each
// case's change made where the C API takes that argument (the decode params and args, the cache's
// description for the scales, mjolnir_backend_create for the thread count); the call fails with
// a message that names the argument.
TEST(CapiDecode, BadInputTable) {
  const mjolnir::testing::BadInputTable table = mjolnir::testing::bad_input_table();
  const nlohmann::json& step_json = table.step;
  const auto c_value = [](const char* (*name_of)(std::int32_t), const std::string& name) {
    for (std::int32_t value = 0; value < 16; ++value) {
      if (const char* n = name_of(value); n != nullptr && name == n) return value;
    }
    ADD_FAILURE() << "no C value named '" << name << "'";
    return std::int32_t{-1};
  };
  auto rng = make_rng();
  StepSpec spec;
  spec.format = c_value(mjolnir_format_name, step_json.at("format"));
  spec.granularity = c_value(mjolnir_granularity_name, step_json.at("granularity"));
  spec.page_size = step_json.at("page_size");
  spec.head_dim = step_json.at("head_dim");
  spec.num_kv_heads = step_json.at("num_kv_heads");
  spec.group = step_json.at("num_q_heads").get<int>() / spec.num_kv_heads;
  spec.q_len = step_json.at("q_len");
  spec.seq_lens = step_json.at("seq_lens").get<std::vector<std::int32_t>>();
  Step step(spec, rng);
  BackendPtr cpu = make_backend("cpu", 2);
  PlanPtr plan = step.make_plan(cpu.get());
  mjolnir_cache* c = step.cache.handle.get();
  size_t bytes = 0;
  const mjolnir_decode_params good_params = step.params();
  ASSERT_OK(mjolnir_workspace_size(cpu.get(), plan.get(), c, &good_params, &bytes));
  std::vector<float> workspace(bytes / sizeof(float) + 8);
  Step::Outputs out(step);
  const mjolnir_decode_args good_args = step.args(out);
  ASSERT_OK(mjolnir_decode(cpu.get(), plan.get(), c, &good_params, &good_args, workspace.data(),
                           bytes));  // the step itself is good

  ASSERT_FALSE(table.cases.empty());
  for (const mjolnir::testing::BadInputCase& bad : table.cases) {
    SCOPED_TRACE(bad.name);
    mjolnir::testing::StepArguments changed{
        .q_len = good_params.q_len,
        .num_q_heads = good_params.num_q_heads,
        .softmax_scale = good_params.softmax_scale,
        .seq_lens = spec.seq_lens,
        .block_table = step.block_table,
        .max_pages_per_seq = step.max_pages,
        .num_pages = step.cache.num_pages,
        .page_size = spec.page_size,
        .k_scale = step.cache.k_scale,
        .v_scale = step.cache.v_scale,
    };
    ASSERT_NO_THROW(changed.apply(bad.change));
    mjolnir_status status = MJOLNIR_OK;
    if (changed.threads_changed) {
      mjolnir_backend* backend = nullptr;
      status = mjolnir_backend_create("cpu", changed.threads, &backend);
      mjolnir_backend_destroy(backend);
    } else if (changed.scales_changed) {
      mjolnir_cache_desc desc = step.cache.desc();
      desc.k_scale = changed.k_scale.data();
      desc.k_scale_count = std::int64_t(changed.k_scale.size());
      desc.v_scale = changed.v_scale.data();
      desc.v_scale_count = std::int64_t(changed.v_scale.size());
      mjolnir_cache* cache = nullptr;
      status = mjolnir_cache_create(&desc, &cache);
      mjolnir_cache_destroy(cache);
    } else {
      mjolnir_decode_params params = good_params;
      params.q_len = changed.q_len;
      params.num_q_heads = changed.num_q_heads;
      params.softmax_scale = changed.softmax_scale;
      mjolnir_decode_args args = good_args;
      args.seq_lens = changed.seq_lens.data();
      args.block_table = changed.block_table.data();
      status = mjolnir_decode(cpu.get(), plan.get(), c, &params, &args, workspace.data(), bytes);
    }
    EXPECT_EQ(status, MJOLNIR_ERROR_INVALID_ARGUMENT)
        << "status " << status << "; expected an invalid argument naming '" << bad.names.front()
        << "'";
    const std::string message = mjolnir_last_error();
    EXPECT_TRUE(mjolnir::testing::names_all(message, bad.names))
        << "message '" << message << "' does not say '" << nlohmann::json(bad.names).dump() << "'";
  }
  // Still works after all that.
  ASSERT_OK(
      mjolnir_decode(cpu.get(), plan.get(), c, &good_params, &good_args, workspace.data(), bytes));
}

TEST(CapiDecode, PaddingOnlyAndEmptySteps) {
  auto rng = make_rng();
  StepSpec spec;
  spec.seq_lens = {0, 0};
  Step step(spec, rng);
  BackendPtr cpu = make_backend("cpu", 2);
  Step::Outputs out(step);
  step.run_c(cpu.get(), out);
  for (float x : out.o_values()) EXPECT_EQ(x, 0.0f);
  for (float x : out.lse_values()) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(out.guards_intact());
}

// The hot path of a serving loop: updating a plan allocates nothing; neither does the C layer
// of mjolnir_decode (what the C++ backend's run() allocates is reported, not asserted here).
TEST(CapiDecode, HotPathAllocations) {
  auto rng = make_rng();
  StepSpec spec;
  spec.seq_lens = {700, 33, 129, 0};
  spec.fixed_splits = 2;
  Step step(spec, rng);
  BackendPtr cpu = make_backend("cpu", 2);
  PlanPtr plan = step.make_plan(cpu.get());
  const mjolnir_decode_params p = step.params();
  size_t bytes = 0;
  ASSERT_OK(mjolnir_workspace_size(cpu.get(), plan.get(), step.cache.handle.get(), &p, &bytes));
  std::vector<float> workspace(bytes / sizeof(float));
  Step::Outputs out(step);
  const mjolnir_decode_args a = step.args(out);
  ASSERT_OK(mjolnir_decode(cpu.get(), plan.get(), step.cache.handle.get(), &p, &a, workspace.data(),
                           bytes));  // warm-up: scratch sized on first use
  for (int round = 0; round < 3; ++round) {
    const long plan_allocations = allocations_during([&] {
      EXPECT_EQ(mjolnir_plan_update(plan.get(), spec.seq_lens.data(),
                                    std::int32_t(spec.seq_lens.size()), spec.q_len, cpu.get()),
                MJOLNIR_OK);
    });
    EXPECT_EQ(plan_allocations, 0) << "mjolnir_plan_update allocated";
  }
  const long decode_allocations = allocations_during([&] {
    EXPECT_EQ(mjolnir_decode(cpu.get(), plan.get(), step.cache.handle.get(), &p, &a,
                             workspace.data(), bytes),
              MJOLNIR_OK);
  });
  std::cout << "[ info     ] allocations in one mjolnir_decode on the cpu backend (calling "
               "thread, C++ backend included): "
            << decode_allocations << std::endl;
}

// ---- scales -----------------------------------------------------------------------------------

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("mjolnir_capi_" + std::to_string(test_seed()) + "_" +
            std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

TEST(CapiScales, WriteReadRoundTripAndAgreeWithTheCppApi) {
  auto rng = make_rng();
  TempDir dir;
  const std::string path = (dir.path / "scales.json").string();
  mjolnir_scales_info info;
  mjolnir_scales_info_init(&info);
  info.format = MJOLNIR_FORMAT_FP8_E4M3;
  info.granularity = MJOLNIR_GRANULARITY_CHANNEL;
  info.num_kv_heads = 2;
  info.head_dim = 32;
  info.headroom = 1.25;
  info.num_layers = 3;
  info.scales_per_layer = 64;
  const auto k = random_floats(rng, 3 * 64, 1e-3f, 0.1f);
  const auto v = random_floats(rng, 3 * 64, 1e-3f, 0.1f);
  ASSERT_OK(mjolnir_scales_write(path.c_str(), &info, k.data(), v.data(), 3 * 64));

  const mjolnir::ScalesFile cpp = mjolnir::read_scales_file(path);
  ASSERT_EQ(cpp.layers.size(), 3u);
  EXPECT_EQ(cpp.headroom, 1.25);

  mjolnir_scales* raw = nullptr;
  ASSERT_OK(mjolnir_scales_read(path.c_str(), &raw));
  ScalesPtr scales(raw);
  mjolnir_scales_info read;
  mjolnir_scales_info_init(&read);
  ASSERT_OK(mjolnir_scales_get_info(scales.get(), &read));
  EXPECT_EQ(read.size, sizeof(read));
  EXPECT_EQ(read.format, info.format);
  EXPECT_EQ(read.granularity, info.granularity);
  EXPECT_EQ(read.num_kv_heads, 2);
  EXPECT_EQ(read.head_dim, 32);
  EXPECT_EQ(read.headroom, 1.25);
  EXPECT_EQ(read.num_layers, 3);
  EXPECT_EQ(read.scales_per_layer, 64);
  for (int layer = 0; layer < 3; ++layer) {
    std::vector<float> k_layer(64), v_layer(64);
    ASSERT_OK(mjolnir_scales_get_layer(scales.get(), layer, k_layer.data(), v_layer.data(), 64));
    EXPECT_TRUE(std::equal(k_layer.begin(), k_layer.end(), k.begin() + layer * 64));
    EXPECT_TRUE(std::equal(v_layer.begin(), v_layer.end(), v.begin() + layer * 64));
    EXPECT_EQ(k_layer, cpp.layers[layer].k_scale);
  }

  // The same file parsed from memory.
  std::ifstream file(path);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  ASSERT_OK(mjolnir_scales_parse(text.data(), text.size(), &raw));
  ScalesPtr parsed(raw);
  std::vector<float> k_layer(64), v_layer(64);
  ASSERT_OK(mjolnir_scales_get_layer(parsed.get(), 2, k_layer.data(), v_layer.data(), 64));
  EXPECT_TRUE(std::equal(k_layer.begin(), k_layer.end(), k.begin() + 128));
}

TEST(CapiScales, ReadAndLayerErrors) {
  TempDir dir;
  const char* fn = "mjolnir_scales_read";
  mjolnir_scales* out = nullptr;
  const std::string missing = (dir.path / "missing.json").string();
  expect_failure(mjolnir_scales_read(missing.c_str(), &out), MJOLNIR_ERROR_FILE, fn, missing);
  expect_failure(mjolnir_scales_read(nullptr, &out), MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "path");
  expect_failure(mjolnir_scales_read(missing.c_str(), nullptr), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "out");
  const std::string truncated = R"({"mjolnir_scales_version": 1, "format": "fp8_e4m3")";
  expect_failure(mjolnir_scales_parse(truncated.data(), truncated.size(), &out), MJOLNIR_ERROR_FILE,
                 "mjolnir_scales_parse", "text");
  const std::string wrong_version = R"({"mjolnir_scales_version": 9})";
  expect_failure(mjolnir_scales_parse(wrong_version.data(), wrong_version.size(), &out),
                 MJOLNIR_ERROR_FILE, "mjolnir_scales_parse", "mjolnir_scales_version");
  expect_failure(mjolnir_scales_parse(nullptr, 5, &out), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_scales_parse", "text");
  EXPECT_EQ(out, nullptr);

  const std::string good =
      R"({"mjolnir_scales_version": 1, "format": "fp8_e5m2", "granularity": "head",
          "num_kv_heads": 3, "head_dim": 64, "headroom": 1.0,
          "layers": [{"k_scale": [0.5, 0.25, 2.0], "v_scale": [1.0, 1.5, 3.0]}]})";
  ASSERT_OK(mjolnir_scales_parse(good.data(), good.size(), &out));
  ScalesPtr scales(out);
  float k[3], v[3];
  const char* layer_fn = "mjolnir_scales_get_layer";
  expect_failure(mjolnir_scales_get_layer(scales.get(), 1, k, v, 3), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 layer_fn, "layer", message_of(mjolnir_scales_last_error, scales.get()));
  expect_failure(mjolnir_scales_get_layer(scales.get(), 0, k, v, 2), MJOLNIR_ERROR_BUFFER_TOO_SMALL,
                 layer_fn, "capacity", message_of(mjolnir_scales_last_error, scales.get()));
  expect_failure(mjolnir_scales_get_layer(scales.get(), 0, nullptr, v, 3),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, layer_fn, "k_scale");
  expect_failure(mjolnir_scales_get_layer(nullptr, 0, k, v, 3), MJOLNIR_ERROR_NULL_HANDLE, layer_fn,
                 "scales");
  ASSERT_OK(mjolnir_scales_get_layer(scales.get(), 0, k, v, 3));
  EXPECT_EQ(k[2], 2.0f);
  EXPECT_EQ(v[1], 1.5f);
  EXPECT_STREQ(mjolnir_scales_last_error(scales.get()), "");

  mjolnir_scales_info info;
  mjolnir_scales_info_init(&info);
  info.size = 8;
  expect_failure(mjolnir_scales_get_info(scales.get(), &info), MJOLNIR_ERROR_STRUCT_SIZE,
                 "mjolnir_scales_get_info", "info->size");
  expect_failure(mjolnir_scales_get_info(scales.get(), nullptr), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 "mjolnir_scales_get_info", "info");
  expect_failure(mjolnir_scales_get_info(nullptr, &info), MJOLNIR_ERROR_NULL_HANDLE,
                 "mjolnir_scales_get_info", "scales");
  // A newer caller's larger info: the tail this library does not know is zeroed.
  struct Newer {
    mjolnir_scales_info v1;
    std::int64_t future;
  } newer;
  std::memset(&newer, 0xFF, sizeof(newer));
  newer.v1.size = sizeof(Newer);
  ASSERT_OK(mjolnir_scales_get_info(scales.get(), &newer.v1));
  EXPECT_EQ(newer.future, 0);
  EXPECT_EQ(newer.v1.size, sizeof(Newer));
  EXPECT_EQ(newer.v1.format, MJOLNIR_FORMAT_FP8_E5M2);
  EXPECT_EQ(newer.v1.granularity, MJOLNIR_GRANULARITY_HEAD);
  EXPECT_EQ(newer.v1.scales_per_layer, 3);
}

TEST(CapiScales, WriteErrors) {
  TempDir dir;
  const std::string path = (dir.path / "s.json").string();
  mjolnir_scales_info info;
  mjolnir_scales_info_init(&info);
  info.granularity = MJOLNIR_GRANULARITY_HEAD;
  info.num_kv_heads = 2;
  info.head_dim = 64;
  info.num_layers = 2;
  info.scales_per_layer = 2;
  std::vector<float> k = {0.1f, 0.2f, 0.3f, 0.4f}, v = {0.5f, 0.6f, 0.7f, 0.8f};
  const char* fn = "mjolnir_scales_write";
  auto with = [&](auto change) {
    mjolnir_scales_info i = info;
    change(i);
    return mjolnir_scales_write(path.c_str(), &i, k.data(), v.data(), 4);
  };
  expect_failure(mjolnir_scales_write(nullptr, &info, k.data(), v.data(), 4),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "path");
  expect_failure(mjolnir_scales_write(path.c_str(), nullptr, k.data(), v.data(), 4),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "info");
  expect_failure(mjolnir_scales_write(path.c_str(), &info, k.data(), v.data(), 3),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "count");
  expect_failure(mjolnir_scales_write(path.c_str(), &info, nullptr, v.data(), 4),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "k_scales");
  expect_failure(with([](auto& i) { i.size = 0; }), MJOLNIR_ERROR_STRUCT_SIZE, fn, "info->size");
  expect_failure(with([](auto& i) { i.format = 99; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "info->format");
  expect_failure(with([](auto& i) { i.granularity = 7; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "info->granularity");
  expect_failure(with([](auto& i) { i.num_kv_heads = 0; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "info->num_kv_heads");
  expect_failure(with([](auto& i) { i.head_dim = 0; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "info->head_dim");
  expect_failure(with([](auto& i) { i.headroom = 0.0; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "info->headroom");
  expect_failure(with([](auto& i) { i.num_layers = 0; }), MJOLNIR_ERROR_INVALID_ARGUMENT, fn,
                 "info->num_layers");
  expect_failure(with([](auto& i) { i.scales_per_layer = 128; }), MJOLNIR_ERROR_INVALID_ARGUMENT,
                 fn, "info->scales_per_layer");
  v[3] = 0.0f;
  expect_failure(mjolnir_scales_write(path.c_str(), &info, k.data(), v.data(), 4),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "v_scales[3] (layer 1)");
  v[3] = 0.8f;
  const std::string unwritable = (dir.path / "no" / "such" / "dir.json").string();
  expect_failure(mjolnir_scales_write(unwritable.c_str(), &info, k.data(), v.data(), 4),
                 MJOLNIR_ERROR_FILE, fn, unwritable);
  EXPECT_FALSE(std::filesystem::exists(path)) << "a rejected write created the file";
  ASSERT_OK(mjolnir_scales_write(path.c_str(), &info, k.data(), v.data(), 4));
}

TEST(CapiScales, FromAmaxEqualsTheCppApi) {
  auto rng = make_rng();
  const int hk = 3, d = 32;
  const auto amax = random_floats(rng, std::size_t(hk) * d, 0.0f, 20.0f);
  for (std::int32_t format = 0; format < 8; ++format) {
    for (std::int32_t granularity = 0; granularity < 3; ++granularity) {
      const auto expected = mjolnir::scales_from_amax(amax, kFormats[format],
                                                      kGranularities[granularity], hk, d, 1.1);
      std::vector<float> scales(hk * d, -1.0f);
      ASSERT_OK(mjolnir_scales_from_amax(amax.data(), std::int64_t(amax.size()), format,
                                         granularity, hk, d, 1.1, scales.data(),
                                         std::int64_t(scales.size())));
      EXPECT_TRUE(std::equal(expected.begin(), expected.end(), scales.begin()));
    }
  }
  float one = 0.0f;
  const char* fn = "mjolnir_scales_from_amax";
  expect_failure(mjolnir_scales_from_amax(amax.data(), hk * d, MJOLNIR_FORMAT_FP8_E4M3,
                                          MJOLNIR_GRANULARITY_HEAD, hk, d, 1.0, &one, 1),
                 MJOLNIR_ERROR_BUFFER_TOO_SMALL, fn, "capacity");
  expect_failure(mjolnir_scales_from_amax(amax.data(), hk * d, 8, 0, hk, d, 1.0, &one, 1),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "format");
  expect_failure(mjolnir_scales_from_amax(amax.data(), hk * d, 2, 3, hk, d, 1.0, &one, 1),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "granularity");
  expect_failure(mjolnir_scales_from_amax(amax.data(), hk * d - 1, 2, 0, hk, d, 1.0, &one, 1),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "amax");
  expect_failure(mjolnir_scales_from_amax(nullptr, hk * d, 2, 0, hk, d, 1.0, &one, 1),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "amax");
  expect_failure(mjolnir_scales_from_amax(amax.data(), -1, 2, 0, hk, d, 1.0, &one, 1),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "amax_count");
  expect_failure(mjolnir_scales_from_amax(amax.data(), hk * d, 2, 0, 0, d, 1.0, &one, 1),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "num_kv_heads");
  expect_failure(mjolnir_scales_from_amax(amax.data(), hk * d, 2, 0, hk, d, -1.0, &one, 1),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "headroom");
  expect_failure(mjolnir_scales_from_amax(amax.data(), hk * d, 2, 0, hk, d, 1.0, nullptr, 1),
                 MJOLNIR_ERROR_INVALID_ARGUMENT, fn, "scales");
}

// The calibration flow end to end through C: write_kv records amax, scales come from it.
TEST(CapiScales, CalibrationFlow) {
  auto rng = make_rng();
  TestCache cache;
  cache.format = MJOLNIR_FORMAT_BF16;  // scales of 1 do for recording
  cache.granularity = MJOLNIR_GRANULARITY_TENSOR;
  cache.k_scale = {1.0f};
  cache.v_scale = {1.0f};
  mjolnir_cache_desc probe = cache.desc();
  size_t bytes = 0;
  ASSERT_OK(mjolnir_pool_bytes(&probe, &bytes));
  cache.pool.assign(bytes, std::byte{0});
  mjolnir_cache_desc d = cache.desc();
  mjolnir_cache* raw = nullptr;
  ASSERT_OK(mjolnir_cache_create(&d, &raw));
  CachePtr handle(raw);
  const int hk = cache.num_kv_heads, hd = cache.head_dim;
  const auto k = random_floats(rng, std::size_t(10) * hk * hd, -3, 3);
  const auto v = random_floats(rng, std::size_t(10) * hk * hd, -1, 1);
  std::vector<std::int64_t> slots(10);
  for (int i = 0; i < 10; ++i) slots[i] = 3 * i;
  std::vector<float> k_amax(std::size_t(hk) * hd, 0.0f), v_amax(k_amax);
  ASSERT_OK(mjolnir_write_kv(handle.get(), k.data(), hk * hd, hd, v.data(), hk * hd, hd,
                             slots.data(), 10, k_amax.data(), v_amax.data()));
  float k_scale = 0.0f;
  ASSERT_OK(mjolnir_scales_from_amax(k_amax.data(), std::int64_t(k_amax.size()),
                                     MJOLNIR_FORMAT_FP8_E4M3, MJOLNIR_GRANULARITY_TENSOR, hk, hd,
                                     1.0, &k_scale, 1));
  float max_k = 0.0f;
  for (float x : k) max_k = std::max(max_k, std::fabs(x));
  EXPECT_FLOAT_EQ(k_scale, max_k / 448.0f);
}

}  // namespace

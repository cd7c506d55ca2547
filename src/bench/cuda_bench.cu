// Device-resident bench workloads and measurements (cuda_bench.h).
#include "bench/cuda_bench.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_decode.h"
#include "cuda/decode_config.h"
#include "cuda/decode_launch.h"
#include "cuda/format_dispatch.h"
#include "cuda/kv_codec.cuh"
#include "mjolnir/error.h"

namespace mjolnir::cuda {

namespace {

constexpr int kFillThreads = 128;

// A pseudo-random value in about N(0, 1) for (row, channel): the sum of four uniforms of a
// 64-bit hash, scaled to unit variance. Deterministic, so every copy holds the same cache.
__device__ float hashed_normal(std::uint64_t row, int channel, std::uint64_t seed) {
  std::uint64_t x = row * 0x9E3779B97F4A7C15ull + std::uint64_t(channel) * 0xBF58476D1CE4E5B9ull +
                    seed * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  float sum = 0;
  for (int i = 0; i < 4; ++i) sum += float((x >> (16 * i)) & 0xFFFF) * (1.0f / 65536.0f);
  return (sum - 2.0f) * 1.7320508f;  // 4 uniforms: variance 1/3
}

struct FillParams {
  std::uint8_t* pool;
  std::int64_t page_stride, head_stride, token_stride, kv_stride;
  int num_pages, num_kv_heads, page_size, head_dim;
  float inv_scale;  // values are divided by the (uniform) outer scale before encoding
  std::uint64_t seed;
};

// One CTA per (page, head, token): encodes its K and V rows.
template <Format kFormat>
__global__ void fill_kernel(const FillParams p) {
  const std::int64_t row_id = blockIdx.x;
  const int token = static_cast<int>(row_id % p.page_size);
  const int head = static_cast<int>(row_id / p.page_size % p.num_kv_heads);
  const std::int64_t page = row_id / p.page_size / p.num_kv_heads;
  const int units = p.head_dim / kChannelsPerUnit<kFormat>;
  for (int e = threadIdx.x; e < 2 * units; e += blockDim.x) {
    const int kv = e / units, u = e - kv * units;
    std::uint8_t* row = p.pool + page * p.page_stride + head * p.head_stride +
                        token * p.token_stride + kv * p.kv_stride;
    const std::uint64_t id = std::uint64_t(row_id) * 2 + kv;
    encode_unit<kFormat>(row, u, p.head_dim,
                         [&](int c) { return hashed_normal(id, c, p.seed) * p.inv_scale; });
  }
}

void launch_fill(Format format, const FillParams& p, std::int64_t rows) {
  const auto grid = static_cast<unsigned>(rows);
  with_format(format, [&]<Format kFormat>() { fill_kernel<kFormat><<<grid, kFillThreads>>>(p); });
  MJOLNIR_CUDA_CHECK(cudaGetLastError());
}

// Reads `count` 16-byte vectors once (grid-stride, 16-byte loads that skip L1, as the decode
// kernels' cache loads do) and folds them into one word per thread, which is written only when
// impossible, so the loads are not dead code and the kernel writes nothing in practice. Four
// independent loads per thread per iteration keep enough bytes in flight to cover HBM latency
// (one at a time reached 3955 GB/s on an H200, below the 4581 GB/s PyTorch's SDPA streamed).
__global__ void read_kernel(const uint4* data, std::size_t count, unsigned* sink) {
  constexpr int kLoads = 4;
  unsigned acc = 0;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kLoads - 1) * stride < count; i += kLoads * stride) {
    uint4 v[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) v[k] = __ldcs(data + i + k * stride);
#pragma unroll
    for (int k = 0; k < kLoads; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < count; i += stride) {
    const uint4 v = __ldcs(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;  // the fill pattern never folds to this
}

__global__ void exp2_kernel(const float* x, float* y, int n, bool correctly_rounded) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = correctly_rounded ? exp2_rn(x[i]) : exp2f(x[i]);
}

// Owning device allocation.
struct DeviceMemory {
  explicit DeviceMemory(std::size_t bytes) {
    if (bytes > 0) MJOLNIR_CUDA_CHECK(cudaMalloc(&data, bytes));
  }
  ~DeviceMemory() { cudaFree(data); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  std::byte* data = nullptr;
};

struct Events {
  Events() {
    MJOLNIR_CUDA_CHECK(cudaEventCreate(&begin));
    MJOLNIR_CUDA_CHECK(cudaEventCreate(&end));
  }
  ~Events() {
    cudaEventDestroy(begin);
    cudaEventDestroy(end);
  }
  float elapsed_ms() const {
    float ms = 0;
    MJOLNIR_CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
    return ms;
  }
  cudaEvent_t begin = nullptr, end = nullptr;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0 : (n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]));
}

int current_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  MJOLNIR_CUDA_CHECK(cudaGetDevice(&device));
  MJOLNIR_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

}  // namespace

std::string device_name() {
  int device = 0;
  MJOLNIR_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  MJOLNIR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

double copy_bandwidth_gbps(std::size_t bytes, int repeats) {
  DeviceMemory src(bytes), dst(bytes);
  MJOLNIR_CUDA_CHECK(cudaMemset(src.data, 0x3C, bytes));  // not zeros: see METHOD.md
  MJOLNIR_CUDA_CHECK(cudaMemcpy(dst.data, src.data, bytes, cudaMemcpyDeviceToDevice));  // warm
  Events events;
  std::vector<double> gbps;
  for (int i = 0; i < repeats; ++i) {
    MJOLNIR_CUDA_CHECK(cudaEventRecord(events.begin));
    MJOLNIR_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, bytes, cudaMemcpyDeviceToDevice));
    MJOLNIR_CUDA_CHECK(cudaEventRecord(events.end));
    MJOLNIR_CUDA_CHECK(cudaEventSynchronize(events.end));
    gbps.push_back(2.0 * double(bytes) / (events.elapsed_ms() * 1e-3) / 1e9);
  }
  return median(gbps);
}

double read_bandwidth_gbps(std::size_t bytes, int repeats) {
  bytes &= ~std::size_t{15};
  DeviceMemory src(bytes), sink(sizeof(unsigned));
  MJOLNIR_CUDA_CHECK(cudaMemset(src.data, 0x3C, bytes));  // not zeros: see METHOD.md
  const auto* data = reinterpret_cast<const uint4*>(src.data);
  auto* out = reinterpret_cast<unsigned*>(sink.data);
  const std::size_t count = bytes / 16;
  // Enough resident threads to keep every SM's loads in flight: 8 CTAs of 256 per SM.
  const unsigned grid =
      static_cast<unsigned>(8 * current_attribute(cudaDevAttrMultiProcessorCount));
  read_kernel<<<grid, 256>>>(data, count, out);  // warm-up
  MJOLNIR_CUDA_CHECK(cudaGetLastError());
  Events events;
  std::vector<double> gbps;
  for (int i = 0; i < repeats; ++i) {
    MJOLNIR_CUDA_CHECK(cudaEventRecord(events.begin));
    read_kernel<<<grid, 256>>>(data, count, out);
    MJOLNIR_CUDA_CHECK(cudaEventRecord(events.end));
    MJOLNIR_CUDA_CHECK(cudaEventSynchronize(events.end));
    gbps.push_back(double(bytes) / (events.elapsed_ms() * 1e-3) / 1e9);
  }
  MJOLNIR_CUDA_CHECK(cudaGetLastError());
  return median(gbps);
}

std::vector<float> device_exp2(std::span<const float> x, bool correctly_rounded) {
  const int n = static_cast<int>(x.size());
  std::vector<float> y(x.size());
  if (n == 0) return y;
  DeviceMemory dx(x.size_bytes()), dy(x.size_bytes());
  MJOLNIR_CUDA_CHECK(cudaMemcpy(dx.data, x.data(), x.size_bytes(), cudaMemcpyHostToDevice));
  exp2_kernel<<<(n + 255) / 256, 256>>>(reinterpret_cast<const float*>(dx.data),
                                        reinterpret_cast<float*>(dy.data), n, correctly_rounded);
  MJOLNIR_CUDA_CHECK(cudaGetLastError());
  MJOLNIR_CUDA_CHECK(cudaMemcpy(y.data(), dy.data, x.size_bytes(), cudaMemcpyDeviceToHost));
  return y;
}

BenchResult bench_decode(const BenchSpec& spec) {
  MJOLNIR_REQUIRE(spec.batch >= 1 && spec.context >= spec.q_len, "bench: batch ", spec.batch,
                  " and context ", spec.context, " must be >= 1 and >= q_len");
  MJOLNIR_REQUIRE(spec.num_q_heads % spec.num_kv_heads == 0, "bench: Hq ", spec.num_q_heads,
                  " is not a multiple of Hk ", spec.num_kv_heads);
  BenchResult result;
  result.device = device_name();

  // --- the cache: geometry, scales, pages ---
  const int pages_per_seq = (spec.context + spec.page_size - 1) / spec.page_size;
  CacheGeometry geometry{spec.format, spec.batch * pages_per_seq, spec.page_size, spec.num_kv_heads,
                         spec.head_dim};
  const CacheStrides strides = layout_strides(geometry, spec.layout);
  const std::size_t pool = pool_bytes(geometry);
  // Values are about N(0, 1); |x| rarely exceeds 4, so that maps onto the format's largest value.
  const float scale = is_quantized(spec.format) ? 4.0f / format_max(spec.format) : 1.0f;
  const std::vector<float> host_scales(
      scale_count(spec.granularity, spec.num_kv_heads, spec.head_dim), scale);

  std::size_t free_bytes = 0, total_bytes = 0;
  MJOLNIR_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const std::size_t l2 = static_cast<std::size_t>(current_attribute(cudaDevAttrL2CacheSize));
  const std::size_t target =
      spec.min_working_set_bytes == 0 ? 0 : std::max(4 * l2, spec.min_working_set_bytes);
  std::size_t copies = std::max<std::size_t>(1, (target + pool - 1) / pool);
  copies =
      std::max<std::size_t>(1, std::min(copies, free_bytes / 2 / std::max<std::size_t>(pool, 1)));
  MJOLNIR_REQUIRE(pool <= free_bytes / 2, "bench: a cache of ", pool, " bytes exceeds half of the ",
                  free_bytes, " free bytes on the device");
  std::vector<std::unique_ptr<DeviceMemory>> pools;
  for (std::size_t i = 0; i < copies; ++i) pools.push_back(std::make_unique<DeviceMemory>(pool));

  FillParams fill{reinterpret_cast<std::uint8_t*>(pools[0]->data),
                  strides.page,
                  strides.head,
                  strides.token,
                  strides.kv,
                  geometry.num_pages,
                  geometry.num_kv_heads,
                  geometry.page_size,
                  geometry.head_dim,
                  1.0f / scale,
                  spec.seed};
  launch_fill(spec.format, fill,
              std::int64_t(geometry.num_pages) * geometry.num_kv_heads * geometry.page_size);
  for (std::size_t i = 1; i < copies; ++i) {
    MJOLNIR_CUDA_CHECK(cudaMemcpy(pools[i]->data, pools[0]->data, pool, cudaMemcpyDeviceToDevice));
  }

  std::mt19937_64 rng(spec.seed);
  std::vector<std::int32_t> physical(geometry.num_pages);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  const std::vector<std::int32_t> seq_lens(spec.batch, spec.context);
  const PagedBatch batch{physical, pages_per_seq, seq_lens};

  // --- queries and outputs ---
  const std::size_t token_rows = std::size_t(spec.batch) * spec.q_len;
  const std::size_t q_floats = token_rows * spec.num_q_heads * spec.head_dim;
  std::vector<float> host_q(q_floats);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : host_q) x = normal(rng);
  DeviceMemory q(q_floats * sizeof(float)), o(q_floats * sizeof(float)),
      lse(token_rows * spec.num_q_heads * sizeof(float));
  MJOLNIR_CUDA_CHECK(
      cudaMemcpy(q.data, host_q.data(), q_floats * sizeof(float), cudaMemcpyHostToDevice));

  KvCacheView view;
  view.geometry = geometry;
  view.strides = strides;
  view.data = pools[0]->data;
  view.bytes = pool;
  view.granularity = spec.granularity;
  view.k_scale = host_scales;
  view.v_scale = host_scales;
  const ScaleBuffers scales(view);

  DecodeArgs args;
  args.cache = view;
  args.batch = batch;
  args.params.q_len = spec.q_len;
  args.params.num_q_heads = spec.num_q_heads;
  args.params.q_mode = spec.q_mode;
  args.params.p_mode = spec.p_mode;
  const std::int64_t head_stride = spec.head_dim;
  const std::int64_t token_stride = std::int64_t(spec.num_q_heads) * spec.head_dim;
  args.q = QueryTensor{reinterpret_cast<const float*>(q.data), token_stride, head_stride};
  args.o = OutputTensor{reinterpret_cast<float*>(o.data), token_stride, head_stride};
  args.lse = std::span<float>(reinterpret_cast<float*>(lse.data), token_rows * spec.num_q_heads);

  // --- plan and step buffers, as a serving loop would hold them ---
  // MJOLNIR_CUDA_MMA_LAYOUT: the layout A/B of scripts/device-check.sh.
  const CudaKernelOptions kernels = cuda_kernel_options_from_environment();
  const auto backend = make_backend("cuda", {.cuda_kernels = kernels});
  const std::string unavailable = backend->unavailable_reason();
  MJOLNIR_REQUIRE(unavailable.empty(), "bench: ", unavailable);
  PlanOptions options = backend->plan_options();
  options.tile_tokens = spec.tile_tokens;
  options.max_splits = spec.max_splits;
  options.max_splits = effective_max_splits(options, spec.batch, spec.num_kv_heads);
  result.max_splits = options.max_splits;
  StepCapacity capacity;
  capacity.plan = PlanCapacity{spec.batch, spec.num_kv_heads, options.max_splits};
  capacity.max_pages_per_seq = pages_per_seq;
  capacity.max_tile_tokens = spec.tile_tokens;
  Plan plan(capacity.plan);
  make_plan(plan, seq_lens, spec.q_len, spec.num_kv_heads, options);
  result.num_items = plan.num_items;
  const int rows = spec.q_len * (spec.num_q_heads / spec.num_kv_heads);
  if (chosen_body(args) == DecodeBody::exact_order) {
    result.body = "exact_order";
  } else {
    constexpr const char* kLayoutNames[] = {"tensor_core", "tensor_core_stacked",
                                            "tensor_core_tokens_on_m"};
    result.body = kLayoutNames[int(mma_layout(geometry.format, rows, mma_layout_limit(kernels)))];
  }
  DecodeStep step(capacity);
  DeviceMemory workspace(decode_workspace_bytes(capacity, geometry, args.params));
  const std::span<std::byte> workspace_span(
      workspace.data, decode_workspace_bytes(capacity, geometry, args.params));

  cudaStream_t stream = nullptr;
  MJOLNIR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } stream_guard{stream};
  step.upload(batch, plan, geometry, stream);

  // One graph per cache copy: the pool pointer is part of the captured launch.
  std::vector<cudaGraphExec_t> graphs;
  struct GraphsGuard {
    std::vector<cudaGraphExec_t>& g;
    ~GraphsGuard() {
      for (cudaGraphExec_t e : g) cudaGraphExecDestroy(e);
    }
  } graphs_guard{graphs};
  for (std::size_t i = 0; i < copies; ++i) {
    DecodeArgs copy = args;
    copy.cache.data = pools[i]->data;
    cudaGraph_t graph = nullptr;
    MJOLNIR_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue_decode(copy, scales.device(), step, workspace_span, stream, kernels);
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    MJOLNIR_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    check_cuda(status, "cudaGraphInstantiate");
    graphs.push_back(exec);
  }

  // Warm-up: every copy once. Then batches of replays rotating over the copies.
  for (cudaGraphExec_t exec : graphs) MJOLNIR_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MJOLNIR_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int per_batch =
      spec.steps_per_repeat > 0 ? spec.steps_per_repeat : std::max<int>(10, int(copies));
  Events events;
  std::vector<double> step_us;
  std::size_t next = 0;
  for (int r = 0; r < spec.repeats; ++r) {
    MJOLNIR_CUDA_CHECK(cudaEventRecord(events.begin, stream));
    for (int i = 0; i < per_batch; ++i) {
      MJOLNIR_CUDA_CHECK(cudaGraphLaunch(graphs[next], stream));
      next = (next + 1) % graphs.size();
    }
    MJOLNIR_CUDA_CHECK(cudaEventRecord(events.end, stream));
    MJOLNIR_CUDA_CHECK(cudaEventSynchronize(events.end));
    step_us.push_back(double(events.elapsed_ms()) * 1e3 / per_batch);
  }
  MJOLNIR_CUDA_CHECK(cudaGetLastError());

  result.median_us = median(step_us);
  result.runs = spec.repeats * per_batch;
  result.copies = static_cast<int>(copies);
  result.working_set_bytes = copies * pool;
  result.kv_bytes =
      std::size_t(spec.batch) * spec.context * spec.num_kv_heads * 2 * geometry.row_bytes();
  result.gbps = double(result.kv_bytes) / (result.median_us * 1e-6) / 1e9;
  return result;
}

}  // namespace mjolnir::cuda

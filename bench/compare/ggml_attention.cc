// Times ggml's CPU flash attention (ggml_flash_attn_ext, what llama.cpp runs for attention with
// flash attention on) over a decode step of the comparison shape, for scripts/cpu_compare.py:
// batch sequences of `context` KV tokens each, one query token, Hq query heads over Hk KV heads
// (GQA broadcast), head dim D, K and V in one of ggml's cache types (f16, q8_0, q4_0).
//
// Like `mjolnir bench`, the caches rotate through a working set larger than the last-level cache
// (copies of the batch's K and V, one graph each), and the median of the timed calls is reported.
// Prints one JSON object. ggml is not part of mjolnir: scripts/cpu_compare.py fetches its source
// (the llama.cpp that PyPI's llama-cpp-python sdist vendors), builds it with native flags and
// compiles this file against it; nothing of ggml is kept in this repository.
//
//   ggml_attention TYPE BATCH CONTEXT THREADS MIN_SECONDS WORKING_SET_BYTES [HQ HK D]

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

ggml_type ParseType(const std::string& name) {
  if (name == "f16") return GGML_TYPE_F16;
  if (name == "q8_0") return GGML_TYPE_Q8_0;
  if (name == "q4_0") return GGML_TYPE_Q4_0;
  std::fprintf(stderr, "ggml_attention: TYPE must be f16, q8_0 or q4_0, not '%s'\n", name.c_str());
  std::exit(2);
}

long Arg(char** argv, int i, const char* name) {
  char* end = nullptr;
  const long value = std::strtol(argv[i], &end, 10);
  if (end == argv[i] || *end != '\0' || value <= 0) {
    std::fprintf(stderr, "ggml_attention: %s must be a positive integer, not '%s'\n", name,
                 argv[i]);
    std::exit(2);
  }
  return value;
}

// Fills `tensor` (rows of `row` elements) with Gaussian rows: a pool of rows encoded once in the
// tensor's type, repeated (the kernel's time does not depend on the values).
void FillRows(ggml_tensor* tensor, std::int64_t row, std::mt19937_64& rng) {
  constexpr std::int64_t kPoolRows = 4096;
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> values(kPoolRows * row);
  for (float& v : values) v = gauss(rng);
  const std::size_t row_bytes = ggml_row_size(tensor->type, row);
  std::vector<std::uint8_t> pool(kPoolRows * row_bytes);
  if (tensor->type == GGML_TYPE_F16) {
    ggml_fp32_to_fp16_row(values.data(), reinterpret_cast<ggml_fp16_t*>(pool.data()),
                          kPoolRows * row);
  } else {
    ggml_quantize_chunk(tensor->type, values.data(), pool.data(), 0, kPoolRows, row, nullptr);
  }
  const std::int64_t rows = ggml_nelements(tensor) / row;
  auto* dst = static_cast<std::uint8_t*>(tensor->data);
  for (std::int64_t r = 0; r < rows; r += kPoolRows) {
    const std::int64_t n = std::min(kPoolRows, rows - r);
    std::memcpy(dst + r * row_bytes, pool.data(), n * row_bytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 10) {
    std::fprintf(stderr,
                 "usage: ggml_attention TYPE BATCH CONTEXT THREADS MIN_SECONDS "
                 "WORKING_SET_BYTES [HQ HK D]\n");
    return 2;
  }
  const ggml_type type = ParseType(argv[1]);
  const long batch = Arg(argv, 2, "BATCH"), context = Arg(argv, 3, "CONTEXT");
  const int threads = static_cast<int>(Arg(argv, 4, "THREADS"));
  const double min_seconds = std::strtod(argv[5], nullptr);
  const long working_set = Arg(argv, 6, "WORKING_SET_BYTES");
  const long hq = argc == 10 ? Arg(argv, 7, "HQ") : 32, hk = argc == 10 ? Arg(argv, 8, "HK") : 8;
  const long d = argc == 10 ? Arg(argv, 9, "D") : 128;
  if (hq % hk != 0) {
    std::fprintf(stderr, "ggml_attention: HQ (%ld) must be a multiple of HK (%ld)\n", hq, hk);
    return 2;
  }

  // K and V of one copy of the batch, and as many copies as fill the working set.
  const std::size_t kv_bytes = 2 * ggml_row_size(type, d) * context * hk * batch;
  const long copies = std::max<long>(1, (working_set + long(kv_bytes) - 1) / long(kv_bytes));
  const std::size_t q_bytes = sizeof(float) * d * hq * batch;
  ggml_init_params params{};
  params.mem_size = copies * kv_bytes + q_bytes + copies * (q_bytes + (1 << 20)) + (64 << 20);
  params.no_alloc = false;
  ggml_context* ctx = ggml_init(params);
  if (ctx == nullptr) {
    std::fprintf(stderr, "ggml_attention: ggml_init could not allocate %zu bytes\n",
                 params.mem_size);
    return 1;
  }
  // ggml's shapes (innermost first): K, V [D, n_kv, Hk, sequences]; Q [D, 1, Hq, sequences].
  ggml_tensor* k_all = ggml_new_tensor_4d(ctx, type, d, context, hk, batch * copies);
  ggml_tensor* v_all = ggml_new_tensor_4d(ctx, type, d, context, hk, batch * copies);
  ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d, 1, hq, batch);
  std::mt19937_64 rng(1);
  FillRows(k_all, d, rng);
  FillRows(v_all, d, rng);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  for (std::int64_t i = 0; i < ggml_nelements(q); ++i) static_cast<float*>(q->data)[i] = gauss(rng);

  std::vector<ggml_cgraph*> graphs;
  for (long c = 0; c < copies; ++c) {
    const auto view = [&](ggml_tensor* all) {
      return ggml_view_4d(ctx, all, d, context, hk, batch, all->nb[1], all->nb[2], all->nb[3],
                          c * batch * all->nb[3]);
    };
    ggml_tensor* out = ggml_flash_attn_ext(ctx, q, view(k_all), view(v_all), nullptr,
                                           1.0f / std::sqrt(float(d)), 0.0f, 0.0f);
    ggml_cgraph* graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);
    graphs.push_back(graph);
  }

  using Clock = std::chrono::steady_clock;
  for (ggml_cgraph* graph : graphs) ggml_graph_compute_with_ctx(ctx, graph, threads);  // warm-up
  std::vector<double> us;
  const auto start = Clock::now();
  for (long i = 0;
       us.size() < 3 || std::chrono::duration<double>(Clock::now() - start).count() < min_seconds;
       ++i) {
    const auto t0 = Clock::now();
    if (ggml_graph_compute_with_ctx(ctx, graphs[i % copies], threads) != GGML_STATUS_SUCCESS) {
      std::fprintf(stderr, "ggml_attention: the graph failed\n");
      return 1;
    }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  std::printf(
      "{\"backend\": \"ggml-cpu\", \"format\": \"%s\", \"batch\": %ld, \"context\": %ld, "
      "\"q_len\": 1, \"hq\": %ld, \"hk\": %ld, \"d\": %ld, \"threads\": %d, \"median_us\": %.3f, "
      "\"runs\": %zu, \"kv_bytes\": %zu, \"working_set_bytes\": %zu, \"copies\": %ld}\n",
      argv[1], batch, context, hq, hk, d, threads, us[us.size() / 2], us.size(), kv_bytes,
      kv_bytes * copies, copies);
  ggml_free(ctx);
  return 0;
}

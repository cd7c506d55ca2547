// Timing of the CUDA decode on device-resident caches, for `mjolnir bench --backend cuda` and
// scripts/device-check.sh, plus the card's device-to-device copy bandwidth (the physical limit
// the results are set against) and a probe of the device's exp2 against the host's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "mjolnir/decode.h"

namespace mjolnir::cuda {

struct BenchSpec {
  Format format = Format::fp8_e4m3;
  Layout layout = Layout::B2NHD;
  ScaleGranularity granularity = ScaleGranularity::head;
  int batch = 16;
  int context = 8192;  // KV tokens per sequence (the q_len new ones included)
  int q_len = 1;
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
  int page_size = 16;
  QMode q_mode = QMode::fp32;
  PMode p_mode = PMode::fp32;
  int tile_tokens = 64;
  int max_splits = 0;  // 0: max_splits_to_fill(the backend's workers, batch, Hk) (plan.h)
  // Cache copies are added until they hold this much and 4x the L2 (so steps read HBM, not L2).
  std::size_t min_working_set_bytes = std::size_t{1} << 30;
  int repeats = 7;           // timed batches; the median batch's mean step time is reported
  int steps_per_repeat = 0;  // replays per timed batch; 0: max(10, number of cache copies)
  std::uint64_t seed = 1;
};

struct BenchResult {
  double median_us = 0;               // one decode step (decode + merge kernels, graph replay)
  int runs = 0;                       // steps timed in all
  std::size_t kv_bytes = 0;           // K and V bytes one step reads
  std::size_t working_set_bytes = 0;  // all cache copies the steps rotate over
  int copies = 0;
  int num_items = 0;   // work items of the plan (CTAs that do work)
  int max_splits = 0;  // the plan's cap on chunks per sequence (spec.max_splits, resolved)
  double gbps = 0;     // kv_bytes / median time
  std::string device;
  // The decode CTA body: "exact_order", or "tensor_core" with its MmaLayout ("_stacked",
  // "_tokens_on_m").
  std::string body;
};

// Builds a cache of spec.batch sequences of spec.context tokens on the device (pseudo-random
// values encoded with the write_kv encoders, scales amax / format max, shuffled pages), copies
// it until the copies exceed four times the L2 cache and spec.min_working_set_bytes (within half
// the free memory),
// plans with the backend's capacity, captures one graph per copy (decode + merge) and times
// graph replays rotating over the copies with CUDA events. Throws Error without a device.
BenchResult bench_decode(const BenchSpec& spec);

// Device-to-device cudaMemcpy bandwidth of the current device, counting bytes read plus bytes
// written (the convention of the GPU notes, ~4.3 TB/s on an H200): the median of `repeats`
// copies of `bytes`.
double copy_bandwidth_gbps(std::size_t bytes = std::size_t{2} << 30, int repeats = 10);

// Read-only bandwidth of the current device: a kernel that streams `bytes` once with 16-byte
// loads and writes nothing, the median of `repeats` runs. The ceiling a decode step (which only
// reads its cache) is held to; a copy's read + write rate understates it (docs/cuda.md).
double read_bandwidth_gbps(std::size_t bytes = std::size_t{4} << 30, int repeats = 10);

// The name of the current device ("NVIDIA H200").
std::string device_name();

// exp2 of every x on the device: correctly_rounded = the decode kernel's exp2 (double, rounded
// once), otherwise CUDA's exp2f. For measuring how often each differs from the host's.
std::vector<float> device_exp2(std::span<const float> x, bool correctly_rounded);

}  // namespace mjolnir::cuda

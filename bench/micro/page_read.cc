// How fast the CPU kernel's memory pattern can be read when nothing else is done: the K and V rows
// of a decode step over a paged cache (vLLM's B2NHD layout, pages in a shuffled order), walked as
// the kernel walks them (a unit of all KV heads, tile by tile, K then V, each phase's rows
// prefetched one phase ahead by the kernel's TilePrefetcher), with one load per cache line and
// no arithmetic. Its rate bounds what any kernel with this pattern can reach, and sets the
// memory side apart from the kernel's arithmetic (bench/micro/kernel_rates) in
// docs/cpu-experiments.md.
//
//   build/bench/micro/page_read [--threads=N] [--row-bytes=B] [--tokens=T] [--no-prefetch]
//                               [--work=N] [--small-pages]
//
// --row-bytes: bytes of one token's row of one head (128: fp8 at D 128; 256: bf16; 64: fp4).
// --work=N: N dependent-free multiply-adds per cache line read, to see how the pattern holds up
// beside arithmetic. --small-pages: no MADV_HUGEPAGE on the pool. Prints GB/s for each thread
// count from 1 to N, and the sequential read bandwidth (the bench's limit) beside it.
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/huge_pages.h"
#include "bench/read_bandwidth.h"
#include "cpu/tile_prefetcher.h"

namespace {

using mjolnir::cpu::TilePrefetcher;

constexpr int kHeads = 8, kPageTokens = 16;
constexpr std::size_t kTileBytes = std::size_t(64) << 10;  // the kernel's fast-path tile (K + V)

struct Options {
  int threads = 2;
  std::size_t row_bytes = 128;
  int tokens = 32768;  // per step, split over the threads
  bool prefetch = true;
  int work = 0;
  bool huge_pages = true;
};

// Two words of one 64-byte line: any load brings the whole line in, and two keep the loop's own
// instructions far below the memory's time.
inline std::uint64_t ReadLine(const std::uint8_t* line) {
  std::uint64_t first, last;
  std::memcpy(&first, line, 8);
  std::memcpy(&last, line + 56, 8);
  return first + last;
}

// Reads the rows of tokens [begin, end) of every head through `pages`, as the kernel does.
std::uint64_t ReadChunk(const std::uint8_t* pool, const std::int32_t* pages, int begin, int end,
                        const Options& o, const std::int64_t* k_offsets,
                        const std::int64_t* v_offsets) {
  const std::size_t token_stride = kHeads * o.row_bytes;
  const std::size_t page_bytes = 2 * kPageTokens * token_stride;
  const int tile = std::min<int>(64, std::max<int>(8, int(kTileBytes / (2 * token_stride)) & ~7));
  std::vector<const std::uint8_t*> bases(2 * tile);
  const auto fill = [&](int first, const std::uint8_t** out) {
    const int n = std::max(0, std::min(tile, end - first));
    for (int i = 0; i < n; ++i) {
      const int pos = first + i;
      out[i] = pool + std::size_t(pages[pos / kPageTokens]) * page_bytes +
               std::size_t(pos % kPageTokens) * token_stride;
    }
    return n;
  };
  std::uint64_t sum = 0;
  float acc[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  TilePrefetcher prefetch;
  const std::uint8_t** cur = bases.data();
  const std::uint8_t** next = cur + tile;
  int count = fill(begin, cur);
  prefetch.Reset(cur, count, k_offsets, kHeads, o.row_bytes);
  if (o.prefetch) prefetch.Issue(prefetch.rows());
  for (int first = begin; first < end; first += tile) {
    const int next_count = fill(first + tile, next);
    for (int phase = 0; phase < 2; ++phase) {
      // Phase 0 reads K while V of this tile is prefetched; phase 1 reads V and prefetches K of
      // the next tile.
      if (phase == 0) {
        prefetch.Reset(cur, count, v_offsets, kHeads, o.row_bytes);
      } else {
        prefetch.Reset(next, next_count, k_offsets, kHeads, o.row_bytes);
      }
      const int lines_per_row = int(o.row_bytes / 64);
      const int quota = (prefetch.rows() + count * kHeads - 1) / (count * kHeads);
      const std::int64_t* offsets = phase == 0 ? k_offsets : v_offsets;
      for (int h = 0; h < kHeads; ++h) {
        for (int t = 0; t < count; ++t) {
          if (o.prefetch) prefetch.Issue(quota);
          const std::uint8_t* row = cur[t] + offsets[h];
          for (int l = 0; l < lines_per_row; ++l) {
            sum += ReadLine(row + 64 * l);
            for (int w = 0; w < o.work; ++w) acc[w & 7] = acc[w & 7] * 0.999f + 0.001f;
          }
        }
      }
    }
    std::swap(cur, next);
    count = next_count;
  }
  return sum + std::uint64_t(acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7]);
}

// GB/s of `threads` threads, each reading its share of a step's tokens, over rotating pages.
double Measure(const Options& o, int threads) {
  const std::size_t token_stride = kHeads * o.row_bytes;
  const std::size_t page_bytes = 2 * kPageTokens * token_stride;
  const std::size_t working_set =
      std::max<std::size_t>(std::size_t(1536) << 20, 4 * mjolnir::cpu::last_level_cache_bytes());
  const std::size_t num_pages = working_set / page_bytes;
  const int step_pages = o.tokens / kPageTokens;
  mjolnir::cpu::HugePageBuffer pool_buffer =
      o.huge_pages ? mjolnir::cpu::allocate_huge_page_buffer(num_pages * page_bytes, "pool")
                   : mjolnir::cpu::HugePageBuffer(static_cast<std::byte*>(
                         std::aligned_alloc(4096, (num_pages * page_bytes + 4095) / 4096 * 4096)));
  auto* pool = reinterpret_cast<std::uint8_t*>(pool_buffer.get());
  std::memset(pool, 1, num_pages * page_bytes);
  std::vector<std::int32_t> order(num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  const int steps = std::max<int>(8, int(3 * num_pages / step_pages));

  std::barrier start(threads + 1), done(threads + 1);
  std::vector<std::jthread> workers;
  std::uint64_t sink = 0;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::vector<std::int64_t> k_offsets(kHeads), v_offsets(kHeads);
      for (int h = 0; h < kHeads; ++h) {
        k_offsets[h] = std::int64_t(h * o.row_bytes);
        v_offsets[h] = k_offsets[h] + std::int64_t(kPageTokens * token_stride);
      }
      const int share = o.tokens / threads;
      for (int s = 0; s < steps; ++s) {
        start.arrive_and_wait();
        // Step s reads pages [s * step_pages, ...) of the shuffled order, wrapping around.
        std::vector<std::int32_t> pages(step_pages);
        for (int i = 0; i < step_pages; ++i) {
          pages[i] = order[(std::size_t(s) * step_pages + i) % num_pages];
        }
        sink += ReadChunk(pool, pages.data(), t * share, (t + 1) * share, o, k_offsets.data(),
                          v_offsets.data());
        done.arrive_and_wait();
      }
    });
  }
  std::vector<double> seconds;
  for (int s = 0; s < steps; ++s) {
    const auto begin = std::chrono::steady_clock::now();
    start.arrive_and_wait();
    done.arrive_and_wait();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  workers.clear();
  if (sink == 42) std::printf(" ");
  std::sort(seconds.begin() + 1, seconds.end());  // the first step warms the threads up
  const double median = seconds[1 + (seconds.size() - 1) / 2];
  return double(o.tokens) * token_stride * 2 / median / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* name) -> const char* {
      const std::size_t n = std::strlen(name);
      return arg.compare(0, n, name) == 0 && arg.size() > n && arg[n] == '=' ? arg.c_str() + n + 1
                                                                             : nullptr;
    };
    if (const char* v = value("--threads")) {
      o.threads = std::max(1, std::atoi(v));
    } else if (const char* v = value("--row-bytes")) {
      o.row_bytes = std::size_t(std::max(64, std::atoi(v) / 64 * 64));
    } else if (const char* v = value("--tokens")) {
      o.tokens = std::max(kPageTokens * 64, std::atoi(v) / kPageTokens * kPageTokens);
    } else if (const char* v = value("--work")) {
      o.work = std::max(0, std::atoi(v));
    } else if (arg == "--no-prefetch") {
      o.prefetch = false;
    } else if (arg == "--small-pages") {
      o.huge_pages = false;
    } else {
      std::fprintf(stderr, "page_read: unknown argument '%s' (see the header of page_read.cc)\n",
                   arg.c_str());
      return 2;
    }
  }
  std::printf(
      "page_read: rows of %zu bytes, %d heads, pages of %d tokens, %d tokens a step, %s, "
      "%s pages, %d multiply-adds per line\n",
      o.row_bytes, kHeads, kPageTokens, o.tokens, o.prefetch ? "prefetched" : "not prefetched",
      o.huge_pages ? "huge" : "small", o.work);
  for (int threads = 1; threads <= o.threads; ++threads) {
    const double paged = Measure(o, threads);
    const double sequential = mjolnir::cpu::measure_read_bandwidth_gbps(threads);
    std::printf("threads %d: paged %.1f GB/s, sequential %.1f GB/s (%.2f)\n", threads, paged,
                sequential, paged / sequential);
  }
  return 0;
}

// Read bandwidth of this machine: the roofline `mjolnir bench` reports each kernel against.
// Compiled once per Highway target (foreach_target.h) and dispatched at run time, like every
// src/cpu kernel, so it reads with the same vector width the decode kernels do.
#include "cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/read_bandwidth.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace mjolnir::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sums `bytes` bytes at `data` (aligned to 64 bytes) as 64-bit words. Eight independent
// accumulators keep enough loads in flight that the loop waits on memory, not on the adds.
std::uint64_t SumWords(const std::uint8_t* data, std::size_t bytes) {
  const hn::ScalableTag<std::uint64_t> d;
  const std::size_t lanes = hn::Lanes(d);
  const auto* words = reinterpret_cast<const std::uint64_t*>(data);
  const std::size_t num_words = bytes / sizeof(std::uint64_t);

  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  auto a4 = hn::Zero(d), a5 = hn::Zero(d), a6 = hn::Zero(d), a7 = hn::Zero(d);
  std::size_t i = 0;
  for (; i + 8 * lanes <= num_words; i += 8 * lanes) {
    a0 = hn::Add(a0, hn::Load(d, words + i + 0 * lanes));
    a1 = hn::Add(a1, hn::Load(d, words + i + 1 * lanes));
    a2 = hn::Add(a2, hn::Load(d, words + i + 2 * lanes));
    a3 = hn::Add(a3, hn::Load(d, words + i + 3 * lanes));
    a4 = hn::Add(a4, hn::Load(d, words + i + 4 * lanes));
    a5 = hn::Add(a5, hn::Load(d, words + i + 5 * lanes));
    a6 = hn::Add(a6, hn::Load(d, words + i + 6 * lanes));
    a7 = hn::Add(a7, hn::Load(d, words + i + 7 * lanes));
  }
  for (; i + lanes <= num_words; i += lanes) a0 = hn::Add(a0, hn::LoadU(d, words + i));
  const auto total =
      hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)), hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)));
  std::uint64_t sum = hn::GetLane(hn::SumOfLanes(d, total));
  for (; i < num_words; ++i) sum += words[i];
  return sum;
}

const char* CurrentTargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace mjolnir::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/huge_pages.h"
#include "bench/read_bandwidth.h"
#include "mjolnir/error.h"

namespace mjolnir::cpu {

HWY_EXPORT(SumWords);
HWY_EXPORT(CurrentTargetName);

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
// Shares start on 2 MiB boundaries so transparent huge pages can back them and no two threads
// touch the same page.
constexpr std::size_t kShareAlignment = 2 * kMiB;
constexpr int kRepetitions = 7;

// "32768K", "32M", "1024" -> bytes; 0 when unparsable.
std::size_t parse_cache_size(const std::string& text) {
  std::size_t value = 0;
  std::size_t pos = 0;
  while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') {
    value = value * 10 + static_cast<std::size_t>(text[pos] - '0');
    ++pos;
  }
  if (pos == 0) return 0;
  if (pos < text.size()) {
    switch (text[pos]) {
      case 'K':
        return value << 10;
      case 'M':
        return value << 20;
      case 'G':
        return value << 30;
      default:
        break;
    }
  }
  return value;
}

// Size of the highest-level data or unified cache listed for cpu0 in sysfs; 0 when none.
std::size_t sysfs_last_level_cache_bytes() {
  int best_level = 0;
  std::size_t best_bytes = 0;
  for (int index = 0; index < 16; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_file(dir + "/level"), type_file(dir + "/type"), size_file(dir + "/size");
    if (!level_file || !size_file) continue;
    int level = 0;
    std::string type, size;
    level_file >> level;
    type_file >> type;
    size_file >> size;
    if (type == "Instruction") continue;
    if (level > best_level) {
      best_level = level;
      best_bytes = parse_cache_size(size);
    }
  }
  return best_bytes;
}

}  // namespace

std::size_t last_level_cache_bytes() {
  std::size_t bytes = sysfs_last_level_cache_bytes();
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) bytes = std::max(bytes, static_cast<std::size_t>(l3));
#endif
  return bytes > 0 ? bytes : 32 * kMiB;
}

std::size_t default_read_bandwidth_bytes() { return std::max(kGiB, 4 * last_level_cache_bytes()); }

double measure_read_bandwidth_gbps(int threads, std::size_t bytes) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  MJOLNIR_REQUIRE(bytes >= kMiB, "bytes: ", bytes, " is too small to measure memory bandwidth");

  // Equal shares, each a multiple of the alignment, so every thread streams whole huge pages.
  const std::size_t share =
      (bytes / threads + kShareAlignment - 1) / kShareAlignment * kShareAlignment;
  const std::size_t total = share * static_cast<std::size_t>(threads);
  // Fresh pages, not touched yet: each thread touches its own share. Huge pages where the
  // system gives them, as the bench's cache copies have (huge_pages.h).
  const HugePageBuffer buffer = allocate_huge_page_buffer(total, "read-bandwidth buffer");

  std::barrier start(threads + 1);
  std::barrier done(threads + 1);
  std::atomic<std::uint64_t> sink{0};  // keeps the sums observable so no load is elided
  std::vector<std::jthread> workers;
  workers.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      auto* mine =
          reinterpret_cast<std::uint8_t*>(buffer.get()) + static_cast<std::size_t>(t) * share;
      std::memset(mine, 1, share);
      done.arrive_and_wait();
      for (int rep = 0; rep < kRepetitions; ++rep) {
        start.arrive_and_wait();
        sink.fetch_add(HWY_DYNAMIC_DISPATCH(SumWords)(mine, share), std::memory_order_relaxed);
        done.arrive_and_wait();
      }
    });
  }
  done.arrive_and_wait();  // every share touched

  std::vector<double> seconds;
  for (int rep = 0; rep < kRepetitions; ++rep) {
    const auto begin = std::chrono::steady_clock::now();
    start.arrive_and_wait();
    done.arrive_and_wait();
    const auto end = std::chrono::steady_clock::now();
    seconds.push_back(std::chrono::duration<double>(end - begin).count());
  }
  workers.clear();  // join

  std::nth_element(seconds.begin(), seconds.begin() + kRepetitions / 2, seconds.end());
  return static_cast<double>(total) / seconds[kRepetitions / 2] / 1e9;
}

std::vector<std::string> compiled_simd_targets() {
  std::vector<std::string> names;
  // Lower bits are better targets in Highway's encoding, so this lists the best first.
  for (std::int64_t targets = HWY_TARGETS; targets != 0; targets &= targets - 1) {
    names.emplace_back(hwy::TargetName(targets & -targets));
  }
  return names;
}

std::string dispatched_simd_target() { return HWY_DYNAMIC_DISPATCH(CurrentTargetName)(); }

}  // namespace mjolnir::cpu

#endif  // HWY_ONCE

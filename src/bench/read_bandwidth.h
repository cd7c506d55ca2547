// The physical limit a decode step is measured against: how fast this machine's threads can read
// a buffer much larger than the last-level cache. `mjolnir bench` divides by it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace mjolnir::cpu {

// Bytes of the largest (last-level) data cache: the larger of what glibc reports
// (sysconf(_SC_LEVEL3_CACHE_SIZE), which on some CPUs is the whole socket's L3) and the highest
// level listed in /sys/devices/system/cpu/cpu0/cache; 32 MiB when neither says.
std::size_t last_level_cache_bytes();

// A buffer size that no cache can hold: max(1 GiB, 4 x the last-level cache).
std::size_t default_read_bandwidth_bytes();

// Read bandwidth in GB/s (1e9 bytes per second) of `threads` threads (0 = every hardware
// thread), each summing its share of a `bytes`-sized buffer with SIMD loads. Every thread
// first-touches the share it later reads (so pages land on its NUMA node), the pass is repeated
// seven times, and the median pass is returned. Throws Error when the buffer cannot be allocated.
double measure_read_bandwidth_gbps(int threads, std::size_t bytes = default_read_bandwidth_bytes());

// Highway targets the src/cpu kernels are compiled for ("AVX3", "AVX2", "SSE4", ...), best
// first, and the one run-time dispatch picks on this CPU.
std::vector<std::string> compiled_simd_targets();
std::string dispatched_simd_target();

}  // namespace mjolnir::cpu

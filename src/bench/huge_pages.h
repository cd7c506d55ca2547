// Host buffers that transparent huge pages may back: the read-bandwidth probe's and the bench's
// KV cache copies. With 4 KiB pages, a step over a serving-sized cache takes a TLB miss every
// 4 KiB of pages scattered through the pool (measured on Zen 5, one thread, fp8 at 32k tokens:
// 6.6-7.7 ms a step against 5.7-6.3 ms with huge pages), and Linux's default "madvise" mode
// gives huge pages only to memory that asks for them.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <string>

namespace mjolnir::cpu {

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using HugePageBuffer = std::unique_ptr<std::byte, FreeDeleter>;

// Alignment and size granule of the buffers: one x86-64 / aarch64 (4 KiB granule) huge page.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// `bytes` (rounded up to kHugePageBytes), aligned to kHugePageBytes and advised MADV_HUGEPAGE
// where the system has it; not touched, so its pages are mapped on first write. Throws Error
// naming `what` when the memory cannot be allocated.
HugePageBuffer allocate_huge_page_buffer(std::size_t bytes, const char* what);

// The system's transparent huge page mode ("always", "madvise" or "never"), or "unknown".
std::string transparent_huge_pages_mode();

}  // namespace mjolnir::cpu

#include "bench/huge_pages.h"

#include <fstream>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "mjolnir/error.h"

namespace mjolnir::cpu {

HugePageBuffer allocate_huge_page_buffer(std::size_t bytes, const char* what) {
  const std::size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  HugePageBuffer buffer(static_cast<std::byte*>(std::aligned_alloc(kHugePageBytes, rounded)));
  MJOLNIR_REQUIRE(buffer != nullptr, what, ": cannot allocate ", rounded, " bytes");
#if defined(MADV_HUGEPAGE)
  // Advice only: where the kernel has no huge pages to give, the buffer keeps small pages.
  madvise(buffer.get(), rounded, MADV_HUGEPAGE);
#endif
  return buffer;
}

std::string transparent_huge_pages_mode() {
  // "always [madvise] never": the bracketed word is the mode.
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string word;
  while (file >> word) {
    if (word.size() > 2 && word.front() == '[' && word.back() == ']') {
      return word.substr(1, word.size() - 2);
    }
  }
  return "unknown";
}

}  // namespace mjolnir::cpu

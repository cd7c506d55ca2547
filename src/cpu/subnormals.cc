#include "cpu/subnormals.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace mjolnir::cpu {
namespace {

bool intel_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::strcmp(vendor, "GenuineIntel") == 0;
#else
  return false;
#endif
}

std::atomic<int> g_override{-1};  // -1: none, else the answer

}  // namespace

void set_fp32_subnormals_slow(std::optional<bool> slow) {
  g_override.store(slow.has_value() ? int(*slow) : -1, std::memory_order_relaxed);
}

bool fp32_subnormals_are_slow() {
  if (const int forced = g_override.load(std::memory_order_relaxed); forced >= 0) return forced;
  static const bool slow = [] {
    if (const char* env = std::getenv("MJOLNIR_CPU_AVOID_SUBNORMALS"); env != nullptr && *env) {
      return std::strcmp(env, "0") != 0;
    }
    return intel_cpu();
  }();
  return slow;
}

}  // namespace mjolnir::cpu

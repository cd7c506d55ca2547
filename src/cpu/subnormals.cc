#include "cpu/subnormals.h"

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

}  // namespace

bool fp32_subnormals_are_slow() {
  static const bool slow = intel_cpu();
  return slow;
}

}  // namespace mjolnir::cpu

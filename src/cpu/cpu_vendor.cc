#include "cpu/cpu_vendor.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace mjolnir::cpu {
namespace {

CpuVendor read_vendor() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return CpuVendor::other;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  if (std::strcmp(vendor, "GenuineIntel") == 0) return CpuVendor::intel;
  if (std::strcmp(vendor, "AuthenticAMD") == 0) return CpuVendor::amd;
#endif
  return CpuVendor::other;
}

}  // namespace

CpuVendor cpu_vendor() {
  static const CpuVendor vendor = read_vendor();
  return vendor;
}

}  // namespace mjolnir::cpu

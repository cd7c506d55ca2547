#include "cpu/amx.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mjolnir::cpu {
namespace {

bool probe_amx() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  if (!amx_bf16 || !amx_tile) return false;
  // Linux keeps the 8 KiB tile state out of a process's signal frames and context switches until
  // the process asks for it (kernel 5.16 and later; older kernels refuse, and AMX stays off).
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

bool cpu_has_amx() {
  static const bool has = probe_amx();
  return has;
}

}  // namespace mjolnir::cpu

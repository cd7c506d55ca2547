#include "cpu/amx.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

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

std::atomic<bool>& amx_flag() {
  static std::atomic<bool> flag{[] {
    const char* env = std::getenv("MJOLNIR_CPU_AMX");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }()};
  return flag;
}

std::atomic<std::uint64_t> g_amx_items{0};
std::atomic<std::uint64_t> g_amx_value_items{0};

}  // namespace

bool cpu_has_amx() {
  static const bool has = probe_amx();
  return has;
}

void set_amx_enabled(bool enabled) { amx_flag().store(enabled); }
bool amx_enabled() { return amx_flag().load(std::memory_order_relaxed); }

std::uint64_t amx_items() { return g_amx_items.load(); }
void count_amx_item() { g_amx_items.fetch_add(1, std::memory_order_relaxed); }

std::uint64_t amx_value_items() { return g_amx_value_items.load(); }
void count_amx_value_item() { g_amx_value_items.fetch_add(1, std::memory_order_relaxed); }

}  // namespace mjolnir::cpu

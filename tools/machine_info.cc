#include "machine_info.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace mjolnir::tools {

std::string cpu_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  // x86 says "model name"; some Arm kernels only give "Hardware" or "CPU part".
  for (const char* key : {"model name", "Hardware"}) {
    cpuinfo.clear();
    cpuinfo.seekg(0);
    while (std::getline(cpuinfo, line)) {
      if (line.rfind(key, 0) != 0) continue;
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      const auto begin = line.find_first_not_of(" \t", colon + 1);
      if (begin != std::string::npos) return line.substr(begin);
    }
  }
  return "unknown";
}

int hardware_threads() {
  // The affinity mask, not the machine's core count: containers and taskset limit it.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

std::size_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  std::size_t value = 0;
  while (meminfo >> key >> value) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") return value * 1024;  // reported in kB
  }
  return 0;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

}  // namespace mjolnir::tools

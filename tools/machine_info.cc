#include "machine_info.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace mjolnir::tools {

namespace {

// The value of the first /proc/cpuinfo line whose key (the text before ':', trailing blanks
// dropped) is `key`, or "".
std::string cpuinfo_value(const std::string& key) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const auto key_end = line.find_last_not_of(" \t", colon == 0 ? 0 : colon - 1);
    if (key_end == std::string::npos || line.compare(0, key_end + 1, key) != 0 ||
        key_end + 1 != key.size()) {
      continue;
    }
    const auto begin = line.find_first_not_of(" \t", colon + 1);
    return begin == std::string::npos ? std::string() : line.substr(begin);
  }
  return "";
}

}  // namespace

std::string amd_zen_generation(int family, int model) {
  switch (family) {
    case 0x17:
      return model < 0x30 ? "Zen" : "Zen 2";
    case 0x19: {
      const bool zen4 = (model >= 0x10 && model <= 0x1F) || (model >= 0x60 && model <= 0x7F) ||
                        (model >= 0xA0 && model <= 0xAF);
      return zen4 ? "Zen 4" : "Zen 3";
    }
    case 0x1A:
      return "Zen 5";
    default:
      return "";
  }
}

std::string intel_xeon_generation(int family, int model) {
  if (family != 6) return "";
  switch (model) {
    case 0x55:
      return "Skylake-SP";  // and Cascade Lake, Cooper Lake: the same model number
    case 0x6A:
    case 0x6C:
      return "Ice Lake";
    case 0x8F:
      return "Sapphire Rapids";
    case 0xCF:
      return "Emerald Rapids";
    case 0xAD:
    case 0xAE:
      return "Granite Rapids";
    default:
      return "";
  }
}

std::string cpu_model_name() {
  // x86 says "model name"; some Arm kernels only give "Hardware".
  std::string name = cpuinfo_value("model name");
  if (name.empty()) name = cpuinfo_value("Hardware");
  if (name.empty()) return "unknown";
  const std::string vendor = cpuinfo_value("vendor_id");
  std::string generation;
  try {
    const int family = std::stoi(cpuinfo_value("cpu family"));
    const int model = std::stoi(cpuinfo_value("model"));
    if (vendor == "AuthenticAMD") generation = amd_zen_generation(family, model);
    // Virtual machines often say only "Intel(R) Xeon(R) Processor": the generation (AMX or not,
    // the cores' width) tells results files apart.
    if (vendor == "GenuineIntel" && name.find("Xeon") != std::string::npos &&
        name.find("Lake") == std::string::npos && name.find("Rapids") == std::string::npos) {
      generation = intel_xeon_generation(family, model);
    }
  } catch (const std::exception&) {  // no family or model: the name alone
  }
  if (!generation.empty()) name += " (" + generation + ")";
  return name;
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

std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[16];
  std::strftime(text, sizeof text, "%Y-%m-%d", &tm);
  return text;
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

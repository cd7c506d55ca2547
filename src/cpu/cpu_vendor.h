// Which company designed this CPU, for the kernel defaults that follow a core's costs rather than
// its instruction set (kernel_config.cc): two CPUs with the same extensions can execute them at
// very different rates.
#pragma once

namespace mjolnir::cpu {

enum class CpuVendor { intel, amd, other };

// From CPUID leaf 0's vendor string; `other` on Arm and anything unrecognised.
CpuVendor cpu_vendor();

}  // namespace mjolnir::cpu

#include "cpu/subnormals.h"

#include "cpu/cpu_vendor.h"

namespace mjolnir::cpu {

bool fp32_subnormals_are_slow() { return cpu_vendor() == CpuVendor::intel; }

}  // namespace mjolnir::cpu

// Whether this CPU multiplies fp32 subnormals at full speed, for the decoders that would make them
// (cpu/kv_decode-inl.h).
#pragma once

namespace mjolnir::cpu {

// True where an FMA with a subnormal fp32 operand takes a microcode assist (Intel cores, 40-60x
// the cost of a normal one; AMD and Arm cores take them at full speed), so the kernels decode
// through formats that never make one even where that costs more instructions: the default of
// CpuKernelOptions::avoid_fp32_subnormals (kernel_config.h).
bool fp32_subnormals_are_slow();

}  // namespace mjolnir::cpu

// Whether this CPU multiplies fp32 subnormals at full speed, for the decoders that would make them
// (cpu/kv_decode-inl.h).
#pragma once

#include <optional>

namespace mjolnir::cpu {

// True where an FMA with a subnormal fp32 operand takes a microcode assist (Intel cores, 40-60x
// the cost of a normal one; AMD and Arm cores take them at full speed), so the kernels decode
// through formats that never make one even where that costs more instructions. The environment
// variable MJOLNIR_CPU_AVOID_SUBNORMALS=1 or 0 overrides the choice (for measuring both ways).
bool fp32_subnormals_are_slow();

// Overrides the answer from now on (tests run the decoders of the other kind of CPU); nullopt goes
// back to the CPU's own.
void set_fp32_subnormals_slow(std::optional<bool> slow);

}  // namespace mjolnir::cpu

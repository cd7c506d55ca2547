// Whether this CPU has AMX tiles (Intel Sapphire Rapids and later) for Q . K and P . V
// (cpu/amx_scores-inl.h, cpu/amx_values-inl.h); a backend takes them where KernelConfig::amx.
#pragma once

namespace mjolnir::cpu {

// True where the CPU has AMX-TILE and AMX-BF16 and Linux grants this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). False elsewhere, and on other systems.
bool cpu_has_amx();

}  // namespace mjolnir::cpu

// Whether the CPU kernels may use AMX tiles (Intel Sapphire Rapids and later) for Q . K
// (cpu/amx_scores-inl.h).
#pragma once

#include <cstdint>

namespace mjolnir::cpu {

// True where the CPU has AMX-TILE and AMX-BF16 and Linux grants this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). False elsewhere, and on other systems.
bool cpu_has_amx();

// Enabled by default; MJOLNIR_CPU_AMX=0 in the environment, or set_amx_enabled(false), keeps Q . K
// on the AVX-512 BF16 dot products.
void set_amx_enabled(bool enabled);
bool amx_enabled();

// Work items whose Q . K ran on AMX tiles since the process started (tests check the path ran).
std::uint64_t amx_items();
void count_amx_item();
// Work items whose P . V ran on AMX tiles (P mode bf16, amx_values-inl.h) since the process
// started.
std::uint64_t amx_value_items();
void count_amx_value_item();

}  // namespace mjolnir::cpu

// Whether the numerics contract's exact-order dot products fuse their multiply-adds on this
// build: the emulator's Q . K (reference/emulator.cc) runs `dot = fma(q, k, dot)` where the host's
// baseline ISA has FMA (__FP_FAST_FMAF: aarch64 always, x86-64 only with -march=haswell or
// later) and `dot += q * k`, each product rounded, elsewhere. Every backend whose scores must
// reproduce the emulator's bit for bit (P mode fp8: its codes are the emulator's) follows this
// one answer: the CPU kernel's exact-order path and the CUDA exact-order body, whose host may
// be x86-64 or aarch64 (Grace). docs/numerics.md, step 2.
#pragma once

namespace mjolnir {

// True where the emulator fuses its dot products' multiply-adds. Defined in a .cc compiled
// with the library's flags, as the emulator is, so host and device code ask the same build.
bool host_fuses_dot_products();

}  // namespace mjolnir

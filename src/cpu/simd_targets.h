// The SIMD targets the src/cpu kernels are compiled for, pinned instead of every attainable one:
// x86-64 AVX3_DL and AVX3 (AVX-512), AVX2 (with FMA, F16C, BMI2) and SSE4; Arm NEON and
// SVE; and Highway's portable fallback (SCALAR, or EMU128 on compilers where it works), which runs
// the scalar portable path (cpu/attention_item.h) rather than emulated vectors.
//
// Include this first in every file that uses hwy/foreach_target.h for src/cpu kernels, so they all
// agree on the list; HWY_DISABLED_TARGETS must be defined before Highway's headers read it.
#pragma once

// AVX3_DL (AVX-512 with VBMI, VNNI and the rest of Ice Lake's set: Zen 4 and later, Sapphire
// Rapids and later) is opt-in in Highway: its byte and word permutes decode every low-bit format
// into true values with no fp32 subnormals (word_decoders-inl.h), which Intel cores multiply
// through a microcode assist at 40-60x the cost.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#ifndef HWY_DISABLED_TARGETS
// SSSE3 adds nothing the kernels use over the fallback that SSE4 does not do better.
#define HWY_DISABLED_TARGETS HWY_SSSE3
#endif

// True while compiling for a target that runs the scalar portable path (evaluate inside #if
// after hwy/highway.h, once per foreach_target pass).
#define MJOLNIR_PORTABLE_TARGET (HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128)

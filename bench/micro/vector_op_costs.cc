// What the CPU kernel's AVX-512 instruction mix costs on this core, with no memory in the way:
// loops of the kernel's own instructions (written out in assembly, so the compiler can neither
// drop nor reorder them), each timed alone and in the combinations the kernel runs them in. On a
// core that issues each kind on its own pipes the combinations cost the larger of their parts;
// where they share pipes, the sum. docs/cpu-experiments.md quotes it for the AMD EPYC Zen 4.
//
//   build/bench/micro/vector_op_costs
//
// Needs AVX-512 with VBMI and BF16 (Zen 4 and later, Sapphire Rapids and later); says so and
// exits otherwise. Every loop's operands are registers or L1-resident lines, and the FMA and dot
// product loops keep 16 independent accumulator chains (more than latency times pipes needs).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

#if defined(__x86_64__)

namespace {

// The loop bodies. Registers: zmm0-15 accumulators, zmm16-23 decoded K/V vectors or broadcast
// probabilities, zmm24-25 scratch, zmm26 the high-word mask, zmm27-30 the fp8 decoder's byte
// tables, zmm31 its sign mask; %1 points at 512 bytes of queries or probabilities, %2 at 256
// bytes of codes. (clang-format would stair-step these string macros.)
// clang-format off

// 16 fp32 FMAs: 4 probabilities (zmm16-19) times 4 decoded V vectors (zmm20-23), P . V's 4 x 4
// block without its decode and broadcasts.
#define MJ_FMA_ROW(p, a0, a1, a2, a3)                                    \
  "vfmadd231ps %%zmm20, " p ", " a0 "\n vfmadd231ps %%zmm21, " p ", " a1 \
  "\n vfmadd231ps %%zmm22, " p ", " a2 "\n vfmadd231ps %%zmm23, " p ", " a3 "\n"
#define MJ_FMA16                                                  \
  MJ_FMA_ROW("%%zmm16", "%%zmm0", "%%zmm1", "%%zmm2", "%%zmm3")   \
  MJ_FMA_ROW("%%zmm17", "%%zmm4", "%%zmm5", "%%zmm6", "%%zmm7")   \
  MJ_FMA_ROW("%%zmm18", "%%zmm8", "%%zmm9", "%%zmm10", "%%zmm11") \
  MJ_FMA_ROW("%%zmm19", "%%zmm12", "%%zmm13", "%%zmm14", "%%zmm15")
// The same 16 FMAs, each probability broadcast from memory by the FMA itself ({1to16}).
#define MJ_FMA_ROW_EMBEDDED(off, a0, a1, a2, a3)                                    \
  "vfmadd231ps " off "(%1)%{1to16%}, %%zmm20, " a0 "\n vfmadd231ps " off            \
  "(%1)%{1to16%}, %%zmm21, " a1 "\n vfmadd231ps " off "(%1)%{1to16%}, %%zmm22, " a2 \
  "\n vfmadd231ps " off "(%1)%{1to16%}, %%zmm23, " a3 "\n"
#define MJ_FMA16_EMBEDDED                                              \
  MJ_FMA_ROW_EMBEDDED("0", "%%zmm0", "%%zmm1", "%%zmm2", "%%zmm3")     \
  MJ_FMA_ROW_EMBEDDED("64", "%%zmm4", "%%zmm5", "%%zmm6", "%%zmm7")    \
  MJ_FMA_ROW_EMBEDDED("128", "%%zmm8", "%%zmm9", "%%zmm10", "%%zmm11") \
  MJ_FMA_ROW_EMBEDDED("192", "%%zmm12", "%%zmm13", "%%zmm14", "%%zmm15")
#define MJ_BROADCAST4                                                                           \
  "vbroadcastss (%1), %%zmm16\n vbroadcastss 64(%1), %%zmm17\n vbroadcastss 128(%1), %%zmm18\n" \
  " vbroadcastss 192(%1), %%zmm19\n"

// The fp8 decoder of word_decoders-inl.h on 64 codes at byte offset `off`: each code's bf16 high
// and low byte looked up by two vpermi2b, the sign put back by vpternlogd, the bytes paired into
// words by two unpacks (into w0, w1).
#define MJ_DECODE64(off, w0, w1)                                          \
  "vmovdqu8 " off "(%2), %%zmm24\n vmovdqu8 " off                         \
  "(%2), %%zmm25\n vpermi2b %%zmm28, %%zmm27, "                           \
  "%%zmm24\n vpermi2b %%zmm30, %%zmm29, %%zmm25\n vpternlogd $0xf8, " off \
  "(%2), %%zmm31, %%zmm24\n vpunpcklbw %%zmm24, %%zmm25, " w0             \
  "\n vpunpckhbw %%zmm24, %%zmm25, " w1 "\n"
// Q . K's step on 4 keys x 64 channels: their decode (20 vector ops).
#define MJ_DECODE_4_KEYS                   \
  MJ_DECODE64("0", "%%zmm16", "%%zmm20")   \
  MJ_DECODE64("64", "%%zmm17", "%%zmm21")  \
  MJ_DECODE64("128", "%%zmm18", "%%zmm22") \
  MJ_DECODE64("192", "%%zmm19", "%%zmm23")
// ... and its 32 bf16 dot products: 4 query rows (2 vectors each, from memory) x 4 keys.
#define MJ_DOT_ROW(q0, q1, a0, a1, a2, a3)                                                        \
  "vdpbf16ps " q0 "(%1), %%zmm16, " a0 "\n vdpbf16ps " q0 "(%1), %%zmm17, " a1 "\n vdpbf16ps " q0 \
  "(%1), %%zmm18, " a2 "\n vdpbf16ps " q0 "(%1), %%zmm19, " a3 "\n vdpbf16ps " q1                 \
  "(%1), %%zmm20, " a0 "\n vdpbf16ps " q1 "(%1), %%zmm21, " a1 "\n vdpbf16ps " q1                 \
  "(%1), %%zmm22, " a2 "\n vdpbf16ps " q1 "(%1), %%zmm23, " a3 "\n"
#define MJ_DOT32                                                     \
  MJ_DOT_ROW("0", "64", "%%zmm0", "%%zmm1", "%%zmm2", "%%zmm3")      \
  MJ_DOT_ROW("128", "192", "%%zmm4", "%%zmm5", "%%zmm6", "%%zmm7")   \
  MJ_DOT_ROW("256", "320", "%%zmm8", "%%zmm9", "%%zmm10", "%%zmm11") \
  MJ_DOT_ROW("384", "448", "%%zmm12", "%%zmm13", "%%zmm14", "%%zmm15")
// Q . K in integers (Q mode int8, int8_dot-inl.h) on 4 keys x 128 e2m1 channels: each key's 64
// code bytes split into nibbles (a load, two ands, a shift) and looked up by two vpshufb (24
// vector ops; zmm27 stands in for the table, zmm31 for the nibble mask).
#define MJ_DECODE_INT(off, even, odd)                                                         \
  "vmovdqu8 " off "(%2), %%zmm24\n vpandd " off "(%2), %%zmm31, " even "\n vpsrlw $4, "       \
  "%%zmm24, %%zmm24\n vpandd %%zmm31, %%zmm24, %%zmm24\n vpshufb " even ", %%zmm27, " even    \
  "\n vpshufb %%zmm24, %%zmm27, " odd "\n"
#define MJ_DECODE_INT_4_KEYS                   \
  MJ_DECODE_INT("0", "%%zmm16", "%%zmm20")   \
  MJ_DECODE_INT("64", "%%zmm17", "%%zmm21")  \
  MJ_DECODE_INT("128", "%%zmm18", "%%zmm22") \
  MJ_DECODE_INT("192", "%%zmm19", "%%zmm23")
// ... and its 32 vpdpbusd: 4 query rows (2 vectors of 64 signed bytes each, from memory) x 4 keys.
#define MJ_INT_ROW(q0, q1, a0, a1, a2, a3)                                                       \
  "vpdpbusd " q0 "(%1), %%zmm16, " a0 "\n vpdpbusd " q0 "(%1), %%zmm17, " a1 "\n vpdpbusd " q0  \
  "(%1), %%zmm18, " a2 "\n vpdpbusd " q0 "(%1), %%zmm19, " a3 "\n vpdpbusd " q1                 \
  "(%1), %%zmm20, " a0 "\n vpdpbusd " q1 "(%1), %%zmm21, " a1 "\n vpdpbusd " q1                 \
  "(%1), %%zmm22, " a2 "\n vpdpbusd " q1 "(%1), %%zmm23, " a3 "\n"
#define MJ_INT32                                                     \
  MJ_INT_ROW("0", "64", "%%zmm0", "%%zmm1", "%%zmm2", "%%zmm3")      \
  MJ_INT_ROW("128", "192", "%%zmm4", "%%zmm5", "%%zmm6", "%%zmm7")   \
  MJ_INT_ROW("256", "320", "%%zmm8", "%%zmm9", "%%zmm10", "%%zmm11") \
  MJ_INT_ROW("384", "448", "%%zmm12", "%%zmm13", "%%zmm14", "%%zmm15")
// P . V's decode of one V row's 64 channels into 4 fp32 vectors (the words widened by a shift
// or a mask, as DecodeViaWords does): 9 vector ops.
#define MJ_DECODE_V64                                                                       \
  MJ_DECODE64("0", "%%zmm24", "%%zmm25")                                                    \
  "vpslld $16, %%zmm24, %%zmm20\n vpandd %%zmm26, %%zmm24, %%zmm21\n vpslld $16, %%zmm25, " \
  "%%zmm22\n vpandd %%zmm26, %%zmm25, %%zmm23\n"
// The 4 x 4 score block's reduction tree, in kind: 16 steps of two shuffles and an add, each
// level reading the one before (the block's own tree: 15 steps, 30 shuffles).
#define MJ_COMBINE(a, b, t)                               \
  "vunpcklps " b ", " a ", %%zmm24\n vunpckhps " b ", " a \
  ", %%zmm25\n vaddps %%zmm25, "                          \
  "%%zmm24, " t "\n"
#define MJ_REDUCE16                                                                   \
  MJ_COMBINE("%%zmm0", "%%zmm1", "%%zmm16") MJ_COMBINE("%%zmm2", "%%zmm3", "%%zmm17")     \
  MJ_COMBINE("%%zmm4", "%%zmm5", "%%zmm18") MJ_COMBINE("%%zmm6", "%%zmm7", "%%zmm19")     \
  MJ_COMBINE("%%zmm8", "%%zmm9", "%%zmm20") MJ_COMBINE("%%zmm10", "%%zmm11", "%%zmm21")   \
  MJ_COMBINE("%%zmm12", "%%zmm13", "%%zmm22") MJ_COMBINE("%%zmm14", "%%zmm15", "%%zmm23") \
  MJ_COMBINE("%%zmm16", "%%zmm17", "%%zmm0") MJ_COMBINE("%%zmm18", "%%zmm19", "%%zmm1")   \
  MJ_COMBINE("%%zmm20", "%%zmm21", "%%zmm2") MJ_COMBINE("%%zmm22", "%%zmm23", "%%zmm3")   \
  MJ_COMBINE("%%zmm0", "%%zmm1", "%%zmm4") MJ_COMBINE("%%zmm2", "%%zmm3", "%%zmm5")       \
  MJ_COMBINE("%%zmm4", "%%zmm5", "%%zmm6") MJ_COMBINE("%%zmm6", "%%zmm7", "%%zmm8")
// clang-format on

alignas(64) float g_queries[128];  // also the probabilities
alignas(64) std::uint8_t g_codes[256];

// Every register a loop reads, set before it starts: plain normal values (no subnormals, which
// some cores take microcode assists on), the decoder's byte tables from the codes, the sign mask
// and the high-word mask.
#define MJ_INIT                                                                     \
  "vbroadcastss (%1), %%zmm0\n"                                                     \
  "vmovaps %%zmm0, %%zmm1\n vmovaps %%zmm0, %%zmm2\n vmovaps %%zmm0, %%zmm3\n"      \
  "vmovaps %%zmm0, %%zmm4\n vmovaps %%zmm0, %%zmm5\n vmovaps %%zmm0, %%zmm6\n"      \
  "vmovaps %%zmm0, %%zmm7\n vmovaps %%zmm0, %%zmm8\n vmovaps %%zmm0, %%zmm9\n"      \
  "vmovaps %%zmm0, %%zmm10\n vmovaps %%zmm0, %%zmm11\n vmovaps %%zmm0, %%zmm12\n"   \
  "vmovaps %%zmm0, %%zmm13\n vmovaps %%zmm0, %%zmm14\n vmovaps %%zmm0, %%zmm15\n"   \
  "vmovaps %%zmm0, %%zmm16\n vmovaps %%zmm0, %%zmm17\n vmovaps %%zmm0, %%zmm18\n"   \
  "vmovaps %%zmm0, %%zmm19\n vmovaps %%zmm0, %%zmm20\n vmovaps %%zmm0, %%zmm21\n"   \
  "vmovaps %%zmm0, %%zmm22\n vmovaps %%zmm0, %%zmm23\n"                             \
  "vmovdqu8 (%2), %%zmm27\n vmovdqu8 64(%2), %%zmm28\n vmovdqu8 128(%2), %%zmm29\n" \
  "vmovdqu8 192(%2), %%zmm30\n vpternlogd $0xff, %%zmm31, %%zmm31, %%zmm31\n"       \
  "vpslld $16, %%zmm31, %%zmm26\n vpslld $31, %%zmm31, %%zmm31\n"

// Runs `body` `iterations` times after MJ_INIT, and returns the time per iteration in ns. Compiled
// for AVX-512 (which names zmm16-31), called only where the CPU has it.
#define MJ_LOOP(name, body)                                                                       \
  __attribute__((target("avx512f"))) double name(long iterations) {                               \
    const auto start = std::chrono::steady_clock::now();                                          \
    long n = iterations;                                                                          \
    asm volatile(MJ_INIT "1:\n" body "dec %0\n jnz 1b\n"                                          \
                 : "+r"(n)                                                                        \
                 : "r"(g_queries), "r"(g_codes)                                                   \
                 : "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",      \
                   "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", \
                   "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24",        \
                   "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31");                \
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)     \
               .count() /                                                                         \
           double(iterations);                                                                    \
  }

MJ_LOOP(Fma16, MJ_FMA16)
MJ_LOOP(Dot32, MJ_DOT32)
MJ_LOOP(Decode4Keys, MJ_DECODE_4_KEYS)
MJ_LOOP(Decode4KeysDot32, MJ_DECODE_4_KEYS MJ_DOT32)
MJ_LOOP(Reduce16, MJ_REDUCE16)
MJ_LOOP(Int32, MJ_INT32)
MJ_LOOP(DecodeInt4Keys, MJ_DECODE_INT_4_KEYS)
MJ_LOOP(DecodeInt4KeysInt32, MJ_DECODE_INT_4_KEYS MJ_INT32)
MJ_LOOP(ValueStepBroadcast, MJ_DECODE_V64 MJ_BROADCAST4 MJ_FMA16)
MJ_LOOP(ValueStepEmbedded, MJ_DECODE_V64 MJ_FMA16_EMBEDDED)

struct Loop {
  const char* name;
  const char* what;
  int instructions;  // vector instructions per iteration (loads that are not operands too)
  double (*run)(long);
  bool vnni = false;  // needs AVX512_VNNI
};

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vbmi") ||
      !__builtin_cpu_supports("avx512bf16")) {
    std::printf("vector_op_costs: this CPU lacks AVX-512 VBMI or BF16; nothing to measure\n");
    return 0;
  }
  for (int i = 0; i < 128; ++i) g_queries[i] = 1.0f + 0.001f * float(i);
  for (int i = 0; i < 256; ++i) g_codes[i] = std::uint8_t(0x30 + i % 64);
  const Loop loops[] = {
      {"fma16", "16 fp32 FMAs (P . V's 4 x 4 block, registers only)", 16, Fma16},
      {"dot32", "32 vdpbf16ps (Q . K's 4 x 4 block on one 64-channel chunk)", 32, Dot32},
      {"decode4", "fp8 decode of 4 keys x 64 channels (8 vpermi2b, 4 vpternlogd, 8 unpacks)", 20,
       Decode4Keys},
      {"decode4+dot32", "both: Q . K's step as the kernel runs it", 52, Decode4KeysDot32},
      {"reduce16", "16 x (2 shuffles + add): the 4 x 4 block's reduction, in kind", 48, Reduce16},
      {"pv+broadcast", "V decode (64 ch), 4 vbroadcastss, 16 FMAs: P . V's step before", 29,
       ValueStepBroadcast},
      {"pv+embedded", "V decode (64 ch), 16 FMAs with {1to16} probabilities: P . V's step", 25,
       ValueStepEmbedded},
      {"int32", "32 vpdpbusd (Q . K's 4 x 4 block on one 128-channel chunk, int8 Q)", 32, Int32,
       true},
      {"decode4int", "e2m1 to bytes, 4 keys x 128 channels (4 loads, 8 ands, 4 shifts, 8 vpshufb)",
       24, DecodeInt4Keys, true},
      {"decode4int+int32", "both: int8 Q . K's step on 128 channels", 56, DecodeInt4KeysInt32,
       true},
  };
  const bool vnni = __builtin_cpu_supports("avx512vnni") != 0;
  constexpr long kIterations = 20'000'000;
  double fma_ns = 0;
  std::printf("%-14s %9s %8s %12s  %s\n", "loop", "ns/iter", "insns", "FMA-slots", "what");
  for (const Loop& loop : loops) {
    if (loop.vnni && !vnni) {
      std::printf("%-14s %9s %8d %12s  %s (no AVX512_VNNI here)\n", loop.name, "-",
                  loop.instructions, "-", loop.what);
      continue;
    }
    double best = 1e30;
    for (int round = 0; round < 5; ++round) best = std::min(best, loop.run(kIterations));
    if (fma_ns == 0) fma_ns = best / 16;  // the first loop: one FMA's issue time
    std::printf("%-14s %9.2f %8d %12.1f  %s\n", loop.name, best, loop.instructions, best / fma_ns,
                loop.what);
  }
  std::printf("FMA-slots: the loop's time in units of one FMA's (16 FMAs / fma16's time)\n");
}

#else
int main() { std::printf("vector_op_costs: x86-64 only\n"); }
#endif

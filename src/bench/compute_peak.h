// The other limit a CPU decode step can hit: fp32 multiply-adds per second. Decoding reads each
// KV byte once but multiplies it by every query row of its group (2 g q_len D flops per channel
// pair of K and V), so at small bytes per element (fp4, fp6) or many query rows the FMA units,
// not memory, bound the step. `mjolnir bench` measures this beside the read bandwidth, and the
// docs' tables show the bound it implies for each row.
#pragma once

namespace mjolnir::cpu {

// GFLOP/s (one FMA = 2 flops) of `threads` threads (0 = every hardware thread) running
// independent fp32 FMA chains at the dispatched target's vector width, the best of 5 passes
// over about `seconds` in all, wall clock: the best any kernel made of FMAs can do here.
double measure_fma_peak_gflops(int threads, double seconds = 0.2);

}  // namespace mjolnir::cpu

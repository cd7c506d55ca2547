// Error bounds the case matrix checks results against; derived in docs/numerics.md.
#pragma once

#include "mjolnir/decode.h"

namespace mjolnir::verify {

// Relative L2 of O between a backend and the emulator in the same mode and plan: only the order
// of fp32 accumulation differs (and, rarely, a P code that rounds the other way at a tie; more
// often where the backend rounds P from its own scores, p_from_own_scores).
double emulator_tolerance(const DecodeParams& params, bool p_from_own_scores = false);

// Relative L2 of O against the fp64 reference on the decoded cache: the error of the Q and P
// modes alone. query_crest: the largest amax / rms of the queries (times per-channel K scales)
// over a sequence's rows of one KV head; int8 Q rounds every value by up to amax / 254, so its
// error relative to a typical value grows with it (the other modes round relative to each value).
double mode_error_bound(const DecodeParams& params, double query_crest);

// Relative L2 of O against the fp64 reference on the original float K/V: the format's
// quantization error plus the mode's.
double format_error_bound(Format format, const DecodeParams& params, double query_crest);

// query_crest of a step (above).
double query_crest(const DecodeArgs& args);

// Unit roundoff of a format: half the spacing of its codes relative to the value,
// 2^-(mantissa bits + 1).
double unit_roundoff(Format format);

}  // namespace mjolnir::verify

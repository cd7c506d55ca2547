// What every fuzz target shares: the check that turns a broken promise of the C API into a
// crash libFuzzer reports (and the corpus replay fails on), and the bounds that keep one input
// small enough to run thousands of times a second.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "mjolnir/mjolnir.h"

// Aborts with the condition and the library's last message: libFuzzer saves the input that got
// here as a crash.
#define FUZZ_CHECK(condition)                                                                    \
  do {                                                                                           \
    if (!(condition)) {                                                                          \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, \
                   #condition, mjolnir_last_error());                                            \
      std::abort();                                                                              \
    }                                                                                            \
  } while (0)

namespace mjolnir_fuzz {

// A failed call must say why: a known status and a message.
inline void check_failure_explained(mjolnir_status status) {
  FUZZ_CHECK(status > MJOLNIR_OK && status <= MJOLNIR_ERROR_INTERNAL);
  // INTERNAL is a bug by the API's own definition.
  FUZZ_CHECK(status != MJOLNIR_ERROR_INTERNAL);
  FUZZ_CHECK(mjolnir_last_error()[0] != '\0');
}

// Buffers a target allocates for the library to read or write, in elements. Inputs whose
// strides would need more are skipped rather than handed a buffer the call may not read past.
inline constexpr long long kMaxBufferElements = 1 << 20;

}  // namespace mjolnir_fuzz

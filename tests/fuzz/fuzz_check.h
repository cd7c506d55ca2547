// What every fuzz target shares: the check that turns a broken promise of the C API into a
// crash libFuzzer reports (and the corpus replay fails on), and the bounds that keep one input
// small enough to run thousands of times a second.
#pragma once

#include <cstdint>
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

// Floats a [rows, heads, D] tensor with these element strides spans (D contiguous), or -1 when
// no buffer here could back them (the call is then skipped: the API cannot know a buffer's end,
// so strides past it are the caller's promise, not the library's to catch).
inline long long tensor_extent(std::int64_t rows, std::int64_t heads, std::int64_t d,
                               std::int64_t token_stride, std::int64_t head_stride) {
  if (rows <= 0 || heads <= 0) return 0;
  if (token_stride < 0 || head_stride < 0 || token_stride > kMaxBufferElements ||
      head_stride > kMaxBufferElements) {
    return -1;
  }
  const long long extent = (rows - 1) * token_stride + (heads - 1) * head_stride + d;
  return extent <= kMaxBufferElements ? extent : -1;
}

}  // namespace mjolnir_fuzz

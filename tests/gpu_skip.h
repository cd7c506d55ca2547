// How every GPU test (label "gpu") stands down on a machine that cannot run it: it skips, saying
// why, and never passes by pretending. Two cases: the CUDA backend is compiled but no device is
// usable (MJOLNIR_SKIP_WITHOUT_GPU at the top of each test), or it is not compiled at all (the
// file then holds only MJOLNIR_GPU_TESTS_NOT_COMPILED).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/gpu_devices.h"

namespace mjolnir::testing {

// Empty when a CUDA device is usable, otherwise why not ("no CUDA device: ...").
inline std::string no_gpu_reason() {
  std::string why;
  if (!cuda_devices(&why).empty()) return {};
  return why.empty() ? "no CUDA device" : why;
}

}  // namespace mjolnir::testing

#define MJOLNIR_SKIP_WITHOUT_GPU()                                                   \
  do {                                                                               \
    if (const std::string why = ::mjolnir::testing::no_gpu_reason(); !why.empty()) { \
      GTEST_SKIP() << "needs a CUDA device (" << why << ")";                         \
    }                                                                                \
  } while (0)

// One skipped test standing for the suite, so ctest reports it as skipped rather than absent.
#define MJOLNIR_GPU_TESTS_NOT_COMPILED(suite)                                           \
  TEST(suite, NotCompiled) {                                                            \
    std::string why;                                                                    \
    ::mjolnir::cuda_devices(&why);                                                      \
    GTEST_SKIP() << "the CUDA backend is not compiled into this build (" << why << ")"; \
  }

// The seed of a test run: MJOLNIR_TEST_SEED when set (to reproduce a failure), otherwise fresh
// from std::random_device. Printed once so every run can be replayed.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>

namespace mjolnir::testing {

inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    std::uint64_t s;
    if (const char* env = std::getenv("MJOLNIR_TEST_SEED")) {
      s = std::strtoull(env, nullptr, 0);
    } else {
      std::random_device rd;
      s = (std::uint64_t(rd()) << 32) | rd();
    }
    std::cout << "[ seed     ] MJOLNIR_TEST_SEED=" << s << std::endl;
    return s;
  }();
  return seed;
}

}  // namespace mjolnir::testing

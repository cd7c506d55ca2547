// `mjolnir verify`: every compiled backend against the emulator and the exact reference over the
// generated case matrix (src/verify/case_matrix.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace mjolnir::tools {

struct VerifyOptions {
  bool quick = false;                 // the covering subset instead of the full matrix
  std::vector<std::string> backends;  // empty: every compiled backend usable here
  std::uint64_t seed = 1;
  std::string filter;  // run only cases whose name contains this
};

// Declares the subcommand and its flags, bound to `options`.
CLI::App* add_verify_command(CLI::App& app, VerifyOptions& options);
// Runs it; returns the process exit code (0 when nothing failed, 1 otherwise).
int run_verify(const VerifyOptions& options);

}  // namespace mjolnir::tools

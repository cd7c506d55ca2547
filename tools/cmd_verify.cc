#include "cmd_verify.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "host_backend.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "verify/case_matrix.h"

namespace mjolnir::tools {

namespace {

using verify::Case;
using verify::CaseResult;
using Clock = std::chrono::steady_clock;
// Long runs (the full matrix, the sanitizer build) say where they are this often.
constexpr double kProgressIntervalSeconds = 5.0;

struct Tally {
  int passed = 0;
  int failed = 0;
  int unsupported = 0;
  double worst_vs_emulator = 0;
  double worst_vs_exact_over_bound = 0;  // 1.0 = at the per-format bound
};

// The backends to run: the ones asked for (all must be usable), or every compiled one that is
// usable on this machine (the others are named with the reason they are skipped).
std::vector<std::unique_ptr<Backend>> usable_backends(const std::vector<std::string>& requested) {
  std::vector<std::unique_ptr<Backend>> backends;
  const bool explicit_request = !requested.empty();
  for (const std::string& name : explicit_request ? requested : compiled_backends()) {
    auto backend = make_host_backend(name);
    const std::string reason = backend->unavailable_reason();
    if (!reason.empty()) {
      MJOLNIR_REQUIRE(!explicit_request, "--backend: ", name, " cannot run here: ", reason);
      std::printf("%s: skipped, %s\n", name.c_str(), reason.c_str());
      continue;
    }
    backends.push_back(std::move(backend));
  }
  return backends;
}

CaseResult run_one(const Case& c, const Backend& backend) {
  // One case throwing (a validation error in a new backend, say) is that case's failure, not
  // the end of the run.
  try {
    return verify::run_case(c, backend);
  } catch (const std::exception& e) {
    CaseResult result;
    result.status = CaseResult::Status::failed;
    result.message = std::string("threw: ") + e.what();
    return result;
  }
}

double seconds_between(Clock::time_point begin, Clock::time_point end) {
  return std::chrono::duration<double>(end - begin).count();
}

// Runs every case on one backend, printing failures as they happen and progress on stderr.
Tally verify_backend(const Backend& backend, const std::vector<Case>& cases) {
  Tally tally;
  const std::string name(backend.name());
  const auto start = Clock::now();
  auto last_progress = start;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const CaseResult result = run_one(cases[i], backend);
    switch (result.status) {
      case CaseResult::Status::passed:
        ++tally.passed;
        break;
      case CaseResult::Status::unsupported:
        ++tally.unsupported;
        break;
      case CaseResult::Status::failed:
        ++tally.failed;
        std::printf("FAILED %s %s: %s\n", name.c_str(), cases[i].name().c_str(),
                    result.message.c_str());
        std::fflush(stdout);
        break;
    }
    if (result.status != CaseResult::Status::unsupported) {
      tally.worst_vs_emulator = std::max(tally.worst_vs_emulator, result.error_vs_emulator);
      if (result.bound_vs_exact > 0) {
        tally.worst_vs_exact_over_bound = std::max(tally.worst_vs_exact_over_bound,
                                                   result.error_vs_exact / result.bound_vs_exact);
      }
    }
    const auto now = Clock::now();
    if (seconds_between(last_progress, now) > kProgressIntervalSeconds) {
      last_progress = now;
      const double elapsed = seconds_between(start, now);
      const double left = elapsed / double(i + 1) * double(cases.size() - i - 1);
      std::fprintf(stderr, "verify: %s %zu/%zu cases, %d failed, %.0f s, about %.0f s left\n",
                   name.c_str(), i + 1, cases.size(), tally.failed, elapsed, left);
    }
  }
  return tally;
}

}  // namespace

CLI::App* add_verify_command(CLI::App& app, VerifyOptions& options) {
  CLI::App* cmd = app.add_subcommand(
      "verify", "Check every backend against the emulator and the exact reference");
  cmd->add_flag("--quick", options.quick,
                "Run the covering subset (every value of every axis) instead of the full matrix");
  cmd->add_option("--backend", options.backends,
                  "Backend to check (repeatable; default: every compiled backend usable here)")
      ->delimiter(',');
  cmd->add_option("--seed", options.seed, "Seed of the generated cases")->capture_default_str();
  cmd->add_option("--filter", options.filter, "Run only the cases whose name contains this");
  return cmd;
}

int run_verify(const VerifyOptions& options) {
  std::vector<Case> cases;
  for (Case& c : verify::case_matrix(options.quick, options.seed)) {
    if (c.name().find(options.filter) != std::string::npos) cases.push_back(std::move(c));
  }
  // A filter that matches nothing is a typo, not a pass.
  MJOLNIR_REQUIRE(!cases.empty(), "--filter: no case name contains '", options.filter, "'");
  const auto backends = usable_backends(options.backends);
  std::printf("%zu cases (%s matrix, seed %llu) on %zu backend%s\n", cases.size(),
              options.quick ? "quick" : "full", static_cast<unsigned long long>(options.seed),
              backends.size(), backends.size() == 1 ? "" : "s");
  std::fflush(stdout);

  Tally total;
  for (const auto& backend : backends) {
    const Tally tally = verify_backend(*backend, cases);
    std::printf(
        "%s: %d passed, %d failed, %d unsupported; worst rel error vs emulator %.2e, "
        "worst error vs exact %.0f%% of its bound\n",
        std::string(backend->name()).c_str(), tally.passed, tally.failed, tally.unsupported,
        tally.worst_vs_emulator, 100 * tally.worst_vs_exact_over_bound);
    total.passed += tally.passed;
    total.failed += tally.failed;
    total.unsupported += tally.unsupported;
  }
  // The last line is the summary scripts look for; unsupported configurations are "skipped":
  // reported, neither passed nor failed.
  std::printf("%d passed, %d failed, %d skipped\n", total.passed, total.failed, total.unsupported);
  return total.failed == 0 ? 0 : 1;
}

}  // namespace mjolnir::tools

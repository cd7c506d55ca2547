// The mjolnir command line: verify | bench | accuracy | calibrate | info. Each command lives in its
// own cmd_*.cc; this file wires them into CLI11 and turns every error into one line and exit
// status 2.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "cmd_accuracy.h"
#include "cmd_bench.h"
#include "cmd_calibrate.h"
#include "cmd_info.h"
#include "cmd_verify.h"
#include "mjolnir/error.h"

namespace {

int fail(const char* message) {
  std::fflush(stdout);
  std::fprintf(stderr, "mjolnir: error: %s\n", message);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mjolnir::tools;
  CLI::App app{"mjolnir: paged decode attention over low-bit KV caches", "mjolnir"};
  app.set_version_flag("--version", MJOLNIR_VERSION_STRING);
  app.require_subcommand(1);

  VerifyOptions verify_options;
  BenchOptions bench_options;
  CalibrateOptions calibrate_options;
  AccuracyOptions accuracy_options;
  CLI::App* verify = add_verify_command(app, verify_options);
  CLI::App* bench = add_bench_command(app, bench_options);
  CLI::App* calibrate = add_calibrate_command(app, calibrate_options);
  CLI::App* accuracy = add_accuracy_command(app, accuracy_options);
  CLI::App* info = add_info_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail((std::string(e.what()) + " (see mjolnir --help)").c_str());
  }

  try {
    if (verify->parsed()) return run_verify(verify_options);
    if (bench->parsed()) return run_bench(bench_options);
    if (calibrate->parsed()) return run_calibrate(calibrate_options);
    if (accuracy->parsed()) return run_accuracy(accuracy_options);
    if (info->parsed()) return run_info();
  } catch (const mjolnir::Error& e) {
    return fail(e.what());
  } catch (const std::exception& e) {
    // Not a validation error: out of memory, a file system failure. Still one line, still 2.
    return fail(e.what());
  }
  return 0;
}

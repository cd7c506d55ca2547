// `mjolnir calibrate`: recorded amax (a calibration run's amax file) -> a versioned scales file.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace mjolnir::tools {

struct CalibrateOptions {
  std::string amax_path;
  std::string out_path;
  std::string format;
  std::string granularity;  // empty: recommended_granularity(format)
  double headroom = 1.0;
};

CLI::App* add_calibrate_command(CLI::App& app, CalibrateOptions& options);
int run_calibrate(const CalibrateOptions& options);

}  // namespace mjolnir::tools

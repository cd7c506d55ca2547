#include "cmd_calibrate.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>

#include "mjolnir/calibrate.h"
#include "mjolnir/format.h"

namespace mjolnir::tools {

CLI::App* add_calibrate_command(CLI::App& app, CalibrateOptions& options) {
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Turn recorded per-(layer, KV head, channel) maxima of |K| and |V| into a scales file "
      "(scale = amax / format max * headroom)");
  cmd->add_option("amax", options.amax_path,
                  "The amax file a calibration run wrote (MJOLNIR_ATTN_KV_CALIBRATE)")
      ->required();
  cmd->add_option("--format", options.format, "The KV cache format the scales are for")->required();
  cmd->add_option("--granularity", options.granularity,
                  "tensor, head or channel (default: the format's recommended one, "
                  "docs/accuracy.md: channel, head for nvfp4)");
  cmd->add_option("--headroom", options.headroom,
                  "Factor on amax, > 0: above 1 keeps values larger than calibration saw from "
                  "saturating (default 1.0)");
  cmd->add_option("--out", options.out_path, "The scales file to write")->required();
  return cmd;
}

int run_calibrate(const CalibrateOptions& options) {
  const Format format = parse_format(options.format, "--format");
  const ScaleGranularity granularity =
      options.granularity.empty() ? recommended_granularity(format)
                                  : parse_granularity(options.granularity, "--granularity");
  const AmaxFile amax = read_amax_file(options.amax_path);
  const ScalesFile scales = scales_from_amax_file(amax, format, granularity, options.headroom);
  write_scales_file(scales, options.out_path);
  float k_min = scales.layers[0].k_scale[0], k_max = k_min;
  for (const ScalesFile::Layer& layer : scales.layers) {
    for (float s : layer.k_scale) k_min = std::min(k_min, s), k_max = std::max(k_max, s);
  }
  std::printf(
      "mjolnir calibrate: %zu layers x %d KV heads x %d channels -> %s scales (%s, "
      "headroom %g), K scales %.3g..%.3g, written to %s\n",
      scales.layers.size(), scales.num_kv_heads, scales.head_dim,
      std::string(to_string(format)).c_str(), std::string(to_string(granularity)).c_str(),
      options.headroom, k_min, k_max, options.out_path.c_str());
  return 0;
}

}  // namespace mjolnir::tools

// `mjolnir info`: version, build options, SIMD targets, CPU, backends: what a bug report needs.
#pragma once

namespace CLI {
class App;
}

namespace mjolnir::tools {

CLI::App* add_info_command(CLI::App& app);
int run_info();

}  // namespace mjolnir::tools

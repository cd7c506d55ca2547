#include "cpu/kernel_config.h"

#include <cstdlib>
#include <optional>
#include <string_view>

#include "cpu/amx.h"
#include "cpu/attention_kernel.h"
#include "cpu/cpu_vendor.h"
#include "cpu/subnormals.h"
#include "mjolnir/error.h"

namespace mjolnir {
namespace {

// 0 or 1 from the variable `name`; nullopt when it is unset or empty.
std::optional<bool> environment_switch(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  const std::string_view text(value);
  MJOLNIR_REQUIRE(text == "0" || text == "1", name, ": '", text, "' is neither 0 nor 1");
  return text == "1";
}

}  // namespace

CpuKernelOptions cpu_kernel_options_from_environment() {
  CpuKernelOptions options;
  options.bf16_dot = environment_switch("MJOLNIR_CPU_BF16_DOT").value_or(true);
  options.amx = environment_switch("MJOLNIR_CPU_AMX").value_or(true);
  options.avoid_fp32_subnormals = environment_switch("MJOLNIR_CPU_AVOID_SUBNORMALS");
  options.bf16_dot_values = environment_switch("MJOLNIR_CPU_BF16_DOT_VALUES");
  options.fma_pair_scores = environment_switch("MJOLNIR_CPU_FMA_PAIR_SCORES");
  return options;
}

namespace cpu {

bool bf16_dot_at_fma_rate() { return cpu_vendor() == CpuVendor::amd; }

KernelConfig resolve_kernel_config(const CpuKernelOptions& options) {
  KernelConfig config;
  config.bf16_dot = options.bf16_dot && cpu_has_bf16_dot();
  config.amx = options.amx && config.bf16_dot && cpu_has_amx();
  config.bf16_dot_below_tiles = config.bf16_dot && !config.amx;
  config.avoid_fp32_subnormals = options.avoid_fp32_subnormals.value_or(fp32_subnormals_are_slow());
  config.bf16_dot_values =
      config.bf16_dot && !config.amx && options.bf16_dot_values.value_or(bf16_dot_at_fma_rate());
  config.fma_pair_scores =
      config.bf16_dot && !config.amx && options.fma_pair_scores.value_or(!bf16_dot_at_fma_rate());
  return config;
}

}  // namespace cpu
}  // namespace mjolnir

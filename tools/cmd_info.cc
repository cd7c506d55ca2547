#include "cmd_info.h"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/huge_pages.h"
#include "bench/read_bandwidth.h"
#include "core/gpu_devices.h"
#include "cpu/amx.h"
#include "cpu/attention_kernel.h"
#include "cpu/kernel_config.h"
#include "cpu/subnormals.h"
#include "machine_info.h"
#include "mjolnir/decode.h"

namespace mjolnir::tools {

namespace {

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string text;
  for (const std::string& item : items) {
    if (!text.empty()) text += separator;
    text += item;
  }
  return text;
}

}  // namespace

CLI::App* add_info_command(CLI::App& app) {
  return app.add_subcommand("info", "Print the version, build options, CPU and backends");
}

int run_info() {
  std::printf("mjolnir %s\n", MJOLNIR_VERSION_STRING);
  std::printf("build: %s, compiler %s, sanitizers %s, CUDA %s\n", MJOLNIR_BUILD_TYPE, __VERSION__,
              MJOLNIR_SANITIZE ? "address+undefined"
              : MJOLNIR_TSAN   ? "thread"
                               : "off",
              MJOLNIR_HAS_CUDA ? "on (MJOLNIR_CUDA)" : "off");
  std::printf("SIMD targets: compiled %s; dispatched here: %s\n",
              join(cpu::compiled_simd_targets(), " ").c_str(),
              cpu::dispatched_simd_target().c_str());
  std::printf("CPU: %s, %d hardware threads, last-level cache %s\n", cpu_model_name().c_str(),
              hardware_threads(), format_bytes(cpu::last_level_cache_bytes()).c_str());
  // The kernel variants the cpu backend takes here: this CPU's, less what the environment turns
  // off (cpu_kernel_options_from_environment).
  const cpu::KernelConfig kernels =
      cpu::resolve_kernel_config(cpu_kernel_options_from_environment());
  std::printf(
      "bf16 dot products (Q . K with Q in bf16 or fp8; P . V with P in bf16 without AMX): %s\n",
      !cpu::cpu_has_bf16_dot() ? "no (the dispatched target or the CPU lacks AVX512_BF16)"
      : !kernels.bf16_dot      ? "off (MJOLNIR_CPU_BF16_DOT=0)"
      : kernels.bf16_dot_below_tiles
          ? "yes"
          : "on the AMX tiles (below their 8 rows Q . K runs on fp32 FMAs, faster on these cores)");
  if (kernels.bf16_dot && !kernels.amx) {
    const bool at_fma_rate = cpu::bf16_dot_at_fma_rate();
    std::printf("P in bf16 from 16 query rows by default, P . V on the dot products: %s\n",
                kernels.bf16_dot_values == at_fma_rate
                    ? (at_fma_rate ? "yes (a vdpbf16ps issues at an FMA's rate on these cores)"
                                   : "no (a vdpbf16ps costs about four FMAs on these cores)")
                    : (kernels.bf16_dot_values ? "yes (MJOLNIR_CPU_BF16_DOT_VALUES=1)"
                                               : "no (MJOLNIR_CPU_BF16_DOT_VALUES=0)"));
    std::printf("Q . K of 16 query rows and more on fp32 FMAs, not the dot products: %s\n",
                kernels.fma_pair_scores != at_fma_rate
                    ? (at_fma_rate ? "no (a vdpbf16ps issues at an FMA's rate on these cores)"
                                   : "yes (a vdpbf16ps costs about four FMAs on these cores)")
                    : (kernels.fma_pair_scores ? "yes (MJOLNIR_CPU_FMA_PAIR_SCORES=1)"
                                               : "no (MJOLNIR_CPU_FMA_PAIR_SCORES=0)"));
  }
  std::printf(
      "AMX tiles (Q . K from 8 query rows, where the dot products apply; P . V with P in bf16): "
      "%s\n",
      !cpu::cpu_has_amx() || !cpu::cpu_has_bf16_dot()
          ? "no (the CPU lacks AMX-BF16, or Linux did not grant the tile state)"
      : kernels.amx ? "yes"
                    : "off (MJOLNIR_CPU_AMX=0 or MJOLNIR_CPU_BF16_DOT=0)");
  std::printf("fp32 subnormal FMAs: %s; decoders that avoid them: %s\n",
              cpu::fp32_subnormals_are_slow() ? "slow (Intel)" : "full speed",
              kernels.avoid_fp32_subnormals == cpu::fp32_subnormals_are_slow()
                  ? (kernels.avoid_fp32_subnormals ? "yes" : "no")
                  : (kernels.avoid_fp32_subnormals ? "yes (MJOLNIR_CPU_AVOID_SUBNORMALS=1)"
                                                   : "no (MJOLNIR_CPU_AVOID_SUBNORMALS=0)"));
  std::printf("transparent huge pages: %s\n", cpu::transparent_huge_pages_mode().c_str());

  std::printf("backends:");
  for (const std::string& name : compiled_backends()) {
    const std::string reason = make_backend(name)->unavailable_reason();
    std::printf(" %s%s%s%s", name.c_str(), reason.empty() ? "" : " (unavailable: ", reason.c_str(),
                reason.empty() ? "" : ")");
  }
  std::printf("\n");
  std::string why_none;
  const std::vector<GpuDevice> gpus = cuda_devices(&why_none);
  if (gpus.empty()) std::printf("GPUs: 0 (%s)\n", why_none.c_str());
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    const GpuDevice& gpu = gpus[i];
    std::printf("GPU %zu: %s, sm_%d%d, %d SMs, %.1f GiB\n", i, gpu.name.c_str(), gpu.sm_major,
                gpu.sm_minor, gpu.multiprocessors, gpu.memory_gib);
  }
  return 0;
}

}  // namespace mjolnir::tools

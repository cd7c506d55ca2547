// The CLI's machine description: the AMD Zen or Intel Xeon generation it adds to the CPU's name
// (the bench's results files are named after it).
#include <gtest/gtest.h>

#include "machine_info.h"

namespace mjolnir::tools {
namespace {

// Family and model pairs of released parts (the vendors' revision guides; /proc/cpuinfo shows them
// in decimal).
TEST(MachineInfo, AmdZenGeneration) {
  EXPECT_EQ(amd_zen_generation(0x17, 0x01), "Zen");    // Naples
  EXPECT_EQ(amd_zen_generation(0x17, 0x31), "Zen 2");  // Rome
  EXPECT_EQ(amd_zen_generation(0x17, 0x71), "Zen 2");  // Matisse
  EXPECT_EQ(amd_zen_generation(0x19, 0x01), "Zen 3");  // Milan
  EXPECT_EQ(amd_zen_generation(0x19, 0x21), "Zen 3");  // Vermeer
  EXPECT_EQ(amd_zen_generation(0x19, 0x11), "Zen 4");  // Genoa
  EXPECT_EQ(amd_zen_generation(0x19, 0x61), "Zen 4");  // Raphael
  EXPECT_EQ(amd_zen_generation(0x19, 0xA0), "Zen 4");  // Bergamo
  EXPECT_EQ(amd_zen_generation(0x1A, 0x02), "Zen 5");  // Turin
  EXPECT_EQ(amd_zen_generation(0x15, 0x02), "");       // Piledriver: before Zen
}

TEST(MachineInfo, IntelXeonGenerations) {
  EXPECT_EQ(intel_xeon_generation(6, 0x55), "Skylake-SP");  // and Cascade Lake
  EXPECT_EQ(intel_xeon_generation(6, 0x6A), "Ice Lake");
  EXPECT_EQ(intel_xeon_generation(6, 143), "Sapphire Rapids");
  EXPECT_EQ(intel_xeon_generation(6, 207), "Emerald Rapids");
  EXPECT_EQ(intel_xeon_generation(6, 0xAD), "Granite Rapids");
  EXPECT_EQ(intel_xeon_generation(6, 0x9E), "");   // a desktop Coffee Lake: not a Xeon here
  EXPECT_EQ(intel_xeon_generation(15, 0x06), "");  // NetBurst
}

TEST(MachineInfo, CpuModelNameIsNeverEmpty) {
  const std::string name = cpu_model_name();
  EXPECT_FALSE(name.empty());
  EXPECT_EQ(name.find('\n'), std::string::npos);
}

}  // namespace
}  // namespace mjolnir::tools

// The CLI's machine description: the AMD Zen generation it adds to the CPU's name (the bench's
// results files are named after it).
#include <gtest/gtest.h>

#include "machine_info.h"

namespace mjolnir::tools {
namespace {

// Family and model pairs of released parts (AMD's revision guides; /proc/cpuinfo shows them in
// decimal).
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

TEST(MachineInfo, CpuModelNameIsNeverEmpty) {
  const std::string name = cpu_model_name();
  EXPECT_FALSE(name.empty());
  EXPECT_EQ(name.find('\n'), std::string::npos);
}

}  // namespace
}  // namespace mjolnir::tools

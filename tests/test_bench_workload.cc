// The bench's rotating copies of a KV cache (tools/bench_workload.h): enough copies to outgrow
// the last-level cache, each a page-aligned byte copy of the problem's pool, back to back, and
// never more than the memory limit allows. Short contexts once took one 2 MiB huge page per copy
// of a 32 KiB cache, 80 GiB for `mjolnir bench --context 16`, and were killed for memory.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "bench_report.h"
#include "bench_series.h"
#include "bench_workload.h"
#include "test_seed.h"

namespace mjolnir::tools {
namespace {

using testing::test_seed;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = kKiB * kKiB;

verify::ProblemSpec SmallSpec(Format format, int head_dim) {
  verify::ProblemSpec spec;
  spec.format = format;
  spec.head_dim = head_dim;
  spec.seq_lens = {16};  // one page
  spec.seed = test_seed();
  return spec;
}

// Every copy holds the problem's bytes, starts on a page of its own, and follows the one before
// at the pool's size rounded up to a page.
void ExpectBackToBackCopies(const RotatingCaches& caches) {
  const KvCacheView original = caches.problem().cache();
  const std::size_t pool = caches.pool_bytes();
  const std::size_t stride = (pool + 4 * kKiB - 1) / (4 * kKiB) * (4 * kKiB);
  for (int i = 0; i < caches.copies(); ++i) {
    const std::byte* data = caches.args(i).cache.data;
    ASSERT_EQ(reinterpret_cast<std::uintptr_t>(data) % (4 * kKiB), 0u) << "copy " << i;
    ASSERT_EQ(data, caches.args(0).cache.data + std::size_t(i) * stride) << "copy " << i;
    ASSERT_EQ(std::memcmp(data, original.data, pool), 0) << "copy " << i;
  }
}

TEST(RotatingCaches, SmallCachesFillTheWorkingSetBackToBack) {
  // fp8, 16 tokens of 8 heads x 128 channels: a 32 KiB pool, a multiple of the page.
  const RotatingCaches caches(SmallSpec(Format::fp8_e4m3, 128), 4 * kMiB, 64 * kMiB);
  ASSERT_EQ(caches.pool_bytes(), 32 * kKiB);
  EXPECT_EQ(caches.copies(), 128);
  EXPECT_EQ(caches.working_set_bytes(), 4 * kMiB);
  ExpectBackToBackCopies(caches);
}

TEST(RotatingCaches, PoolsThatAreNotWholePagesStartOnPages) {
  // fp6, D 32: 24-byte rows, a 6 KiB pool, so each copy takes 8 KiB.
  const RotatingCaches caches(SmallSpec(Format::fp6_e2m3, 32), 1 * kMiB, 64 * kMiB);
  ASSERT_EQ(caches.pool_bytes(), 6 * kKiB);
  EXPECT_EQ(caches.copies(), 171);  // 1 MiB / 6 KiB, rounded up: the bytes a rotation reads
  EXPECT_GE(caches.working_set_bytes(), 1 * kMiB);
  ExpectBackToBackCopies(caches);
}

TEST(RotatingCaches, TheMemoryLimitCapsTheCopies) {
  const RotatingCaches caches(SmallSpec(Format::fp8_e4m3, 128), 64 * kMiB, 1 * kMiB);
  EXPECT_EQ(caches.copies(), 32);  // 1 MiB / 32 KiB, not the 2048 the working set asks for
  ExpectBackToBackCopies(caches);
  // Below one copy's size the limit still leaves the one copy a step needs.
  const RotatingCaches one(SmallSpec(Format::fp8_e4m3, 128), 64 * kMiB, 1 * kKiB);
  EXPECT_EQ(one.copies(), 1);
  ExpectBackToBackCopies(one);
}

// A sweep's results file never replaces an earlier one of the same name (same day, machine and
// modes): the next free -2, -3, ... is taken. (A second sweep once overwrote the first's file.)
TEST(SweepResultsPath, TakesTheNextFreeNumber) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("mjolnir-results-" + std::to_string(test_seed()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string first =
      sweep_results_path(dir.string(), "cpu", "2026-12-07", "AMD EPYC (Zen 3) 2t", "auto", "auto");
  EXPECT_EQ(first, (dir / "cpu-sweep-2026-12-07-amd-epyc-zen-3-2t-auto.json").string());
  EXPECT_EQ(unused_results_path(first), first);
  std::ofstream(first) << "{}";
  const std::string second = unused_results_path(first);
  EXPECT_EQ(second, (dir / "cpu-sweep-2026-12-07-amd-epyc-zen-3-2t-auto-2.json").string());
  std::ofstream(second) << "{}";
  EXPECT_EQ(unused_results_path(first),
            (dir / "cpu-sweep-2026-12-07-amd-epyc-zen-3-2t-auto-3.json").string());
  std::filesystem::remove_all(dir);
}

// The workload line says which mode each format ran in when "auto" picked different ones.
TEST(WorkloadModes, NameWhatAutoPickedForWhichFormat) {
  const auto spec = [](Format format, QMode q, PMode p) {
    verify::ProblemSpec s;
    s.format = format;
    s.params.q_mode = q;
    s.params.p_mode = p;
    return s;
  };
  const std::vector<verify::ProblemSpec> specs = {spec(Format::bf16, QMode::bf16, PMode::bf16),
                                                  spec(Format::fp4_e2m1, QMode::int8, PMode::bf16),
                                                  spec(Format::fp8_e4m3, QMode::bf16, PMode::bf16),
                                                  spec(Format::nvfp4, QMode::int8, PMode::fp32),
                                                  spec(Format::fp6_e3m2, QMode::bf16, PMode::bf16)};
  EXPECT_EQ(describe_modes("auto", specs, &DecodeParams::q_mode),
            "auto (int8 for fp4_e2m1, nvfp4; bf16 for the rest)");
  EXPECT_EQ(describe_modes("auto", specs, &DecodeParams::p_mode),
            "auto (fp32 for nvfp4; bf16 for the rest)");
  EXPECT_EQ(describe_modes("auto", {specs[0], specs[2]}, &DecodeParams::q_mode), "auto: bf16");
  EXPECT_EQ(describe_modes("fp32", specs, &DecodeParams::p_mode), "fp32");
  EXPECT_EQ(describe_modes("auto", {}, &DecodeParams::p_mode), "auto");
}

}  // namespace
}  // namespace mjolnir::tools

// The CUDA kernels' code run on the CPU (label "cpu", no GPU needed): the decode and merge
// kernels of src/cuda/decode_kernel.cuh, with the launch configuration of decode_config.h and
// the step buffer of step_layout.h, through verify::run_case against the emulator and the exact
// references; and the write_kv kernels against the host write_kv, byte for byte. One CPU thread
// per CUDA thread (src/cuda/cpu_emulation.h). This checks the kernels' indexing, masking, tiling,
// row passes, splits and merge, and every format's codec on every build; what only a GPU shows
// (races the barriers do not order, cp.async, the device's libm, resource limits) is left to the
// "gpu" tests. MJOLNIR_CUDA_EMULATION_ALL=1 runs the whole quick matrix instead of a sample.
#define MJOLNIR_CUDA_EMULATION 1

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "cuda/decode_config.h"
#include "cuda/decode_kernel.cuh"
#include "cuda/decode_mma_kernel.cuh"
#include "cuda/format_dispatch.h"
#include "cuda/step_layout.h"
#include "cuda/write_kv_kernel.cuh"
#include "mjolnir/write_kv.h"
#include "non_finite_cases.h"
#include "test_seed.h"
#include "verify/case_matrix.h"

namespace mjolnir::cuda {
namespace {

// Shared memory per CTA on an H100 / H200 (opt-in), and their compute capability.
constexpr std::size_t kHopperSmem = 227 * 1024;
constexpr int kHopper = 90;

emulation::CtaRunner& runner() {
  static emulation::CtaRunner pool(kDecodeThreads);
  return pool;
}

// The kernels behind the Backend interface, on host memory: the step buffer packed as
// DecodeStep::upload packs it, the configuration make_decode_config() picks for a device with
// `smem_limit` bytes per CTA, and a fixed grid of the plan's capacity as a captured graph runs,
// or (`eager`) the grids sized to the plan that an eager call launches (enqueue_planned_decode:
// Backend::run and the PyTorch ops).
class EmulatedKernels final : public Backend {
 public:
  explicit EmulatedKernels(std::size_t smem_limit, int score_tokens = 0,
                           MmaLayout layout_limit = MmaLayout::tokens_on_m, bool eager = false)
      : smem_limit_(smem_limit),
        score_tokens_(score_tokens),
        layout_limit_(layout_limit),
        eager_(eager) {}
  std::string_view name() const override { return "cuda-emulated"; }
  std::string unsupported_reason(const CacheGeometry&, const DecodeParams& params) const override {
    // As the CUDA backend (cuda::unsupported_reason): its kernels run decode steps only, and not
    // P mode fp16.
    if (params.p_mode == PMode::fp16) return "P mode fp16 is not implemented on CUDA";
    return params.q_len == 0 ? "ragged steps are not implemented on CUDA yet" : "";
  }
  int workers() const override { return 8; }
  void run(const DecodeArgs& args, const BackendPlan& planned,
           std::span<std::byte> workspace) const override {
    validate(args);
    const Plan& plan = planned.plan();
    const CacheGeometry& geo = args.cache.geometry;
    std::size_t pages = 0;
    for (int len : args.batch.seq_lens) pages += std::size_t(used_pages(len, geo.page_size));
    std::vector<std::byte> step(
        step_regions(plan.items.size(), std::size_t(plan.num_seqs), pages).end);
    pack_step(args.batch, plan, geo.page_size, step.data());
    LaunchShape shape = planned_launch_shape(plan, args.params.num_q_heads);
    if (!eager_) {  // the capacity's grids; the rest as the plan's
      shape.decode_ctas = static_cast<int>(plan.items.size());
      shape.merge_ctas = plan.capacity.max_seqs * plan.q_len * args.params.num_q_heads;
    }
    shape.score_tokens = std::max(shape.score_tokens, score_tokens_);
    const DecodeConfig config =
        make_decode_config(args, args.cache.k_scale.data(), args.cache.v_scale.data(), step.data(),
                           workspace, shape, smem_limit_, kHopper, layout_limit_);
    EXPECT_LE(config.smem_bytes, kEmulatedSharedMemoryBytes);
    last_pass_rows = config.params.pass_rows;
    last_body = config.body;
    last_layout = static_cast<MmaLayout>(config.params.mma_layout);
    for (int b = 0; b < shape.decode_ctas; ++b) {
      if (config.body == DecodeBody::tensor_core) {
        with_mma_shape(geo.format, geo.head_dim, [&]<Format kFormat, int kHeadDim>() {
          runner().run(kMmaThreads, unsigned(b),
                       [&] { decode_mma_kernel<kFormat, kHeadDim>(config.params); });
        });
        continue;
      }
      with_format(geo.format, [&]<Format kFormat>() {
        runner().run(kDecodeThreads, unsigned(b), [&] { decode_kernel<kFormat>(config.params); });
      });
    }
    for (int b = 0; b < shape.merge_ctas; ++b) {
      runner().run(kMergeThreads, unsigned(b), [&] { merge_kernel(config.params); });
    }
  }
  mutable int last_pass_rows = 0;
  mutable DecodeBody last_body = DecodeBody::exact_order;
  mutable MmaLayout last_layout = MmaLayout::plain;

 private:
  std::size_t smem_limit_;
  int score_tokens_;
  MmaLayout layout_limit_;
  bool eager_;
};

struct Tally {
  int cases = 0, bit_exact = 0, multi_pass = 0, tensor_core = 0;
  int layouts[3] = {};  // tensor-core cases per MmaLayout
  double worst = 0;
};

Tally run_all(const std::vector<verify::Case>& cases, const EmulatedKernels& backend) {
  Tally tally;
  for (const verify::Case& c : cases) {
    if (c.spec.params.p_mode == PMode::fp16) continue;  // unsupported on CUDA
    const verify::CaseResult r = verify::run_case(c, backend);
    EXPECT_EQ(r.status, verify::CaseResult::Status::passed) << c.name() << ": " << r.message;
    ++tally.cases;
    if (r.error_vs_emulator == 0) ++tally.bit_exact;
    tally.worst = std::max(tally.worst, r.error_vs_emulator);
    if (backend.last_pass_rows < c.spec.group * c.spec.params.q_len) ++tally.multi_pass;
    if (backend.last_body == DecodeBody::tensor_core) {
      ++tally.tensor_core;
      ++tally.layouts[int(backend.last_layout)];
    }
  }
  std::cout << "[ emulated ] " << tally.cases << " cases, " << tally.bit_exact
            << " bit-identical to the emulator, worst rel L2 " << tally.worst << ", "
            << tally.multi_pass << " in several row passes, " << tally.tensor_core
            << " on the tensor-core body (plain " << tally.layouts[0] << ", stacked "
            << tally.layouts[1] << ", tokens on M " << tally.layouts[2] << ")" << std::endl;
  return tally;
}

bool all_cases() {
  const char* env = std::getenv("MJOLNIR_CUDA_EMULATION_ALL");
  return env != nullptr && env[0] == '1';
}

TEST(CudaEmulated, DecodeMatchesTheEmulatorOnTheQuickMatrix) {
  std::vector<verify::Case> matrix;
  for (const verify::Case& c : verify::case_matrix(true, testing::test_seed())) {
    if (c.spec.params.q_len > 0) matrix.push_back(c);  // the CUDA kernels run decode steps only
  }
  std::vector<verify::Case> cases;
  // A sample that still covers every format (the matrix holds 12 consecutive cases per format).
  for (std::size_t i = 0; i < matrix.size(); i += all_cases() ? 1 : 5) cases.push_back(matrix[i]);
  run_all(cases, EmulatedKernels(kHopperSmem));
}

// The grids an eager call launches (planned_launch_shape: the plan's items, one merge CTA per
// query row of its sequences) on a sample of the quick matrix, with splits: no work item or
// merged row is left out, as a captured graph's larger grids would hide.
TEST(CudaEmulated, PlannedGridsMatchTheEmulator) {
  std::vector<verify::Case> cases;
  int at = 0;
  for (const verify::Case& c : verify::case_matrix(true, testing::test_seed())) {
    if (c.spec.params.q_len > 0 && at++ % (all_cases() ? 1 : 5) == 0) cases.push_back(c);
  }
  const Tally tally =
      run_all(cases, EmulatedKernels(kHopperSmem, 0, MmaLayout::tokens_on_m, /*eager=*/true));
  EXPECT_GT(tally.cases, 10);
}

verify::Case odd_case(Format format, Layout layout, int page, int d, int g, int q_len, bool causal,
                      int splits, int tile, QMode q_mode, PMode p_mode,
                      ScaleGranularity granularity, std::vector<std::int32_t> lens,
                      std::uint64_t seed) {
  verify::Case c;
  verify::ProblemSpec& s = c.spec;
  s.format = format;
  s.layout = layout;
  s.page_size = page;
  s.head_dim = d;
  s.group = g;
  s.num_kv_heads = 2;
  s.params.q_len = q_len;
  s.params.causal = causal;
  s.params.q_mode = q_mode;
  s.params.p_mode = p_mode;
  s.granularity = granularity;
  s.seq_lens = std::move(lens);
  s.seed = seed;
  s.extra_pages = 1;
  c.splits = splits;
  c.tile_tokens = tile;
  return c;
}

// Shapes outside the matrix: D 32, 96, 160, 224; pages 8 and 256; groups 3, 5, 16; q_len 8;
// tiles 7 and 48; rows (nvfp4 D 96, 54 bytes) that only allow byte copies; shared memory sized
// for a larger tile than the plan's.
TEST(CudaEmulated, OddShapes) {
  std::uint64_t seed = testing::test_seed();
  std::vector<verify::Case> cases;
  int i = 0;
  for (Format f : kAllFormats) {
    switch (i++ % 4) {
      case 0:
        cases.push_back(odd_case(f, Layout::BHN2D, 8, 96, 3, 3, true, 2, 16, QMode::fp8,
                                 PMode::bf16, ScaleGranularity::channel, {70, 3, 0}, seed++));
        break;
      case 1:
        cases.push_back(odd_case(f, Layout::_2BHND, 256, 32, 16, 8, false, 3, 64, QMode::bf16,
                                 PMode::fp8, ScaleGranularity::head, {290, 9, 60}, seed++));
        break;
      case 2:
        cases.push_back(odd_case(f, Layout::B2HND, 32, 160, 1, 1, true, 1, 48, QMode::fp32,
                                 PMode::fp32, ScaleGranularity::tensor, {1, 33, 97}, seed++));
        break;
      default:
        cases.push_back(odd_case(f, Layout::BNH2D, 16, 224, 5, 2, true, 4, 7, QMode::fp8,
                                 PMode::fp8, ScaleGranularity::channel, {129, 2, 0, 45}, seed++));
        break;
    }
  }
  cases.push_back(odd_case(Format::nvfp4, Layout::B2NHD, 16, 96, 2, 2, true, 2, 32, QMode::fp32,
                           PMode::bf16, ScaleGranularity::head, {77, 20}, seed++));
  cases.push_back(odd_case(Format::fp6_e3m2, Layout::BNH2D, 16, 96, 3, 2, true, 2, 16, QMode::int8,
                           PMode::bf16, ScaleGranularity::channel, {70, 5}, seed++));
  run_all(cases, EmulatedKernels(kHopperSmem, 128));
}

// P mode fp8 takes its codes from the emulator's scores, so the exact-order body must compute
// those scores bit for bit: the same sum order, fused where the emulator's host fuses
// (core/fused_dot.h: aarch64 does, x86-64 does not). Scores fused on one side only round some
// P codes the other way, which moved O by 1.2e-7 to 3e-7 in every case here under qemu; with
// the same scores O differs from the emulator's by the order of a few fp32 sums (the merge of
// splits, the row passes), 3e-8 at most, below one fp32 unit (2^-24). Q in fp32, whose products
// are not exact in fp32, over long dot products (D 128, 256). Outside the suite CudaEmulated.*
// so that the Arm check (scripts/arm-check.sh) runs it under qemu, where the emulator fuses.
TEST(CudaEmulatedContract, ExactOrderScoresAreTheEmulators) {
  std::uint64_t seed = testing::test_seed() + 23;
  std::vector<verify::Case> cases;
  const Format formats[] = {Format::fp8_e4m3, Format::fp6_e3m2, Format::nvfp4, Format::bf16};
  int i = 0;
  for (const Format f : formats) {
    for (const int d : {128, 256}) {
      cases.push_back(odd_case(f, i % 2 ? Layout::_2BHND : Layout::BHN2D, 32, d, 4 + 4 * (i % 2),
                               1 + i % 4, true, 1 + i % 3, 32, QMode::fp32, PMode::fp8,
                               i % 3 == 0 ? ScaleGranularity::tensor : ScaleGranularity::head,
                               {180 + 17 * i, 60, 9}, seed++));
      ++i;
    }
  }
  const EmulatedKernels backend(kHopperSmem);
  for (const verify::Case& c : cases) {
    const verify::CaseResult r = verify::run_case(c, backend);
    EXPECT_EQ(r.status, verify::CaseResult::Status::passed) << c.name() << ": " << r.message;
    EXPECT_EQ(backend.last_body, DecodeBody::exact_order) << c.name();
    EXPECT_LE(r.error_vs_emulator, 0x1p-24)
        << c.name() << " (the host fuses its dot products: " << host_fuses_dot_products() << ")";
  }
}

// The tensor-core body (fp32 P): every format (fp8, 16-bit, fp6, fp4, nvfp4), D 64 / 128 / 256,
// 1 to 16 query rows, every Q mode (int8 too), causal and not, splits, partial last steps, layouts
// and scale granularities.
TEST(CudaEmulated, TensorCoreBody) {
  std::uint64_t seed = testing::test_seed() + 11;
  const std::vector<verify::Case> cases = {
      odd_case(Format::fp8_e4m3, Layout::B2NHD, 16, 128, 4, 1, true, 2, 64, QMode::fp32,
               PMode::fp32, ScaleGranularity::tensor, {300, 45, 0, 17}, seed++),
      odd_case(Format::fp8_e5m2, Layout::BHN2D, 8, 64, 8, 2, true, 1, 32, QMode::bf16, PMode::fp32,
               ScaleGranularity::channel, {77, 3}, seed++),
      odd_case(Format::bf16, Layout::_2BHND, 32, 128, 2, 4, false, 3, 16, QMode::fp32, PMode::fp32,
               ScaleGranularity::head, {150, 33}, seed++),
      odd_case(Format::fp16, Layout::BNH2D, 16, 64, 16, 1, true, 1, 64, QMode::fp8, PMode::fp32,
               ScaleGranularity::channel, {90, 0, 129}, seed++),
      odd_case(Format::fp8_e4m3, Layout::B2HND, 16, 256, 5, 3, true, 2, 48, QMode::fp8, PMode::fp32,
               ScaleGranularity::head, {200, 31}, seed++),
      odd_case(Format::bf16, Layout::B2NHD, 64, 64, 1, 1, true, 1, 64, QMode::bf16, PMode::fp32,
               ScaleGranularity::tensor, {1, 65}, seed++),
      odd_case(Format::fp4_e2m1, Layout::BHN2D, 16, 128, 4, 2, true, 2, 64, QMode::fp32,
               PMode::fp32, ScaleGranularity::channel, {140, 9, 0}, seed++),
      odd_case(Format::fp4_e2m1, Layout::B2NHD, 8, 64, 3, 1, false, 1, 32, QMode::fp8, PMode::fp32,
               ScaleGranularity::head, {50, 17}, seed++),
      odd_case(Format::nvfp4, Layout::B2NHD, 16, 128, 4, 1, true, 3, 64, QMode::fp32, PMode::fp32,
               ScaleGranularity::tensor, {200, 33}, seed++),
      odd_case(Format::nvfp4, Layout::_2BHND, 32, 256, 2, 4, true, 1, 48, QMode::bf16, PMode::fp32,
               ScaleGranularity::channel, {100, 5}, seed++),
      odd_case(Format::fp6_e2m3, Layout::B2NHD, 16, 128, 4, 1, true, 2, 64, QMode::fp32,
               PMode::fp32, ScaleGranularity::head, {130, 20}, seed++),
      odd_case(Format::fp6_e3m2, Layout::BHN2D, 16, 256, 8, 2, false, 1, 32, QMode::fp8,
               PMode::fp32, ScaleGranularity::channel, {75, 0, 16}, seed++),
      odd_case(Format::fp6_e3m2, Layout::B2NHD, 8, 128, 2, 1, true, 3, 64, QMode::bf16, PMode::fp32,
               ScaleGranularity::tensor, {180}, seed++),
      // Stacked terms (5-8 rows) and tokens on M (1-4 rows) for the 8- and 16-bit formats.
      odd_case(Format::fp8_e5m2, Layout::B2NHD, 16, 128, 8, 1, true, 2, 64, QMode::fp32,
               PMode::fp32, ScaleGranularity::head, {260, 40}, seed++),
      odd_case(Format::fp16, Layout::BHN2D, 32, 128, 2, 3, true, 1, 32, QMode::fp32, PMode::fp32,
               ScaleGranularity::channel, {97, 6}, seed++),
      odd_case(Format::fp8_e4m3, Layout::_2BHND, 8, 64, 1, 1, false, 3, 32, QMode::fp32,
               PMode::fp32, ScaleGranularity::tensor, {333, 1, 0}, seed++),
      odd_case(Format::fp16, Layout::B2HND, 16, 64, 4, 1, true, 2, 48, QMode::bf16, PMode::fp32,
               ScaleGranularity::head, {150, 31}, seed++),
      odd_case(Format::fp8_e4m3, Layout::B2NHD, 16, 128, 2, 2, true, 2, 64, QMode::fp8, PMode::fp32,
               ScaleGranularity::channel, {211, 2}, seed++),
      // int8 Q: integer codes, exact in either operand type.
      odd_case(Format::fp4_e2m1, Layout::B2NHD, 16, 128, 4, 1, true, 2, 64, QMode::int8,
               PMode::fp32, ScaleGranularity::head, {190, 7}, seed++),
      odd_case(Format::nvfp4, Layout::BHN2D, 16, 128, 8, 1, true, 1, 64, QMode::int8, PMode::fp32,
               ScaleGranularity::channel, {120, 40}, seed++),
      odd_case(Format::fp6_e2m3, Layout::_2BHND, 32, 128, 2, 3, false, 3, 32, QMode::int8,
               PMode::fp32, ScaleGranularity::tensor, {99, 3}, seed++),
  };
  const Tally tally = run_all(cases, EmulatedKernels(kHopperSmem));
  EXPECT_EQ(tally.tensor_core, int(cases.size()));
  for (int count : tally.layouts) EXPECT_GE(count, 3);  // every layout, several formats
}

// The packed codes' placement into f16 (mma_fragments.cuh) against core/minifloat's decoding:
// every e2m1 code in each byte of both parities, and every fp6 code at every bit it may sit at.
TEST(CudaEmulated, PackedCodesPlacedIntoF16) {
  std::mt19937 rng(static_cast<std::uint32_t>(testing::test_seed()));
  auto f16 = [](std::uint32_t bits) { return decode_minifloat<kFp16Spec>(bits & 0xFFFFu); };
  for (int i = 0; i < 8; ++i) {  // code i of the word: byte i / 2 of parity i % 2
    for (std::uint32_t code = 0; code < 16; ++code) {
      const std::uint32_t other = rng();  // the other codes
      const std::uint32_t word = (other & ~(0xFu << (4 * i))) | code << (4 * i);
      const std::uint32_t bytes = e2m1_bytes(word, (i & 1) != 0);
      const int byte = i >> 1;
      // Into bytes 1 and 3, as the V operand's permute does (the K operand's are bytes 1 and 3
      // as they are, or shifted there by a byte).
      const std::uint32_t pair =
          e2m1x2_from_bytes(byte_perm(bytes, bytes, byte_pair_selector(byte)));
      SCOPED_TRACE("e2m1 code " + std::to_string(code) + " at " + std::to_string(i));
      EXPECT_EQ(f16(pair), decode_minifloat<kE2M1Spec>(code) * 0x1p-14f);
      EXPECT_EQ(f16(pair >> 16), decode_minifloat<kE2M1Spec>(code) * 0x1p-14f);
    }
  }
  // fp6 codes at every bit a half can hold them at (0 to 10), the other bits random.
  for (int t = 0; t <= 10; ++t) {
    for (std::uint32_t code = 0; code < 64; ++code) {
      const std::uint32_t other = rng() & 0x3Fu;
      const std::uint32_t noise = rng() & ~(0x3Fu << t | 0x3Fu << (16 + t));
      const std::uint32_t halves = code << t | other << (16 + t) | noise;
      const std::uint32_t e2m3 = fp6x2_to_f16x2<Format::fp6_e2m3>(halves, t);
      const std::uint32_t e3m2 = fp6x2_to_f16x2<Format::fp6_e3m2>(halves, t);
      SCOPED_TRACE("fp6 code " + std::to_string(code) + " at bit " + std::to_string(t));
      EXPECT_EQ(f16(e2m3), decode_minifloat<kE2M3Spec>(code) * 0x1p-14f);
      EXPECT_EQ(f16(e2m3 >> 16), decode_minifloat<kE2M3Spec>(other) * 0x1p-14f);
      EXPECT_EQ(f16(e3m2), decode_minifloat<kE3M2Spec>(code) * 0x1p-12f);
      EXPECT_EQ(f16(e3m2 >> 16), decode_minifloat<kE3M2Spec>(other) * 0x1p-12f);
    }
  }
}

// Which body a launch gets (decode_config.h): the tensor-core one only where its conditions
// hold, each refusal for its own reason. Host logic; the pool is never read.
TEST(CudaEmulated, BodyChoice) {
  alignas(16) static std::byte pool[64];
  auto reason = [](Format format, int d, int rows, PMode p_mode, std::size_t misalign = 0,
                   int compute_capability = kHopper) {
    KvCacheView cache;
    cache.geometry = CacheGeometry{format, 4, 16, 8, d};
    cache.strides = layout_strides(cache.geometry, Layout::B2NHD);
    cache.data = pool + misalign;
    DecodeParams params;
    params.p_mode = p_mode;
    return tensor_core_unsupported(cache, params, rows, compute_capability, kHopperSmem);
  };
  for (Format f : kAllFormats) {
    SCOPED_TRACE(std::string(to_string(f)));
    EXPECT_EQ(reason(f, 128, 4, PMode::fp32), "");
    EXPECT_EQ(reason(f, 128, 16, PMode::fp32), "");
    EXPECT_EQ(reason(f, 128, 17, PMode::fp32), "more than 16 query rows (q_len * group)");
    EXPECT_EQ(reason(f, 128, 4, PMode::bf16), "P mode is not fp32");
    EXPECT_EQ(reason(f, 128, 4, PMode::fp8), "P mode is not fp32");
    EXPECT_EQ(reason(f, 96, 4, PMode::fp32), "no tensor-core body for this format and head_dim");
    EXPECT_EQ(reason(f, 128, 4, PMode::fp32, 4), "rows are not aligned enough");
    EXPECT_EQ(reason(f, 128, 4, PMode::fp32, 0, 75), "device older than sm_80");
  }
  EXPECT_EQ(reason(Format::fp6_e2m3, 64, 4, PMode::fp32),
            "no tensor-core body for this format and head_dim");
  EXPECT_EQ(reason(Format::fp8_e4m3, 64, 4, PMode::fp32), "");
  EXPECT_EQ(reason(Format::bf16, 256, 4, PMode::fp32), "16-bit rows of 256 channels");
  EXPECT_EQ(reason(Format::fp8_e4m3, 256, 4, PMode::fp32), "");
  EXPECT_EQ(reason(Format::nvfp4, 128, 4, PMode::fp32, 8), "");  // 72-byte rows: 8 is enough
  EXPECT_EQ(reason(Format::fp8_e4m3, 128, 4, PMode::fp32, 8), "rows are not aligned enough");
}

// The same cases of up to 4 query rows under each layout limit (CudaKernelOptions): each
// layout on its own matches the emulator, so a layout that fails on a device can be told apart.
TEST(CudaEmulated, EveryLayoutOnTheSameCases) {
  std::uint64_t seed = testing::test_seed() + 13;
  const std::vector<verify::Case> cases = {
      odd_case(Format::fp8_e4m3, Layout::B2NHD, 16, 128, 4, 1, true, 2, 64, QMode::fp32,
               PMode::fp32, ScaleGranularity::head, {190, 21}, seed++),
      odd_case(Format::fp16, Layout::BNH2D, 8, 64, 2, 2, false, 1, 32, QMode::fp32, PMode::fp32,
               ScaleGranularity::channel, {70, 3}, seed++),
      odd_case(Format::fp6_e2m3, Layout::B2HND, 16, 256, 3, 1, true, 2, 48, QMode::bf16,
               PMode::fp32, ScaleGranularity::tensor, {120, 0, 9}, seed++),
      odd_case(Format::nvfp4, Layout::_2BNHD, 32, 128, 1, 4, true, 3, 64, QMode::fp8, PMode::fp32,
               ScaleGranularity::channel, {230, 17}, seed++),
  };
  for (const MmaLayout limit : {MmaLayout::plain, MmaLayout::stacked, MmaLayout::tokens_on_m}) {
    SCOPED_TRACE("layout limit " + std::to_string(int(limit)));
    const Tally tally = run_all(cases, EmulatedKernels(kHopperSmem, 0, limit));
    EXPECT_EQ(tally.layouts[int(limit)], int(cases.size()));
  }
}

// Which layout the tensor-core body takes: f16 operands with at most 8 (stacked) or 4 (tokens on
// M) rows, never beyond the limit.
TEST(CudaEmulated, LayoutChoice) {
  using enum MmaLayout;
  for (Format f : kAllFormats) {
    SCOPED_TRACE(std::string(to_string(f)));
    const bool f16 = f != Format::bf16;
    EXPECT_EQ(mma_layout(f, 1), f16 ? tokens_on_m : plain);
    EXPECT_EQ(mma_layout(f, 4), f16 ? tokens_on_m : plain);
    EXPECT_EQ(mma_layout(f, 5), f16 ? stacked : plain);
    EXPECT_EQ(mma_layout(f, 8), f16 ? stacked : plain);
    EXPECT_EQ(mma_layout(f, 9), plain);
    EXPECT_EQ(mma_layout(f, 16), plain);
    EXPECT_EQ(mma_layout(f, 4, stacked), f16 ? stacked : plain);
    EXPECT_EQ(mma_layout(f, 4, plain), plain);
    EXPECT_EQ(mma_layout(f, 8, tokens_on_m), f16 ? stacked : plain);
  }
  // The public option names the same limits.
  EXPECT_EQ(mma_layout_limit(CudaKernelOptions{CudaMmaLayout::plain}), plain);
  EXPECT_EQ(mma_layout_limit(CudaKernelOptions{CudaMmaLayout::stacked}), stacked);
  EXPECT_EQ(mma_layout_limit(CudaKernelOptions{}), tokens_on_m);
}

// Sequences cut into many chunks, as a GPU plan cuts them at batch 1 (about a hundred per KV
// head): more chunks than merge threads (the strided max and sum), chunk counts that are not a
// multiple of the merge warps, causal rows that cannot see the last chunks, D 64 to 256, both
// bodies.
TEST(CudaEmulated, ManySplits) {
  std::uint64_t seed = testing::test_seed() + 17;
  const std::vector<verify::Case> cases = {
      odd_case(Format::fp8_e4m3, Layout::B2NHD, 16, 128, 4, 1, true, 133, 8, QMode::fp32,
               PMode::fp32, ScaleGranularity::head, {1061, 300}, seed++),
      odd_case(Format::bf16, Layout::BHN2D, 8, 64, 2, 3, true, 13, 16, QMode::bf16, PMode::bf16,
               ScaleGranularity::channel, {213, 40}, seed++),
      odd_case(Format::nvfp4, Layout::_2BHND, 16, 256, 1, 1, false, 70, 8, QMode::fp8, PMode::fp8,
               ScaleGranularity::tensor, {600}, seed++),
  };
  const Tally tally = run_all(cases, EmulatedKernels(kHopperSmem));
  EXPECT_EQ(tally.cases, int(cases.size()));
}

// The non-finite policy (docs/numerics.md) on both bodies and the merge kernel
// (non_finite_cases.h): decode (tokens on M) and 5 query tokens x g 2 = 10 rows (plain), unsplit
// and split. The kernels on CPU threads take about 6 s a configuration, so six are checked: each
// format that has NaN or Inf codes, both bodies, every Q and P mode (three with
// MJOLNIR_TEST_QUICK=1). MJOLNIR_TEST_NON_FINITE_ALL=1 checks all 96 (7 min).
TEST(CudaEmulated, NonFiniteInputsPoisonExactlyTheRowsThatMeetThem) {
  const EmulatedKernels backend(kHopperSmem);
  const char* all = std::getenv("MJOLNIR_TEST_NON_FINITE_ALL");
  std::vector<testing::NonFiniteConfig> configs = testing::non_finite_configs();
  if (all == nullptr || std::string(all) != "1") {
    configs = {{Format::bf16, QMode::fp32, PMode::fp32, 5, 1},
               {Format::fp8_e5m2, QMode::bf16, PMode::fp32, 1, 3},
               {Format::fp8_e4m3, QMode::fp8, PMode::fp8, 5, 3},
               {Format::nvfp4, QMode::int8, PMode::bf16, 1, 1},
               {Format::fp16, QMode::fp8, PMode::fp32, 5, 3},
               {Format::fp6_e2m3, QMode::bf16, PMode::fp8, 1, 3}};
    // The ASan suite: the first three, both bodies still.
    const char* quick = std::getenv("MJOLNIR_TEST_QUICK");
    if (quick != nullptr && std::string(quick) == "1") configs.resize(3);
  }
  int bodies[2] = {};
  for (const auto& config : configs) {
    testing::check_non_finite_policy(backend, config, testing::test_seed() + 29);
    ++bodies[backend.last_body == DecodeBody::tensor_core ? 1 : 0];
  }
  EXPECT_GT(bodies[0], 0);  // both bodies were checked
  EXPECT_GT(bodies[1], 0);
}

// The runner itself: every fiber runs with its own threadIdx, a barrier holds each until all
// have arrived (values written before it are seen after it), shuffles trade within the warp,
// and a barrier some threads never reach is an error instead of a hang.
TEST(CudaEmulated, RunnerBarriersAndShuffles) {
  constexpr int kThreads = 128;
  std::vector<int> before(kThreads, -1), after(kThreads, -1);
  std::vector<float> shuffled(kThreads, -1.0f);
  runner().run(kThreads, 7, [&] {
    const unsigned t = threadIdx.x;
    EXPECT_EQ(blockIdx.x, 7u);
    EXPECT_EQ(blockDim.x, unsigned(kThreads));
    before[t] = int(t);
    __syncthreads();
    // Every thread's write before the barrier, read by another thread after it.
    after[t] = before[(t + 37) % kThreads];
    __syncwarp();
    shuffled[t] = __shfl_xor_sync(0xffffffffu, float(t), 5);
  });
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(after[t], (t + 37) % kThreads) << "thread " << t;
    EXPECT_EQ(shuffled[t], float(t ^ 5)) << "thread " << t;
  }
  try {
    runner().run(64, 3, [] {
      if (threadIdx.x % 2 == 0) __syncthreads();
    });
    ADD_FAILURE() << "a barrier half the threads skip did not fail the run";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("32 threads wait at a barrier"), std::string::npos)
        << e.what();
  }
  // The runner is usable after that.
  int ran = 0;
  runner().run(32, 0, [&] {
    __syncwarp();
    ++ran;
  });
  EXPECT_EQ(ran, 32);
}

// A device with less shared memory: the query rows no longer fit one pass.
TEST(CudaEmulated, SeveralRowPasses) {
  std::uint64_t seed = testing::test_seed() + 7;
  const std::vector<verify::Case> cases = {
      odd_case(Format::bf16, Layout::B2NHD, 16, 256, 8, 4, true, 3, 64, QMode::fp8, PMode::bf16,
               ScaleGranularity::channel, {150, 40, 0}, seed++),
      odd_case(Format::fp6_e2m3, Layout::BHN2D, 32, 128, 16, 2, false, 1, 32, QMode::fp32,
               PMode::fp8, ScaleGranularity::head, {90, 5}, seed++),
  };
  const Tally tally = run_all(cases, EmulatedKernels(72 * 1024));
  EXPECT_EQ(tally.multi_pass, int(cases.size()));
}

// write_kv kernels vs the host write_kv: every format, every granularity, the layouts cycling.
TEST(CudaEmulated, WriteKvMatchesTheHostBitForBit) {
  std::mt19937_64 rng(testing::test_seed());
  int layout_index = 0;
  for (Format format : kAllFormats) {
    for (auto granularity :
         {ScaleGranularity::tensor, ScaleGranularity::head, ScaleGranularity::channel}) {
      const Layout layout = kAllLayouts[layout_index++ % std::size(kAllLayouts)];
      SCOPED_TRACE(std::string(to_string(format)) + "/" + std::string(to_string(layout)) + "/" +
                   std::string(to_string(granularity)));
      const CacheGeometry geo{format, 5, 8, 2, 64};
      std::uniform_real_distribution<float> scale(0.25f, 2.0f);
      std::vector<float> k_scale, v_scale;
      for (std::size_t i = 0; i < scale_count(granularity, 2, 64); ++i) {
        k_scale.push_back(scale(rng));
        v_scale.push_back(scale(rng));
      }
      const std::vector<std::int64_t> slots{0, 7, -1, 8, 21, 39, 30, -5, 15, 16, -1, 33};
      const std::int64_t head_stride = 67, token_stride = 2 * head_stride + 5;
      std::vector<float> k(slots.size() * token_stride), v(k.size());
      std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
      std::uniform_int_distribution<int> exponent(-20, 12), special(0, 15);
      for (std::vector<float>* values : {&k, &v}) {
        for (float& x : *values) {
          x = std::ldexp(mantissa(rng), exponent(rng));
          if (rng() & 1) x = -x;
          const int s = special(rng);
          if (s == 0) x = 0.0f;
          if (s == 1) x = -0.0f;
          if (s == 2) x = 1e30f;  // saturates
        }
      }
      for (int c = 16; c < 32; ++c) k[token_stride + c] = 0.0f;  // an all-zero nvfp4 block

      KvCacheView view;
      view.geometry = geo;
      view.strides = layout_strides(geo, layout);
      view.bytes = pool_bytes(geo);
      view.granularity = granularity;
      view.k_scale = k_scale;
      view.v_scale = v_scale;
      std::vector<std::byte> host(view.bytes, std::byte{0xA5}), device(view.bytes, std::byte{0xA5});
      view.data = host.data();
      write_kv(view, TokenRows{k.data(), token_stride, head_stride},
               TokenRows{v.data(), token_stride, head_stride}, slots);

      write_detail::WriteParams p;
      p.pool = reinterpret_cast<std::uint8_t*>(device.data());
      p.page_stride = view.strides.page;
      p.head_stride = view.strides.head;
      p.token_stride = view.strides.token;
      p.kv_stride = view.strides.kv;
      p.num_slots = 40;
      p.page_size = 8;
      p.head_dim = 64;
      p.num_kv_heads = 2;
      p.granularity = static_cast<int>(granularity);
      p.k = k.data();
      p.k_token_stride = token_stride;
      p.k_head_stride = head_stride;
      p.v = v.data();
      p.v_token_stride = token_stride;
      p.v_head_stride = head_stride;
      p.k_scale = k_scale.data();
      p.v_scale = v_scale.data();
      p.slots = slots.data();
      unsigned long long status = write_detail::kNoError;
      p.status = &status;
      for (unsigned t = 0; t < slots.size(); ++t) {
        runner().run(write_detail::kWriteThreads, t, [&] { write_detail::check_kernel(p); });
      }
      ASSERT_EQ(status, write_detail::kNoError);
      with_format(format, [&]<Format kFormat>() {
        for (unsigned t = 0; t < slots.size(); ++t) {
          runner().run(write_detail::kWriteThreads, t,
                       [&] { write_detail::write_kernel<kFormat>(p); });
        }
      });
      for (std::size_t i = 0; i < host.size(); ++i) {
        ASSERT_EQ(int(device[i]), int(host[i])) << "pool byte " << i;
      }
    }
  }
}

}  // namespace
}  // namespace mjolnir::cuda

// Soak test of the C API (docs/testing.md, "Soak"): what a serving engine does for weeks, in
// minutes. A rotation of random configurations (format, layout, scales, heads, page size, modes,
// backend) is served over and over: each visit creates the cache, plan and workspace, runs a
// growing batch through write_kv + plan_update + decode, provokes the errors a bad request
// brings (a slot past the pool, a stale plan, a NaN in K), checks one step against the reference
// backend, and destroys everything.
//
// It fails (exit 1) on a wrong status, an output off the reference, resident memory that grows
// after the first rotation (not checked under ASan, whose quarantine holds freed memory; its leak
// checker covers that build), or steps that grow slower over the run.
//
//   soak_capi [--seconds S] [--rotations N] [--seed N]
//   (stops at whichever comes first; defaults: 20 s, no rotation limit, a fresh seed)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "mjolnir/mjolnir.h"

#if defined(__SANITIZE_ADDRESS__)
#define SOAK_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SOAK_UNDER_ASAN 1
#endif
#endif
#ifndef SOAK_UNDER_ASAN
#define SOAK_UNDER_ASAN 0
#endif

namespace {

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "soak: FAILED: %s (last error: %s)\n", what.c_str(), mjolnir_last_error());
  std::exit(1);
}

void require_ok(mjolnir_status status, const char* call) {
  if (status != MJOLNIR_OK) {
    fail(std::string(call) + " returned " + mjolnir_status_string(status));
  }
}

void require_status(mjolnir_status status, mjolnir_status expected, const char* what) {
  if (status != expected) {
    fail(std::string(what) + ": expected " + mjolnir_status_string(expected) + ", got " +
         mjolnir_status_string(status));
  }
}

// Resident set size in KiB, from /proc/self/statm.
long resident_kib() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * 4;
}

struct Config {
  int32_t format, layout, granularity, page_size, num_kv_heads, group, head_dim, q_len, q_mode,
      p_mode;
  bool cpu;  // else the reference backend
};

Config random_config(std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Config c;
  c.format = pick(0, 7);
  c.layout = pick(1, 6);
  c.granularity = pick(0, 2);
  c.page_size = 8 << pick(0, 2);
  c.num_kv_heads = pick(1, 4);
  c.group = 1 << pick(0, 2);
  c.head_dim = 64 * pick(1, 2);
  c.q_len = pick(0, 3) == 0 ? pick(2, 8) : 1;
  c.q_mode = pick(0, 2);
  c.p_mode = pick(0, 2);
  c.cpu = pick(0, 3) != 0;
  return c;
}

struct Handles {
  mjolnir_backend* cpu = nullptr;
  mjolnir_backend* reference = nullptr;
};

struct Counts {
  long steps = 0, tokens_written = 0, errors_provoked = 0, checks = 0;
};

float rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return scale > 0 ? float(worst / scale) : float(worst);
}

// One visit of a configuration: everything created, served for `steps` steps, destroyed.
void serve(const Config& c, const Handles& handles, std::mt19937_64& rng, int steps,
           Counts& counts) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int32_t num_seqs = 1 + int32_t(rng() % 4);
  const int32_t max_tokens = 160;
  const int32_t pages_per_seq = (max_tokens + c.page_size - 1) / c.page_size;

  mjolnir_cache_desc desc;
  mjolnir_cache_desc_init(&desc);
  desc.format = c.format;
  desc.layout = c.layout;
  desc.granularity = c.granularity;
  desc.page_size = c.page_size;
  desc.num_kv_heads = c.num_kv_heads;
  desc.head_dim = c.head_dim;
  desc.num_pages = num_seqs * pages_per_seq + 3;
  const int64_t scale_count = c.granularity == MJOLNIR_GRANULARITY_TENSOR ? 1
                              : c.granularity == MJOLNIR_GRANULARITY_HEAD
                                  ? c.num_kv_heads
                                  : int64_t(c.num_kv_heads) * c.head_dim;
  std::vector<float> scales(static_cast<std::size_t>(scale_count));
  // Scales that fit N(0, 1) values into the format (amax about 4), as calibration would.
  for (float& s : scales) s = 5.0f / 448.0f * (0.5f + float(rng() % 100) / 100.0f);
  if (c.format == MJOLNIR_FORMAT_BF16 || c.format == MJOLNIR_FORMAT_FP16) {
    std::fill(scales.begin(), scales.end(), 1.0f);
  }
  desc.k_scale = desc.v_scale = scales.data();
  desc.k_scale_count = desc.v_scale_count = scale_count;
  std::size_t pool_bytes = 0;
  require_ok(mjolnir_pool_bytes(&desc, &pool_bytes), "mjolnir_pool_bytes");
  std::vector<uint8_t> pool(pool_bytes, 0);
  desc.pool = pool.data();
  desc.pool_bytes = pool.size();
  mjolnir_cache* cache = nullptr;
  require_ok(mjolnir_cache_create(&desc, &cache), "mjolnir_cache_create");

  mjolnir_backend* backend = c.cpu ? handles.cpu : handles.reference;
  mjolnir_plan* plan = nullptr;
  require_ok(mjolnir_plan_create(num_seqs, c.num_kv_heads, 8, &plan), "mjolnir_plan_create");
  if (rng() % 2) {
    require_ok(mjolnir_plan_set_option(plan, MJOLNIR_PLAN_MIN_CHUNK_TOKENS, 32),
               "mjolnir_plan_set_option");
  }

  // Pages: a shuffled pool, each sequence its own.
  std::vector<int32_t> pages(static_cast<std::size_t>(desc.num_pages));
  for (std::size_t i = 0; i < pages.size(); ++i) pages[i] = int32_t(i);
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<int32_t> block_table(static_cast<std::size_t>(num_seqs * pages_per_seq));
  std::copy_n(pages.begin(), block_table.size(), block_table.begin());

  mjolnir_decode_params params;
  mjolnir_decode_params_init(&params);
  params.q_len = c.q_len;
  params.num_q_heads = c.num_kv_heads * c.group;
  params.q_mode = c.q_mode;
  params.p_mode = c.p_mode;
  std::size_t workspace_bytes = 0;
  require_ok(mjolnir_workspace_size(backend, plan, cache, &params, &workspace_bytes),
             "mjolnir_workspace_size");
  std::vector<uint8_t> workspace(std::max<std::size_t>(workspace_bytes, 1));
  std::size_t reference_bytes = 0;
  require_ok(mjolnir_workspace_size(handles.reference, plan, cache, &params, &reference_bytes),
             "mjolnir_workspace_size");
  std::vector<uint8_t> reference_workspace(std::max<std::size_t>(reference_bytes, 1));

  const int64_t hk = c.num_kv_heads, d = c.head_dim, hq = params.num_q_heads;
  std::vector<int32_t> seq_lens(static_cast<std::size_t>(num_seqs), 0);
  const int check_step = int(rng() % std::max(steps, 1));
  for (int step = 0; step < steps; ++step) {
    // New tokens: q_len for every sequence still under max_tokens (a finished one is padding).
    std::vector<int64_t> slots;
    for (int32_t b = 0; b < num_seqs; ++b) {
      const int32_t grow = seq_lens[b] + c.q_len <= max_tokens ? c.q_len : 0;
      for (int32_t t = seq_lens[b]; t < seq_lens[b] + grow; ++t) {
        slots.push_back(int64_t(block_table[b * pages_per_seq + t / c.page_size]) * c.page_size +
                        t % c.page_size);
      }
      seq_lens[b] += grow;
    }
    const int64_t n = int64_t(slots.size());
    std::vector<float> k(static_cast<std::size_t>(std::max<int64_t>(n * hk * d, 1)));
    std::vector<float> v(k.size());
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    if (n > 0) {
      // A bad request first: a slot past the pool, then a NaN; neither may write anything.
      std::vector<int64_t> bad = slots;
      bad.back() = int64_t(desc.num_pages) * c.page_size;
      require_status(mjolnir_write_kv(cache, k.data(), hk * d, d, v.data(), hk * d, d, bad.data(),
                                      n, nullptr, nullptr),
                     MJOLNIR_ERROR_INVALID_ARGUMENT, "write_kv with a slot past the pool");
      const float saved = k[0];
      k[0] = std::nanf("");
      require_status(mjolnir_write_kv(cache, k.data(), hk * d, d, v.data(), hk * d, d, slots.data(),
                                      n, nullptr, nullptr),
                     MJOLNIR_ERROR_INVALID_ARGUMENT, "write_kv with a NaN in K");
      k[0] = saved;
      counts.errors_provoked += 2;
      require_ok(mjolnir_write_kv(cache, k.data(), hk * d, d, v.data(), hk * d, d, slots.data(), n,
                                  nullptr, nullptr),
                 "mjolnir_write_kv");
      counts.tokens_written += n;
    }

    require_ok(mjolnir_plan_update(plan, seq_lens.data(), num_seqs, c.q_len, backend),
               "mjolnir_plan_update");
    const int64_t rows = int64_t(num_seqs) * c.q_len;
    std::vector<float> q(static_cast<std::size_t>(rows * hq * d));
    for (float& x : q) x = normal(rng);
    std::vector<float> o(q.size()), lse(static_cast<std::size_t>(rows * hq));
    mjolnir_decode_args args;
    mjolnir_decode_args_init(&args);
    args.seq_lens = seq_lens.data();
    args.num_seqs = num_seqs;
    args.block_table = block_table.data();
    args.max_pages_per_seq = pages_per_seq;
    args.q = q.data();
    args.q_token_stride = hq * d;
    args.q_head_stride = d;
    args.o = o.data();
    args.o_token_stride = hq * d;
    args.o_head_stride = d;
    args.lse = lse.data();
    require_ok(
        mjolnir_decode(backend, plan, cache, &params, &args, workspace.data(), workspace_bytes),
        "mjolnir_decode");
    ++counts.steps;

    if (step == check_step) {
      // The same step and plan on the reference backend: the contract compares a backend with
      // the emulator in the same modes and plan (docs/numerics.md), since fp8 P codes depend on
      // the chunks. Its bound there is 1e-5 rel L2 in fp32 / bf16 modes and 1e-4 with an fp8 one
      // (2^-8 for P from the CPU's own scores in bf16); 10x of each in the largest output here.
      std::vector<float> expected(o.size());
      args.o = expected.data();
      args.lse = nullptr;
      require_ok(mjolnir_decode(handles.reference, plan, cache, &params, &args,
                                reference_workspace.data(), reference_bytes),
                 "mjolnir_decode (reference)");
      const bool fp8_mode = c.q_mode == MJOLNIR_Q_FP8 || c.p_mode == MJOLNIR_P_FP8;
      const float bound = c.p_mode == MJOLNIR_P_BF16 ? 1.0f / 256 : fp8_mode ? 1e-3f : 1e-4f;
      const float diff = rel_diff(o, expected);
      if (!(diff <= bound)) {
        fail("decode off the reference by " + std::to_string(diff) + " (format " +
             mjolnir_format_name(c.format) + ", layout " + mjolnir_layout_name(c.layout) +
             ", q_mode " + std::to_string(c.q_mode) + ", p_mode " + std::to_string(c.p_mode) + ")");
      }
      ++counts.checks;
      args.o = o.data();
    }

    if (step % 4 == 3 && num_seqs > 0) {
      // A stale plan: the step's lengths moved on without an update (by one token the pages
      // still hold, so only the plan check can catch it).
      const int32_t change = seq_lens[0] > 0 ? -1 : 1;
      seq_lens[0] += change;
      require_status(
          mjolnir_decode(backend, plan, cache, &params, &args, workspace.data(), workspace_bytes),
          MJOLNIR_ERROR_PLAN_MISMATCH, "decode with a stale plan");
      seq_lens[0] -= change;
      ++counts.errors_provoked;
    }
  }
  mjolnir_plan_destroy(plan);
  mjolnir_cache_destroy(cache);
}

// The fastest of a run of rotations: a shared machine's noise (other tests under ctest -j,
// other tenants) slows stretches of rotations, sometimes a whole third of the run 2x; it does
// not slow every one of them, while a cost that grows with the steps served does.
double fastest(const std::vector<double>& values) {
  return values.empty() ? 0 : *std::min_element(values.begin(), values.end());
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 20;
  long max_rotations = -1;
  uint64_t seed = std::random_device{}();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc || (arg != "--seconds" && arg != "--rotations" && arg != "--seed")) {
      std::fprintf(stderr, "usage: soak_capi [--seconds S] [--rotations N] [--seed N]\n");
      return 2;
    }
    const char* value = argv[++i];
    if (arg == "--seconds") {
      seconds = std::atof(value);
    } else if (arg == "--rotations") {
      max_rotations = std::atol(value);
    } else {
      seed = std::strtoull(value, nullptr, 10);
    }
  }
  std::printf("soak: seed %llu (--seed %llu repeats it)\n", (unsigned long long)seed,
              (unsigned long long)seed);
  std::mt19937_64 rng(seed);

  Handles handles;
  require_ok(mjolnir_backend_create("cpu", 2, &handles.cpu), "mjolnir_backend_create(cpu)");
  require_ok(mjolnir_backend_create("reference", 0, &handles.reference),
             "mjolnir_backend_create(reference)");

  constexpr int kConfigs = 12;
  constexpr int kStepsPerVisit = 24;
  std::vector<Config> configs;
  for (int i = 0; i < kConfigs; ++i) configs.push_back(random_config(rng));

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  Counts counts;
  long rotations = 0;
  long rss_after_warmup = 0;
  std::vector<double> rotation_seconds;
  while (max_rotations < 0 || rotations < max_rotations) {
    const auto rotation_start = Clock::now();
    for (const Config& c : configs) serve(c, handles, rng, kStepsPerVisit, counts);
    rotation_seconds.push_back(
        std::chrono::duration<double>(Clock::now() - rotation_start).count());
    ++rotations;
    // The first rotation fills the allocator's and the pools' high-water marks.
    if (rotations == 1) rss_after_warmup = resident_kib();
    if (std::chrono::duration<double>(Clock::now() - start).count() >= seconds) break;
  }
  const long rss_end = resident_kib();
  mjolnir_backend_destroy(handles.cpu);
  mjolnir_backend_destroy(handles.reference);

  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf(
      "soak: %ld rotations of %d configurations, %ld decode steps, %ld tokens written, %ld "
      "bad requests refused, %ld steps checked against the reference, in %.1f s\n",
      rotations, kConfigs, counts.steps, counts.tokens_written, counts.errors_provoked,
      counts.checks, elapsed);
  std::printf("soak: resident memory %ld KiB after the first rotation, %ld KiB at the end\n",
              rss_after_warmup, rss_end);

  bool ok = true;
  if (!SOAK_UNDER_ASAN && rotations >= 3) {
    // Allocator noise is a few pages; a leak of one small allocation per step would be
    // rotations x 288 steps of it.
    const long growth = rss_end - rss_after_warmup;
    if (growth > 4096) {
      std::fprintf(stderr, "soak: FAILED: resident memory grew %ld KiB after warm-up\n", growth);
      ok = false;
    }
  }
  if (rotations >= 12) {
    // Later rotations against the early ones (the same configurations and steps): the fastest
    // of a third of the run each, 2x apart at most; a cost that grows with the steps served
    // grows without bound.
    const std::size_t third = rotation_seconds.size() / 3;
    const double early =
        fastest({rotation_seconds.begin() + 1, rotation_seconds.begin() + 1 + third});
    const double late = fastest({rotation_seconds.end() - third, rotation_seconds.end()});
    std::printf("soak: a rotation took %.1f ms early, %.1f ms late (fastest of each third)\n",
                early * 1e3, late * 1e3);
    if (late > 2.0 * early) {
      std::fprintf(stderr, "soak: FAILED: rotations slowed down %.2fx\n", late / early);
      ok = false;
    }
  }
  if (!ok) return 1;
  std::printf("soak: passed\n");
  return 0;
}

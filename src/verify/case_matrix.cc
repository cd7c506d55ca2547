// The case matrix and the per-case check (see case_matrix.h).
#include "verify/case_matrix.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <sstream>

#include "reference/emulator_backend.h"
#include "reference/exact.h"
#include "verify/error_bounds.h"

namespace mjolnir::verify {

namespace {

constexpr int kPageSizes[] = {16, 32, 64, 128};
constexpr int kHeadDims[] = {64, 128, 256};
constexpr int kGroups[] = {1, 4, 8};
constexpr int kQLens[] = {1, 2, 4};
constexpr int kSplits[] = {1, 3};
constexpr int kTiles[] = {16, 32, 64};
constexpr QMode kQModes[] = {QMode::fp32, QMode::bf16, QMode::fp8, QMode::int8};
// fp16 last: only the formats it takes draw it (half_sums_take).
constexpr PMode kPModes[] = {PMode::fp32, PMode::bf16, PMode::fp8, PMode::fp16};
constexpr ScaleGranularity kGranularities[] = {ScaleGranularity::tensor, ScaleGranularity::head,
                                               ScaleGranularity::channel};

std::uint64_t mix(std::uint64_t x) {  // splitmix64 finalizer: per-case seeds from (seed, index)
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Fills the seed-dependent fields: modes, granularity, tile, and sequence lengths that are not
// multiples of the page size, long enough for the splits, with a padding request in half.
Case make_case(Format format, Layout layout, int page, int d, int g, int q_len, bool causal,
               int splits, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Case c;
  ProblemSpec& s = c.spec;
  s.format = format;
  s.layout = layout;
  s.page_size = page;
  s.head_dim = d;
  s.group = g;
  s.num_kv_heads = 2;
  s.params.q_len = q_len;
  s.params.causal = causal;
  s.params.q_mode = kQModes[rng() % std::size(kQModes)];
  s.params.p_mode = kPModes[rng() % (half_sums_take(format) ? 4 : 3)];
  s.granularity = kGranularities[rng() % 3];
  s.seed = seed;
  s.extra_pages = int(rng() % 3);
  c.splits = splits;
  c.tile_tokens = kTiles[rng() % 3];
  const int longest = std::max(splits * c.tile_tokens + 7, 2 * page + page / 2);
  auto length = [&](int lo, int hi) {
    int len = lo + int(rng() % std::uint64_t(hi - lo + 1));
    if (len % page == 0) ++len;
    return len;
  };
  if (q_len == 0) {
    // A ragged step, as a serving engine batches one: the tail of a chunked prefill (9-72 query
    // tokens over a longer cache), a whole prompt (2-4 query tiles), and a decode, a query tile
    // or a tile and one token; sometimes a sequence that has no query this step.
    constexpr int kTile = kQueryTileTokens;
    s.seq_lens = {length(longest / 2, longest + kTile), length(kTile + 8, 3 * kTile + 20),
                  length(kTile + 1, longest + kTile)};
    s.query_lens = {std::min(s.seq_lens[0], 9 + int(rng() % 64)), s.seq_lens[1],
                    std::array{1, kTile, kTile + 1}[rng() % 3]};
    if (rng() % 2) {
      s.seq_lens.push_back(length(1, page + 3));
      s.query_lens.push_back(0);
    }
    return c;
  }
  s.seq_lens = {length(longest / 2, longest), length(q_len, page + 3), length(q_len, longest)};
  if (rng() % 2) s.seq_lens.push_back(0);  // a padding request trailing the batch
  return c;
}

double rel_l2(std::span<const float> got, std::span<const double> want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

std::string Case::name() const {
  std::ostringstream os;
  const ProblemSpec& s = spec;
  os << to_string(s.format) << "/" << to_string(s.layout) << "/P" << s.page_size << "/D"
     << s.head_dim << "/g" << s.group << "/"
     << (s.params.q_len > 0 ? "q" + std::to_string(s.params.q_len) : std::string("ragged")) << "/"
     << (s.params.causal ? "causal" : "noncausal") << "/splits" << splits << "/T" << tile_tokens
     << "/Q" << to_string(s.params.q_mode) << "/P" << to_string(s.params.p_mode) << "/"
     << to_string(s.granularity) << (s.bf16_queries ? "/bf16queries" : "") << "/lens";
  for (int len : s.seq_lens) os << "_" << len;
  if (!s.query_lens.empty()) {
    os << "/queries";
    for (int n : s.query_lens) os << "_" << n;
  }
  os << "/seed" << s.seed;
  return os.str();
}

std::vector<Case> case_matrix(bool quick, std::uint64_t seed) {
  std::vector<Case> cases;
  std::uint64_t index = 0;
  std::uint64_t ragged = 0;
  // Ragged cases draw their seeds from indices of their own, far from the decode cases'.
  constexpr std::uint64_t kRaggedSeeds = std::uint64_t(1) << 40;
  if (quick) {
    // Every format x layout pair twice; the other axes cycle so each value of each appears.
    for (Format f : kAllFormats) {
      for (Layout l : kAllLayouts) {
        for (int v = 0; v < 2; ++v, ++index) {
          const auto i = index;
          cases.push_back(make_case(f, l, kPageSizes[i % 4], kHeadDims[(i / 2) % 3],
                                    kGroups[(i / 3) % 3], kQLens[(i / 5) % 3], (i / 7) % 2 == 0,
                                    kSplits[i % 2], mix(seed ^ mix(i))));
        }
        // A ragged step (prefill and mixed query lengths) per format x layout, numbered on its
        // own so the decode cases stay those of the matrix without them.
        const auto r = ragged++;
        cases.push_back(make_case(f, l, kPageSizes[r % 4], kHeadDims[(r / 2) % 3],
                                  kGroups[(r / 3) % 3], 0, (r / 7) % 2 == 0, kSplits[r % 2],
                                  mix(seed ^ mix(kRaggedSeeds + r))));
      }
    }
    return cases;
  }
  for (Format f : kAllFormats)
    for (Layout l : kAllLayouts)
      for (int page : kPageSizes)
        for (int d : kHeadDims)
          for (int g : kGroups)
            for (int q_len : kQLens)
              for (bool causal : {true, false})
                for (int splits : kSplits) {
                  cases.push_back(
                      make_case(f, l, page, d, g, q_len, causal, splits, mix(seed ^ mix(index++))));
                }
  // Ragged steps: every format x layout x D x g x causality, page size and splits cycling
  // (each costs several query tiles, so not the whole product).
  for (Format f : kAllFormats)
    for (Layout l : kAllLayouts)
      for (int d : kHeadDims)
        for (int g : kGroups)
          for (bool causal : {true, false}) {
            const auto r = ragged++;
            cases.push_back(make_case(f, l, kPageSizes[r % 4], d, g, 0, causal,
                                      kSplits[(r / 4) % 2], mix(seed ^ mix(kRaggedSeeds + r))));
          }
  return cases;
}

CaseResult run_case(const Case& c, const Backend& backend) {
  CaseResult result;
  auto fail = [&](std::string message) {
    result.status = CaseResult::Status::failed;
    result.message = std::move(message);
    return result;
  };
  try {
    const std::string unsupported = backend.unsupported_reason(
        CacheGeometry{c.spec.format, 1, c.spec.page_size, c.spec.num_kv_heads, c.spec.head_dim},
        c.spec.params);
    if (!unsupported.empty()) {
      result.status = CaseResult::Status::unsupported;
      result.message = unsupported;
      return result;
    }
    Problem problem(c.spec);
    DecodeArgs args = problem.args();
    validate(args);
    PlanOptions options = backend.plan_options();
    options.fixed_splits = c.splits;
    options.max_splits = std::max(1, c.splits);
    options.tile_tokens = c.tile_tokens;
    const StepShape step = args.step_shape();
    BackendPlan plan(PlanCapacity{
        .max_seqs = args.batch.num_seqs(),
        .num_kv_heads = c.spec.num_kv_heads,
        .max_splits = options.max_splits,
        .max_query_tiles = step.query_start.empty() ? 0 : query_tiles_needed(step.query_start)});
    backend.plan(plan, step, options);

    // The backend, with guard bytes around its workspace.
    constexpr std::size_t kWorkspaceGuard = 256;
    constexpr std::byte kGuardByte{0x5a};
    const std::size_t ws_bytes =
        backend.workspace_bytes(plan.plan(), args.cache.geometry, args.params);
    std::vector<std::byte> workspace(ws_bytes + 2 * kWorkspaceGuard, kGuardByte);
    problem.poison_outputs();
    backend.run(args, plan, {workspace.data() + kWorkspaceGuard, ws_bytes});
    const std::vector<float> o(problem.output().begin(), problem.output().end());
    const std::vector<float> lse(problem.lse().begin(), problem.lse().end());
    if (!problem.guards_intact()) return fail("wrote outside the o / lse tensors");
    for (std::size_t i = 0; i < kWorkspaceGuard; ++i) {
      if (workspace[i] != kGuardByte || workspace[workspace.size() - 1 - i] != kGuardByte) {
        return fail("wrote outside its workspace");
      }
    }

    // Check order: NaN / Inf, then padding rows, then values.
    const int d = c.spec.head_dim;
    const int hq = args.params.num_q_heads;
    for (std::size_t i = 0; i < o.size(); ++i) {
      if (!std::isfinite(o[i])) {
        std::ostringstream os;
        os << "o[" << i / (std::size_t(hq) * d) << "][" << (i / d) % hq << "][" << i % d << "] is "
           << o[i] << " (NaN: row not written or bad read)";
        return fail(os.str());
      }
    }
    for (int b = 0; b < args.batch.num_seqs(); ++b) {
      const bool padding = args.batch.seq_lens[b] == 0;
      for (int t = 0; t < args.query_len(b); ++t) {
        const std::int64_t row = args.query_row(b, t);
        for (int h = 0; h < hq; ++h) {
          const float x = lse[std::size_t(row) * hq + h];
          if (padding != std::isinf(x) || std::isnan(x)) {
            std::ostringstream os;
            os << "lse[" << row << "][" << h << "] is " << x
               << (padding ? " for a padding request (want -inf)" : " (want finite)");
            return fail(os.str());
          }
        }
        if (padding) {
          for (int i = 0; i < hq * d; ++i) {
            if (o[std::size_t(row) * hq * d + i] != 0.0f) {
              return fail("padding request " + std::to_string(b) + " has non-zero output");
            }
          }
        }
      }
    }

    // Against the emulator in the same mode and plan.
    const bool is_emulator = backend.name() == "reference";
    if (!is_emulator) {
      const auto emulator = reference::make_emulator_backend();
      problem.poison_outputs();
      // The same items: the emulator runs a plan any backend made (it prepares nothing).
      std::vector<std::byte> ws(
          emulator->workspace_bytes(plan.plan(), args.cache.geometry, args.params));
      emulator->run(args, plan, ws);
      std::vector<double> want(problem.output().begin(), problem.output().end());
      result.error_vs_emulator = rel_l2(o, want);
      double lse_diff = 0;
      for (std::size_t i = 0; i < lse.size(); ++i) {
        if (std::isfinite(lse[i]))
          lse_diff = std::max<double>(lse_diff, std::abs(lse[i] - problem.lse()[i]));
      }
      const double tol = emulator_tolerance(
          c.spec.params, backend.rounds_p_from_own_scores(args.cache.geometry, c.spec.params));
      if (result.error_vs_emulator > tol || lse_diff > 1e-4) {
        std::ostringstream os;
        os << "vs emulator: rel L2 " << result.error_vs_emulator << " (tolerance " << tol
           << "), max |lse diff| " << lse_diff << " (tolerance 1e-4)";
        return fail(os.str());
      }
    }

    // Against the exact reference: on the decoded cache (the mode's error), then on the
    // original K/V (the format's and mode's error together).
    const auto exact_codes =
        reference::exact_attention(args, reference::kv_rows_from_cache(args.cache, args.batch));
    result.mode_error = rel_l2(o, exact_codes.o);
    const double crest = query_crest(args);
    result.mode_bound = mode_error_bound(c.spec.params, crest);
    if (result.mode_error > result.mode_bound) {
      std::ostringstream os;
      os << "vs exact reference on the decoded cache: rel L2 " << result.mode_error << " > bound "
         << result.mode_bound;
      return fail(os.str());
    }
    const auto exact_original = reference::exact_attention(
        args, [&](int seq, int head, int pos, int kv, std::span<double> out) {
          const float* x = problem.original_kv(seq, head, pos, kv);
          std::copy(x, x + d, out.begin());
        });
    result.error_vs_exact = rel_l2(o, exact_original.o);
    result.bound_vs_exact = format_error_bound(c.spec.format, c.spec.params, crest);
    if (result.error_vs_exact > result.bound_vs_exact) {
      std::ostringstream os;
      os << "vs exact reference on the original K/V: rel L2 " << result.error_vs_exact
         << " > bound " << result.bound_vs_exact << " for " << to_string(c.spec.format);
      return fail(os.str());
    }
  } catch (const std::exception& e) {
    return fail(std::string("threw: ") + e.what());
  }
  return result;
}

}  // namespace mjolnir::verify

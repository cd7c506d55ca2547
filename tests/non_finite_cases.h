// The non-finite policy (docs/numerics.md, "Non-finite inputs"; core/non_finite.h) checked on one
// backend: a NaN or an infinity planted in one q row, one K value or one V value (each format's
// NaN and Inf codes, nvfp4's NaN block scale) makes exactly the rows that meet it NaN, in every
// channel of O and in the LSE, and leaves every other row bit for bit as the same backend computes
// it without the planted value (for a q row: with that row zeroed). Run over every format, every
// Q and P mode, decode and causal multi-token steps, unsplit and split plans. Shared by
// test_non_finite.cc (cpu, reference), test_cuda_emulated.cc (the CUDA kernels on CPU threads) and
// test_cuda_backend.cc (a GPU).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "mjolnir/decode.h"
#include "mjolnir/format.h"
#include "verify/problem.h"

namespace mjolnir::testing {

// One planted value: in q (query row of sequence `seq`, token `token`, query head `head`), or in
// the K (kv 0) or V (kv 1) row of (seq, KV head `head`, `position`).
struct Plant {
  enum class In { q, k, v } in;
  std::string what;  // "K NaN code", "q +Inf", ...
  int seq = 0, token = 0, head = 0, position = 0, channel = 0;
  std::vector<std::uint8_t> bytes;  // the code bytes written at byte `offset` of the row
  std::size_t offset = 0;
  float q_value = 0;  // for In::q
};

// The non-finite codes a format can hold, as (name, byte offset within the row, bytes) for
// channel c; empty for fp6 and fp4, which have none.
inline std::vector<Plant> non_finite_codes(Format format, int head_dim, int c) {
  const auto at = [](std::string what, std::size_t offset, std::vector<std::uint8_t> bytes) {
    Plant p{.in = Plant::In::k, .what = std::move(what)};
    p.offset = offset;
    p.bytes = std::move(bytes);
    return p;
  };
  const std::size_t u16 = 2 * std::size_t(c);
  switch (format) {
    case Format::bf16:
      return {at("NaN", u16, {0xC0, 0x7F}), at("+Inf", u16, {0x80, 0x7F}),
              at("-Inf", u16, {0x80, 0xFF})};
    case Format::fp16:
      return {at("NaN", u16, {0x00, 0x7E}), at("+Inf", u16, {0x00, 0x7C})};
    case Format::fp8_e4m3:
      return {at("NaN", std::size_t(c), {0x7F}), at("-NaN", std::size_t(c), {0xFF})};
    case Format::fp8_e5m2:
      return {at("NaN", std::size_t(c), {0x7E}), at("+Inf", std::size_t(c), {0x7C}),
              at("-Inf", std::size_t(c), {0xFC})};
    case Format::nvfp4:  // the e4m3 block scale of channel c's block of 16
      return {at("NaN block scale", std::size_t(head_dim / 2 + c / 16), {0x7F})};
    default:
      return {};
  }
}

struct NonFiniteConfig {
  Format format;
  QMode q_mode;
  PMode p_mode;
  int q_len;         // 1: decode; 5: a causal step of five query tokens (10 rows: AMX tiles)
  int fixed_splits;  // 1: unsplit; 3: every sequence in three chunks, merged
};

inline std::string describe(const NonFiniteConfig& c) {
  return std::string(to_string(c.format)) + " q " + std::string(to_string(c.q_mode)) + " p " +
         std::string(to_string(c.p_mode)) + " q_len " + std::to_string(c.q_len) + " splits " +
         std::to_string(c.fixed_splits);
}

// Every format x Q mode x P mode, cycling through (q_len, splits) so each pair meets each mode.
// Five query tokens of a group of 2 are 10 rows, enough for the AMX paths where the CPU has them.
inline std::vector<NonFiniteConfig> non_finite_configs() {
  const int shapes[4][2] = {{1, 1}, {5, 3}, {1, 3}, {5, 1}};
  std::vector<NonFiniteConfig> out;
  int i = 0;
  for (Format f : kAllFormats) {
    for (QMode q : {QMode::fp32, QMode::bf16, QMode::fp8, QMode::int8}) {
      for (PMode p : {PMode::fp32, PMode::bf16, PMode::fp8}) {
        out.push_back({f, q, p, shapes[i % 4][0], shapes[i % 4][1]});
        ++i;
      }
    }
  }
  return out;
}

// O and LSE of one run, copied out.
struct RunResult {
  std::vector<float> o, lse;
};

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Runs every plant of `config` on `backend` and checks the policy. `seed` draws the problem and
// the planted positions.
inline void check_non_finite_policy(const Backend& backend, const NonFiniteConfig& config,
                                    std::uint64_t seed) {
  SCOPED_TRACE(describe(config));
  verify::ProblemSpec spec;
  spec.format = config.format;
  spec.granularity = config.format == Format::fp6_e2m3 || config.format == Format::fp4_e2m1
                         ? ScaleGranularity::channel
                         : ScaleGranularity::head;
  spec.head_dim = 64;
  spec.num_kv_heads = 2;
  spec.group = 2;
  spec.params.q_len = config.q_len;
  spec.params.causal = true;
  spec.params.q_mode = config.q_mode;
  spec.params.p_mode = config.p_mode;
  spec.seq_lens = {300, 41, 150};
  spec.seed = seed;
  verify::Problem problem(spec);
  const int d = spec.head_dim, g = spec.group, hq = spec.num_kv_heads * g;
  PlanOptions options{.workers = backend.workers(),
                      .max_splits = 4,
                      .tile_tokens = 32,
                      .min_chunk_tokens = 32,
                      .fixed_splits = config.fixed_splits};

  const auto run = [&] {
    problem.poison_outputs();
    decode(backend, problem.args(), options);
    return RunResult{{problem.output().begin(), problem.output().end()},
                     {problem.lse().begin(), problem.lse().end()}};
  };

  // The plants: a q row; K and V codes in a sequence's first token, in one a few chunks in, and
  // (K only) in a token only the step's last query token sees, which the rows before it must not
  // meet; for V only tokens every query row sees (a dense reference multiplies a masked token's
  // V by p = 0 too, so that case is left unspecified).
  std::mt19937_64 rng(seed);
  const auto pick = [&](int n) { return int(rng() % std::uint64_t(n)); };
  std::vector<Plant> plants;
  for (float value : {std::nanf(""), INFINITY, -INFINITY}) {
    Plant p{.in = Plant::In::q,
            .what = std::isnan(value) ? "q NaN"
                    : value > 0       ? "q +Inf"
                                      : "q -Inf"};
    p.seq = pick(3);
    p.token = pick(config.q_len);
    p.head = pick(hq);
    p.channel = pick(d);
    p.q_value = value;
    plants.push_back(p);
  }
  const int c = pick(d);
  for (Plant code : non_finite_codes(config.format, d, c)) {
    for (int kv : {0, 1}) {
      for (int seq : {0, 2}) {
        const int seq_len = spec.seq_lens[seq];
        const int seen_by_all = seq_len - config.q_len + 1;  // positions [0, seen_by_all)
        Plant p = code;
        p.in = kv == 0 ? Plant::In::k : Plant::In::v;
        p.what = std::string(kv == 0 ? "K " : "V ") + code.what;
        p.seq = seq;
        p.head = pick(spec.num_kv_heads);
        p.channel = c;
        p.position = seq == 0 ? pick(seen_by_all) : 0;
        plants.push_back(p);
        if (kv == 0 && config.q_len > 1 && seq == 0) {
          p.position = seq_len - 1;
          p.what += " (last token)";
          plants.push_back(p);
        }
      }
    }
  }

  const RunResult clean = run();
  for (const Plant& plant : plants) {
    SCOPED_TRACE(plant.what + " at seq " + std::to_string(plant.seq) + " head " +
                 std::to_string(plant.head) + " position " + std::to_string(plant.position) +
                 " token " + std::to_string(plant.token) + " channel " +
                 std::to_string(plant.channel));
    DecodeArgs args = problem.args();
    // Which (query row, query head) pairs must be poisoned.
    const auto poisoned = [&](int seq, int token, int head) {
      if (seq != plant.seq) return false;
      if (plant.in == Plant::In::q) return token == plant.token && head == plant.head;
      const int last_seen = spec.seq_lens[seq] - config.q_len + token;
      return head / g == plant.head && plant.position <= last_seen;
    };

    RunResult baseline = clean;
    float* q_row = nullptr;
    std::vector<float> q_saved(static_cast<std::size_t>(d));
    std::span<std::byte> row;
    std::vector<std::byte> row_saved;
    if (plant.in == Plant::In::q) {
      const std::size_t at =
          (std::size_t(args.query_row(plant.seq, plant.token)) * hq + std::size_t(plant.head)) * d;
      q_row = problem.mutable_query().data() + at;
      std::copy(q_row, q_row + d, q_saved.begin());
      std::fill(q_row, q_row + d, 0.0f);  // the policy: others as if this row were zero
      baseline = run();
      q_row[plant.channel] = plant.q_value;
    } else {
      row = problem.kv_row_bytes(plant.seq, plant.head, plant.position,
                                 plant.in == Plant::In::k ? 0 : 1);
      row_saved.assign(row.begin(), row.end());
      for (std::size_t i = 0; i < plant.bytes.size(); ++i)
        row[plant.offset + i] = std::byte{plant.bytes[i]};
    }
    const RunResult got = run();
    if (q_row != nullptr) std::copy(q_saved.begin(), q_saved.end(), q_row);
    if (!row.empty()) std::copy(row_saved.begin(), row_saved.end(), row.begin());

    int poisoned_rows = 0, failures = 0;
    for (int seq = 0; seq < 3; ++seq) {
      for (int token = 0; token < config.q_len; ++token) {
        const std::size_t query_row = std::size_t(args.query_row(seq, token));
        for (int head = 0; head < hq; ++head) {
          const std::size_t r = query_row * hq + head;
          const float* o = &got.o[r * d];
          const float* want = &baseline.o[r * d];
          const bool expect_nan = poisoned(seq, token, head);
          poisoned_rows += expect_nan;
          bool ok = true;
          for (int ch = 0; ch < d; ++ch) {
            ok &= expect_nan ? std::isnan(o[ch]) : same_bits(o[ch], want[ch]);
          }
          ok &= expect_nan ? std::isnan(got.lse[r]) : same_bits(got.lse[r], baseline.lse[r]);
          if (!ok && failures++ < 4) {
            ADD_FAILURE() << "seq " << seq << " token " << token << " head " << head
                          << (expect_nan ? ": expected NaN, got o[0] " : ": expected o[0] ")
                          << (expect_nan ? o[0] : want[0]) << " lse " << got.lse[r]
                          << (expect_nan ? "" : ", got o[0] ") << (expect_nan ? 0.0f : o[0]);
          }
        }
      }
    }
    EXPECT_EQ(failures, 0);
    EXPECT_GT(poisoned_rows, 0);  // every plant is in a row some query meets
  }
}

}  // namespace mjolnir::testing

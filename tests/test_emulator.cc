// Hand-worked values for the numerics contract, run on the emulator and the CPU backend alike:
// single token, causal and non-causal masks, fp8 P rounding, fp16 P sums, fp8 Q codes, and the
// LSE merge.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/chunk_merge.h"
#include "expect_error.h"
#include "mjolnir/decode.h"
#include "mjolnir/write_kv.h"
#include "reference/emulator.h"

namespace mjolnir {
namespace {

constexpr int kD = 32;

// Pages of 8 tokens (as many as the tokens take), Hk = 1, D = 32, bf16 by default (so small
// integers and halves are exact), scales 1.
struct TinyCache {
  CacheGeometry geometry;
  std::vector<std::byte> pool;
  std::vector<float> ones{1.0f};
  std::vector<std::int32_t> block_table;
  std::vector<std::int32_t> seq_lens;

  explicit TinyCache(const std::vector<std::vector<float>>& k,
                     const std::vector<std::vector<float>>& v, Format format = Format::bf16)
      : geometry{format, std::max(1, int(k.size() + 7) / 8), 8, 1, kD},
        pool(pool_bytes(geometry)),
        block_table(std::size_t(geometry.num_pages)) {
    std::iota(block_table.begin(), block_table.end(), 0);
    std::vector<std::int64_t> slots(k.size());
    std::iota(slots.begin(), slots.end(), 0);
    std::vector<float> k_flat, v_flat;
    for (std::size_t i = 0; i < k.size(); ++i) {
      k_flat.insert(k_flat.end(), k[i].begin(), k[i].end());
      v_flat.insert(v_flat.end(), v[i].begin(), v[i].end());
    }
    write_kv(view(), TokenRows{k_flat.data(), kD, kD}, TokenRows{v_flat.data(), kD, kD}, slots);
    seq_lens = {static_cast<std::int32_t>(k.size())};
  }
  KvCacheView view() {
    KvCacheView c;
    c.geometry = geometry;
    c.strides = layout_strides(geometry, Layout::B2NHD);
    c.data = pool.data();
    c.bytes = pool.size();
    c.k_scale = ones;
    c.v_scale = ones;
    return c;
  }
};

std::vector<float> basis(int channel, float value) {
  std::vector<float> x(kD, 0.0f);
  x[channel] = value;
  return x;
}

std::vector<float> iota_row(float start) {
  std::vector<float> x(kD);
  for (int c = 0; c < kD; ++c) x[c] = start + c;
  return x;
}

struct Outputs {
  std::vector<float> o, lse;
};

Outputs run(const std::string& backend_name, TinyCache& cache, const std::vector<float>& q,
            int q_len, bool causal, DecodeParams params = {}) {
  params.q_len = q_len;
  params.num_q_heads = 1;
  params.causal = causal;
  Outputs r;
  r.o.assign(q.size(), std::numeric_limits<float>::quiet_NaN());
  r.lse.assign(q_len, std::numeric_limits<float>::quiet_NaN());
  DecodeArgs args{cache.view(),
                  PagedBatch{cache.block_table, int(cache.block_table.size()), cache.seq_lens},
                  params,
                  QueryTensor{q.data(), kD, kD},
                  OutputTensor{r.o.data(), kD, kD},
                  r.lse};
  decode(*make_backend(backend_name), args);
  return r;
}

class HandWorked : public ::testing::TestWithParam<std::string> {};

TEST_P(HandWorked, OneTokenReturnsItsValue) {
  TinyCache cache({basis(0, 2.0f)}, {iota_row(1.0f)});
  const std::vector<float> q = basis(0, 3.0f);
  const Outputs r = run(GetParam(), cache, q, 1, true);
  for (int c = 0; c < kD; ++c) EXPECT_EQ(r.o[c], 1.0f + c);
  // lse = s = q . k / sqrt(D) = 6 / sqrt(32).
  EXPECT_NEAR(r.lse[0], 6.0 / std::sqrt(32.0), 1e-6);
}

TEST_P(HandWorked, CausalAndNonCausalMasks) {
  // q = 0 makes every score 0, so each row averages the V rows it may see.
  TinyCache cache({basis(1, 1.0f), basis(2, 1.0f), basis(3, 1.0f)},
                  {iota_row(0.0f), iota_row(10.0f), iota_row(20.0f)});
  const std::vector<float> q(2 * kD, 0.0f);
  const Outputs causal = run(GetParam(), cache, q, 2, true);
  const Outputs full = run(GetParam(), cache, q, 2, false);
  for (int c = 0; c < kD; ++c) {
    EXPECT_FLOAT_EQ(causal.o[c], 5.0f + c) << "token 0 sees positions 0..1";
    EXPECT_FLOAT_EQ(causal.o[kD + c], 10.0f + c) << "token 1 sees positions 0..2";
    EXPECT_FLOAT_EQ(full.o[c], 10.0f + c);
    EXPECT_FLOAT_EQ(full.o[kD + c], 10.0f + c);
  }
  EXPECT_NEAR(causal.lse[0], std::log(2.0), 1e-6);
  EXPECT_NEAR(causal.lse[1], std::log(3.0), 1e-6);
}

TEST_P(HandWorked, Fp8ProbabilitiesRoundAsE4m3OfPTimes256) {
  // Scores (log2 units): token 0 -> 0, token 1 -> log2(0.3). p = 1 and 0.3; in fp8 P mode
  // 0.3 * 256 = 76.8 rounds to the e4m3 code 80 (spacing 8 in [64, 128)), so
  // O = (v0 + 80/256 v1) / (1 + 0.3), with l the fp32 sum of unrounded p.
  TinyCache cache({basis(0, 0.0f), basis(0, 1.0f)}, {basis(0, 1.0f), basis(1, 1.0f)});
  std::vector<float> q = basis(0, std::log(0.3f));
  DecodeParams params;
  params.softmax_scale = 1.0f;
  params.p_mode = PMode::fp8;
  const Outputs r = run(GetParam(), cache, q, 1, true, params);
  EXPECT_NEAR(r.o[0], 1.0 / 1.3, 2e-7);
  EXPECT_NEAR(r.o[1], 0.3125 / 1.3, 2e-7);
  params.p_mode = PMode::fp32;
  const Outputs exact = run(GetParam(), cache, q, 1, true, params);
  EXPECT_NEAR(exact.o[1], 0.3 / 1.3, 2e-7);
}

TEST_P(HandWorked, Fp16ProbabilitiesNeedACacheTheirSumsTake) {
  TinyCache cache({basis(0, 1.0f)}, {basis(0, 1.0f)});  // bf16: values fp16 cannot hold
  DecodeParams params;
  params.p_mode = PMode::fp16;
  mjolnir::testing::expect_error([&] { run(GetParam(), cache, basis(0, 1.0f), 1, true, params); },
                                 "p_mode: fp16");
}

INSTANTIATE_TEST_SUITE_P(Backends, HandWorked, ::testing::Values("reference", "cpu"));

TEST(Emulator, Fp16ProbabilitiesSumInFp16PerGroupOf32Keys) {
  // 33 keys with equal scores (q = 0): p = 1 each. Channel 0 of V: 448 for the first key, 0.125
  // for the other 32 (both e4m3 values). In fp16 448 + 0.125 is a tie between 448 and 448.25
  // (spacing 0.25 in [256, 512)) that rounds to 448, the even one, so the first group's 31 small
  // terms vanish: 448. The second group (key 32) is 0.125 alone, added in fp32: O = 448.125 / 33.
  // P in fp32 sums all of them: (448 + 32 * 0.125) / 33. Channel 1 (1.0 everywhere) is 1 either
  // way.
  std::vector<std::vector<float>> k(33, basis(0, 1.0f)), v(33, basis(0, 0.125f));
  v[0][0] = 448.0f;
  for (auto& row : v) row[1] = 1.0f;
  TinyCache cache(k, v, Format::fp8_e4m3);
  DecodeParams params;
  params.p_mode = PMode::fp16;
  const std::vector<float> q(kD, 0.0f);
  const Outputs half = run("reference", cache, q, 1, true, params);
  EXPECT_FLOAT_EQ(half.o[0], 448.125f / 33);
  EXPECT_FLOAT_EQ(half.o[1], 1.0f);
  params.p_mode = PMode::fp32;
  const Outputs single = run("reference", cache, q, 1, true, params);
  EXPECT_FLOAT_EQ(single.o[0], 452.0f / 33);
  EXPECT_FLOAT_EQ(single.o[1], 1.0f);
}

TEST(Emulator, Fp16ProbabilitiesSumE5M2ValuesAtAScaleFp16Holds) {
  // 32 keys with equal scores (q = 0): p = 1 each. Channel 0 of V: 57344, e5m2's largest value,
  // for every key: summed as it is, fp16 would overflow at the second key (114688 > 65504); at
  // half_sum_scale 2^-8 each is 224 and the 32 sum to 7168 exactly, so O = 57344. Channel 1: 0.5
  // for the first key, 2^-16 (e5m2's smallest) for the other 31: scaled, 2^-9 + 2^-24 rounds back
  // to 2^-9 (2^-24 is a quarter of fp16's spacing there, 2^-19) every time, so O = 0.5 / 32,
  // where P fp32 keeps them: (0.5 + 31 * 2^-16) / 32.
  std::vector<std::vector<float>> k(32, basis(0, 1.0f)), v(32, basis(0, 57344.0f));
  for (auto& row : v) row[1] = 0x1p-16f;
  v[0][1] = 0.5f;
  TinyCache cache(k, v, Format::fp8_e5m2);
  DecodeParams params;
  params.p_mode = PMode::fp16;
  const std::vector<float> q(kD, 0.0f);
  const Outputs half = run("reference", cache, q, 1, true, params);
  EXPECT_FLOAT_EQ(half.o[0], 57344.0f);
  EXPECT_FLOAT_EQ(half.o[1], 0.5f / 32);
  params.p_mode = PMode::fp32;
  const Outputs single = run("reference", cache, q, 1, true, params);
  EXPECT_FLOAT_EQ(single.o[0], 57344.0f);
  EXPECT_FLOAT_EQ(single.o[1], (0.5f + 31 * 0x1p-16f) / 32);
}

TEST(Emulator, Fp8QueryCodesPerSequenceAndHead) {
  // amax 896 -> sq = 896 / 448 = 2; q / sq = 448, 0.5, 1.65 -> e4m3 448, 0.5, 1.625.
  TinyCache cache({basis(0, 1.0f)}, {basis(0, 1.0f)});
  std::vector<float> q(kD, 0.0f);
  q[0] = 896.0f;
  q[1] = 1.0f;
  q[2] = 3.3f;
  std::vector<float> o(kD);
  DecodeParams params;
  params.num_q_heads = 1;
  params.q_mode = QMode::fp8;
  const DecodeArgs args{
      cache.view(),
      PagedBatch{cache.block_table, int(cache.block_table.size()), cache.seq_lens},
      params,
      QueryTensor{q.data(), kD, kD},
      OutputTensor{o.data(), kD, kD},
      {}};
  const reference::PreparedQuery prepared = reference::prepare_query(args, 0, 0);
  EXPECT_EQ(prepared.values[0], 448.0f);
  EXPECT_EQ(prepared.values[1], 0.5f);
  EXPECT_EQ(prepared.values[2], 1.625f);
  EXPECT_EQ(prepared.values[3], 0.0f);
  EXPECT_FLOAT_EQ(prepared.score_scale, 2.0f / std::sqrt(32.0f) * 1.4426950408889634f);
}

TEST(Merge, WeightsChunksByTheirLse) {
  // lse ln 1 and ln 3: weights 1/4 and 3/4, merged lse ln 4.
  const std::vector<float> partial_o{1.0f, 2.0f, 5.0f, 6.0f};
  const std::vector<float> partial_lse{0.0f, std::log(3.0f)};
  std::vector<float> o(2);
  float lse = 0;
  merge_chunks(partial_o.data(), 2, partial_lse.data(), 1, 2, 2, o.data(), &lse);
  EXPECT_FLOAT_EQ(o[0], 0.25f * 1 + 0.75f * 5);
  EXPECT_FLOAT_EQ(o[1], 0.25f * 2 + 0.75f * 6);
  EXPECT_FLOAT_EQ(lse, std::log(4.0f));
}

TEST(Merge, EmptyChunksWeighNothingAndAllEmptyIsZero) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> o(2);
  float lse = 0;
  const float first_empty_o[] = {9.0f, 9.0f, 3.0f, 4.0f}, first_empty_lse[] = {-inf, 1.5f};
  merge_chunks(first_empty_o, 2, first_empty_lse, 1, 2, 2, o.data(), &lse);
  EXPECT_EQ(o[0], 3.0f);
  EXPECT_EQ(o[1], 4.0f);
  EXPECT_EQ(lse, 1.5f);
  const float both_empty_o[] = {9.0f, 9.0f, 9.0f, 9.0f}, both_empty_lse[] = {-inf, -inf};
  merge_chunks(both_empty_o, 2, both_empty_lse, 1, 2, 2, o.data(), &lse);
  EXPECT_EQ(o[0], 0.0f);
  EXPECT_EQ(o[1], 0.0f);
  EXPECT_EQ(lse, -inf);
}

// The partial layout's strides (slots of every head's rows apart): chunks of D 2 three floats
// apart with a stray value between them, LSEs two apart. Then a poisoned chunk (LSE NaN).
TEST(Merge, ReadsChunksAtTheirStridesAndAPoisonedChunkPoisonsTheRow) {
  const float partial_o[] = {1.0f, 2.0f, 100.0f, 5.0f, 6.0f};
  const float partial_lse[] = {0.0f, 100.0f, std::log(3.0f)};
  std::vector<float> o(2);
  float lse = 0;
  merge_chunks(partial_o, 3, partial_lse, 2, 2, 2, o.data(), &lse);
  EXPECT_FLOAT_EQ(o[0], 0.25f * 1 + 0.75f * 5);
  EXPECT_FLOAT_EQ(o[1], 0.25f * 2 + 0.75f * 6);
  EXPECT_FLOAT_EQ(lse, std::log(4.0f));
  const float poisoned_lse[] = {0.0f, 100.0f, std::numeric_limits<float>::quiet_NaN()};
  merge_chunks(partial_o, 3, poisoned_lse, 2, 2, 2, o.data(), &lse);
  EXPECT_TRUE(std::isnan(o[0]) && std::isnan(o[1]) && std::isnan(lse));
}

}  // namespace
}  // namespace mjolnir

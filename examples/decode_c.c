/* decode_c: one decode step over an fp8 KV cache through the mjolnir C API.
 *
 * Builds a paged fp8_e4m3 cache, writes random K/V into it with mjolnir_write_kv, plans and
 * decodes a small batch (q_len 2: one token plus one speculative token) on the "cpu" backend,
 * then checks the output twice: against the "reference" backend (the bit-faithful emulator) run
 * through the same API, and against a plain double-precision attention computed here from the
 * fp8 codes read back out of the pool. Prints the largest differences; exits 0 when both are
 * within tolerance.
 *
 * Usage: decode_c [seed]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mjolnir/mjolnir.h"

enum {
  kNumKvHeads = 2,
  kGroup = 4, /* query heads per KV head */
  kNumQHeads = kNumKvHeads * kGroup,
  kHeadDim = 64,
  kPageSize = 16,
  kNumPages = 24,
  kNumSeqs = 3,
  kQLen = 2,
  kMaxPagesPerSeq = 8
};

/* Sequence lengths (the q_len new tokens included); sequence 2 spans a page boundary + 1. */
static const int32_t kSeqLens[kNumSeqs] = {37, 100, kPageSize + 1};

/* A small seeded generator (xorshift64*), uniform in [-1, 1). */
static uint64_t g_state;
static float uniform(void) {
  g_state ^= g_state >> 12;
  g_state ^= g_state << 25;
  g_state ^= g_state >> 27;
  return (float)((double)((g_state * 2685821657736338717ull) >> 11) / 9007199254740992.0 * 2.0 -
                 1.0);
}

/* OCP E4M3FN code to its value (no Inf; S.1111.111 is NaN). */
static double decode_e4m3(uint8_t code) {
  const int sign = code >> 7, exponent = (code >> 3) & 15, mantissa = code & 7;
  double value;
  if (exponent == 15 && mantissa == 7) return NAN;
  if (exponent == 0) {
    value = ldexp(mantissa / 8.0, -6);
  } else {
    value = ldexp(1.0 + mantissa / 8.0, exponent - 7);
  }
  return sign ? -value : value;
}

#define CHECK(call)                                                                 \
  do {                                                                              \
    mjolnir_status status_ = (call);                                                \
    if (status_ != MJOLNIR_OK) {                                                    \
      fprintf(stderr, "%s failed: %s: %s\n", #call, mjolnir_status_string(status_), \
              mjolnir_last_error());                                                \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

/* Causal attention of one query row against the cache, in double, from the stored codes. */
static void plain_attention(const uint8_t* pool, const int64_t strides[4], const int32_t* table,
                            int seq, int t, int head, const float* q, float k_scale, float v_scale,
                            double* out) {
  const int kv_head = head / kGroup;
  const int visible = kSeqLens[seq] - kQLen + t + 1; /* KV positions [0, visible) */
  const double softmax_scale = 1.0 / sqrt((double)kHeadDim);
  double scores[kMaxPagesPerSeq * kPageSize];
  double max_score = -INFINITY, sum = 0.0;
  int n, c;
  for (n = 0; n < visible; ++n) {
    const int32_t page = table[seq * kMaxPagesPerSeq + n / kPageSize];
    const uint8_t* k_row =
        pool + page * strides[0] + kv_head * strides[1] + (n % kPageSize) * strides[2];
    double dot = 0.0;
    for (c = 0; c < kHeadDim; ++c) dot += (double)q[c] * decode_e4m3(k_row[c]) * k_scale;
    scores[n] = dot * softmax_scale;
    if (scores[n] > max_score) max_score = scores[n];
  }
  for (c = 0; c < kHeadDim; ++c) out[c] = 0.0;
  for (n = 0; n < visible; ++n) {
    const int32_t page = table[seq * kMaxPagesPerSeq + n / kPageSize];
    const uint8_t* v_row =
        pool + page * strides[0] + kv_head * strides[1] + (n % kPageSize) * strides[2] + strides[3];
    const double p = exp(scores[n] - max_score);
    sum += p;
    for (c = 0; c < kHeadDim; ++c) out[c] += p * decode_e4m3(v_row[c]) * v_scale;
  }
  for (c = 0; c < kHeadDim; ++c) out[c] /= sum;
}

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 20240611u;
  const float k_scale = 2.0f / 448.0f, v_scale = 1.5f / 448.0f; /* K in [-2, 2), V in [-1.5, 1.5) */
  const int num_rows = kNumSeqs * kQLen;                        /* query token rows */
  mjolnir_cache_desc desc;
  mjolnir_decode_params params;
  mjolnir_decode_args args;
  mjolnir_cache* cache = NULL;
  mjolnir_backend *cpu = NULL, *reference = NULL;
  mjolnir_plan* plan = NULL;
  size_t pool_bytes = 0, workspace_bytes = 0, reference_bytes = 0;
  void *pool, *workspace;
  int32_t block_table[kNumSeqs * kMaxPagesPerSeq];
  int64_t strides[4];
  float *k, *v, *q, *o_cpu, *o_ref, *lse;
  int64_t* slots;
  int num_tokens = 0, b, i, t, h, c, items, partials, seqs, exit_code;
  double max_backend_diff = 0.0, max_plain_diff = 0.0;

  g_state = seed * 0x9E3779B97F4A7C15ull + 1;
  printf("mjolnir %s (C API), seed %llu\n", mjolnir_version_string(), (unsigned long long)seed);

  /* 1. The cache: describe it, size and allocate the pool, create the handle. */
  mjolnir_cache_desc_init(&desc);
  desc.format = MJOLNIR_FORMAT_FP8_E4M3;
  desc.page_size = kPageSize;
  desc.num_kv_heads = kNumKvHeads;
  desc.head_dim = kHeadDim;
  desc.num_pages = kNumPages;
  desc.layout = MJOLNIR_LAYOUT_B2NHD; /* vLLM's flash layout */
  desc.granularity = MJOLNIR_GRANULARITY_TENSOR;
  desc.k_scale = &k_scale;
  desc.k_scale_count = 1;
  desc.v_scale = &v_scale;
  desc.v_scale_count = 1;
  CHECK(mjolnir_pool_bytes(&desc, &pool_bytes));
  pool = calloc(pool_bytes, 1);
  desc.pool = pool;
  desc.pool_bytes = pool_bytes;
  CHECK(mjolnir_cache_create(&desc, &cache));
  CHECK(mjolnir_cache_strides(cache, strides));

  /* 2. Pages: sequence b owns pages b, b + 3, b + 6, ... (interleaved, as an allocator would). */
  for (b = 0; b < kNumSeqs; ++b) {
    for (i = 0; i < kMaxPagesPerSeq; ++i) block_table[b * kMaxPagesPerSeq + i] = b + kNumSeqs * i;
    num_tokens += kSeqLens[b];
  }

  /* 3. Write every token's K and V: [num_tokens, Hk, D], dense. */
  k = malloc(sizeof(float) * num_tokens * kNumKvHeads * kHeadDim);
  v = malloc(sizeof(float) * num_tokens * kNumKvHeads * kHeadDim);
  slots = malloc(sizeof(int64_t) * num_tokens);
  for (i = 0; i < num_tokens * kNumKvHeads * kHeadDim; ++i) {
    k[i] = 2.0f * uniform();
    v[i] = 1.5f * uniform();
  }
  i = 0;
  for (b = 0; b < kNumSeqs; ++b) {
    for (t = 0; t < kSeqLens[b]; ++t, ++i) {
      slots[i] =
          (int64_t)block_table[b * kMaxPagesPerSeq + t / kPageSize] * kPageSize + t % kPageSize;
    }
  }
  CHECK(mjolnir_write_kv(cache, k, kNumKvHeads * kHeadDim, kHeadDim, v, kNumKvHeads * kHeadDim,
                         kHeadDim, slots, num_tokens, NULL, NULL));

  /* 4. Backends, a plan for this step, and the workspace (sized once, owned here). */
  CHECK(mjolnir_backend_create("cpu", 2, &cpu));
  CHECK(mjolnir_backend_create("reference", 0, &reference));
  CHECK(mjolnir_plan_create(kNumSeqs, kNumKvHeads, 4, &plan));
  /* Short sequences are not split by default; force two chunks to exercise the merge. */
  CHECK(mjolnir_plan_set_option(plan, MJOLNIR_PLAN_FIXED_SPLITS, 2));
  CHECK(mjolnir_plan_set_option(plan, MJOLNIR_PLAN_TILE_TOKENS, 16));
  CHECK(mjolnir_plan_update(plan, kSeqLens, kNumSeqs, kQLen, cpu));
  CHECK(mjolnir_plan_counts(plan, &seqs, &items, &partials));
  printf("plan: %d sequences, %d work items, %d split partials\n", seqs, items, partials);

  mjolnir_decode_params_init(&params);
  params.q_len = kQLen;
  params.num_q_heads = kNumQHeads;
  CHECK(mjolnir_workspace_size(cpu, plan, cache, &params, &workspace_bytes));
  CHECK(mjolnir_workspace_size(reference, plan, cache, &params, &reference_bytes));
  if (reference_bytes > workspace_bytes) workspace_bytes = reference_bytes;
  workspace = malloc(workspace_bytes);

  /* 5. Decode: Q and O are [num_seqs * q_len, Hq, D], dense. */
  q = malloc(sizeof(float) * num_rows * kNumQHeads * kHeadDim);
  o_cpu = malloc(sizeof(float) * num_rows * kNumQHeads * kHeadDim);
  o_ref = malloc(sizeof(float) * num_rows * kNumQHeads * kHeadDim);
  lse = malloc(sizeof(float) * num_rows * kNumQHeads);
  for (i = 0; i < num_rows * kNumQHeads * kHeadDim; ++i) q[i] = uniform();
  mjolnir_decode_args_init(&args);
  args.seq_lens = kSeqLens;
  args.num_seqs = kNumSeqs;
  args.block_table = block_table;
  args.max_pages_per_seq = kMaxPagesPerSeq;
  args.q = q;
  args.q_token_stride = kNumQHeads * kHeadDim;
  args.q_head_stride = kHeadDim;
  args.o = o_cpu;
  args.o_token_stride = kNumQHeads * kHeadDim;
  args.o_head_stride = kHeadDim;
  args.lse = lse;
  CHECK(mjolnir_decode(cpu, plan, cache, &params, &args, workspace, workspace_bytes));
  args.o = o_ref;
  args.lse = NULL;
  CHECK(mjolnir_decode(reference, plan, cache, &params, &args, workspace, workspace_bytes));

  /* 6. Check. */
  for (b = 0; b < kNumSeqs; ++b) {
    for (t = 0; t < kQLen; ++t) {
      const int row = b * kQLen + t;
      for (h = 0; h < kNumQHeads; ++h) {
        const float* out = o_cpu + ((int64_t)row * kNumQHeads + h) * kHeadDim;
        const float* ref = o_ref + ((int64_t)row * kNumQHeads + h) * kHeadDim;
        double plain[kHeadDim];
        plain_attention((const uint8_t*)pool, strides, block_table, b, t, h,
                        q + ((int64_t)row * kNumQHeads + h) * kHeadDim, k_scale, v_scale, plain);
        for (c = 0; c < kHeadDim; ++c) {
          const double backend_diff = fabs((double)out[c] - ref[c]);
          const double plain_diff = fabs((double)out[c] - plain[c]);
          if (!(backend_diff <= max_backend_diff)) max_backend_diff = backend_diff; /* NaN too */
          if (!(plain_diff <= max_plain_diff)) max_plain_diff = plain_diff;
        }
      }
    }
  }
  printf("o[0][0][0..3] = %.6f %.6f %.6f %.6f, lse[0][0] = %.6f\n", o_cpu[0], o_cpu[1], o_cpu[2],
         o_cpu[3], lse[0]);
  printf("max |cpu - reference|        = %.3g (tolerance 1e-4)\n", max_backend_diff);
  printf("max |cpu - plain C (double)| = %.3g (tolerance 1e-3)\n", max_plain_diff);
  exit_code = max_backend_diff <= 1e-4 && max_plain_diff <= 1e-3 ? 0 : 1;
  printf("%s\n", exit_code == 0 ? "ok" : "FAILED");

  mjolnir_plan_destroy(plan);
  mjolnir_backend_destroy(reference);
  mjolnir_backend_destroy(cpu);
  mjolnir_cache_destroy(cache);
  free(pool);
  free(workspace);
  free(k);
  free(v);
  free(slots);
  free(q);
  free(o_cpu);
  free(o_ref);
  free(lse);
  return exit_code;
}

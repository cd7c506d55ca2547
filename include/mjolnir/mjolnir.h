/* mjolnir C API: paged decode attention over low-bit KV caches, callable from C (C99 and up).
 *
 * Conventions (docs/c-api.md walks through a whole step):
 *  - Every call that can fail returns an mjolnir_status. MJOLNIR_OK is 0; the other values are
 *    pinned and the list only grows. mjolnir_status_string() names a status.
 *  - Detail goes to a message that names the offending argument, prefixed by the function
 *    ("mjolnir_decode: block_table[3][7]: page 912 is outside the pool of 512 pages"). Each
 *    handle keeps the message of the most recent call that named it as its first argument
 *    (mjolnir_cache_last_error() etc.; "" after a success), and each thread keeps the message of
 *    its own most recent call (mjolnir_last_error()), which is where calls that fail before a
 *    handle exists (the create functions) leave theirs. A message stays valid until the next
 *    call on that handle, or on that thread.
 *  - Handles are opaque, made by a create function and released by its destroy function;
 *    destroy(NULL) does nothing. A failed create leaves *out NULL.
 *  - Input structs begin with a `size` field: set it to sizeof(the struct), or use the
 *    mjolnir_*_init() functions below, which also fill the defaults. A size smaller than the
 *    first published version of the struct fails with MJOLNIR_ERROR_STRUCT_SIZE; a larger one
 *    (a caller built against a newer header) is accepted when every byte this library does not
 *    know is zero.
 *  - Enumerated values travel as int32_t (struct fields and arguments), so any value a caller
 *    passes is well defined here; an unknown one is MJOLNIR_ERROR_INVALID_ARGUMENT.
 *  - Sizes and strides are explicit: strides count elements for float tensors and bytes for the
 *    cache pool. Tensor shapes are written outermost first: [num_tokens, Hk, D].
 *  - No C++ exception crosses this API; out of memory is MJOLNIR_ERROR_OUT_OF_MEMORY.
 *  - Threads: calls on different handles may run concurrently. A call may change the handle it
 *    names first (its message; a plan's step in mjolnir_plan_update), so that handle is used by
 *    one thread at a time. The handles a call takes after the first it only reads (the plan and
 *    cache of mjolnir_decode and mjolnir_workspace_size, the backend of mjolnir_plan_update):
 *    any number of calls may read one at once, while no call names it first. Concurrent decodes
 *    therefore need a backend handle and a workspace each, and may share one cache and one plan
 *    (updated before they start, not while they run). mjolnir_last_error() is per thread. Caller
 *    memory: the pool, scales, q, seq_lens and block_table may be read by concurrent calls; o,
 *    lse, the workspace and k_amax / v_amax belong to one call at a time. mjolnir_write_kv writes
 *    only the rows of its slots: writers with a cache handle each (over one pool) may write
 *    distinct slots at once, also while decodes read other rows. A "cpu" backend runs one step at
 *    a time on worker threads of its own. tests/test_concurrency.cc checks this
 *    (scripts/test.sh --tsan: under ThreadSanitizer).
 *  - Memory: with the "cpu" and "reference" backends every pointer is host memory, and
 *    mjolnir_write_kv always writes the pool from the host. A device backend says where its
 *    arguments live (for "cuda", once built: pool, q, o, lse and workspace on the device; scales,
 *    block_table and seq_lens on the host).
 *  - The decode hot path (mjolnir_plan_update, mjolnir_decode) allocates nothing in this layer:
 *    the plan lives in buffers sized at creation and the caller owns the workspace.
 */
#ifndef MJOLNIR_MJOLNIR_H_
#define MJOLNIR_MJOLNIR_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* MJOLNIR_API marks the exported functions. Define MJOLNIR_STATIC when linking the static
 * library on Windows. */
#if defined(_WIN32)
#if defined(MJOLNIR_STATIC)
#define MJOLNIR_API
#elif defined(MJOLNIR_BUILDING_LIBRARY)
#define MJOLNIR_API __declspec(dllexport)
#else
#define MJOLNIR_API __declspec(dllimport)
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define MJOLNIR_API __attribute__((visibility("default")))
#else
#define MJOLNIR_API
#endif

#define MJOLNIR_VERSION_MAJOR 0
#define MJOLNIR_VERSION_MINOR 1
#define MJOLNIR_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, as mjolnir_version() returns it. */
#define MJOLNIR_VERSION_NUMBER \
  (MJOLNIR_VERSION_MAJOR * 10000 + MJOLNIR_VERSION_MINOR * 100 + MJOLNIR_VERSION_PATCH)

/* mjolnir_decode() needs its workspace aligned to this many bytes (malloc's alignment). */
#define MJOLNIR_WORKSPACE_ALIGNMENT 16

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status and errors ------------------------------------------------------------------- */

/* Pinned values, append-only. */
typedef enum mjolnir_status {
  MJOLNIR_OK = 0,
  /* An argument is out of range or inconsistent (shape, stride, count, name, pointer). */
  MJOLNIR_ERROR_INVALID_ARGUMENT = 1,
  /* A handle argument is NULL. */
  MJOLNIR_ERROR_NULL_HANDLE = 2,
  /* A struct's `size` field is too small, or a newer caller set fields this library lacks. */
  MJOLNIR_ERROR_STRUCT_SIZE = 3,
  /* A caller buffer (scales, workspace) is smaller than the call needs. */
  MJOLNIR_ERROR_BUFFER_TOO_SMALL = 4,
  /* The backend or configuration is not available in this build or on this machine. */
  MJOLNIR_ERROR_UNSUPPORTED = 5,
  /* The step needs more than the plan was created for (sequences). */
  MJOLNIR_ERROR_CAPACITY_EXCEEDED = 6,
  /* The plan was not filled for this step (seq_lens, q_len or KV heads differ). */
  MJOLNIR_ERROR_PLAN_MISMATCH = 7,
  /* A file cannot be read or written, or its contents are malformed. */
  MJOLNIR_ERROR_FILE = 8,
  MJOLNIR_ERROR_OUT_OF_MEMORY = 9,
  /* Anything else: a bug in mjolnir; the message says what. */
  MJOLNIR_ERROR_INTERNAL = 10
} mjolnir_status;

/* A static name for the status ("MJOLNIR_ERROR_PLAN_MISMATCH"), or "unknown status". */
MJOLNIR_API const char* mjolnir_status_string(int status);
/* This thread's most recent message ("" when its last call succeeded). Never NULL. */
MJOLNIR_API const char* mjolnir_last_error(void);

/* MJOLNIR_VERSION_NUMBER of the library at run time, and "0.1.0". */
MJOLNIR_API unsigned mjolnir_version(void);
MJOLNIR_API const char* mjolnir_version_string(void);

/* ---- formats, layouts, scales --------------------------------------------------------------- */

/* KV cache element formats (docs/design.md section 3). Pinned values. */
typedef enum mjolnir_format {
  MJOLNIR_FORMAT_BF16 = 0,
  MJOLNIR_FORMAT_FP16 = 1,
  MJOLNIR_FORMAT_FP8_E4M3 = 2,
  MJOLNIR_FORMAT_FP8_E5M2 = 3,
  MJOLNIR_FORMAT_FP6_E2M3 = 4,
  MJOLNIR_FORMAT_FP6_E3M2 = 5,
  MJOLNIR_FORMAT_FP4_E2M1 = 6,
  MJOLNIR_FORMAT_NVFP4 = 7
} mjolnir_format;

/* Named cache layouts, dimensions outermost first: B page, H KV head, N token in page, 2 K/V,
 * D the packed channels. MJOLNIR_LAYOUT_STRIDES takes the explicit byte strides of
 * mjolnir_cache_desc instead. vLLM's flash layout is B2NHD. */
typedef enum mjolnir_layout {
  MJOLNIR_LAYOUT_STRIDES = 0,
  MJOLNIR_LAYOUT_BHN2D = 1,
  MJOLNIR_LAYOUT_BNH2D = 2,
  MJOLNIR_LAYOUT_B2NHD = 3,
  MJOLNIR_LAYOUT_B2HND = 4,
  MJOLNIR_LAYOUT_2BNHD = 5,
  MJOLNIR_LAYOUT_2BHND = 6
} mjolnir_layout;

/* How K and V scales are indexed: 1 value, [Hk], or [Hk, D]. */
typedef enum mjolnir_granularity {
  MJOLNIR_GRANULARITY_TENSOR = 0,
  MJOLNIR_GRANULARITY_HEAD = 1,
  MJOLNIR_GRANULARITY_CHANNEL = 2
} mjolnir_granularity;

/* "fp8_e4m3", "B2NHD", "channel"; NULL for a value outside the enum. */
MJOLNIR_API const char* mjolnir_format_name(int32_t format);
MJOLNIR_API const char* mjolnir_layout_name(int32_t layout);
MJOLNIR_API const char* mjolnir_granularity_name(int32_t granularity);

/* ---- the KV cache --------------------------------------------------------------------------- */

/* Describes a paged KV cache pool that the caller owns. */
typedef struct mjolnir_cache_desc {
  size_t size;          /* sizeof(mjolnir_cache_desc) */
  int32_t format;       /* mjolnir_format */
  int32_t page_size;    /* tokens per page: a power of two in [8, 256] */
  int32_t num_kv_heads; /* Hk >= 1 */
  int32_t head_dim;     /* D: a multiple of 32 in [32, 256] */
  int32_t num_pages;    /* pages in the pool, >= 1 */
  int32_t layout;       /* mjolnir_layout */
  /* Byte strides, read only when layout is MJOLNIR_LAYOUT_STRIDES: row (page, head, token, kv)
   * (kv 0 = K, 1 = V) starts at pool + page * page_stride + head * head_stride + token *
   * token_stride + kv * kv_stride and holds one packed row of D channels. */
  int64_t page_stride;
  int64_t head_stride;
  int64_t token_stride;
  int64_t kv_stride;
  int32_t granularity; /* mjolnir_granularity */
  /* Positive finite scales: 1, Hk or Hk * D values each (stored value = decoded code * scale).
   * They are copied at creation. */
  const float* k_scale;
  int64_t k_scale_count;
  const float* v_scale;
  int64_t v_scale_count;
  /* The pool: every addressed row lies inside [pool, pool + pool_bytes). Not copied, not owned:
   * it must outlive the handle. */
  void* pool;
  size_t pool_bytes;
} mjolnir_cache_desc;

/* Sets size and the defaults: fp8_e4m3, page 16, D 128, B2NHD, one tensor scale; num_kv_heads,
 * num_pages, the scales and the pool are left 0 / NULL for the caller. */
static inline void mjolnir_cache_desc_init(mjolnir_cache_desc* desc) {
  memset(desc, 0, sizeof(*desc));
  desc->size = sizeof(mjolnir_cache_desc);
  desc->format = MJOLNIR_FORMAT_FP8_E4M3;
  desc->page_size = 16;
  desc->head_dim = 128;
  desc->layout = MJOLNIR_LAYOUT_B2NHD;
  desc->granularity = MJOLNIR_GRANULARITY_TENSOR;
}

typedef struct mjolnir_cache mjolnir_cache;

/* Bytes a dense pool of desc's format and geometry occupies (any named layout); the layout,
 * scale and pool fields are not read. */
MJOLNIR_API mjolnir_status mjolnir_pool_bytes(const mjolnir_cache_desc* desc, size_t* bytes);
/* Validates desc (geometry, strides inside the pool and not overlapping, scale counts and
 * values) and makes a handle that refers to the pool. */
MJOLNIR_API mjolnir_status mjolnir_cache_create(const mjolnir_cache_desc* desc,
                                                mjolnir_cache** out);
MJOLNIR_API void mjolnir_cache_destroy(mjolnir_cache* cache);
MJOLNIR_API const char* mjolnir_cache_last_error(const mjolnir_cache* cache);
/* The byte strides in use (page, head, token, kv): the named layout's, or desc's. */
MJOLNIR_API mjolnir_status mjolnir_cache_strides(mjolnir_cache* cache, int64_t strides[4]);

/* The element type of the float rows the library reads and writes: k and v of
 * mjolnir_write_kv_rows, q and o of mjolnir_decode_args. */
typedef enum mjolnir_row_type {
  MJOLNIR_ROWS_F32 = 0, /* float */
  /* bf16 bits in uint16_t (a bf16 model's own tensors): an input row is its float32 widening,
   * exactly; an output row (o) is the float32 result rounded to nearest even (NaN as 0x7FC0),
   * bit for bit. */
  MJOLNIR_ROWS_BF16 = 1
} mjolnir_row_type;

/* Quantizes new tokens into their cache slots, as vLLM's reshape_and_cache_flash does.
 *   k, v: float32 [num_tokens, Hk, D], channels contiguous, strides in elements.
 *   slot_mapping: int64 [num_tokens], slot = page * page_size + offset; negative = skip.
 *   k_amax, v_amax: NULL, or both [Hk, D] running maxima of |x| that the call only raises
 *   (calibration; see mjolnir_scales_from_amax).
 * Everything is checked before any byte is written; a non-finite value to be stored is an error
 * that names it ("k[5][2][17] is NaN"). Two tokens in one slot: the later one wins. */
MJOLNIR_API mjolnir_status mjolnir_write_kv(mjolnir_cache* cache, const float* k,
                                            int64_t k_token_stride, int64_t k_head_stride,
                                            const float* v, int64_t v_token_stride,
                                            int64_t v_head_stride, const int64_t* slot_mapping,
                                            int64_t num_tokens, float* k_amax, float* v_amax);
/* The same with k and v of row_type (mjolnir_row_type): MJOLNIR_ROWS_BF16 writes a bf16 model's
 * K and V as they are, the cache bytes those of their float32 widening. */
MJOLNIR_API mjolnir_status mjolnir_write_kv_rows(mjolnir_cache* cache, int32_t row_type,
                                                 const void* k, int64_t k_token_stride,
                                                 int64_t k_head_stride, const void* v,
                                                 int64_t v_token_stride, int64_t v_head_stride,
                                                 const int64_t* slot_mapping, int64_t num_tokens,
                                                 float* k_amax, float* v_amax);

/* ---- backends ------------------------------------------------------------------------------- */

typedef struct mjolnir_backend mjolnir_backend;

/* name: "cpu" (threads: worker threads, 0 = all cores) or "reference" (the bit-faithful
 * emulator, single-threaded; threads is ignored). "cuda" is MJOLNIR_ERROR_UNSUPPORTED through the
 * C API for now: the CUDA backend takes device memory, which this API does not yet describe. */
MJOLNIR_API mjolnir_status mjolnir_backend_create(const char* name, int32_t threads,
                                                  mjolnir_backend** out);
MJOLNIR_API void mjolnir_backend_destroy(mjolnir_backend* backend);
MJOLNIR_API const char* mjolnir_backend_last_error(const mjolnir_backend* backend);
/* The backend's name ("cpu"); NULL for a NULL handle. */
MJOLNIR_API const char* mjolnir_backend_name(const mjolnir_backend* backend);

/* ---- plan ----------------------------------------------------------------------------------- */

typedef struct mjolnir_plan mjolnir_plan;

/* Plan options: set with mjolnir_plan_set_option(), bounds from mjolnir_plan_option_bounds().
 * Pinned values, append-only. */
typedef enum mjolnir_plan_option {
  /* Device capacity the split heuristic fills; 0 (default) = the backend's worker count. */
  MJOLNIR_PLAN_WORKERS = 0,
  /* Cap on chunks per sequence; default and upper limit: the plan's max_splits capacity. */
  MJOLNIR_PLAN_MAX_SPLITS = 1,
  /* Tokens per online-softmax tile; chunk bounds are multiples of it. Default 64. */
  MJOLNIR_PLAN_TILE_TOKENS = 2,
  /* A sequence is not cut into chunks shorter than this. Default 256. */
  MJOLNIR_PLAN_MIN_CHUNK_TOKENS = 3,
  /* > 0: cut every sequence into this many chunks (tests, tuning). Default 0. */
  MJOLNIR_PLAN_FIXED_SPLITS = 4
} mjolnir_plan_option;

MJOLNIR_API mjolnir_status mjolnir_plan_option_bounds(int32_t option, int32_t* lower,
                                                      int32_t* upper);

/* A plan in buffers for up to max_seqs sequences of num_kv_heads KV heads, each cut into at
 * most max_splits chunks. Later updates never allocate, so a serving loop (or a captured CUDA
 * graph) reuses it for every step that fits. */
MJOLNIR_API mjolnir_status mjolnir_plan_create(int32_t max_seqs, int32_t num_kv_heads,
                                               int32_t max_splits, mjolnir_plan** out);
MJOLNIR_API void mjolnir_plan_destroy(mjolnir_plan* plan);
MJOLNIR_API const char* mjolnir_plan_last_error(const mjolnir_plan* plan);
MJOLNIR_API mjolnir_status mjolnir_plan_set_option(mjolnir_plan* plan, int32_t option,
                                                   int32_t value);
MJOLNIR_API mjolnir_status mjolnir_plan_get_option(mjolnir_plan* plan, int32_t option,
                                                   int32_t* value);
/* Refills the plan for one step on this backend: seq_lens [num_seqs] (KV tokens per sequence,
 * the q_len new ones included; 0 = a padding request), q_len query tokens per sequence (1..8).
 * The backend supplies the worker count (unless MJOLNIR_PLAN_WORKERS is set) and prepares what
 * it runs the step with, once for every mjolnir_decode of the step (one per layer): the cpu
 * backend its work units, so a cpu backend decodes only with a plan a cpu backend updated (the
 * reference backend runs any plan). num_seqs above the capacity is
 * MJOLNIR_ERROR_CAPACITY_EXCEEDED. */
MJOLNIR_API mjolnir_status mjolnir_plan_update(mjolnir_plan* plan, const int32_t* seq_lens,
                                               int32_t num_seqs, int32_t q_len,
                                               const mjolnir_backend* backend);
/* What the last update made: sequences, work items, and split partial slots in use. */
MJOLNIR_API mjolnir_status mjolnir_plan_counts(mjolnir_plan* plan, int32_t* num_seqs,
                                               int32_t* num_items, int32_t* num_partials);

/* ---- decode --------------------------------------------------------------------------------- */

typedef enum mjolnir_q_mode {
  MJOLNIR_Q_FP32 = 0,
  MJOLNIR_Q_BF16 = 1,
  MJOLNIR_Q_FP8 = 2, /* dynamic per (sequence, KV head): sq = amax / 448 */
  MJOLNIR_Q_INT8 = 3 /* dynamic per (sequence, KV head): sq = amax / 127, integer codes */
} mjolnir_q_mode;

typedef enum mjolnir_p_mode {
  MJOLNIR_P_FP32 = 0,
  MJOLNIR_P_BF16 = 1,
  MJOLNIR_P_FP8 = 2, /* e4m3(p * 256), the 256 folded into 1 / l */
  MJOLNIR_P_FP16 = 3 /* fp16 p, products summed in fp16 per 32 keys (fp8_e4m3, fp6, fp4, nvfp4) */
} mjolnir_p_mode;

/* The numerics of a step (docs/design.md section 4). */
typedef struct mjolnir_decode_params {
  size_t size;         /* sizeof(mjolnir_decode_params) */
  int32_t q_len;       /* query tokens per sequence, 1..8 */
  int32_t num_q_heads; /* Hq, a multiple of the cache's Hk */
  int32_t causal;      /* nonzero: token t sees KV [0, seq_len - q_len + t]; 0: [0, seq_len) */
  float softmax_scale; /* 0: 1 / sqrt(D) */
  int32_t q_mode;      /* mjolnir_q_mode */
  int32_t p_mode;      /* mjolnir_p_mode */
} mjolnir_decode_params;

/* Sets size and the defaults: q_len 1, causal, softmax_scale 0, fp32 Q and P; num_q_heads 0 is
 * left for the caller. */
static inline void mjolnir_decode_params_init(mjolnir_decode_params* params) {
  memset(params, 0, sizeof(*params));
  params->size = sizeof(mjolnir_decode_params);
  params->q_len = 1;
  params->causal = 1;
  params->q_mode = MJOLNIR_Q_FP32;
  params->p_mode = MJOLNIR_P_FP32;
}

/* The tensors of one step. Query and output token row b * q_len + t belongs to query token t of
 * sequence b; D channels are contiguous. */
typedef struct mjolnir_decode_args {
  size_t size;             /* sizeof(mjolnir_decode_args) */
  const int32_t* seq_lens; /* [num_seqs], the same values the plan was updated with */
  int32_t num_seqs;
  const int32_t* block_table; /* [num_seqs, max_pages_per_seq] row-major physical pages */
  int32_t max_pages_per_seq;
  const void* q;          /* [num_seqs * q_len, Hq, D] of q_type (float unless set) */
  int64_t q_token_stride; /* elements */
  int64_t q_head_stride;  /* elements */
  void* o;                /* [num_seqs * q_len, Hq, D] of o_type (float unless set) */
  int64_t o_token_stride;
  int64_t o_head_stride;
  float* lse; /* NULL, or contiguous [num_seqs * q_len, Hq]: natural-log LSE, -inf if empty */
  /* Since 0.1.0's second version of this struct (a smaller size reads them as 0, float): */
  int32_t q_type; /* mjolnir_row_type of q */
  int32_t o_type; /* mjolnir_row_type of o */
} mjolnir_decode_args;

static inline void mjolnir_decode_args_init(mjolnir_decode_args* args) {
  memset(args, 0, sizeof(*args));
  args->size = sizeof(mjolnir_decode_args);
}

/* Workspace bytes mjolnir_decode() needs with this backend, plan (its capacity) and step
 * shape. The size for the largest q_len and num_q_heads a loop uses serves every smaller step. */
MJOLNIR_API mjolnir_status mjolnir_workspace_size(mjolnir_backend* backend,
                                                  const mjolnir_plan* plan,
                                                  const mjolnir_cache* cache,
                                                  const mjolnir_decode_params* params,
                                                  size_t* bytes);

/* Runs one decode step: validates every argument, checks that the plan was updated for these
 * seq_lens and q_len (by a cpu backend where this is one), then writes o (and lse) for every query
 * row. The workspace is caller-owned (aligned to MJOLNIR_WORKSPACE_ALIGNMENT, at least
 * mjolnir_workspace_size() bytes) and must not be shared by concurrent calls. Errors are recorded
 * on the backend handle. */
MJOLNIR_API mjolnir_status mjolnir_decode(mjolnir_backend* backend, const mjolnir_plan* plan,
                                          const mjolnir_cache* cache,
                                          const mjolnir_decode_params* params,
                                          const mjolnir_decode_args* args, void* workspace,
                                          size_t workspace_bytes);

/* ---- scales file ---------------------------------------------------------------------------- */

/* What a scales file holds: one K and one V scale vector per layer, each scales_per_layer long
 * (1, Hk or Hk * D by granularity). */
typedef struct mjolnir_scales_info {
  size_t size;         /* sizeof(mjolnir_scales_info) */
  int32_t format;      /* mjolnir_format */
  int32_t granularity; /* mjolnir_granularity */
  int32_t num_kv_heads;
  int32_t head_dim;
  double headroom; /* scale = amax / max(format) * headroom */
  int32_t num_layers;
  int64_t scales_per_layer;
} mjolnir_scales_info;

static inline void mjolnir_scales_info_init(mjolnir_scales_info* info) {
  memset(info, 0, sizeof(*info));
  info->size = sizeof(mjolnir_scales_info);
  info->format = MJOLNIR_FORMAT_FP8_E4M3;
  info->granularity = MJOLNIR_GRANULARITY_CHANNEL;
  info->headroom = 1.0;
}

typedef struct mjolnir_scales mjolnir_scales;

/* Reads and checks a scales file (versioned JSON; malformed, truncated, wrong-version or
 * inconsistent files are MJOLNIR_ERROR_FILE with the file and field named). */
MJOLNIR_API mjolnir_status mjolnir_scales_read(const char* path, mjolnir_scales** out);
/* The same from the file's contents in memory (length bytes, not NUL-terminated necessarily). */
MJOLNIR_API mjolnir_status mjolnir_scales_parse(const char* text, size_t length,
                                                mjolnir_scales** out);
MJOLNIR_API void mjolnir_scales_destroy(mjolnir_scales* scales);
MJOLNIR_API const char* mjolnir_scales_last_error(const mjolnir_scales* scales);
/* Fills *info (set info->size first; mjolnir_scales_info_init does). */
MJOLNIR_API mjolnir_status mjolnir_scales_get_info(mjolnir_scales* scales,
                                                   mjolnir_scales_info* info);
/* Copies layer's scales into k_scale and v_scale, each of capacity floats (at least
 * scales_per_layer, else MJOLNIR_ERROR_BUFFER_TOO_SMALL). */
MJOLNIR_API mjolnir_status mjolnir_scales_get_layer(mjolnir_scales* scales, int32_t layer,
                                                    float* k_scale, float* v_scale,
                                                    int64_t capacity);
/* Writes a scales file. k_scales and v_scales hold count floats each, layer-major
 * [num_layers, scales_per_layer]; count must equal num_layers * scales_per_layer, and every
 * scale must be positive and finite. */
MJOLNIR_API mjolnir_status mjolnir_scales_write(const char* path, const mjolnir_scales_info* info,
                                                const float* k_scales, const float* v_scales,
                                                int64_t count);
/* scale = amax / max(format) * headroom from per-(head, channel) amax [Hk * D] (as write_kv
 * records it), reduced to the granularity by max; a zero amax gives FLT_MIN. Writes
 * 1, Hk or Hk * D scales to scales (capacity floats). */
MJOLNIR_API mjolnir_status mjolnir_scales_from_amax(const float* amax, int64_t amax_count,
                                                    int32_t format, int32_t granularity,
                                                    int32_t num_kv_heads, int32_t head_dim,
                                                    double headroom, float* scales,
                                                    int64_t capacity);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MJOLNIR_MJOLNIR_H_ */

/* A pre-norm decoder layer's decode step (Llama: RMSNorm, RoPE, SwiGLU; Touvron et al.,
 * arXiv 2302.13971) as three calls around attention and the SwiGLU activation, instead of
 * the forty-odd torch ops and kernel calls of the op-by-op layer, whose Python and dispatch
 * cost a small model's decode step more than its attention.
 * The products are kvlab_gemv's, the norms kvlab_rms_norm's; rotation and residual adds are
 * rounded as torch rounds them in the model's dtype (fp32 or bf16), so the layer's outputs
 * are the op-by-op layer's (built without fast-math: build.py's EXACT; ISO C contracts no
 * multiply-add). Activations, norm weights and rotary tables share one dtype (bf16 = 1:
 * bf16), every activation row is contiguous and M rows of one token each are decoded. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_job.h" /* Job */
#include "bf16.h"
#include "block_select.h" /* BlockSelect */
#include "timers.h"

/* A linear layer: weight (out_features, in_features), bias (out_features,) or NULL. KIND
 * FP: an fp32 or bf16 weight (kvlab_gemv; the bias added before rounding, as F.linear);
 * INT8: int8 codes with a scale per output (kvlab_gemv_int8); INT4: int4 codes in blocks
 * with their scales and offsets (kvlab_gemv_int4, groups of `group` inputs). Quantized
 * layers add the bias to the rounded product, as kvlab.quant.rtn's layers do. W8A8: INT8's
 * weights with x quantized to int8 too, a scale every `group` inputs of a row (the row's
 * length: one a row; kvlab_gemv_w8a8); W4A8: INT4's with
 * each group of each row of x quantized to int8 (kvlab_gemv_w4a8). input_perm (in_features,)
 * or NULL: input k of the product is x's input input_perm[k] (GPTQ's act-order, whose
 * groups are runs of the permuted inputs), as Int4Linear's index_select takes it.
 * compute_bf16: a quantized layer of an fp32 model that computes in bf16 (its
 * compute_dtype; its scales bf16 too): x rounded to bf16, the product in bf16, widened, the
 * bias added in fp32 (bf16_product). */
enum { FP = 0, INT8 = 1, INT4 = 2, W8A8 = 3, W4A8 = 4 };
typedef struct {
  const void *weight;
  int32_t weight_bf16;
  int32_t bias_bf16;
  const void *bias;
  int64_t out_features, in_features;
  int32_t kind, scale_bf16;
  const void *scale;
  int64_t group;
  const int64_t *input_perm;
  int32_t compute_bf16;
  int32_t in_order; /* FP, INT8, W8A8: one row walks the weight rows in order (the plan's) */
} Linear;

void kvlab_gemv(const void *x, int x_bf16, int64_t x_stride, const void *w, int w_bf16,
                const void *bias, int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N,
                int64_t K, int in_order);
void kvlab_gemv_int8(const void *x, int x_bf16, int64_t x_stride, const int8_t *q,
                     const void *scale, int scale_bf16, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int in_order);
void kvlab_gemv_w8a8(const void *x, int x_bf16, int64_t x_stride, const int8_t *q,
                     const void *scale, int scale_bf16, int64_t AG, const void *bias,
                     int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                     int in_order);
void kvlab_gemv_int4(const void *x, int x_bf16, int64_t x_stride, const uint8_t *codes,
                     const void *so, int so_bf16, int64_t G, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K);
void kvlab_gemv_w4a8(const void *x, int x_bf16, int64_t x_stride, const uint8_t *codes,
                     const void *so, int so_bf16, int64_t G, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K);
void kvlab_rms_norm(const void *x, int64_t stride, const void *weight, void *out, int bf16,
                    int64_t rows, int64_t dim, float eps);

static void permuted_product(const Linear *l, const void *x, int bf16, void *y, int64_t M);
static void bf16_product(const Linear *l, const float *x, float *y, int64_t M);

static void product(const Linear *l, const void *x, int bf16, void *y, int64_t M) {
  const int64_t N = l->out_features, K = l->in_features;
  if (l->input_perm) {
    permuted_product(l, x, bf16, y, M);
    return;
  }
  if (l->compute_bf16 && !bf16) {
    bf16_product(l, x, y, M);
    return;
  }
  if (l->kind == FP) {
    kvlab_gemv(x, bf16, K, l->weight, l->weight_bf16, l->bias, l->bias_bf16, y, bf16, M, N, K,
               l->in_order);
    return;
  }
  if (l->kind == INT8)
    kvlab_gemv_int8(x, bf16, K, l->weight, l->scale, l->scale_bf16, NULL, 0, y, bf16, M, N, K,
                    l->in_order);
  else if (l->kind == W8A8)
    kvlab_gemv_w8a8(x, bf16, K, l->weight, l->scale, l->scale_bf16, l->group, NULL, 0, y, bf16,
                    M, N, K, l->in_order);
  else if (l->kind == W4A8)
    kvlab_gemv_w4a8(x, bf16, K, l->weight, l->scale, l->scale_bf16, l->group, NULL, 0, y, bf16,
                    M, N, K);
  else
    kvlab_gemv_int4(x, bf16, K, l->weight, l->scale, l->scale_bf16, l->group, NULL, 0, y, bf16,
                    M, N, K);
  if (l->bias)
    for (int64_t i = 0; i < M * N; i++)
      store(y, bf16, i, value_at(y, bf16, i) + value_at(l->bias, l->bias_bf16, i % N));
}

/* product() of x's inputs gathered in l->input_perm's order. */
static void permuted_product(const Linear *l, const void *x, int bf16, void *y, int64_t M) {
  const int64_t K = l->in_features, *perm = l->input_perm;
  void *gathered = malloc(M * K * (bf16 ? 2 : 4));
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k++)
      if (bf16)
        ((uint16_t *)gathered)[m * K + k] = ((const uint16_t *)x)[m * K + perm[k]];
      else
        ((float *)gathered)[m * K + k] = ((const float *)x)[m * K + perm[k]];
  Linear natural = *l;
  natural.input_perm = NULL;
  product(&natural, gathered, bf16, y, M);
  free(gathered);
}

/* product() of an fp32 model's x through a layer that computes in bf16, as the layer's
 * x.to(bfloat16), its kernel, .to(float32) and + bias take it. */
static void bf16_product(const Linear *l, const float *x, float *y, int64_t M) {
  const int64_t N = l->out_features, K = l->in_features;
  uint16_t *rounded = malloc(sizeof(uint16_t) * M * (K + N)), *out = rounded + M * K;
  for (int64_t i = 0; i < M * K; i++) rounded[i] = to_bf16(x[i]);
  Linear in_bf16 = *l;
  in_bf16.compute_bf16 = 0, in_bf16.bias = NULL;
  product(&in_bf16, rounded, 1, out, M);
  for (int64_t i = 0; i < M * N; i++)
    y[i] = l->bias ? bf16_value(out[i]) + value_at(l->bias, l->bias_bf16, i % N)
                   : bf16_value(out[i]);
  free(rounded);
}

static void linear(const Linear *l, const void *x, int bf16, void *y, int64_t M) {
  TIMED(TIMER_LINEARS, product(l, x, bf16, y, M));
}

static float rounded(float value, int bf16) {
  return bf16 ? bf16_value(to_bf16(value)) : value;
}

/* out (M, heads, dim) = the first `heads` heads of each row of qkv (M, N) rotated as
 * RotaryTables.rotate: x * cos + roll(x, dim / 2) * sin, sin signed (M, dim) per row, each
 * product and the sum rounded to the dtype. */
static void rotate(const void *qkv, int64_t N, const void *cos, const void *sin, int bf16,
                   int64_t M, int64_t heads, int64_t dim, void *out) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t h = 0; h < heads; h++) {
      const int64_t in = m * N + h * dim, at = (m * heads + h) * dim;
      for (int64_t d = 0; d < dim; d++) {
        const float x = value_at(qkv, bf16, in + d);
        const float turned = value_at(qkv, bf16, in + (d + dim / 2) % dim);
        const float a = rounded(x * value_at(cos, bf16, m * dim + d), bf16);
        const float b = rounded(turned * value_at(sin, bf16, m * dim + d), bf16);
        store(out, bf16, at + d, a + b);
      }
    }
}

/* y (M, n) = x + delta, rounded to the dtype. */
static void add(const void *x, const void *delta, int bf16, int64_t M, int64_t n, void *y) {
  for (int64_t i = 0; i < M * n; i++)
    store(y, bf16, i, value_at(x, bf16, i) + value_at(delta, bf16, i));
}

/* Before attention: normed = rms_norm(x) (M, hidden); qkv = qkv_proj(normed) (M, N);
 * where the model norms each query and key head (Qwen3: q_norm, k_norm (dim,), NULL where
 * it does not), each of qkv's `heads` query heads and `kv_heads` key heads normed in place
 * with eps qk_eps; rotated (M, heads + kv_heads, dim) = those heads of qkv rotated. */
void kvlab_layer_attention_in(const void *x, int bf16, int64_t M, const void *norm_weight,
                              float eps, const Linear *qkv_proj, const void *q_norm,
                              const void *k_norm, float qk_eps, const void *cos,
                              const void *sin, int64_t heads, int64_t kv_heads, int64_t dim,
                              void *normed, void *qkv, void *rotated) {
  const int64_t hidden = qkv_proj->in_features, N = qkv_proj->out_features;
  const int64_t size = bf16 ? 2 : 4;
  kvlab_rms_norm(x, hidden, norm_weight, normed, bf16, M, hidden, eps);
  linear(qkv_proj, normed, bf16, qkv, M);
  for (int64_t m = 0; q_norm && m < M; m++) {
    char *row = (char *)qkv + m * N * size;
    kvlab_rms_norm(row, dim, q_norm, row, bf16, heads, dim, qk_eps);
    kvlab_rms_norm(row + heads * dim * size, dim, k_norm, row + heads * dim * size, bf16,
                   kv_heads, dim, qk_eps);
  }
  rotate(qkv, N, cos, sin, bf16, M, heads + kv_heads, dim, rotated);
}

/* After attention: mid = x + o_proj(attention) (M, hidden); gate_up =
 * gate_up_proj(rms_norm(mid)); scratch: (M, hidden) twice. */
void kvlab_layer_mlp_in(const void *attention, const void *x, int bf16, int64_t M,
                        const Linear *o_proj, const void *norm_weight, float eps,
                        const Linear *gate_up_proj, void *mid, void *gate_up, void *scratch) {
  const int64_t hidden = o_proj->out_features;
  void *normed = (char *)scratch + M * hidden * (bf16 ? 2 : 4);
  linear(o_proj, attention, bf16, scratch, M);
  add(x, scratch, bf16, M, hidden, mid);
  kvlab_rms_norm(mid, hidden, norm_weight, normed, bf16, M, hidden, eps);
  linear(gate_up_proj, normed, bf16, gate_up, M);
}

/* The layer's output: y = mid + down_proj(activation) (M, hidden); scratch: (M, hidden). */
void kvlab_layer_out(const void *activation, const void *mid, int bf16, int64_t M,
                     const Linear *down_proj, void *scratch, void *y) {
  linear(down_proj, activation, bf16, scratch, M);
  add(mid, scratch, bf16, M, down_proj->out_features, y);
}

/* A cache's writes and attention for one layer, for the whole layer in one call
 * (kvlab.kernels.attention.cached.CachedAttention): the tensors (blocks, H_kv, slots, D) the
 * step's keys and values are written to exactly, in the model dtype (a contiguous store's
 * blocks are its rows, a paged store's its pool, a KIVI store's its exact ring), strides
 * in elements (the same for both); the decode attention jobs over what the cache holds
 * (decode_attention.c's Job, one per segment) and the fp32 queries they read.
 * Optionally (NULL: none) a second, `raw` write of the keys before RoPE and the values,
 * row m to its block m at slot raw_at[m] (a pooling layer's buffers), and a `select`ion:
 * a top-k of entries per (row, KV head) written into a job's table before the jobs run
 * (a CSA layer's indexer, indexer.c). */
typedef struct {
  const void *keys;
  int32_t bf16;
  int64_t s_row, s_head, s_slot;
  const int64_t *seen, *base;
  int64_t top_k;
  int64_t *table;
} Selection;

/* A step's pooling (DeepSeek-V4's compressor with the uniform gate, pooled/pooling.py):
 * row m whose window closes (into[m] >= 0) pools slots sources[m * span + j] (-1: empty) of
 * its raw buffers, after the step's own write, with weights[m * span + j] (the model dtype)
 * into entry into[m] of block m of the entries (keys, values: (blocks, H_kv, slots, D),
 * strides in elements), the key rotated by cos, sin (M, dim) at the window's first
 * position. */
typedef struct {
  void *keys, *values;
  int64_t s_b, s_h, s_s, blocks, slots;
  const int64_t *into, *sources;
  const void *weights, *cos, *sin;
  int64_t span;
} PoolWrite;

typedef struct {
  void *keys, *values;
  int64_t s_b, s_h, s_s, blocks, slots;
  const int64_t *at;
  const PoolWrite *pool;
} RawWrite;

/* A step's bounds for one of a layer's decode jobs: its block table (B, width), rows
 * table_stride apart, and each row's logical tokens [lo[b], hi[b]). */
typedef struct {
  const int64_t *table;
  int64_t table_stride, width;
  const int64_t *lo, *hi;
} JobBounds;

#define MAX_JOBS 4
/* What every layer of a store reads in a decode step, written once a step
 * (kvlab.kernels.attention.cached.LayerAttentions): its jobs' bounds, and the work buffer
 * their partial results go to (the layers run in turn). */
typedef struct {
  JobBounds jobs[MAX_JOBS];
  float *work;
} StepBounds;

/* A ragged store's layer (kvlab.cache.stores.ragged: what eviction keeps): each (row, KV
 * head) bh = m * kv_heads + h holds its own held[bh] tokens in its run of blocks (table,
 * rows table_stride apart, width blocks of block_size slots); a step's new token goes
 * after them and held[bh] counts it, before the jobs read rows bh over [0, held[bh]). */
typedef struct {
  const int64_t *table;
  int64_t table_stride, width, block_size;
  int64_t *held;
} RaggedHeads;

/* How a store holds the step's rows when they are codes (NULL: exactly, in the model
 * dtype; kvlab.kernels.attention.cached.Encoding): the codec's C encoder (codes.c) by its
 * format, with that encoder's parameters (fp8: mantissa, bias, largest; fp4: mx,
 * tensor_scale and the scale byte's 256 values in `table`; codebook: norm, largest and the
 * count - 1 midpoints in `table`), and the n_parts parts a row is written to, keys' at
 * keys[p] and values' at values[p], strides (block, head, slot) in elements, a row of
 * width[p] elements of size[p] bytes each, in tensors of `blocks` blocks of `slots`. */
typedef struct {
  int32_t format, bits, group, scale_bf16;
  int32_t mantissa, bias, mx, norm, count;
  float largest, tensor_scale;
  const float *table;
  int64_t n_parts;
  void *keys[3], *values[3];
  int64_t strides[3][3];
  int64_t width[3], size[3];
  int64_t blocks, slots;
} Encoding;

void kvlab_encode_token_codes(const void *x, int x_bf16, int64_t x_stride, int64_t n,
                              int64_t D, int64_t group, int bits, uint32_t *words,
                              void *scale, void *zero, int scale_bf16);
void kvlab_encode_fp8(const void *x, int x_bf16, int64_t x_stride, int64_t n, int64_t D,
                      int64_t group, int mantissa, int bias, float largest, uint8_t *codes,
                      void *scale, int scale_bf16);
void kvlab_encode_fp4(const void *x, int x_bf16, int64_t x_stride, int64_t n, int64_t D,
                      int64_t group, int mx, float tensor_scale, const float *scales,
                      uint8_t *codes, uint8_t *scale_codes);
void kvlab_encode_codebook(const void *x, int x_bf16, int64_t x_stride, int64_t n, int64_t D,
                           int64_t group, int bits, int norm, float largest,
                           const float *midpoints, int count, uint8_t *codes, void *scale,
                           int scale_bf16);

/* Row m's kv heads `x` (kv, dim, in the model dtype) encoded as `e` says and written at slot
 * `slot` of block `block` of the parts of keys (`values` 0) or values (1); a place outside
 * the tensors (the store's error, refused before the layers) is not written. */
static void encode_row(const Encoding *e, int values, const void *x, int bf16, int64_t kv,
                       int64_t dim, int64_t block, int64_t slot) {
  if (block < 0 || block >= e->blocks || slot < 0 || slot >= e->slots) return;
  char buffer[3][kv * (dim * 4 + 16)]; /* a part's rows: at most 4 bytes a channel */
  void *out[3] = {buffer[0], buffer[1], buffer[2]};
  if (e->format == FMT_TOKEN_CODES)
    kvlab_encode_token_codes(x, bf16, dim, kv, dim, e->group, e->bits, out[0], out[1], out[2],
                             e->scale_bf16);
  else if (e->format == FMT_FP8)
    kvlab_encode_fp8(x, bf16, dim, kv, dim, e->group, e->mantissa, e->bias, e->largest, out[0],
                     out[1], e->scale_bf16);
  else if (e->format == FMT_FP4)
    kvlab_encode_fp4(x, bf16, dim, kv, dim, e->group, e->mx, e->tensor_scale, e->table, out[0],
                     out[1]);
  else
    kvlab_encode_codebook(x, bf16, dim, kv, dim, e->group, e->bits, e->norm, e->largest,
                          e->table, e->count, out[0], out[1], e->scale_bf16);
  for (int64_t p = 0; p < e->n_parts; p++) {
    char *part = values ? e->values[p] : e->keys[p];
    const int64_t *st = e->strides[p], row = e->width[p] * e->size[p];
    for (int64_t h = 0; h < kv; h++)
      memcpy(part + (block * st[0] + h * st[1] + slot * st[2]) * e->size[p],
             buffer[p] + h * row, (size_t)row);
  }
}

/* merge (0: none): the layer's KV heads merged in groups of `merge` before they are
 * written (kvlab.cache.policies.merged_heads; the written tensors hold kv / merge heads):
 * each group's mean (kvlab_merged_heads), or with merge_first its first head.
 * block_select (NULL: none): a block selection (block_select.c, Quest): the new keys folded
 * into their blocks' bounds and each (row, KV head)'s blocks chosen into the step's table,
 * which the jobs then read, a row per (row, KV head). encoding (NULL: exact rows): the
 * step's rows written as codes (Encoding). rotation, rotation_t (NULL: none): a codec's
 * rotation (dim, dim) and its transpose: the new keys (after RoPE) and values and the
 * queries turned by it before anything else, the output turned back after the attention
 * (kvlab_rotate_rows). */
typedef struct {
  void *keys, *values;
  int64_t s_b, s_h, s_s, blocks, slots;
  Job *jobs;
  int64_t n_jobs;
  float *queries;
  const RawWrite *raw;
  const Selection *select;
  const StepBounds *step;
  const RaggedHeads *ragged;
  int64_t merge;
  int32_t merge_first;
  const BlockSelect *block_select;
  const Encoding *encoding;
  const float *rotation, *rotation_t;
} CachedAttention;

/* The layer's own pointers and shapes (kvlab.models.fused_layer.FusedDecode); qk_norms:
 * the query and key heads' norm weights (Qwen3), NULL where the model has none. */
typedef struct {
  const void *norms[2];
  float eps[2];
  const Linear *qkv_proj, *o_proj, *gate_up_proj;
  int64_t heads, kv_heads, dim;
  const Linear *down_proj;
  int64_t inner;
  const void *qk_norms[2];
  float qk_eps;
} LayerPlan;

void kvlab_decode_attention(const Job *jobs, int n_jobs, void *out, int out_bf16,
                            const float *sinks);
void kvlab_top_k_entries(const void *q, int q_bf16, int64_t R, int64_t H, int64_t G, int64_t D,
                         const void *keys, int k_bf16, int64_t s_row, int64_t s_head,
                         int64_t s_slot, const int64_t *seen, const int64_t *base,
                         int64_t top_k, int64_t *out);

/* One row's kv heads, `key` and `value` (kv heads of dim elements each, `size` bytes an
 * element), written at slot `slot` of block `block` of keys and values (strides in
 * elements: block, head, slot); a place outside the tensors (the store's error, refused
 * before the layers) is not written. */
static void write_row(void *keys, void *values, const int64_t *strides, int64_t blocks,
                      int64_t slots, int64_t block, int64_t slot, const char *key,
                      const char *value, int64_t kv, int64_t dim, int64_t size) {
  if (block < 0 || block >= blocks || slot < 0 || slot >= slots) return;
  for (int64_t j = 0; j < kv; j++) {
    const int64_t at = (block * strides[0] + j * strides[1] + slot * strides[2]) * size;
    memcpy((char *)keys + at, key + j * dim * size, dim * size);
    memcpy((char *)values + at, value + j * dim * size, dim * size);
  }
}

/* out (rows, kv / factor, dim) = each group of `factor` consecutive heads of x (rows, kv,
 * dim), fp32 or bf16 (bf16 = 1): its first head (first = 1) or its mean as torch's mean
 * over the group takes it: the heads summed in fp32 in order, divided by factor, rounded
 * to the dtype. */
void kvlab_merged_heads(const void *x, int bf16, int64_t rows, int64_t kv, int64_t dim,
                        int64_t factor, int first, void *out) {
  const int64_t merged = kv / factor;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < merged; j++)
      for (int64_t d = 0; d < dim; d++) {
        const int64_t at = (r * kv + j * factor) * dim + d;
        float sum = value_at(x, bf16, at);
        for (int64_t i = 1; i < factor && !first; i++) sum += value_at(x, bf16, at + i * dim);
        store(out, bf16, (r * merged + j) * dim + d, first ? sum : sum / (float)factor);
      }
}

/* Row m's kv heads of `key` and `value`, each after its own held tokens in a ragged layer
 * (RaggedHeads), which then counts it; a head without room left (the store's error,
 * refused before the layers) is neither written nor counted. */
static void write_heads(const CachedAttention *c, int64_t m, const char *key,
                        const char *value, int64_t kv, int64_t dim, int64_t size) {
  const RaggedHeads *r = c->ragged;
  const int64_t strides[3] = {c->s_b, c->s_h, c->s_s};
  for (int64_t h = 0; h < kv; h++) {
    const int64_t bh = m * kv + h, held = r->held[bh];
    if (held / r->block_size >= r->width) continue;
    const int64_t block = r->table[bh * r->table_stride + held / r->block_size];
    write_row(c->keys, c->values, strides, c->blocks, c->slots, block, held % r->block_size,
              key + h * dim * size, value + h * dim * size, 1, dim, size);
    r->held[bh] = held + 1;
  }
}

/* One KV head of an entry: out (dim values in the dtype) = sum_j rounded(weights[j] *
 * part[from[j]]) over the span's filled slots, each product rounded to the dtype and summed
 * in fp32 in slot order (torch's sum over the window), then rounded. */
static void pool_head(const void *part, const int64_t *from, const void *weights,
                      int64_t span, int64_t slots, int64_t s_s, int bf16, int64_t dim,
                      void *out) {
  float acc[256];
  for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
  for (int64_t j = 0; j < span; j++) {
    if (from[j] < 0 || from[j] >= slots) continue;
    const float w = value_at(weights, bf16, j);
    for (int64_t d = 0; d < dim; d++)
      acc[d] += rounded(value_at(part, bf16, from[j] * s_s + d) * w, bf16);
  }
  for (int64_t d = 0; d < dim; d++) store(out, bf16, d, acc[d]);
}

/* Row m's entry, if its window closes (PoolWrite), from its raw buffers: the value pooled
 * into place, the key pooled, then rotated into place as the step's keys are. */
static void pool_row(const RawWrite *r, int64_t m, int64_t kv, int64_t dim, int bf16) {
  const PoolWrite *p = r->pool;
  const int64_t into = p->into[m], size = bf16 ? 2 : 4;
  if (into < 0 || into >= p->slots || m >= p->blocks || m >= r->blocks) return;
  const int64_t *from = p->sources + m * p->span;
  const char *weights = (const char *)p->weights + m * p->span * size;
  const char *cos = (const char *)p->cos + m * dim * size;
  const char *sin = (const char *)p->sin + m * dim * size;
  float key[256]; /* room for dim values of either dtype */
  for (int64_t h = 0; h < kv; h++) {
    const int64_t raw_at = (m * r->s_b + h * r->s_h) * size;
    const int64_t at = (m * p->s_b + h * p->s_h + into * p->s_s) * size;
    pool_head((const char *)r->keys + raw_at, from, weights, p->span, r->slots, r->s_s, bf16,
              dim, key);
    rotate(key, dim, cos, sin, bf16, 1, 1, dim, (char *)p->keys + at);
    pool_head((const char *)r->values + raw_at, from, weights, p->span, r->slots, r->s_s,
              bf16, dim, (char *)p->values + at);
  }
}

/* The layer's jobs pointed at the step's bounds: job i over bounds i in ceil(span / chunk)
 * chunks (span: its ring, else its table's blocks), the partial results of all jobs one
 * after another in the step's work buffer, as CachedAttention.work_floats sizes it. */
static void point_jobs(const CachedAttention *c) {
  const StepBounds *s = c->step;
  int32_t total = 0;
  for (int64_t i = 0; i < c->n_jobs; i++) {
    Job *job = &c->jobs[i];
    const int64_t span = job->ring > 0 ? job->ring : s->jobs[i].width * job->block_size;
    job->n_chunks = (int32_t)((span + job->chunk - 1) / job->chunk);
    total += job->n_chunks;
  }
  const int64_t rows = (int64_t)c->jobs[0].B * c->jobs[0].H * total * c->jobs[0].G;
  int32_t offset = 0;
  for (int64_t i = 0; i < c->n_jobs; i++) {
    Job *job = &c->jobs[i];
    const JobBounds *b = &s->jobs[i];
    job->table = b->table, job->table_stride = b->table_stride;
    job->lo = b->lo, job->hi = b->hi;
    job->partial_offset = offset, job->partial_total = total;
    job->m = s->work, job->l = s->work + rows, job->o = s->work + 2 * rows;
    offset += job->n_chunks;
  }
}

/* out (rows, dim) = x (rows, dim) times `rotation` (dim, dim, fp32: row j, column i at
 * j * dim + i), each product summed in fp32 in j order and rounded to the dtype (bf16 = 1:
 * bf16): a codec's rotation (kvlab.cache.codecs.rotation), in place too (out may be x).
 * The cache's torch form calls it as well, so a rotated step is the same bits on both
 * paths. */
void kvlab_rotate_rows(const void *x, int bf16, int64_t rows, int64_t dim,
                       const float *rotation, void *out) {
  float row[dim], acc[dim];
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t j = 0; j < dim; j++) row[j] = value_at(x, bf16, r * dim + j), acc[j] = 0.f;
    for (int64_t j = 0; j < dim; j++)
      for (int64_t i = 0; i < dim; i++) acc[i] += row[j] * rotation[j * dim + i];
    for (int64_t i = 0; i < dim; i++) store(out, bf16, r * dim + i, acc[i]);
  }
}

/* Row m's new keys (rotated heads heads..heads + kv_heads - 1) and values (the last
 * kv_heads heads of qkv) written at slot slots[m] of block blocks[m] (a ragged layer: each
 * head after its own tokens, write_heads; merged heads: merged first), and before RoPE to
 * the raw write if any (then the row's closing window pooled, if the raw write pools);
 * the queries (the first `heads` rotated heads) widened into the job's buffer; the
 * selection if any; then the attention, out (M, heads * dim) in the model dtype. */
static void attend_cached(const CachedAttention *c, const LayerPlan *p, const void *rotated,
                          const void *qkv, int bf16, int64_t M, const int64_t *blocks,
                          const int64_t *slots, void *out) {
  const int64_t heads = p->heads, kv = p->kv_heads, dim = p->dim, size = bf16 ? 2 : 4;
  const int64_t width = (heads + kv) * dim, qkv_width = (heads + 2 * kv) * dim;
  const int64_t strides[3] = {c->s_b, c->s_h, c->s_s};
  const RawWrite *r = c->raw;
  char turned[c->rotation ? 2 * kv * dim * size : 1];
  for (int64_t m = 0; m < M; m++) {
    const char *key = (const char *)rotated + (m * width + heads * dim) * size;
    const char *raw_key = (const char *)qkv + (m * qkv_width + heads * dim) * size;
    const char *value = raw_key + kv * dim * size;
    if (c->rotation) { /* the row as the codec holds it: turned */
      kvlab_rotate_rows(key, bf16, kv, dim, c->rotation, turned);
      kvlab_rotate_rows(value, bf16, kv, dim, c->rotation, turned + kv * dim * size);
      key = turned, value = turned + kv * dim * size;
    }
    if (c->ragged) {
      write_heads(c, m, key, value, kv, dim, size);
    } else {
      char merged_key[kv * dim * size], merged_value[kv * dim * size];
      const char *k_row = key, *v_row = value;
      int64_t heads_written = kv;
      if (c->merge > 1) {
        kvlab_merged_heads(key, bf16, 1, kv, dim, c->merge, c->merge_first, merged_key);
        kvlab_merged_heads(value, bf16, 1, kv, dim, c->merge, c->merge_first, merged_value);
        k_row = merged_key, v_row = merged_value, heads_written = kv / c->merge;
      }
      if (c->encoding) {
        encode_row(c->encoding, 0, k_row, bf16, heads_written, dim, blocks[m], slots[m]);
        encode_row(c->encoding, 1, v_row, bf16, heads_written, dim, blocks[m], slots[m]);
      } else {
        write_row(c->keys, c->values, strides, c->blocks, c->slots, blocks[m], slots[m],
                  k_row, v_row, heads_written, dim, size);
      }
    }
    if (r) {
      const int64_t raw_strides[3] = {r->s_b, r->s_h, r->s_s};
      write_row(r->keys, r->values, raw_strides, r->blocks, r->slots, m, r->at[m], raw_key,
                value, kv, dim, size);
      if (r->pool) pool_row(r, m, kv, dim, bf16);
    }
    if (c->rotation) { /* the queries turned as the keys are */
      char q[heads * dim * size];
      kvlab_rotate_rows((const char *)rotated + m * width * size, bf16, heads, dim, c->rotation,
                        q);
      for (int64_t i = 0; i < heads * dim; i++)
        c->queries[m * heads * dim + i] = value_at(q, bf16, i);
    } else {
      for (int64_t i = 0; i < heads * dim; i++)
        c->queries[m * heads * dim + i] = value_at(rotated, bf16, m * width + i);
    }
  }
  if (c->block_select) /* a selection, timed as the indexer is (timers.h) */
    TIMED(TIMER_INDEXER,
          (kvlab_block_bounds(c->block_select, bf16, M, kv, dim, blocks, slots,
                              (const char *)rotated + heads * dim * size, width),
           kvlab_block_select(c->block_select, bf16, c->queries, M, kv, heads / kv, dim)));
  point_jobs(c);
  const Selection *s = c->select;
  if (s)
    kvlab_top_k_entries(c->queries, 0, M * kv, kv, heads / kv, dim, s->keys, s->bf16, s->s_row,
                        s->s_head, s->s_slot, s->seen, s->base, s->top_k, s->table);
  kvlab_decode_attention(c->jobs, (int)c->n_jobs, out, bf16, NULL);
  if (c->rotation) kvlab_rotate_rows(out, bf16, M * heads, dim, c->rotation_t, out);
}

/* A layer's decode step up to its SwiGLU activation, attention included, where the cache
 * holds the layer's keys and values exactly in place (`cache`; row m's new ones go to
 * slot slots[m] of block blocks[m]): attention_in, the cache's writes and attention, then
 * mlp_in. Scratch as the three calls take it: qkv (M, N), rotated (M, heads + kv_heads,
 * dim), attention (M, heads * dim), mid (M, hidden), gate_up (M, 2 * inner), scratch
 * (2 M hidden). */
void kvlab_layer_decode_in(const void *x, int bf16, int64_t M, const LayerPlan *p,
                           const void *cos, const void *sin, const CachedAttention *cache,
                           const int64_t *blocks, const int64_t *slots, void *qkv,
                           void *rotated, void *attention, void *mid, void *gate_up,
                           void *scratch) {
  kvlab_layer_attention_in(x, bf16, M, p->norms[0], p->eps[0], p->qkv_proj, p->qk_norms[0],
                           p->qk_norms[1], p->qk_eps, cos, sin, p->heads, p->kv_heads, p->dim,
                           scratch, qkv, rotated);
  attend_cached(cache, p, rotated, qkv, bf16, M, blocks, slots, attention);
  kvlab_layer_mlp_in(attention, x, bf16, M, p->o_proj, p->norms[1], p->eps[1],
                     p->gate_up_proj, mid, gate_up, scratch);
}

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* out (inner,) = silu(gate) * up of one bf16 row gate_up (2 inner,), gate first: silu
 * looked up in `silu`, torch's own silu of every bf16 value (its 65536 bit patterns in
 * order, then two bytes of padding: a vector gather reads 32 bits at each value;
 * kvlab.kernels.layer.activation), and each product rounded to bf16 as torch's bf16 mul
 * rounds it (the product of two bf16 values is exact in fp32); vector and scalar lanes
 * give the same bits. */
static void swiglu_bf16(const uint16_t *gate_up, const uint16_t *silu, int64_t inner,
                        uint16_t *out) {
  const uint16_t *gate = gate_up, *up = gate + inner;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i low = _mm512_set1_epi32(0xFFFF), half = _mm512_set1_epi32(0x7FFF);
  const __m512i one = _mm512_set1_epi32(1);
  for (; i + 16 <= inner; i += 16) {
    const __m512i at = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gate + i)));
    const __m512i s = _mm512_and_si512(_mm512_i32gather_epi32(at, (const void *)silu, 2), low);
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(up + i)));
    const __m512 product = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(s, 16)),
                                         _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
    __m512i bits = _mm512_castps_si512(product); /* to_bf16, lane by lane */
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(
                                      half, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
    _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
#elif defined(__AVX2__)
  const __m256i low = _mm256_set1_epi32(0xFFFF), half = _mm256_set1_epi32(0x7FFF);
  const __m256i one = _mm256_set1_epi32(1);
  for (; i + 8 <= inner; i += 8) {
    const __m256i at = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(gate + i)));
    const __m256i s = _mm256_and_si256(_mm256_i32gather_epi32((const int *)silu, at, 2), low);
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(up + i)));
    const __m256 product = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(s, 16)),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
    __m256i bits = _mm256_castps_si256(product);
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(
                                      half, _mm256_and_si256(_mm256_srli_epi32(bits, 16), one)));
    bits = _mm256_srli_epi32(bits, 16); /* 16-bit lanes: pack without saturating */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                            _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i *)(out + i), packed);
  }
#endif
  for (; i < inner; i++)
    out[i] = to_bf16(bf16_value(silu[gate[i]]) * bf16_value(up[i]));
}

/* How a layer's SwiGLU activation is computed in C (kvlab.kernels.layer.activation's
 * Activation): bf16, looked up in `table`; fp32, as torch's vectorized silu computes it,
 * g / (1 + exp(-g)) `width` floats at a time through `exp`, the vector exp torch's own
 * kernels call (Sleef's, taken from libtorch for the width torch runs at: 16 or 8). */
typedef struct {
  const uint16_t *table;
  const void *exp;
  int64_t width;
} Activation;

/* out (inner,) = silu(gate) * up of one fp32 row gate_up (2 inner,), gate first, each
 * operation rounded as torch's silu and mul round it: the negation a sign flip, the sum,
 * quotient and product IEEE's. inner is a multiple of the width (no scalar tail: torch
 * would take std::exp there). A width this build has no vectors for is refused by
 * kvlab_activation_widths before a plan uses it. */
static void swiglu_f32(const float *gate_up, const Activation *a, int64_t inner, float *out) {
  const float *gate = gate_up, *up = gate + inner;
#if defined(__AVX512F__)
  if (a->width == 16) {
    __m512 (*vexp)(__m512) = (__m512(*)(__m512))a->exp;
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    for (int64_t i = 0; i < inner; i += 16) {
      const __m512 g = _mm512_loadu_ps(gate + i);
      const __m512 e = vexp(_mm512_castsi512_ps(
          _mm512_xor_si512(_mm512_castps_si512(g), _mm512_castps_si512(sign))));
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
    }
    return;
  }
#endif
#if defined(__AVX2__)
  if (a->width == 8) {
    __m256 (*vexp)(__m256) = (__m256(*)(__m256))a->exp;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < inner; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, vexp(_mm256_xor_ps(g, sign))));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    return;
  }
#endif
  (void)a, (void)gate, (void)up, (void)out;
}

/* The vector widths (floats) swiglu_f32 runs in this build, as bits: 16 -> 2, 8 -> 1. */
int kvlab_activation_widths(void) {
  int widths = 0;
#if defined(__AVX512F__)
  widths |= 2;
#endif
#if defined(__AVX2__)
  widths |= 1;
#endif
  return widths;
}

/* Elements from which kvlab_swiglu shares its rows among the OpenMP team: torch's grain
 * size (at::internal::GRAIN_SIZE), below which its own elementwise ops run serial (a few
 * decode rows: waking the team would cost more than the work). */
#define SWIGLU_PARALLEL_ELEMENTS 32768

/* activation (M, inner) = silu(gate) * up, one row of gate_up (M, 2 inner) a row, in the
 * model's dtype (bf16 = 1: bf16), computed as `a` says; rows shared among the threads
 * where there are many (a prefill chunk's, a batch's), each row's values the same either
 * way. */
void kvlab_swiglu(const void *gate_up, int bf16, int64_t M, int64_t inner, const Activation *a,
                  void *activation) {
  const int64_t item = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M * inner >= SWIGLU_PARALLEL_ELEMENTS)
  for (int64_t m = 0; m < M; m++) {
    const char *row = (const char *)gate_up + m * 2 * inner * item;
    char *out = (char *)activation + m * inner * item;
    if (bf16)
      swiglu_bf16((const uint16_t *)row, a->table, inner, (uint16_t *)out);
    else
      swiglu_f32((const float *)row, a, inner, (float *)out);
  }
}

/* A layer's whole decode step in one call where the cache holds its keys and values in
 * place: kvlab_layer_decode_in, the SwiGLU activation (kvlab_swiglu, as `a` says) into
 * `activation` (M, inner), then kvlab_layer_out into y (M, hidden). */
void kvlab_layer_decode(const void *x, int bf16, int64_t M, const LayerPlan *p,
                        const void *cos, const void *sin, const CachedAttention *cache,
                        const int64_t *blocks, const int64_t *slots, void *qkv, void *rotated,
                        void *attention, void *mid, void *gate_up, void *scratch,
                        const Activation *a, void *activation, void *y) {
  kvlab_layer_decode_in(x, bf16, M, p, cos, sin, cache, blocks, slots, qkv, rotated,
                        attention, mid, gate_up, scratch);
  kvlab_swiglu(gate_up, bf16, M, p->inner, a, activation);
  kvlab_layer_out(activation, mid, bf16, M, p->down_proj, scratch, y);
}

/* One layer of a whole decode step (kvlab.models.fused_layer.FusedStep): its plan and the
 * cache's writes and attention for it this step, row m's new keys and values going to
 * slot slots[m] of block blocks[m]. */
typedef struct {
  const LayerPlan *plan;
  const CachedAttention *cache;
  const int64_t *blocks, *slots;
} LayerStep;

/* A model's decode step through its n layers in one call, instead of a call and its
 * Python a layer: kvlab_layer_decode layer after layer, x into the first, each layer's
 * output the next one's input (in `between`, two (M, hidden) buffers taken in turn), the
 * last one's into y. Scratch as kvlab_layer_decode takes it, shared: the layers run in
 * turn, every one of the same shapes. */
static void layers_decode(const void *x, int bf16, int64_t M, int64_t n,
                          const LayerStep *layers, const void *cos, const void *sin, void *qkv,
                          void *rotated, void *attention, void *mid, void *gate_up,
                          void *scratch, const Activation *a, void *activation, void *between,
                          void *y) {
  const int64_t hidden = layers[0].plan->down_proj->out_features, size = bf16 ? 2 : 4;
  const void *in = x;
  for (int64_t i = 0; i < n; i++) {
    const LayerStep *l = &layers[i];
    void *out = i == n - 1 ? y : (char *)between + (i % 2) * M * hidden * size;
    kvlab_layer_decode(in, bf16, M, l->plan, cos, sin, l->cache, l->blocks, l->slots, qkv,
                       rotated, attention, mid, gate_up, scratch, a, activation, out);
    in = out;
  }
}

void kvlab_layers_decode(const void *x, int bf16, int64_t M, int64_t n,
                         const LayerStep *layers, const void *cos, const void *sin, void *qkv,
                         void *rotated, void *attention, void *mid, void *gate_up,
                         void *scratch, const Activation *a, void *activation, void *between,
                         void *y) {
  TIMED(TIMER_LAYERS, layers_decode(x, bf16, M, n, layers, cos, sin, qkv, rotated, attention,
                                    mid, gate_up, scratch, a, activation, between, y));
}

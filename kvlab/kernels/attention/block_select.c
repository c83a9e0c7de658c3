/* Query-aware block selection (Quest, Tang et al., ICML 2024): per paged block and KV head
 * the min and max of its keys per channel; a decode query group scores each full block of
 * its row by the bound sum_g sum_d max(q_gd min_d, q_gd max_d) and reads its `picks`
 * best blocks and its newest one, through a table per (row, KV head). The policy's torch
 * form and the fused decode layer (decode_layer.c) both call these, so a block is chosen the
 * same way on both paths whatever the order of the bound's sum. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "block_select.h"
#include "simd.h"

/* Fold row m's new key (kv heads of dim values, fp32 or bf16) into the bounds of block
 * blocks[m]: slot 0 starts the block (its old bounds are a freed block's), the others
 * widen them. */
void kvlab_block_bounds(const BlockSelect *s, int bf16, int64_t M, int64_t kv, int64_t dim,
                        const int64_t *blocks, const int64_t *slots, const void *keys,
                        int64_t key_stride) {
  for (int64_t m = 0; m < M; m++) {
    const int fresh = slots[m] == 0;
    for (int64_t h = 0; h < kv; h++) {
      const int64_t at = blocks[m] * s->s_block + h * s->s_head;
      const int64_t from = m * key_stride + h * dim;
      for (int64_t d = 0; d < dim; d++) {
        const float k = value_at(keys, bf16, from + d);
        const float low = value_at(s->low, bf16, at + d), high = value_at(s->high, bf16, at + d);
        store(s->low, bf16, at + d, fresh || k < low ? k : low);
        store(s->high, bf16, at + d, fresh || k > high ? k : high);
      }
    }
  }
}

/* The bound of one block: sum_g sum_d max(q_gd low_d, q_gd high_d), which is
 * sum_d (pos_d high_d + neg_d low_d) with pos_d, neg_d the sums over g of q_gd's positive
 * and negative parts (low_d <= high_d): two products a channel, one sum a block. */
static float block_bound(const float *pos, const float *neg, int64_t dim, const void *low,
                         const void *high, int bf16) {
  int64_t d = 0;
  float sum = 0.f;
#ifdef LANES
  vec acc = vzero();
  for (; d + LANES <= dim; d += LANES)
    acc = vfma(vload_f32(pos + d), vload(high, bf16, d),
               vfma(vload_f32(neg + d), vload(low, bf16, d), acc));
  sum = vsum(acc);
#endif
  for (; d < dim; d++) sum += pos[d] * value_at(high, bf16, d) + neg[d] * value_at(low, bf16, d);
  return sum;
}

/* pos, neg (dim,): the sums over the G queries (G, dim) of their positive and negative
 * parts. */
static void signed_sums(const float *q, int64_t G, int64_t dim, float *pos, float *neg) {
  for (int64_t d = 0; d < dim; d++) {
    float p = 0.f, n = 0.f;
    for (int64_t g = 0; g < G; g++) {
      const float x = q[g * dim + d];
      p += x > 0.f ? x : 0.f;
      n += x < 0.f ? x : 0.f;
    }
    pos[d] = p, neg[d] = n;
  }
}

/* A score's bits as an unsigned key in the same order (a larger float, a larger key). */
static inline uint32_t order_key(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* The k-th largest (1 <= k <= n) of n keys, a byte at a time from the top (a radix
 * select over the few hundred blocks of a row: four passes of 256 counts, each over the
 * keys still in the running, which `keys` (n of scratch) holds). */
static uint32_t kth_largest(const uint32_t *all, int64_t n, int64_t k, uint32_t *keys) {
  uint32_t prefix = 0;
  int64_t m = n, want = k;
  memcpy(keys, all, sizeof(uint32_t) * (size_t)n);
  for (int shift = 24; shift >= 0; shift -= 8) {
    int32_t count[256] = {0};
    for (int64_t j = 0; j < m; j++) count[(keys[j] >> shift) & 255]++;
    uint32_t bucket = 255;
    while (count[bucket] < want) want -= count[bucket--];
    prefix |= bucket << shift;
    int64_t kept = 0; /* the keys in that bucket, to the front */
    for (int64_t j = 0; j < m; j++) {
      keys[kept] = keys[j];
      kept += ((keys[j] >> shift) & 255) == bucket;
    }
    m = kept;
  }
  return prefix;
}

/* Row bh's chosen blocks from its scores (one a full block of its row, see
 * kvlab_block_select): the best count of them (on equal scores the earlier ones), in table
 * order, so the attention reads them as they lie; then the newest. */
static void choose(const BlockStep *t, int64_t bh, int64_t b, int64_t h, const float *scores,
                   int64_t width) {
  const int64_t current = t->current[b];
  const int64_t count = current < t->picks ? current : t->picks;
  const int64_t *table = t->table + b * t->table_stride;
  int64_t *out = t->picked + bh * width, n = 0;
  const int64_t base = h * t->pool_blocks;
  if (count > 0) {
    uint32_t keys[current], scratch[current];
    for (int64_t p = 0; p < current; p++) keys[p] = order_key(scores[p]);
    const uint32_t threshold = kth_largest(keys, current, count, scratch);
    int64_t ties = count; /* how many at the threshold are taken: count less those above */
    for (int64_t p = 0; p < current; p++) ties -= keys[p] > threshold;
    for (int64_t p = 0; p < current; p++)
      if (keys[p] > threshold || (keys[p] == threshold && ties-- > 0))
        out[n++] = base + table[p];
  }
  for (int64_t i = n; i < width; i++) out[i] = base + table[current];
  t->hi[bh] = n * t->block_size + t->fill[b];
}

#define SCORE_RUN 32 /* blocks a thread scores at a time */

/* Each (row, KV head) bh = b * kv + h: its row's full blocks (table entries before
 * current[b]) scored by their bounds for its G queries (queries (B, kv, G, dim) fp32), in
 * runs of SCORE_RUN blocks over the threads; then the best min(current[b], picks) of them
 * (on equal scores the earlier ones) in table order, then its newest block, written to
 * picked (B * kv, picks + 1) as rows of the pool seen heads first (head h's block n at
 * h * pool_blocks + n); the rest of the row repeats the newest; hi[bh] = the tokens those
 * blocks hold. */
void kvlab_block_select(const BlockSelect *s, int bf16, const float *queries, int64_t B,
                        int64_t kv, int64_t G, int64_t dim) {
  const BlockStep *t = s->step;
  int64_t most = 0;
  for (int64_t b = 0; b < B; b++) most = t->current[b] > most ? t->current[b] : most;
  const int64_t runs = (most + SCORE_RUN - 1) / SCORE_RUN, width = t->picks + 1;
  float *scores = malloc(sizeof(float) * (size_t)(B * kv * (most > 0 ? most : 1)));
  const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < B * kv * runs; job++) {
      const int64_t bh = job / runs, b = bh / kv, h = bh % kv;
      const int64_t first = job % runs * SCORE_RUN, current = t->current[b];
      if (first >= current) continue;
      const int64_t last = first + SCORE_RUN < current ? first + SCORE_RUN : current;
      float pos[dim], neg[dim];
      signed_sums(queries + bh * G * dim, G, dim, pos, neg);
      const int64_t *table = t->table + b * t->table_stride;
      for (int64_t p = first; p < last; p++) {
        const int64_t at = (table[p] * s->s_block + h * s->s_head) * size;
        scores[bh * most + p] = block_bound(pos, neg, dim, (const char *)s->low + at,
                                            (const char *)s->high + at, bf16);
      }
    }
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * kv; bh++)
      choose(t, bh, bh / kv, bh % kv, scores + bh * most, width);
  }
  free(scores);
}

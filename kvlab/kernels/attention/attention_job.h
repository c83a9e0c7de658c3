/* What kvlab's CPU decode attention kernels share: a K or V store as the cache holds it
 * (`Store`), one segment's work (`Job`, see decode_attention.c for its addressing) and the
 * walk over a row's logical tokens in runs that share a block and a key scale row. */
#ifndef KVLAB_ATTENTION_JOB_H
#define KVLAB_ATTENTION_JOB_H

#include <stdint.h>
#include <string.h>

#include "bf16.h" /* bf16_value, value_at */

#define MAX_D 256
#define EMPTY (-1e30f) /* max of no scores (the build is -ffast-math: no infinities) */

/* The stored formats (kvlab.kernels.attention.segments.FORMATS, checked equal by a test). */
enum {
  FMT_F32 = 0, FMT_BF16 = 1, FMT_TOKEN_CODES = 2, FMT_CHANNEL_CODES = 3, FMT_FP8 = 4, FMT_FP4 = 5,
  FMT_CODEBOOK = 6
};

typedef struct {
  int32_t format, bits, group, scale_bf16;
  const void *data;
  int64_t s_block, s_head, s_slot;
  const void *scale, *zero;
  int64_t z_block, z_head, z_row;
} Store;

typedef struct {
  const float *q; /* (B, H, G, D) contiguous */
  Store k, v;
  const int64_t *table;
  int64_t table_stride, block_size, ring;
  const int64_t *lo, *hi; /* (B,) */
  int32_t B, H, G, D, chunk, n_chunks, partial_offset, partial_total;
  float scale;
  float *m, *l, *o; /* (B, H, P, G), (B, H, P, G), (B, H, P, G, D) with P = partial_total */
} Job;

#define TILE 32

/* The run of logical tokens t.. (< end) that lie in one block (and one pass of the ring):
 * sets block and slot, returns its length. */
static inline int64_t block_run(const Job *job, int b, int64_t t, int64_t end, int64_t *block,
                                int64_t *slot) {
  const int64_t u = job->ring > 0 ? t % job->ring : t;
  const int64_t bs = job->block_size;
  *block = job->table[b * job->table_stride + u / bs];
  *slot = u % bs;
  int64_t run = end - t;
  if (run > bs - *slot) run = bs - *slot;
  if (job->ring > 0 && run > job->ring - u) run = job->ring - u;
  return run;
}

/* The next run of logical tokens t.. (< end) that share a block and a key scale row: sets
 * block and slot, returns its length (<= TILE). */
static inline int next_run(const Job *job, int b, int64_t t, int64_t end, int64_t *block,
                           int64_t *slot) {
  int64_t run = block_run(job, b, t, end, block, slot);
  const Store *stores[2] = {&job->k, &job->v};
  for (int i = 0; i < 2; i++) {
    if (stores[i]->format != FMT_CHANNEL_CODES) continue;
    const int64_t group = stores[i]->group;
    if (run > group - *slot % group) run = group - *slot % group;
  }
  return (int)(run < TILE ? run : TILE);
}

/* decode_attention.c: the rows (and scales) of tokens t.. (< end) asked for ahead of use. */
void kvlab_prefetch_rows(const Job *job, const Store *s, int b, int h, int64_t t,
                         int64_t end);

/* attention_codes.c: keys in channel or token codes and values in token codes read
 * without dequantizing rows, where the CPU's vectors fit their layout (*_apply). */
int kvlab_codes_keys_apply(const Job *job);
void kvlab_codes_key_scores(const Job *job, int b, int h, int64_t t0, int64_t t1,
                            const float *q, float *scores, int n);
int kvlab_codes_values_apply(const Job *job);
void kvlab_codes_add_values(const Job *job, int b, int h, int64_t t0, int64_t t1,
                            const float *p, int n, float *o);

#endif

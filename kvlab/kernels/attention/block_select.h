/* Quest's block bounds and selection (block_select.c), as the policy's torch form and the
 * fused decode layer (decode_layer.c) both call them. */
#ifndef KVLAB_BLOCK_SELECT_H
#define KVLAB_BLOCK_SELECT_H

#include <stdint.h>

/* A decode step's block tables, the same for every layer: the rows' tables (B, width),
 * rows table_stride apart; each row's newest block's entry current[b] and the tokens in it
 * fill[b]; `picks` blocks chosen a (row, KV head) besides the newest; block_size tokens a
 * block; pool_blocks blocks a head in the pool seen heads first; the chosen tables
 * picked (B * kv, picks + 1) and their tokens hi (B * kv,), written a layer at a time. */
typedef struct {
  const int64_t *table;
  int64_t table_stride;
  const int64_t *current, *fill;
  int64_t picks, block_size, pool_blocks;
  int64_t *picked, *hi;
} BlockStep;

/* A layer's bounds: low and high (pool_blocks, kv, dim) in the model dtype, strides in
 * elements, and the step's tables. */
typedef struct {
  void *low, *high;
  int64_t s_block, s_head;
  const BlockStep *step;
} BlockSelect;

void kvlab_block_bounds(const BlockSelect *s, int bf16, int64_t M, int64_t kv, int64_t dim,
                        const int64_t *blocks, const int64_t *slots, const void *keys,
                        int64_t key_stride);
void kvlab_block_select(const BlockSelect *s, int bf16, const float *queries, int64_t B,
                        int64_t kv, int64_t G, int64_t dim);

#endif

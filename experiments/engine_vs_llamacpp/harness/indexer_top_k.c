/* Compressed attention's CSA indexer (kvlab_top_k_entries) alone, as a decode step at 4096
 * tokens calls it a layer: 3 (row, KV head) pairs of 3 query heads, 1024 pooled fp32 entries
 * of 64 channels each, the top 512 kept. 64 sets of random keys in turn, so the scores (and
 * the branches a selection takes on them) differ call to call as a model's do. Prints the
 * median time of a call over 31 rounds. Not a test; build against a kvlab library:
 *
 *   lib=$(python -c 'from kvlab.kernels import build; print(build.library()._name)')
 *   gcc -O2 -fopenmp indexer_top_k.c -o indexer_top_k "$lib" -Wl,-rpath,"$(dirname "$lib")"
 *   ./indexer_top_k
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "timing.h"

void kvlab_top_k_entries(const void *q, int q_bf16, int64_t R, int64_t H, int64_t G, int64_t D,
                         const void *keys, int k_bf16, int64_t s_row, int64_t s_head,
                         int64_t s_slot, const int64_t *seen, const int64_t *base,
                         int64_t top_k, int64_t *out);

enum { H = 3, G = 3, D = 64, ENTRIES = 1024, TOP_K = 512, SETS = 64, ROUNDS = 31 };

int main(void) {
  float *keys = malloc(sizeof(float) * SETS * H * ENTRIES * D), q[H * G * D];
  int64_t seen[1] = {ENTRIES}, base[H], out[H * TOP_K];
  for (int64_t i = 0; i < (int64_t)SETS * H * ENTRIES * D; i++) keys[i] = uniform();
  for (int i = 0; i < H * G * D; i++) q[i] = uniform();
  for (int h = 0; h < H; h++) base[h] = h * ENTRIES;
  double times[ROUNDS];
  int64_t check = 0;
  for (int round = 0; round < ROUNDS; round++) {
    const double start = now();
    for (int set = 0; set < SETS; set++) {
      kvlab_top_k_entries(q, 0, H, H, G, D, keys + (int64_t)set * H * ENTRIES * D, 0,
                          H * ENTRIES * D, ENTRIES * D, D, seen, base, TOP_K, out);
      check += out[set % (H * TOP_K)];
    }
    times[round] = (now() - start) / SETS;
  }
  qsort(times, ROUNDS, sizeof(double), by_value);
  printf("kvlab_top_k_entries, %d pairs x %d entries x %d channels, top %d: %.1f us a call "
         "(median of %d rounds; checksum %lld)\n", H, ENTRIES, D, TOP_K, times[ROUNDS / 2] * 1e6,
         ROUNDS, (long long)check);
  return 0;
}

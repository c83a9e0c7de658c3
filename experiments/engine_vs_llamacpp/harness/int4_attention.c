/* int4 KV decode attention (kvlab_decode_attention on KIVI codes: channel-code keys, token-
 * code values, 4 bits, groups of 32) as a decode step of SmolLM2-135M at 4096 tokens meets
 * it: 30 layers, each its own K/V codes and scales (3 KV heads of 64 channels, 3 query heads
 * each), and before each layer's call 18 MB of "weights" read on every thread (what the
 * layer's fp32 matrices stream), so the codes come from memory as they do in the engine,
 * not from a cache the previous call warmed. Kernel builds given as libraries take turns,
 * step by step, in one process; each prints its median attention time a layer and a row
 * a thread over the steps. Not a test. Build and run against two kvlab libraries:
 *
 *   gcc -O2 -fopenmp int4_attention.c -o int4_attention -ldl
 *   OMP_NUM_THREADS=2 ./int4_attention A.so B.so
 *
 * (scripts/bench_attention_builds.py's compiled() builds a kernel folder into a library.)
 */
#define _POSIX_C_SOURCE 199309L
#include <dlfcn.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../../kvlab/kernels/attention/attention_job.h"
#include "timing.h"

enum { LAYERS = 30, H = 3, G = 3, D = 64, W = D * 4 / 32, GROUP = 32, TOKENS = 4096 };
#ifndef CHUNK_TOKENS /* what backend_c.chunk_tokens picks for this span on 2 threads; */
#define CHUNK_TOKENS 1024 /* -DCHUNK_TOKENS=256: the chunks before session k */
#endif
enum { CAPACITY = 4608, CHUNK = CHUNK_TOKENS, CHUNKS = (CAPACITY + CHUNK - 1) / CHUNK };
enum { STEPS = 41, MAX_LIBS = 8 };
#ifndef WEIGHT_MB /* -DWEIGHT_MB=0 -DKV_LAYERS=1: the codes stay in cache (compute alone) */
#define WEIGHT_MB 18 /* a layer's fp32 matrices */
#endif
#ifndef KV_LAYERS
#define KV_LAYERS LAYERS /* layers with codes of their own (1: every layer reads the same) */
#endif
static const int64_t WEIGHT_FLOATS = WEIGHT_MB * 1024 * 1024 / 4 + 1;

typedef void (*attention_fn)(const Job *, int, void *, int);

/* Layer l's job over its own codes: keys (H, CAPACITY, W) words with a scale and zero row
 * of D per GROUP tokens, values the same words with a scale and zero per token and group. */
static Job layer_job(const float *q, const int64_t *table, const int64_t *lo, const int64_t *hi,
                     float *m, float *l, float *o) {
  Job job;
  memset(&job, 0, sizeof(job));
  Store *k = &job.k, *v = &job.v;
  uint32_t *kw = malloc(sizeof(uint32_t) * H * CAPACITY * W);
  uint32_t *vw = malloc(sizeof(uint32_t) * H * CAPACITY * W);
  float *ks = malloc(sizeof(float) * H * CAPACITY / GROUP * D);
  float *kz = malloc(sizeof(float) * H * CAPACITY / GROUP * D);
  float *vs = malloc(sizeof(float) * H * CAPACITY * (D / GROUP));
  float *vz = malloc(sizeof(float) * H * CAPACITY * (D / GROUP));
  for (int64_t i = 0; i < (int64_t)H * CAPACITY * W; i++)
    kw[i] = (uint32_t)rand() * 2654435761u, vw[i] = (uint32_t)rand() * 2654435761u;
  for (int64_t i = 0; i < (int64_t)H * CAPACITY / GROUP * D; i++)
    ks[i] = 0.02f + 0.01f * uniform(), kz[i] = uniform();
  for (int64_t i = 0; i < (int64_t)H * CAPACITY * (D / GROUP); i++)
    vs[i] = 0.02f + 0.01f * uniform(), vz[i] = uniform();
  *k = (Store){FMT_CHANNEL_CODES, 4, GROUP, 0, kw, 0, CAPACITY * W, W, ks, kz,
               0, CAPACITY / GROUP * D, D};
  *v = (Store){FMT_TOKEN_CODES, 4, GROUP, 0, vw, 0, CAPACITY * W, W, vs, vz,
               0, CAPACITY * (D / GROUP), D / GROUP};
  job.q = q, job.table = table, job.table_stride = 1, job.block_size = CAPACITY;
  job.lo = lo, job.hi = hi;
  job.B = 1, job.H = H, job.G = G, job.D = D, job.chunk = CHUNK, job.n_chunks = CHUNKS;
  job.partial_offset = 0, job.partial_total = CHUNKS, job.scale = 0.125f;
  job.m = m, job.l = l, job.o = o;
  return job;
}

/* Every thread reads its share of a layer's weights (the decode step's matrix reads). */
static float stream_weights(const float *weights) {
  float total = 0.f;
#pragma omp parallel for reduction(+ : total) schedule(static)
  for (int64_t i = 0; i < WEIGHT_FLOATS; i++) total += weights[i];
  return total;
}

int main(int argc, char **argv) {
  const int libs = argc - 1;
  if (libs < 1 || libs > MAX_LIBS) {
    fprintf(stderr, "usage: %s LIBRARY.so [LIBRARY.so ...] (at most %d)\n", argv[0], MAX_LIBS);
    return 2;
  }
  attention_fn attend[MAX_LIBS];
  for (int i = 0; i < libs; i++) {
    void *handle = dlopen(argv[i + 1], RTLD_NOW | RTLD_LOCAL);
    attend[i] = handle ? (attention_fn)dlsym(handle, "kvlab_decode_attention") : NULL;
    if (attend[i] == NULL) {
      fprintf(stderr, "%s: no kvlab_decode_attention (%s)\n", argv[i + 1], dlerror());
      return 2;
    }
  }
  static float q[H * G * D], out[H * G * D];
  static float m[H * CHUNKS * G], l[H * CHUNKS * G], o[H * CHUNKS * G * D];
  const int64_t table[1] = {0}, lo[1] = {0}, hi[1] = {TOKENS};
  for (int i = 0; i < H * G * D; i++) q[i] = uniform();
  Job jobs[LAYERS];
  for (int layer = 0; layer < LAYERS; layer++)
    jobs[layer] =
        layer < KV_LAYERS ? layer_job(q, table, lo, hi, m, l, o) : jobs[layer % KV_LAYERS];
  float *weights = malloc(sizeof(float) * WEIGHT_FLOATS * LAYERS);
  for (int64_t i = 0; i < WEIGHT_FLOATS * LAYERS; i++) weights[i] = 1e-6f * (float)(i & 1023);
  static double seconds[MAX_LIBS][STEPS];
  double check[MAX_LIBS] = {0}, sink = 0.;
  for (int step = 0; step < STEPS + 1; step++) /* step 0: warm-up */
    for (int i = 0; i < libs; i++) {
      double total = 0.;
      for (int layer = 0; layer < LAYERS; layer++) {
        sink += stream_weights(weights + layer * WEIGHT_FLOATS);
        const double start = now();
        attend[i](&jobs[layer], 1, out, 0);
        total += now() - start;
        check[i] += out[layer % (H * G * D)];
      }
      if (step) seconds[i][step - 1] = total;
    }
  const int64_t rows_a_thread = (int64_t)H * TOKENS / omp_get_max_threads();
  for (int i = 0; i < libs; i++) {
    qsort(seconds[i], STEPS, sizeof(double), by_value);
    const double step = seconds[i][STEPS / 2], layer = step / LAYERS;
    printf("%s: %.1f us a layer, %.1f ns a row a thread (%d threads), %.3f of the first; "
           "checksum %.6g\n", argv[i + 1], layer * 1e6, layer / rows_a_thread * 1e9,
           omp_get_max_threads(), step / seconds[0][STEPS / 2], check[i]);
  }
  return sink == 42. ? 1 : 0;
}

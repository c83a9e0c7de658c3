/* The one-row weight kernels over a decode step's 120 matrices of SmolLM2-135M (qkv 960 x 576,
 * o 576 x 576, gate/up 3072 x 576, down 576 x 1536, 30 times; 106 MB in int8), called from C,
 * so no Python call sits between them. Prints the median time the kernels took a step (15
 * rounds of 5 steps) and the bandwidth it means. With "between", an OpenMP region that
 * sums 1000 numbers runs before each layer's first matrix, as attention's regions run in a
 * decode step (its own time is not counted). int4: groups of 32 with bf16 scales and
 * offsets (~66 MB). w8a8, w4a8: the int8 or int4 codes times int8 activations
 * (gemv_w8a8.c, gemv_w4a8.c; w8a8's activations a scale a row, or with GROUP=n in the
 * environment a scale every n channels). With HUGE=1
 * in the environment the weights lie in one mapping advised MADV_HUGEPAGE before first
 * touch, as kvlab/kernels/huge_pages.py places a run's weights (else aligned_alloc's, on
 * 4 KiB pages where THP is "madvise"). Not a test; build against
 * kvlab's library:
 *
 *   lib=$(python -c 'from kvlab.kernels import build; print(build.library()._name)')
 *   gcc -O2 -march=native -fopenmp gemv_stack.c -o gemv_stack "$lib" -Wl,-rpath,"$(dirname "$lib")"
 *   ./gemv_stack int8 rows between
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/mman.h>

#include "timing.h"

/* n bytes for a weight matrix: from aligned_alloc, or with HUGE=1 from one mapping advised
 * for 2 MiB pages (1 GiB reserved, bumped 64 bytes at a time). */
static void *weights_alloc(size_t n) {
  static char *arena = NULL;
  static size_t used = 0;
  const char *huge = getenv("HUGE");
  if (huge == NULL || *huge == '\0' || *huge == '0') return aligned_alloc(64, n);
  if (arena == NULL) {
    const size_t size = (size_t)1 << 30, page = (size_t)2 << 20;
    char *p = mmap(NULL, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    arena = (char *)(((uintptr_t)p + page - 1) & ~(uintptr_t)(page - 1));
    madvise(arena, size, MADV_HUGEPAGE);
  }
  void *at = arena + used;
  used += (n + 63) / 64 * 64;
  return at;
}

void kvlab_gemv_int8(const void *x, int x_bf16, int64_t x_stride, const int8_t *q,
                     const void *scale, int scale_bf16, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int in_order);
void kvlab_gemv(const void *x, int x_bf16, int64_t x_stride, const void *w, int w_bf16,
                const void *bias, int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N,
                int64_t K, int in_order);
void kvlab_gemv_int4(const void *x, int x_bf16, int64_t x_stride, const uint8_t *codes,
                     const void *so, int so_bf16, int64_t G, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K);
void kvlab_gemv_w8a8(const void *x, int x_bf16, int64_t x_stride, const int8_t *q,
                     const void *scale, int scale_bf16, int64_t AG, const void *bias,
                     int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                     int in_order);
void kvlab_gemv_w4a8(const void *x, int x_bf16, int64_t x_stride, const uint8_t *codes,
                     const void *so, int so_bf16, int64_t G, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K);

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s fp32|bf16|int8|w8a8|int4|w4a8 rows|tiles [between]\n", argv[0]);
    return 2;
  }
  const int w4a8 = !strcmp(argv[1], "w4a8"), int4 = !strcmp(argv[1], "int4") || w4a8;
  const int w8a8 = !strcmp(argv[1], "w8a8");
  const int64_t w8a8_group = getenv("GROUP") ? atoll(getenv("GROUP")) : 0;
  const int format = !strcmp(argv[1], "int8") || w8a8 ? 2 : !strcmp(argv[1], "bf16") ? 1 : 0;
  const int size = format == 2 ? 1 : format == 1 ? 2 : 4, between = argc > 3;
  const int in_order = !strcmp(argv[2], "rows");
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  void *w[120], *so[120];
  uint16_t *scale = malloc(2 * 4096), *x = malloc(4 * 4096), *y = malloc(4 * 4096);
  for (int i = 0; i < 4096; i++) {
    scale[i] = 0x3c00;                          /* bf16 2^-7 */
    x[i] = (uint16_t)(0x3f00 + (i % 64)); /* bf16 0.5 .. 0.99 */
  }
  double bytes = 0;
  for (int i = 0; i < 120; i++) {
    const int64_t count = shapes[i % 4][0] * shapes[i % 4][1];
    const int64_t n = int4 ? count / 2 : count * size, groups = count / 32;
    w[i] = weights_alloc(n);
    for (int64_t j = 0; j < n; j++) ((uint8_t *)w[i])[j] = (uint8_t)(j * 37 + i);
    bytes += n;
    if (!int4) continue;
    so[i] = weights_alloc(4 * groups); /* a bf16 scale and offset a group */
    for (int64_t j = 0; j < 2 * groups; j++) ((uint16_t *)so[i])[j] = 0x3c00;
    bytes += 4 * groups;
  }
  volatile float sink = 0;
  double times[15];
  for (int r = 0; r < 15; r++) {
    double kernels = 0;
    for (int step = 0; step < 5; step++)
      for (int i = 0; i < 120; i++) {
        const int64_t N = shapes[i % 4][0], K = shapes[i % 4][1];
        if (between && i % 4 == 0) {
          float acc = 0;
#pragma omp parallel for reduction(+ : acc)
          for (int j = 0; j < 1000; j++) acc += (float)j;
          sink += acc;
        }
        const double t0 = now();
        if (w4a8)
          kvlab_gemv_w4a8(x, 1, K, w[i], so[i], 1, 32, NULL, 0, y, 1, 1, N, K);
        else if (int4)
          kvlab_gemv_int4(x, 1, K, w[i], so[i], 1, 32, NULL, 0, y, 1, 1, N, K);
        else if (w8a8)
          kvlab_gemv_w8a8(x, 1, K, w[i], scale, 1, w8a8_group ? w8a8_group : K, NULL, 0, y, 1, 1, N,
                          K, in_order);
        else if (format == 2)
          kvlab_gemv_int8(x, 1, K, w[i], scale, 1, NULL, 0, y, 1, 1, N, K, in_order);
        else
          kvlab_gemv(x, format == 1, K, w[i], format == 1, NULL, 0, y, format == 1, 1, N, K,
                     in_order);
        kernels += now() - t0;
      }
    times[r] = kernels / 5;
  }
  qsort(times, 15, sizeof(double), by_value);
  printf("%s %s%s: %.2f ms a step (median of 15), %.1f GB/s\n", argv[1], argv[2],
         between ? " between" : "", times[7] * 1e3, bytes / times[7] / 1e9);
  return 0;
}

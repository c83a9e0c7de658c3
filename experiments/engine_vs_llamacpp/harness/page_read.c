/* A streaming read from 4 KiB pages against the same read from 2 MiB pages: 512 MiB in
 * each of two private mappings, one advised MADV_NOHUGEPAGE and one MADV_HUGEPAGE before
 * first touch (what kvlab/kernels/huge_pages.py does for weights and KV), summed on every
 * thread with four vector accumulators, in turns, six times. Prints GB/s per read and the
 * huge pages the second mapping got. Not a test:
 *
 *   gcc -O2 -march=native -fopenmp page_read.c -o page_read && OMP_NUM_THREADS=2 ./page_read
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "timing.h"

#define HUGE_PAGE ((size_t)2 << 20)

static float *mapping(size_t bytes, int huge) {
  char *p = mmap(NULL, bytes + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (p == MAP_FAILED) return NULL;
  p = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
  madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  memset(p, 1, bytes);
  return (float *)p;
}

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define VZERO _mm512_setzero_ps()
#define VLOAD _mm512_loadu_ps
#define VADD _mm512_add_ps
static float hsum(vec a) { return _mm512_reduce_add_ps(a); }
#else
typedef __m256 vec;
#define LANES 8
#define VZERO _mm256_setzero_ps()
#define VLOAD _mm256_loadu_ps
#define VADD _mm256_add_ps
static float hsum(vec a) {
  float o[8];
  _mm256_storeu_ps(o, a);
  return o[0] + o[1] + o[2] + o[3] + o[4] + o[5] + o[6] + o[7];
}
#endif

static float streamed(const float *x, size_t n) {
  float total = 0.f;
#pragma omp parallel reduction(+ : total)
  {
    vec a0 = VZERO, a1 = VZERO, a2 = VZERO, a3 = VZERO;
#pragma omp for schedule(static) nowait
    for (size_t i = 0; i < n; i += 4 * LANES) {
      a0 = VADD(a0, VLOAD(x + i)), a1 = VADD(a1, VLOAD(x + i + LANES));
      a2 = VADD(a2, VLOAD(x + i + 2 * LANES)), a3 = VADD(a3, VLOAD(x + i + 3 * LANES));
    }
    total += hsum(VADD(VADD(a0, a1), VADD(a2, a3)));
  }
  return total;
}

/* AnonHugePages of the mapping holding `p`, in kB (from /proc/self/smaps). */
static long huge_kb(const void *p) {
  FILE *f = fopen("/proc/self/smaps", "r");
  char line[512];
  int inside = 0;
  long kb = -1;
  while (f && fgets(line, sizeof line, f)) {
    uintptr_t lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, ':') > strchr(line, ' '))
      inside = lo <= (uintptr_t)p && (uintptr_t)p < hi;
    else if (inside && sscanf(line, "AnonHugePages: %ld kB", &kb) == 1)
      break;
  }
  if (f) fclose(f);
  return kb;
}

int main(void) {
  const size_t bytes = (size_t)512 << 20, n = bytes / sizeof(float);
  float *pages[2] = {mapping(bytes, 0), mapping(bytes, 1)};
  if (!pages[0] || !pages[1]) return 2;
  float sink = 0.f;
  for (int round = 0; round < 6; round++)
    for (int huge = 0; huge < 2; huge++) {
      const double start = now();
      sink += streamed(pages[huge], n);
      const double seconds = now() - start;
      printf("%s pages: %.1f GB/s\n", huge ? "2 MiB" : "4 KiB", bytes / seconds / 1e9);
    }
  printf("huge pages the second mapping got: %ld of %zu kB\n", huge_kb(pages[1]), bytes >> 10);
  return sink == 42.f;
}

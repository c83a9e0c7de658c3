/* What pairs of AVX-512 operations cost on this CPU when they issue side by side: eight
 * independent chains of each operation of a pair, interleaved, in cycles per pair (the clock
 * taken from a lone FMA chain set, which runs at one zmm FMA a cycle on the Zen4 EPYC and
 * the Xeons here). A pair that costs the larger of its two lone costs issues on separate
 * pipes; one that costs their sum shares them. Read it before choosing how a kernel widens
 * codes to floats: the FMAs are the floor, and what shares their pipes adds to it. Not a
 * test. Build and run:
 *
 *   gcc -O2 -march=native vector_ops.c -o vector_ops && ./vector_ops
 */
#define _POSIX_C_SOURCE 199309L
#include <immintrin.h>
#include <stdio.h>

#include "timing.h"

enum { PAIRS = 50000000 };

#define FMA(a) a = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(a), fm, fa))
#define SRLI(a) a = _mm512_srli_epi32(a, 3)
#define SRLV(a) a = _mm512_srlv_epi32(a, count)
#define ROL(a) a = _mm512_rol_epi32(a, 3)
#define AND(a) __asm__("vpandd %1, %0, %0" : "+v"(a) : "v"(mask))
#define TERN(a) a = _mm512_ternarylogic_epi32(a, mask, count, 0x96)
#define CVT(a) a = _mm512_castps_si512(_mm512_cvtepi32_ps(a))
#define CVTU(a) a = _mm512_castps_si512(_mm512_cvtepu32_ps(a))
#define PERM(a) a = _mm512_permutexvar_epi32(count, a)
#define NONE(a) (void)0
#define ONE_EACH(OPA, OPB, i) \
  OPA(a##i);                 \
  OPB(b##i)
#define KEEP(x) __asm__ volatile("" : "+v"(x##0), "+v"(x##1), "+v"(x##2), "+v"(x##3), \
                                 "+v"(x##4), "+v"(x##5), "+v"(x##6), "+v"(x##7))

/* Seconds for PAIRS pairs of OPA and OPB, each over eight chains held in registers. */
#define PAIR_SECONDS(OPA, OPB)                                                          \
  static double seconds_##OPA##_##OPB(void) {                                          \
    const __m512 fm = _mm512_set1_ps(0.5f), fa = _mm512_set1_ps(1.f);                   \
    const __m512i count = _mm512_set1_epi32(3), mask = _mm512_set1_epi32(0x780000);     \
    __m512i a0 = _mm512_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,     \
            a6 = a0, a7 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0,     \
            b6 = a0, b7 = a0;                                                           \
    const double start = now();                                                         \
    for (long n = 0; n < PAIRS / 8; n++) {                                              \
      ONE_EACH(OPA, OPB, 0); ONE_EACH(OPA, OPB, 1); ONE_EACH(OPA, OPB, 2);              \
      ONE_EACH(OPA, OPB, 3); ONE_EACH(OPA, OPB, 4); ONE_EACH(OPA, OPB, 5);              \
      ONE_EACH(OPA, OPB, 6); ONE_EACH(OPA, OPB, 7);                                     \
      KEEP(a);                                                                          \
      KEEP(b);                                                                          \
    }                                                                                   \
    (void)fm, (void)fa, (void)count, (void)mask;                                        \
    return now() - start;                                                               \
  }
PAIR_SECONDS(FMA, NONE)
PAIR_SECONDS(SRLI, NONE)
PAIR_SECONDS(CVT, NONE)
PAIR_SECONDS(AND, NONE)
PAIR_SECONDS(FMA, FMA)
PAIR_SECONDS(FMA, SRLI)
PAIR_SECONDS(FMA, SRLV)
PAIR_SECONDS(FMA, ROL)
PAIR_SECONDS(FMA, TERN)
PAIR_SECONDS(FMA, AND)
PAIR_SECONDS(FMA, CVT)
PAIR_SECONDS(FMA, PERM)
PAIR_SECONDS(SRLI, CVT)
PAIR_SECONDS(AND, CVT)
PAIR_SECONDS(FMA, CVTU)
PAIR_SECONDS(AND, CVTU)

int main(void) {
  const double cycle = seconds_FMA_NONE() / PAIRS; /* one zmm FMA a cycle */
  const struct { const char *name; double (*seconds)(void); } pairs[] = {
      {"fma alone", seconds_FMA_NONE},   {"srli alone", seconds_SRLI_NONE},
      {"cvtdq2ps alone", seconds_CVT_NONE}, {"and alone", seconds_AND_NONE},
      {"fma + fma", seconds_FMA_FMA},     {"fma + srli", seconds_FMA_SRLI},
      {"fma + srlv", seconds_FMA_SRLV},   {"fma + rol", seconds_FMA_ROL},
      {"fma + ternlog", seconds_FMA_TERN}, {"fma + and", seconds_FMA_AND},
      {"fma + cvtdq2ps", seconds_FMA_CVT}, {"fma + permd", seconds_FMA_PERM},
      {"srli + cvtdq2ps", seconds_SRLI_CVT}, {"and + cvtdq2ps", seconds_AND_CVT},
      {"fma + cvtudq2ps", seconds_FMA_CVTU}, {"and + cvtudq2ps", seconds_AND_CVTU},
  };
  /* the rate itself: what an FMA-bound kernel's floor is computed from (a core) */
  printf("lone zmm FMA chains: %.2f G FMAs a second\n", 1e-9 / cycle);
  for (unsigned i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++)
    printf("%-16s %.2f cycles a pair\n", pairs[i].name, pairs[i].seconds() / PAIRS / cycle);
  return 0;
}

/* kvlab's CPU matrix-vector product over grouped int4 weights for decode (RTN / GPTQ int4,
 * symmetric or asymmetric): y (M, N) = x (M, K) . W^T (+ bias) with
 * W[n][k] = (code[n][k] - 8) * scale[g][n] + offset[g][n], g = k / G, as
 * kvlab.quant.rtn.dequantize_int4 defines it. Vectors run along output channels, as in
 * PyTorch's int4 kernel: codes are held in blocks of 16 output channels, a byte per channel
 * and pair of input channels (kvlab.quant.rtn.block_int4: low nibble the even channel), so
 * one 16-byte load is two channels' codes for 16 outputs, each multiplied by one broadcast
 * value of x; scales and offsets are read as vectors, once per group, the offset term as
 * (offset - 8 * scale) times the group's sum of x. No horizontal sums, nothing dequantized
 * into memory, fp32 accumulation: the dequantized layer's outputs up to summation order.
 * Blocks are split across threads, each streaming one block's codes for up to INT4_ROWS
 * rows of x. Needs N % 16 == 0, G % 4 == 0 and K % G == 0 (the caller checks). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

#define BLOCK 16 /* output channels of a block */
#if defined(__AVX512F__)
#define INT4_ROWS 4 /* rows of x a block takes at once */
#define HALVES 1    /* vectors a block spans */
#elif defined(LANES)
#define INT4_ROWS 2
#define HALVES 2
#else
#define INT4_ROWS 1
#endif

/* What every block reads: its codes (N/16, K/2, 16), its scales and offsets (N/16, K/G, 2,
 * 16), x (M, K) widened to fp32 (and as given, where bf16) and each row's group sums. */
typedef struct {
  const uint8_t *codes;
  const void *so; /* (N/16, K/G, 2, 16): each block's scales then offsets, group by group */
  int so_bf16;
  int64_t N, K, G;
  const float *x, *sums;
  const uint16_t *x_bf16; /* x itself where its rows are bf16, x_stride apart; else NULL */
  int64_t x_stride;
} Int4;

#ifdef LANES
/* Lanes [h * LANES, (h + 1) * LANES) of a block's 16 code bytes at p, as fp32 codes: the
 * even channel's (low nibbles) in lo, the odd one's in hi. */
static inline void vload_nibbles(const uint8_t *p, int h, vec *lo, vec *hi) {
#if defined(__AVX512F__)
  (void)h;
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
#else
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
  *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
#endif
}

/* out[m * 16 + r] = output 16 b + r for rows m0 .. m0 + M of x: per group, even and odd
 * chains per vector (two pairs of channels in flight for one row), summed, scaled, plus
 * the offset term. (Four blocks at once, four memory streams, read slower here.) */
static inline __attribute__((always_inline)) void tile(const Int4 *w, int64_t b, int64_t m0,
                                                       const int M, float *out) {
  const int64_t K = w->K, G = w->G, groups = K / G;
  const uint8_t *codes = w->codes + b * (K / 2) * BLOCK;
  vec acc[INT4_ROWS][HALVES];
  for (int m = 0; m < M; m++)
    for (int v = 0; v < HALVES; v++) acc[m][v] = vzero();
  const int U = M * HALVES <= 2 ? 2 : 1; /* 2 * U * HALVES chains cover the FMA latency */
  for (int64_t g = 0; g < groups; g++) {
    vec even[INT4_ROWS][HALVES][2], odd[INT4_ROWS][HALVES][2];
    for (int m = 0; m < M; m++)
      for (int v = 0; v < HALVES; v++)
        for (int u = 0; u < U; u++) even[m][v][u] = odd[m][v][u] = vzero();
    for (int64_t p = g * G / 2; p < (g + 1) * G / 2; p += U)
      for (int u = 0; u < U; u++)
        for (int v = 0; v < HALVES; v++) {
          const uint8_t *at = codes + (p + u) * BLOCK;
          if (v == 0 && (p + u) % 4 == 0) __builtin_prefetch(at + 128 * BLOCK, 0, 2);
          vec lo, hi;
          vload_nibbles(at, v, &lo, &hi);
          for (int m = 0; m < M; m++) {
            const float *x = w->x + (m0 + m) * K + 2 * (p + u);
            even[m][v][u] = vfma(lo, vset1(x[0]), even[m][v][u]);
            odd[m][v][u] = vfma(hi, vset1(x[1]), odd[m][v][u]);
          }
        }
    for (int m = 0; m < M; m++)
      for (int v = 0; v < HALVES; v++)
        for (int u = 1; u < U; u++) {
          even[m][v][0] = even[m][v][0] + even[m][v][u];
          odd[m][v][0] = odd[m][v][0] + odd[m][v][u];
        }
    for (int v = 0; v < HALVES; v++) {
      const int64_t at = (b * groups + g) * 2 * BLOCK + v * LANES;
      const vec scale = vload(w->so, w->so_bf16, at);
      const vec shift = vfma(scale, vset1(-8.f), vload(w->so, w->so_bf16, at + BLOCK));
      for (int m = 0; m < M; m++) {
        acc[m][v] = vfma(even[m][v][0] + odd[m][v][0], scale, acc[m][v]);
        acc[m][v] = vfma(shift, vset1(w->sums[(m0 + m) * groups + g]), acc[m][v]);
      }
    }
  }
  for (int m = 0; m < M; m++)
    for (int v = 0; v < HALVES; v++) vstore(out + m * BLOCK + v * LANES, acc[m][v]);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAS_TILE_BF16 1
#define CHAINS 4 /* a row's dot products in flight: vdpbf16ps' latency, not its rate */
/* tile() for bf16 rows where the CPU has AVX512-BF16: each code byte's two nibbles become
 * the bf16 values of code - 8 (exact, -8..7), two channels a 32-bit lane, through a
 * 16-entry vpermw table, and vdpbf16ps multiplies 32 codes by a broadcast pair of x in
 * one instruction (products exact, fp32 accumulation). A group adds
 * scale * dot + offset * sum x. (The codes as 1 + n / 16 by two shifts, a ternlog and an
 * OR, with the group's sum of x taken off again after, took 1.12x the time with the
 * matrix in cache, one thread, Zen4.) U chains a row (CHAINS for one row, 2 for two, one
 * from three on) keep U * M vdpbf16ps in flight: one chain a row, as before, waited on
 * each one's latency (one row of x 0.77x the time in cache, 0.8x over a step's 120
 * matrices from memory, Zen4; 8 chains no faster than 4). */
static inline __attribute__((always_inline)) void tile_bf16_chains(const Int4 *w, int64_t b,
                                                                   int64_t m0, const int M,
                                                                   const int U, float *out) {
  const int64_t K = w->K, G = w->G, groups = K / G;
  const uint8_t *codes = w->codes + b * (K / 2) * BLOCK;
  /* the nibbles' places as word indices: the even channel's in bits 0-3, the odd's 16-19 */
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  /* bf16 of n - 8 at word n (-8 .. 7), in both halves: vpermw indexes 32 words */
  const __m512i values = _mm512_broadcast_i64x4(_mm256_setr_epi16(
      (short)0xC100, (short)0xC0E0, (short)0xC0C0, (short)0xC0A0, (short)0xC080,
      (short)0xC040, (short)0xC000, (short)0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080,
      0x40A0, 0x40C0, 0x40E0));
  __m512 acc[INT4_ROWS];
  for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 dot[INT4_ROWS][CHAINS];
    for (int m = 0; m < M; m++)
      for (int u = 0; u < U; u++) dot[m][u] = _mm512_setzero_ps();
    for (int64_t p = g * G / 2; p < (g + 1) * G / 2; p += U)
      for (int u = 0; u < U; u++) {
        const uint8_t *at = codes + (p + u) * BLOCK;
        if ((p + u) % 4 == 0) __builtin_prefetch(at + 128 * BLOCK, 0, 2);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at));
        const __m512i index =
            _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8); /* (a|b)&c */
        const __m512bh codes_bf16 = (__m512bh)_mm512_permutexvar_epi16(index, values);
        for (int m = 0; m < M; m++) {
          int32_t pair; /* x[2p], x[2p + 1] */
          memcpy(&pair, w->x_bf16 + (m0 + m) * w->x_stride + 2 * (p + u), sizeof(pair));
          dot[m][u] = _mm512_dpbf16_ps(dot[m][u], codes_bf16, (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    const int64_t at = (b * groups + g) * 2 * BLOCK;
    const __m512 scale = vload(w->so, w->so_bf16, at);
    const __m512 offset = vload(w->so, w->so_bf16, at + BLOCK);
    for (int m = 0; m < M; m++) {
      for (int u = 1; u < U; u++) dot[m][0] = dot[m][0] + dot[m][u];
      acc[m] = vfma(dot[m][0], scale, acc[m]);
      acc[m] = vfma(offset, vset1(w->sums[(m0 + m) * groups + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; m++) vstore(out + m * BLOCK, acc[m]);
}

static inline __attribute__((always_inline)) void tile_bf16(const Int4 *w, int64_t b,
                                                            int64_t m0, const int M,
                                                            float *out) {
  if (M == 1 && w->G % (2 * CHAINS) == 0)
    tile_bf16_chains(w, b, m0, 1, CHAINS, out);
  else if (M <= 2)
    tile_bf16_chains(w, b, m0, M, 2, out);
  else
    tile_bf16_chains(w, b, m0, M, 1, out);
}
#endif

#ifndef LANES
static inline void tile(const Int4 *w, int64_t b, int64_t m0, const int M, float *out) {
  const int64_t K = w->K, G = w->G;
  for (int m = 0; m < M; m++)
    for (int r = 0; r < BLOCK; r++) {
      const uint8_t *codes = w->codes + b * (K / 2) * BLOCK + r;
      const float *x = w->x + (m0 + m) * K;
      float sum = 0.f;
      for (int64_t g = 0; g < K / G; g++) {
        const int64_t at = (b * (K / G) + g) * 2 * BLOCK + r;
        const float scale = value_at(w->so, w->so_bf16, at);
        const float shift = value_at(w->so, w->so_bf16, at + BLOCK) - 8.f * scale;
        float dot = 0.f;
        for (int64_t p = g * G / 2; p < (g + 1) * G / 2; p++) {
          const uint8_t byte = codes[p * BLOCK];
          dot += (float)(byte & 15) * x[2 * p] + (float)(byte >> 4) * x[2 * p + 1];
        }
        sum += dot * scale + shift * w->sums[(m0 + m) * (K / G) + g];
      }
      out[m * BLOCK + r] = sum;
    }
}
#endif

#ifdef HAS_TILE_BF16
#define TILE(MM) w.x_bf16 ? tile_bf16(&w, b, m0, MM, acc) : tile(&w, b, m0, MM, acc)
#else
#define TILE(MM) tile(&w, b, m0, MM, acc)
#endif
#define INT4_CASE(MM) \
  case MM:            \
    TILE(MM);         \
    break;

/* x: (M, K), rows x_stride apart, fp32 or bf16; codes: (N/16, K/2, 16) bytes; so: scales
 * and offsets (N/16, K/G, 2, 16), fp32 or bf16; bias (N,) or NULL; y: (M, N), fp32 or
 * bf16. */
void kvlab_gemv_int4(const void *x, int x_bf16, int64_t x_stride, const uint8_t *codes,
                     const void *so, int so_bf16, int64_t G,
                     const void *bias, int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N,
                     int64_t K) {
  const int64_t groups = K / G;
  float *xf = malloc(sizeof(float) * M * (K + groups)), *sums = xf + M * K;
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      float sum = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; k++) {
        xf[m * K + k] = value_at(x, x_bf16, m * x_stride + k);
        sum += xf[m * K + k];
      }
      sums[m * groups + g] = sum;
    }
  const Int4 w = {codes, so, so_bf16, N, K, G, xf, sums,
                  x_bf16 ? (const uint16_t *)x : NULL, x_stride};
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < N / BLOCK; b++)
    for (int64_t m0 = 0; m0 < M; m0 += INT4_ROWS) {
      const int64_t rows = M - m0 < INT4_ROWS ? M - m0 : INT4_ROWS;
      float acc[INT4_ROWS * BLOCK];
      switch (rows) {
        INT4_CASE(1)
#if INT4_ROWS >= 2
        INT4_CASE(2)
#endif
#if INT4_ROWS >= 4
        INT4_CASE(3)
        INT4_CASE(4)
#endif
      }
      for (int64_t m = 0; m < rows; m++)
        for (int r = 0; r < BLOCK; r++) {
          const int64_t n = b * BLOCK + r;
          const float bias_n = bias ? value_at(bias, bias_bf16, n) : 0.f;
          store(y, y_bf16, (m0 + m) * N + n, acc[m * BLOCK + r] + bias_n);
        }
    }
  free(xf);
}

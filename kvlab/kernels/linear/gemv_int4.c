/* kvlab's CPU matrix-vector product over grouped int4 weights for decode (RTN / GPTQ int4,
 * symmetric or asymmetric): y (M, N) = x (M, K) . W^T (+ bias) with
 * W[n][k] = (code[n][k] - 8) * scale[g][n] + offset[g][n], g = k / G, as
 * kvlab.quant.rtn.dequantize_int4 defines it. Vectors run along output channels, as in
 * PyTorch's int4 kernel: codes are held in blocks of 16 output channels and chunks of 8
 * input channels, 64 bytes a chunk, one 32-bit word per output (kvlab.quant.packing.
 * block_int4): nibble j of output r's word holds input channel 2j (j < 4) or 2(j - 4) + 1
 * of the chunk, so one 64-byte load is 8 channels' codes for 16 outputs, and the word's
 * low 16 bits and high 16 bits shifted by 4 i hold channels 2i and 2i + 1 in their low
 * nibbles. Scales and offsets are read as vectors, once per group, the offset term as
 * (offset - 8 * scale) times the group's sum of x. No horizontal sums, nothing dequantized
 * into memory, fp32 accumulation: the dequantized layer's outputs up to summation order.
 * Blocks are split across threads, each streaming one block's codes for up to INT4_ROWS
 * rows of x. Needs N % 16 == 0, G % 8 == 0 and K % G == 0 (the caller checks). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

#define BLOCK 16 /* output channels of a block */
#define CHUNK_BYTES (4 * BLOCK) /* 8 input channels of a block */
#define AHEAD (32 * CHUNK_BYTES) /* how far ahead of use a block's codes are asked for */
#if defined(__AVX512F__)
#define INT4_ROWS 4 /* rows of x a block takes at once */
#define HALVES 1    /* vectors a block spans */
#define FP_CHAINS 4 /* accumulators a row and vector (tile) */
#elif defined(LANES)
#define INT4_ROWS 2
#define HALVES 2
#define FP_CHAINS 2
#else
#define INT4_ROWS 1
#endif

/* What every block reads: its codes (N/16, K/8, 16, 4 bytes), its scales and offsets
 * (N/16, K/G, 2, 16), x (M, K) widened to fp32 (and as given, where bf16) and each row's
 * group sums. */
typedef struct {
  const uint8_t *codes;
  const void *so; /* (N/16, K/G, 2, 16): each block's scales then offsets, group by group */
  int so_bf16;
  int64_t N, K, G;
  const float *x, *sums;
  const uint16_t *x_bf16; /* x itself where its rows are bf16, x_stride apart; else NULL */
  int64_t x_stride;
} Int4;

/* The input channel (of 8) nibble j of an output's word holds. */
static inline int chunk_channel(int j) { return j < 4 ? 2 * j : 2 * (j - 4) + 1; }

#ifdef LANES
#if defined(__AVX512F__)
typedef __m512i words;
static inline words vload_words(const uint8_t *p, int h) {
  (void)h;
  return _mm512_loadu_si512((const void *)p);
}
/* Nibble j of every word, as fp32 codes. */
static inline vec vnibble(words w, int j) {
  const __m512i shifted = _mm512_srli_epi32(w, 4 * j);
  return _mm512_cvtepi32_ps(_mm512_and_si512(shifted, _mm512_set1_epi32(15)));
}
#else
typedef __m256i words;
static inline words vload_words(const uint8_t *p, int h) {
  return _mm256_loadu_si256((const __m256i *)(p + 4 * LANES * h));
}
static inline vec vnibble(words w, int j) {
  const __m256i shifted = _mm256_srli_epi32(w, 4 * j);
  return _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(15)));
}
#endif

/* out[m * 16 + r] = output 16 b + r for rows m0 .. m0 + M of x: per group, FP_CHAINS
 * chains per row and vector (nibble j feeds chain j % FP_CHAINS), summed, scaled, plus the
 * offset term. */
static inline __attribute__((always_inline)) void tile(const Int4 *w, int64_t b, int64_t m0,
                                                       const int M, float *out) {
  const int64_t K = w->K, G = w->G, groups = K / G;
  const uint8_t *codes = w->codes + b * (K / 8) * CHUNK_BYTES;
  vec acc[INT4_ROWS][HALVES];
  for (int m = 0; m < M; m++)
    for (int v = 0; v < HALVES; v++) acc[m][v] = vzero();
  for (int64_t g = 0; g < groups; g++) {
    vec dot[INT4_ROWS][HALVES][FP_CHAINS];
    for (int m = 0; m < M; m++)
      for (int v = 0; v < HALVES; v++)
        for (int u = 0; u < FP_CHAINS; u++) dot[m][v][u] = vzero();
    for (int64_t c = g * G / 8; c < (g + 1) * G / 8; c++) {
      const uint8_t *at = codes + c * CHUNK_BYTES;
      __builtin_prefetch(at + AHEAD, 0, 2);
      for (int v = 0; v < HALVES; v++) {
        const words word = vload_words(at, v);
        for (int j = 0; j < 8; j++) {
          const vec code = vnibble(word, j);
          for (int m = 0; m < M; m++) {
            const float *x = w->x + (m0 + m) * K + 8 * c + chunk_channel(j);
            dot[m][v][j % FP_CHAINS] = vfma(code, vset1(x[0]), dot[m][v][j % FP_CHAINS]);
          }
        }
      }
    }
    for (int m = 0; m < M; m++)
      for (int v = 0; v < HALVES; v++)
        for (int u = 1; u < FP_CHAINS; u++) dot[m][v][0] = dot[m][v][0] + dot[m][v][u];
    for (int v = 0; v < HALVES; v++) {
      const int64_t at = (b * groups + g) * 2 * BLOCK + v * LANES;
      const vec scale = vload(w->so, w->so_bf16, at);
      const vec shift = vfma(scale, vset1(-8.f), vload(w->so, w->so_bf16, at + BLOCK));
      for (int m = 0; m < M; m++) {
        acc[m][v] = vfma(dot[m][v][0], scale, acc[m][v]);
        acc[m][v] = vfma(shift, vset1(w->sums[(m0 + m) * groups + g]), acc[m][v]);
      }
    }
  }
  for (int m = 0; m < M; m++)
    for (int v = 0; v < HALVES; v++) vstore(out + m * BLOCK + v * LANES, acc[m][v]);
}
#endif

#if defined(KVLAB_BF16_DOT)
/* tile() for bf16 rows where the CPU has AVX512-BF16: a chunk's 16 words, shifted by 4 i,
 * hold channels 2i and 2i + 1 in the low nibbles of their two halves, which a 16-entry
 * vpermw table (it reads an index's low bits only) turns into the bf16 values of code - 8
 * (exact, -8..7); vdpbf16ps multiplies those 32 codes by the broadcast pair x[2i], x[2i + 1]
 * in one instruction (products exact, fp32 accumulation). A chunk: one load, three shifts,
 * four lookups, four products. A group adds scale * dot + offset * sum x. U chains a row
 * (4 for one row, 2 for two, one from three on) keep U * M vdpbf16ps in flight. (A byte per
 * channel pair widened to words and masked takes more instructions a code than the table
 * lookup.) */
static inline __attribute__((always_inline)) void tile_bf16(const Int4 *w, int64_t b,
                                                            int64_t m0, const int M,
                                                            float *out) {
  const int U = M == 1 ? 4 : M == 2 ? 2 : 1;
  const int64_t K = w->K, G = w->G, groups = K / G;
  const uint8_t *codes = w->codes + b * (K / 8) * CHUNK_BYTES;
  /* bf16 of n - 8 at word n (-8 .. 7), in both halves: vpermw indexes 32 words */
  const __m512i values = _mm512_broadcast_i64x4(_mm256_setr_epi16(
      (short)0xC100, (short)0xC0E0, (short)0xC0C0, (short)0xC0A0, (short)0xC080,
      (short)0xC040, (short)0xC000, (short)0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080,
      0x40A0, 0x40C0, 0x40E0));
  __m512 acc[INT4_ROWS];
  for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 dot[INT4_ROWS][4];
    for (int m = 0; m < M; m++)
      for (int u = 0; u < U; u++) dot[m][u] = _mm512_setzero_ps();
    for (int64_t c = g * G / 8; c < (g + 1) * G / 8; c++) {
      const uint8_t *at = codes + c * CHUNK_BYTES;
      __builtin_prefetch(at + AHEAD, 0, 2);
      const __m512i word = _mm512_loadu_si512((const void *)at);
      for (int i = 0; i < 4; i++) {
        const __m512i index = i ? _mm512_srli_epi32(word, 4 * i) : word;
        const __m512bh codes_bf16 = (__m512bh)_mm512_permutexvar_epi16(index, values);
        for (int m = 0; m < M; m++) {
          int32_t pair; /* x[8c + 2i], x[8c + 2i + 1] */
          memcpy(&pair, w->x_bf16 + (m0 + m) * w->x_stride + 8 * c + 2 * i, sizeof(pair));
          __m512 *chain = &dot[m][i % U];
          *chain = _mm512_dpbf16_ps(*chain, codes_bf16, (__m512bh)_mm512_set1_epi32(pair));
        }
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
#endif

#ifndef LANES
static inline void tile(const Int4 *w, int64_t b, int64_t m0, const int M, float *out) {
  const int64_t K = w->K, G = w->G;
  for (int m = 0; m < M; m++)
    for (int r = 0; r < BLOCK; r++) {
      const uint8_t *codes = w->codes + b * (K / 8) * CHUNK_BYTES + 4 * r;
      const float *x = w->x + (m0 + m) * K;
      float sum = 0.f;
      for (int64_t g = 0; g < K / G; g++) {
        const int64_t at = (b * (K / G) + g) * 2 * BLOCK + r;
        const float scale = value_at(w->so, w->so_bf16, at);
        const float shift = value_at(w->so, w->so_bf16, at + BLOCK) - 8.f * scale;
        float dot = 0.f;
        for (int64_t c = g * G / 8; c < (g + 1) * G / 8; c++) {
          uint32_t word;
          memcpy(&word, codes + c * CHUNK_BYTES, sizeof(word));
          for (int j = 0; j < 8; j++)
            dot += (float)((word >> (4 * j)) & 15) * x[8 * c + chunk_channel(j)];
        }
        sum += dot * scale + shift * w->sums[(m0 + m) * (K / G) + g];
      }
      out[m * BLOCK + r] = sum;
    }
}
#endif

#ifdef KVLAB_BF16_DOT
#define TILE(MM) w.x_bf16 ? tile_bf16(&w, b, m0, MM, acc) : tile(&w, b, m0, MM, acc)
#else
#define TILE(MM) tile(&w, b, m0, MM, acc)
#endif
#define INT4_CASE(MM) \
  case MM:            \
    TILE(MM);         \
    break;

/* x: (M, K), rows x_stride apart, fp32 or bf16; codes: (N/16, K/8, 16, 4) bytes; so: scales
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

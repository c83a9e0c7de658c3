/* kvlab's CPU matrix-vector product over grouped int4 weights with int8 activations (W4A8,
 * dynamic, one activation scale per weight group: llama.cpp's Q4_1 x Q8_1 dot products
 * quantize activations the same way, in blocks of 32). The weights are gemv_int4.c's:
 * W[n][k] = (code - 8) * scale[g][n] + offset[g][n] over groups of G input channels, in
 * blocks of 16 outputs and chunks of 8 inputs (kvlab.quant.packing.block_int4). Group g of
 * row m of x is quantized once: d = max|x_g| / 127, xq = nearbyint(x / d) (IEEE division,
 * ties to even, as torch's; hence no fast-math here, build.py's EXACT). Then
 *   y[m][n] = sum_g  (float)(sum_{k in g} code[n][k] * xq[k]) * (scale[g][n] * d)
 *                   + (offset[g][n] - 8 * scale[g][n]) * sum_{k in g} x[k],
 * the integer dot exact in int32 and the offset term on the unquantized x, so the result is
 * kvlab.kernels.linear.w4a8.w4a8_reference's up to fp32 summation order. The codes never become
 * floats: AVX512-VNNI's vpdpbusd multiplies 64 of them (unsigned nibbles) by 64 int8
 * activations a step (AVX2: vpmaddubsw and vpmaddwd; else scalar code). A chunk's 16 words,
 * one an output, hold its 8 channels at nibbles j = 0..7 (channel 2j for j < 4, else
 * 2(j - 4) + 1), so the low nibbles of a word's four bytes are channels 0, 4, 1, 5 and the
 * high nibbles 2, 6, 3, 7: each row's codes are packed in that order, four to an int32,
 * which vpdpbusd takes broadcast. Blocks are split across threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int8_codes.h"
#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
static inline vec vcvt_i32(const int32_t *p) {
  return _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)p));
}
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
#elif defined(LANES)
static inline vec vcvt_i32(const int32_t *p) {
  return _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
#endif

#define BLOCK 16
#define CHUNK_BYTES (4 * BLOCK)
#define AHEAD (32 * CHUNK_BYTES) /* how far ahead of use a block's codes are asked for */

/* Row m of x quantized group by group (see above). */
typedef struct {
  int32_t *packed; /* (K / 8) chunks of two int32: channels 0, 4, 1, 5 then 2, 6, 3, 7 */
  float *step;     /* (K / G,): d of each group */
  float *sum;      /* (K / G,): sum of x over each group, unquantized */
} Quantized;

/* The sum of x[at .. at + n) (fp32 or bf16), 16 lanes at a time then the rest. */
static float sum_of(const void *x, int x_bf16, int64_t at, int64_t n) {
  float sum = 0.f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 sums = _mm512_setzero_ps();
  for (; k + 16 <= n; k += 16) sums = _mm512_add_ps(sums, vload(x, x_bf16, at + k));
  sum = _mm512_reduce_add_ps(sums);
#endif
  for (; k < n; k++) sum += value_at(x, x_bf16, at + k);
  return sum;
}

/* The group's codes (int8_codes.h) into codes[0 .. n), its d and its sum of x. */
static float group_codes(const void *x, int x_bf16, int64_t at, int64_t n, int8_t *codes,
                         float *d) {
  *d = max_abs(x, x_bf16, at, n) / 127.f;
  int8_codes(x, x_bf16, at, n, *d, codes);
  return sum_of(x, x_bf16, at, n);
}

static void quantize_row(const void *x, int x_bf16, int64_t at, int64_t K, int64_t G,
                         int8_t *codes, Quantized *q) {
  for (int64_t g = 0; g < K / G; g++) {
    q->sum[g] = group_codes(x, x_bf16, at + g * G, G, codes + g * G, &q->step[g]);
  }
  static const int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  int64_t c = 0;
#if defined(__AVX2__)
  const __m128i shuffle = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  for (; c + 2 <= K / 8; c += 2) { /* two chunks a shuffle */
    const __m128i v = _mm_loadu_si128((const __m128i *)(codes + 8 * c));
    _mm_storeu_si128((__m128i *)(q->packed + 2 * c), _mm_shuffle_epi8(v, shuffle));
  }
#endif
  for (; c < K / 8; c++) {
    uint8_t bytes[8];
    for (int i = 0; i < 8; i++) bytes[i] = (uint8_t)codes[8 * c + order[i]];
    memcpy(q->packed + 2 * c, bytes, sizeof(bytes));
  }
}

/* The integer dot products of one block's 16 outputs with one row over chunks c0 .. c1 of
 * 8 channels (exact: |dot| <= 15 * 127 * K). */
static inline void chunk_dots(const uint8_t *codes, const int32_t *packed, int64_t c0,
                              int64_t c1, int32_t *dots) {
  int64_t c = c0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i low = _mm512_set1_epi8(15);
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  for (; c < c1; c++) {
    const uint8_t *at = codes + c * CHUNK_BYTES;
    __builtin_prefetch(at + AHEAD, 0, 2);
    const __m512i w = _mm512_loadu_si512((const void *)at);
    lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(w, low), _mm512_set1_epi32(packed[2 * c]));
    hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(_mm512_srli_epi16(w, 4), low),
                             _mm512_set1_epi32(packed[2 * c + 1]));
  }
  _mm512_storeu_si512((void *)dots, _mm512_add_epi32(lo, hi));
  return;
#elif defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (; c < c1; c++) {
    const uint8_t *at = codes + c * CHUNK_BYTES;
    __builtin_prefetch(at + AHEAD, 0, 2);
    const __m256i x_lo = _mm256_set1_epi32(packed[2 * c]);
    const __m256i x_hi = _mm256_set1_epi32(packed[2 * c + 1]);
    for (int h = 0; h < 2; h++) {
      const __m256i w = _mm256_loadu_si256((const __m256i *)(at + 32 * h));
      const __m256i a = _mm256_maddubs_epi16(_mm256_and_si256(w, low), x_lo);
      const __m256i b = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), low),
                                             x_hi);  /* |a + b| <= 4 * 15 * 127: no overflow */
      acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_add_epi16(a, b), ones));
    }
  }
  _mm256_storeu_si256((__m256i *)dots, acc[0]);
  _mm256_storeu_si256((__m256i *)(dots + 8), acc[1]);
  return;
#else
  for (int r = 0; r < BLOCK; r++) dots[r] = 0;
  for (; c < c1; c++)
    for (int r = 0; r < BLOCK; r++) {
      const uint8_t *word = codes + c * CHUNK_BYTES + 4 * r;
      const int8_t *xs = (const int8_t *)(packed + 2 * c);
      for (int i = 0; i < 4; i++)
        dots[r] += (word[i] & 15) * xs[i] + (word[i] >> 4) * xs[4 + i];
    }
#endif
}

/* Block b's 16 outputs for one quantized row into out[0 .. 16): per group, the integer dots
 * times scale * d, plus (offset - 8 * scale) times the group's sum of x, in fp32 (the same
 * operations in vectors of LANES outputs as in scalar code, so the same values). */
static void block_row(const uint8_t *codes, const void *so, int so_bf16, int64_t b, int64_t K,
                      int64_t G, const Quantized *q, float *out) {
  const int64_t groups = K / G, chunks = G / 8;
  const uint8_t *block = codes + b * (K / 8) * CHUNK_BYTES;
#if defined(LANES)
  vec acc[BLOCK / LANES];
  for (int v = 0; v < BLOCK / LANES; v++) acc[v] = vzero();
#else
  float acc[BLOCK] = {0};
#endif
  for (int64_t g = 0; g < groups; g++) {
    int32_t dots[BLOCK];
    chunk_dots(block, q->packed, g * chunks, (g + 1) * chunks, dots);
    const int64_t at = (b * groups + g) * 2 * BLOCK;
#if defined(LANES)
    for (int v = 0; v < BLOCK / LANES; v++) {
      const vec scale = vload(so, so_bf16, at + v * LANES);
      const vec shift = vfma(scale, vset1(-8.f), vload(so, so_bf16, at + BLOCK + v * LANES));
      const vec dot = vcvt_i32(dots + v * LANES);
      acc[v] = vfma(dot, vmul(scale, vset1(q->step[g])), acc[v]);
      acc[v] = vfma(shift, vset1(q->sum[g]), acc[v]);
    }
#else
    for (int r = 0; r < BLOCK; r++) {
      const float scale = value_at(so, so_bf16, at + r);
      const float shift = fmaf(scale, -8.f, value_at(so, so_bf16, at + BLOCK + r));
      acc[r] = fmaf((float)dots[r], scale * q->step[g], acc[r]);
      acc[r] = fmaf(shift, q->sum[g], acc[r]);
    }
#endif
  }
#if defined(LANES)
  for (int v = 0; v < BLOCK / LANES; v++) vstore(out + v * LANES, acc[v]);
#else
  memcpy(out, acc, sizeof(acc));
#endif
}

/* x: (M, K), rows x_stride apart, fp32 or bf16; codes: (N/16, K/8, 16, 4) bytes; so: scales
 * and offsets (N/16, K/G, 2, 16), fp32 or bf16; bias (N,) or NULL; y: (M, N), fp32 or
 * bf16. Needs N % 16 == 0, G % 8 == 0 and K % G == 0 (the caller checks). */
void kvlab_gemv_w4a8(const void *x, int x_bf16, int64_t x_stride, const uint8_t *codes,
                     const void *so, int so_bf16, int64_t G, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = K / G;
  int8_t *row_codes = malloc((size_t)K);
  int32_t *packed = malloc(sizeof(int32_t) * (size_t)(M * K / 4));
  float *floats = malloc(sizeof(float) * (size_t)(2 * M * groups));
  Quantized *rows = malloc(sizeof(Quantized) * (size_t)(M > 0 ? M : 1));
  for (int64_t m = 0; m < M; m++) {
    rows[m] = (Quantized){packed + m * K / 4, floats + 2 * m * groups,
                          floats + (2 * m + 1) * groups};
    quantize_row(x, x_bf16, m * x_stride, K, G, row_codes, &rows[m]);
  }
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < N / BLOCK; b++)
    for (int64_t m = 0; m < M; m++) { /* the block's codes stay in L1 across the rows */
      float out[BLOCK];
      block_row(codes, so, so_bf16, b, K, G, &rows[m], out);
      for (int r = 0; r < BLOCK; r++) {
        const int64_t n = b * BLOCK + r;
        store(y, y_bf16, m * N + n, out[r] + (bias ? value_at(bias, bias_bf16, n) : 0.f));
      }
    }
  free(rows);
  free(floats);
  free(packed);
  free(row_codes);
}

/* Prefill rows of x (M, K, rows x_stride apart) as W8A8 and W4A8 quantize them (a scale
 * every G channels), for one product over the dequantized weight
 * (kvlab.kernels.linear.w4a8.w4a8_dequantized, w8a8.w8a8_dequantized): out (M, K) = each group's
 * codes times its d, in fp32, stored as fp32 or rounded to bf16 (out_bf16), and correction
 * (M, K/G) = the group's sum of x less the sum of those fp32 values. One pass over x where
 * torch's ops take a dozen; rows split across threads. */
void kvlab_fake_quantize_groups(const void *x, int x_bf16, int64_t x_stride, int64_t M,
                                int64_t K, int64_t G, void *out, int out_bf16,
                                float *correction) {
  const int64_t groups = K / G;
#pragma omp parallel
  {
    int8_t *codes = malloc((size_t)G);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
      for (int64_t g = 0; g < groups; g++) {
        const int64_t at = m * x_stride + g * G;
        float d;
        const float sum = group_codes(x, x_bf16, at, G, codes, &d);
        float quantized_sum = 0.f;
        for (int64_t k = 0; k < G; k++) {
          const float v = (float)codes[k] * d;
          quantized_sum += v;
          store(out, out_bf16, m * K + g * G + k, v);
        }
        correction[m * groups + g] = sum - quantized_sum;
      }
    free(codes);
  }
}

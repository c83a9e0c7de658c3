/* kvlab's CPU matrix-vector product over int8 weights for decode: y (M, N) = scale[n] *
 * (x (M, K) . q (N, K)^T) (+ bias), one symmetric scale per output channel (RTN int8,
 * LLM.int8 without outliers). The codes are widened to fp32 in registers and multiplied by
 * the rows in fp32, so the result is the dequantized layer's up to summation order. Decode
 * is memory-bound: weight rows are streamed four at a time (four memory streams, the next
 * four prefetched), each code widened once for up to CODE_ROWS rows of x, output rows split
 * across threads; x (fp32 or bf16) is widened to fp32 once by each thread. One
 * row of x walks the rows one after another instead (in_order, as the kernel plan says), in
 * blocks (rows_in_order).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

#ifdef LANES
/* LANES int8 codes widened to fp32. */
static inline vec vload_codes(const int8_t *p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}
#endif

/* out[j] = row j of w (COUNT consecutive rows of K codes) . x, over every channel. */
static inline __attribute__((always_inline)) void dot_codes(const int8_t *w, int64_t K,
                                                            const float *x, const int COUNT,
                                                            float *out) {
  int64_t k0 = 0;
#if defined(__AVX512F__)
  vec a[4], b[4]; /* two chains a row: eight FMAs in flight cover the FMA latency */
  for (int j = 0; j < COUNT; j++) a[j] = b[j] = vzero();
  for (; k0 + 2 * LANES <= K; k0 += 2 * LANES) {
    const vec x0 = vload_f32(x + k0), x1 = vload_f32(x + k0 + LANES);
    for (int j = 0; j < COUNT; j++) {
      if (COUNT > 1) __builtin_prefetch(w + (COUNT + j) * K + k0, 0, 2); /* one row: a stream */
      a[j] = vfma(vload_codes(w + j * K + k0), x0, a[j]);
      b[j] = vfma(vload_codes(w + j * K + k0 + LANES), x1, b[j]);
    }
  }
  for (int j = 0; j < COUNT; j++) a[j] = a[j] + b[j];
#elif defined(LANES)
  vec a[4];
  for (int j = 0; j < COUNT; j++) a[j] = vzero();
#endif
#if defined(LANES)
  for (; k0 + LANES <= K; k0 += LANES) {
    const vec xv = vload_f32(x + k0);
    for (int j = 0; j < COUNT; j++) a[j] = vfma(vload_codes(w + j * K + k0), xv, a[j]);
  }
  for (int j = 0; j < COUNT; j++) out[j] = vsum(a[j]);
#else
  for (int j = 0; j < COUNT; j++) out[j] = 0.f;
#endif
  for (int64_t k = k0; k < K; k++)
    for (int j = 0; j < COUNT; j++) out[j] += (float)w[j * K + k] * x[k];
}

#if defined(__AVX512F__)
#define CODE_ROWS 6 /* rows of x a tile of weight rows takes at once: 4 x 6 accumulators */
#elif defined(__AVX2__) && defined(__FMA__)
#define CODE_ROWS 2
#else
#define CODE_ROWS 1
#endif

/* out[j * M + m] = row j of w (COUNT rows) . row m of x (M rows, K apart): each code is
 * widened once for all M rows (one row: dot_codes). */
static inline __attribute__((always_inline)) void dot_codes_rows(const int8_t *w, int64_t K,
                                                                 const float *x, const int COUNT,
                                                                 const int M, float *out) {
  if (M == 1) {
    dot_codes(w, K, x, COUNT, out);
    return;
  }
  int64_t k0 = 0;
#if defined(LANES)
  vec a[4][CODE_ROWS];
  for (int j = 0; j < COUNT; j++)
    for (int m = 0; m < M; m++) a[j][m] = vzero();
  for (; k0 + LANES <= K; k0 += LANES) {
    vec wv[4];
    for (int j = 0; j < COUNT; j++) {
      __builtin_prefetch(w + (COUNT + j) * K + k0, 0, 2);
      wv[j] = vload_codes(w + j * K + k0);
    }
    for (int m = 0; m < M; m++) {
      const vec xv = vload_f32(x + m * K + k0);
      for (int j = 0; j < COUNT; j++) a[j][m] = vfma(wv[j], xv, a[j][m]);
    }
  }
  for (int j = 0; j < COUNT; j++)
    for (int m = 0; m < M; m++) out[j * M + m] = vsum(a[j][m]);
#else
  for (int i = 0; i < COUNT * M; i++) out[i] = 0.f;
#endif
  for (int64_t k = k0; k < K; k++)
    for (int j = 0; j < COUNT; j++)
      for (int m = 0; m < M; m++) out[j * M + m] += (float)w[j * K + k] * x[m * K + k];
}

#define CODES_CASE(MM)                                          \
  case MM:                                                      \
    if (count == 4)                                             \
      dot_codes_rows(q + n * K, K, xf + m0 * K, 4, MM, acc);    \
    else                                                        \
      dot_codes_rows(q + n * K, K, xf + m0 * K, 1, MM, acc);    \
    break;

#if defined(KVLAB_BF16_DOT)
/* Row w of K codes . x, x's bf16 values as they are, by vdpbf16ps, 32 products an
 * instruction where widening codes to fp32 takes a convert and an FMA every 16 (from cache
 * the core's vector pipes are the bound). A code c (two's
 * complement, sign bit c7) is (128 + (c & 127)) - 128 (1 + c7): both terms are exact bf16
 * values made by one vpternlogd each from the code sign-extended to 16 bits, and each
 * meets the same pair of x's values, so each product is exact and the sums are fp32 sums
 * of the products, as in dot_codes (x below 2^-126, flushed by vdpbf16ps, aside). */
static float dot_codes_bf16(const int8_t *w, int64_t K, const uint16_t *x) {
  __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
  const __m512i low = _mm512_set1_epi16(0x007F), magnitude = _mm512_set1_epi16(0x4300);
  const __m512i sign = _mm512_set1_epi16(0x0080), offset = _mm512_set1_epi16((short)0xC300);
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) { /* (A & B) | C: 0xEA */
    const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k)));
    const __m512i t = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k + 32)));
    const __m512bh xs = (__m512bh)_mm512_loadu_si512((const void *)(x + k));
    const __m512bh xt = (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32));
    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_ternarylogic_epi32(s, low, magnitude, 0xEA), xs);
    b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_ternarylogic_epi32(s, sign, offset, 0xEA), xs);
    c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_ternarylogic_epi32(t, low, magnitude, 0xEA), xt);
    d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_ternarylogic_epi32(t, sign, offset, 0xEA), xt);
  }
  float out = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
  for (; k < K; k++) out += (float)w[k] * bf16_value(x[k]);
  return out;
}
#endif

/* One row of x (xf, widened) against this thread's share of the weight rows, one after
 * another (one memory stream a thread), in blocks of ROW_BLOCK rows: the block's dot
 * products first, in a loop of nothing else, then its scales, biases and stores. With each
 * row's scale, bias and store after its dot product, a short row's loop shares the core
 * with their branches and reloads. */
#define ROW_BLOCK 16
static void rows_in_order(const int8_t *q, const float *xf, const uint16_t *xb,
                          const void *scale, int scale_bf16, const void *bias, int bias_bf16,
                          void *y, int y_bf16, int64_t N, int64_t K) {
#pragma omp for schedule(static)
  for (int64_t block = 0; block < (N + ROW_BLOCK - 1) / ROW_BLOCK; block++) {
    const int64_t n0 = ROW_BLOCK * block, count = N - n0 < ROW_BLOCK ? N - n0 : ROW_BLOCK;
    float sums[ROW_BLOCK];
#ifdef KVLAB_BF16_DOT
    if (xb)
      for (int64_t j = 0; j < count; j++) sums[j] = dot_codes_bf16(q + (n0 + j) * K, K, xb);
    else
#else
    (void)xb; /* the bf16 walk needs vdpbf16ps */
#endif
      for (int64_t j = 0; j < count; j++) dot_codes(q + (n0 + j) * K, K, xf, 1, sums + j);
    for (int64_t j = 0; j < count; j++) {
      const float b = bias ? value_at(bias, bias_bf16, n0 + j) : 0.f;
      store(y, y_bf16, n0 + j, sums[j] * value_at(scale, scale_bf16, n0 + j) + b);
    }
  }
}

/* Tiles of four weight rows (the next four prefetched; 1 for the last N % 4), this thread's
 * share, against chunks of up to CODE_ROWS rows of xf (M rows, widened). */
static void tiles(const int8_t *q, const float *xf, const void *scale, int scale_bf16,
                  const void *bias, int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N,
                  int64_t K) {
  const int64_t quads = N / 4;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < quads + (N - 4 * quads); r++) {
    const int64_t n = r < quads ? 4 * r : 4 * quads + (r - quads), count = r < quads ? 4 : 1;
    for (int64_t m0 = 0; m0 < M; m0 += CODE_ROWS) {
      const int64_t rows = M - m0 < CODE_ROWS ? M - m0 : CODE_ROWS;
      float acc[4 * CODE_ROWS];
      switch (rows) {
        CODES_CASE(1)
#if CODE_ROWS >= 2
        CODES_CASE(2)
#endif
#if CODE_ROWS >= 6
        CODES_CASE(3)
        CODES_CASE(4)
        CODES_CASE(5)
        CODES_CASE(6)
#endif
      }
      for (int64_t j = 0; j < count; j++) {
        const float b = bias ? value_at(bias, bias_bf16, n + j) : 0.f;
        const float sc = value_at(scale, scale_bf16, n + j);
        for (int64_t m = 0; m < rows; m++)
          store(y, y_bf16, (m0 + m) * N + n + j, acc[j * rows + m] * sc + b);
      }
    }
  }
}

/* x: (M, K) with row stride x_stride, fp32 or bf16; q: (N, K) int8 contiguous; scale: (N,)
 * and bias (N,) or NULL, fp32 or bf16; y: (M, N) contiguous, fp32 or bf16. Each thread
 * widens x into a buffer on its own stack: one malloc'd buffer widened by the calling
 * thread and read by the others is slow to reach them wherever another parallel region
 * ran between, as attention's do in a decode step. */
#define STACK_FLOATS 8192 /* a widened x of up to 32 KB on each thread's stack */
void kvlab_gemv_int8(const void *x, int x_bf16, int64_t x_stride, const int8_t *q,
                     const void *scale, int scale_bf16, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                     int in_order) {
#pragma omp parallel
  {
    float on_stack[STACK_FLOATS];
    float *xf = M * K <= STACK_FLOATS ? on_stack : malloc(sizeof(float) * M * K);
    for (int64_t m = 0; m < M; m++)
      for (int64_t k = 0; k < K; k++) xf[m * K + k] = value_at(x, x_bf16, m * x_stride + k);
    const uint16_t *xb = x_bf16 ? (const uint16_t *)x : NULL; /* one row: rows_in_order's */
    if (M == 1 && in_order)
      rows_in_order(q, xf, xb, scale, scale_bf16, bias, bias_bf16, y, y_bf16, N, K);
    else
      tiles(q, xf, scale, scale_bf16, bias, bias_bf16, y, y_bf16, M, N, K);
    if (xf != on_stack) free(xf);
  }
}

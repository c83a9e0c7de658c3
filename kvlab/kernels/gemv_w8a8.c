/* kvlab's CPU matrix-vector product over int8 weights with int8 activations (W8A8, dynamic
 * per-token: torchao's int8 dynamic-activation int8-weight scheme; llama.cpp's Q8_0 dot
 * products quantize activations the same way, in blocks of 32). Each row m of x is
 * quantized once, d_m = max|x_m| / 127, xq = nearbyint(x / d_m) (ties to even, as
 * torch.round); then y (M, N) = (float)(xq_m . q_n) * d_m * scale[n] (+ bias) in that
 * order, the dot product exact in int32, so the result is kvlab.kernels.linear's torch
 * reference's bit for bit. The int8 products run on AVX512-VNNI's vpdpbusd where the CPU
 * has it (64 codes an instruction: u8 activations xq + 128, the 128 * sum(q) taken off
 * after), else on AVX2's vpmaddubsw (|q| times xq signed as q, llama.cpp's trick: no
 * int16 saturation as |q|, |xq| <= 127), else in scalar code. Output rows split across
 * threads; one row of x walks the weight rows one after another where the int8 weights'
 * order says so (gemv_order.h), else weight rows go four at a time, the next four
 * prefetched into L2. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "gemv_order.h"
#include "int8_codes.h"
#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* dots[j] = row j of w (COUNT rows of K codes, K apart) . xq, xu = xq + 128 (as u8). */
static inline __attribute__((always_inline)) void int_dots(const int8_t *w, int64_t K,
                                                           const int8_t *xq, const uint8_t *xu,
                                                           const int COUNT, int32_t *dots) {
  int64_t k0 = 0;
  (void)xu;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i acc[4], sums[4];
  const __m512i ones = _mm512_set1_epi8(1);
  for (int j = 0; j < COUNT; j++) acc[j] = sums[j] = _mm512_setzero_si512();
  for (; k0 < K; k0 += 64) {
    const __mmask64 lanes = K - k0 >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k0)) - 1);
    const __m512i u = _mm512_maskz_loadu_epi8(lanes, xu + k0);
    for (int j = 0; j < COUNT; j++) {
      if (COUNT > 1) __builtin_prefetch(w + (COUNT + j) * K + k0, 0, 2); /* into L2 */
      const __m512i q = _mm512_maskz_loadu_epi8(lanes, w + j * K + k0);
      acc[j] = _mm512_dpbusd_epi32(acc[j], u, q);
      sums[j] = _mm512_dpbusd_epi32(sums[j], ones, q);
    }
  }
  for (int j = 0; j < COUNT; j++)
    dots[j] = _mm512_reduce_add_epi32(acc[j]) - 128 * _mm512_reduce_add_epi32(sums[j]);
#elif defined(__AVX2__)
  __m256i acc[4];
  const __m256i ones = _mm256_set1_epi16(1);
  for (int j = 0; j < COUNT; j++) acc[j] = _mm256_setzero_si256();
  for (; k0 + 32 <= K; k0 += 32) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + k0));
    for (int j = 0; j < COUNT; j++) {
      if (COUNT > 1) __builtin_prefetch(w + (COUNT + j) * K + k0, 0, 2);
      const __m256i q = _mm256_loadu_si256((const __m256i *)(w + j * K + k0));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(pairs, ones));
    }
  }
  for (int j = 0; j < COUNT; j++) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[j]), _mm256_extracti128_si256(acc[j], 1));
    s = _mm_hadd_epi32(s, s);
    dots[j] = _mm_cvtsi128_si32(_mm_hadd_epi32(s, s));
  }
#else
  for (int j = 0; j < COUNT; j++) dots[j] = 0;
#endif
  for (int64_t k = k0; k < K; k++)
    for (int j = 0; j < COUNT; j++) dots[j] += (int32_t)w[j * K + k] * xq[k];
}

/* Row m of x (fp32 or bf16) quantized: its scale, its codes xq and xu = xq + 128 (torch's
 * numbers: int8_codes.h). */
static float quantize_row(const void *x, int x_bf16, int64_t at, int64_t K, int8_t *xq,
                          uint8_t *xu) {
  const float d = max_abs(x, x_bf16, at, K) / 127.f;
  int8_codes(x, x_bf16, at, K, d, xq);
  for (int64_t k = 0; k < K; k++) xu[k] = (uint8_t)(xq[k] + 128);
  return d;
}

/* y (N,) = one row of x (quantized: xq, xu, d) against this thread's share of the weight
 * rows, one row after another (one memory stream a thread), in blocks of ROW_BLOCK rows:
 * the block's dot products first, then its scales, biases and stores (gemv_int8.c's
 * rows_in_order, whose order the int8 weights were timed in, gemv_order.h). */
#define ROW_BLOCK 16
static void rows_in_order(const int8_t *q, const int8_t *xq, const uint8_t *xu, float d,
                          const void *scale, int scale_bf16, const void *bias, int bias_bf16,
                          void *y, int y_bf16, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < (N + ROW_BLOCK - 1) / ROW_BLOCK; block++) {
    const int64_t n0 = ROW_BLOCK * block, count = N - n0 < ROW_BLOCK ? N - n0 : ROW_BLOCK;
    int32_t dots[ROW_BLOCK];
    for (int64_t j = 0; j < count; j++) int_dots(q + (n0 + j) * K, K, xq, xu, 1, dots + j);
    for (int64_t j = 0; j < count; j++) {
      const float b = bias ? value_at(bias, bias_bf16, n0 + j) : 0.f;
      const float product = (float)dots[j] * d * value_at(scale, scale_bf16, n0 + j);
      store(y, y_bf16, n0 + j, bias ? product + b : product);
    }
  }
}

/* Tiles of four weight rows (the next four prefetched; 1 for the last N % 4) split across
 * threads, each against every row of x. */
static void tiles(const int8_t *q, const int8_t *xq, const uint8_t *xu, const float *d,
                  const void *scale, int scale_bf16, const void *bias, int bias_bf16, void *y,
                  int y_bf16, int64_t M, int64_t N, int64_t K) {
  const int64_t quads = N / 4;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < quads + N % 4; r++) {
    const int64_t n = r < quads ? 4 * r : 4 * quads + (r - quads), count = r < quads ? 4 : 1;
    for (int64_t m = 0; m < M; m++) {
      int32_t dots[4];
      if (count == 4)
        int_dots(q + n * K, K, xq + m * K, xu + m * K, 4, dots);
      else
        int_dots(q + n * K, K, xq + m * K, xu + m * K, 1, dots);
      for (int64_t j = 0; j < count; j++) {
        const float b = bias ? value_at(bias, bias_bf16, n + j) : 0.f;
        const float product = (float)dots[j] * d[m] * value_at(scale, scale_bf16, n + j);
        store(y, y_bf16, m * N + n + j, bias ? product + b : product);
      }
    }
  }
}

/* x: (M, K) with row stride x_stride, fp32 or bf16; q: (N, K) int8 contiguous, |q| <= 127;
 * scale: (N,) and bias (N,) or NULL, fp32 or bf16; y: (M, N) contiguous, fp32 or bf16.
 * One row walks the weight rows in order where int8 weights were timed faster so
 * (kvlab_rows_in_order[ORDER_INT8]). Over a step's 120 matrices (harness gemv_stack.c,
 * Zen4, 2 threads) that reads 42-43 GB/s, as fast as the int8 kernel; the tiles read 28
 * (22 with their prefetches into L1, as they were, which took 5.4 ms a step where the
 * weight-only int8 kernel took 2.4). */
void kvlab_gemv_w8a8(const void *x, int x_bf16, int64_t x_stride, const int8_t *q,
                     const void *scale, int scale_bf16, const void *bias, int bias_bf16,
                     void *y, int y_bf16, int64_t M, int64_t N, int64_t K) {
  int8_t *xq = malloc((size_t)(M * K * 2 + 64));
  uint8_t *xu = (uint8_t *)xq + M * K;
  float *d = malloc(sizeof(float) * (size_t)(M > 0 ? M : 1));
  for (int64_t m = 0; m < M; m++) d[m] = quantize_row(x, x_bf16, m * x_stride, K, xq + m * K,
                                                      xu + m * K);
  if (M == 1 && kvlab_rows_in_order[ORDER_INT8])
    rows_in_order(q, xq, xu, d[0], scale, scale_bf16, bias, bias_bf16, y, y_bf16, N, K);
  else
    tiles(q, xq, xu, d, scale, scale_bf16, bias, bias_bf16, y, y_bf16, M, N, K);
  free(d);
  free(xq);
}

/* kvlab's CPU matrix-vector product over int8 weights with int8 activations (W8A8, dynamic
 * per-token activation scales: one a row, torchao's int8 dynamic-activation int8-weight
 * scheme, or one a group of AG channels of a row, as llama.cpp's Q8_0 dot products quantize
 * activations in blocks of 32). Each span of x (a row, or a group) is quantized once,
 * d = max|x| / 127, xq = nearbyint(x / d) (ties to even, as torch.round). One scale a row:
 * y (M, N) = (float)(xq_m . q_n) * d_m * scale[n] (+ bias) in that order, the dot product
 * exact in int32, so the result is kvlab.kernels.linear.w8a8's torch reference's bit for bit. A
 * scale a group: y = (sum over groups of d_g * (xq_g . q_g)) * scale[n], each group's part
 * taken from the integer products of four channels at a time (exact), converted and scaled
 * in fp32: the reference's numbers up to fp32 summation order. The int8 products run on
 * AVX512-VNNI's vpdpbusd where the CPU has it (64 codes an instruction; it multiplies u8 by
 * s8: a scale a row, the activations xq + 128 times the codes, 128 * sum(q) taken off
 * after; a scale a group, the codes q + 128 times xq, 128 * sum(step * xq) taken off the
 * row's sum, one number a token), else on AVX2's vpmaddubsw (|q| times xq signed as q,
 * llama.cpp's trick: no int16 saturation as |q|, |xq| <= 127), else in scalar code. Output
 * rows split across threads; one row of x walks the weight rows one after another where the
 * int8 weights' order says so (rows_in_order), else weight rows go four at a time, the next
 * four prefetched into L2. A scale a group costs a conversion and an FMA a 64 codes more
 * (experiments/weight_quant/ measures it); its activation buffers start on cache lines, so
 * the two loads a 64 codes never split one. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "int8_codes.h"
#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
/* Lane l (of 8): the exact sum of q[k] * x[k] over channels 4l .. 4l + 3 of 32, by
 * vpmaddubsw on |q| and x signed as q (llama.cpp's trick: no int16 saturation as |q|,
 * |x| <= 127), then pairs of those summed. */
static inline __m256i quad_dots(__m256i q, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
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
  for (int j = 0; j < COUNT; j++) acc[j] = _mm256_setzero_si256();
  for (; k0 + 32 <= K; k0 += 32) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + k0));
    for (int j = 0; j < COUNT; j++) {
      if (COUNT > 1) __builtin_prefetch(w + (COUNT + j) * K + k0, 0, 2);
      const __m256i q = _mm256_loadu_si256((const __m256i *)(w + j * K + k0));
      acc[j] = _mm256_add_epi32(acc[j], quad_dots(q, x));
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

/* dots[j] = sum over channels of steps[k / 4] * xq[k] * w_j[k] (COUNT rows of K codes, K
 * apart): the integer products of each four channels exact (one int32 lane), then
 * converted and scaled by their group's step in fp32 (steps: one a four channels). With
 * VNNI the codes are the unsigned side, q + 128 (an xor of their sign bit), times xq, and
 * `offset` = sum of steps[k / 4] * 128 * xq[k] is taken off the row's sum. */
static inline __attribute__((always_inline)) void grouped_dots(const int8_t *w, int64_t K,
                                                               const int8_t *xq,
                                                               const float *steps,
                                                               float offset, const int COUNT,
                                                               float *dots) {
  int64_t k0 = 0;
  (void)offset;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[4];
  const __m512i sign = _mm512_set1_epi8((char)0x80);
  for (int j = 0; j < COUNT; j++) acc[j] = _mm512_setzero_ps();
  for (; k0 < K; k0 += 64) {
    const int full = K - k0 >= 64; /* the last 64 channels masked (K % 4 == 0) */
    const __mmask64 lanes = full ? ~(__mmask64)0 : (((__mmask64)1 << (K - k0)) - 1);
    const __mmask16 quads = full ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k0) / 4) - 1);
    const __m512i x = full ? _mm512_loadu_si512((const void *)(xq + k0))
                           : _mm512_maskz_loadu_epi8(lanes, xq + k0);
    const __m512 step = full ? _mm512_loadu_ps(steps + k0 / 4)
                             : _mm512_maskz_loadu_ps(quads, steps + k0 / 4);
    for (int j = 0; j < COUNT; j++) {
      if (COUNT > 1) __builtin_prefetch(w + (COUNT + j) * K + k0, 0, 2); /* into L2 */
      const __m512i q = full ? _mm512_loadu_si512((const void *)(w + j * K + k0))
                             : _mm512_maskz_loadu_epi8(lanes, w + j * K + k0);
      /* masked-off lanes: 0 ^ 0x80 = 128 times x = 0 */
      const __m512i with_128 = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                   _mm512_xor_si512(q, sign), x);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(with_128), step, acc[j]);
    }
  }
  for (int j = 0; j < COUNT; j++) dots[j] = _mm512_reduce_add_ps(acc[j]) - offset;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[4];
  for (int j = 0; j < COUNT; j++) acc[j] = _mm256_setzero_ps();
  for (; k0 + 32 <= K; k0 += 32) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + k0));
    const __m256 step = _mm256_loadu_ps(steps + k0 / 4);
    for (int j = 0; j < COUNT; j++) {
      if (COUNT > 1) __builtin_prefetch(w + (COUNT + j) * K + k0, 0, 2);
      const __m256i q = _mm256_loadu_si256((const __m256i *)(w + j * K + k0));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quad_dots(q, x)), step, acc[j]);
    }
  }
  for (int j = 0; j < COUNT; j++) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
    s = _mm_hadd_ps(s, s);
    dots[j] = _mm_cvtss_f32(_mm_hadd_ps(s, s));
  }
#else
  for (int j = 0; j < COUNT; j++) dots[j] = 0.f;
#endif
  for (; k0 < K; k0 += 4) /* four channels at a time, as the lanes above */
    for (int j = 0; j < COUNT; j++) {
      int32_t quad = 0;
      for (int64_t k = k0; k < k0 + 4; k++) quad += (int32_t)w[j * K + k] * xq[k];
      dots[j] += (float)quad * steps[k0 / 4];
    }
}

/* One row of x quantized (quantize_row): its codes; where the row has one scale d, xu =
 * xq + 128 (as u8); else the step of every four channels (d = 1) and the offset that
 * grouped_dots takes off. */
typedef struct {
  int8_t *xq;
  uint8_t *xu;
  float *steps; /* NULL: one scale a row */
  float offset;
  float d;
} Row;

/* dots[j] = row j of w (COUNT rows of K codes, K apart) . x's row, in fp32. */
static inline __attribute__((always_inline)) void row_dots(const int8_t *w, int64_t K,
                                                           const Row *x, const int COUNT,
                                                           float *dots) {
  if (x->steps != NULL) {
    grouped_dots(w, K, x->xq, x->steps, x->offset, COUNT, dots);
    return;
  }
  int32_t exact[4];
  int_dots(w, K, x->xq, x->xu, COUNT, exact);
  for (int j = 0; j < COUNT; j++) dots[j] = (float)exact[j];
}

/* Row m of x (fp32 or bf16, K channels from `at`) quantized in spans of AG channels (AG =
 * K: the whole row; torch's numbers, int8_codes.h) into r's buffers. */
static void quantize_row(const void *x, int x_bf16, int64_t at, int64_t K, int64_t AG, Row *r) {
  r->offset = 0.f, r->d = 1.f;
  for (int64_t k0 = 0; k0 < K; k0 += AG) {
    const float step = max_abs(x, x_bf16, at + k0, AG) / 127.f;
    int8_codes(x, x_bf16, at + k0, AG, step, r->xq + k0);
    if (r->steps == NULL) { /* one span, the row: its scale, and xq + 128 for int_dots */
      r->d = step;
      for (int64_t k = 0; k < K; k++) r->xu[k] = (uint8_t)(r->xq[k] + 128);
      continue;
    }
    int32_t sum = 0;
    for (int64_t k = k0; k < k0 + AG; k++) sum += r->xq[k];
    for (int64_t k = k0; k < k0 + AG; k += 4) r->steps[k / 4] = step;
    r->offset += step * (float)(128 * sum);
  }
}

/* y (N,) = one row of x against this thread's share of the weight rows, one row after
 * another (one memory stream a thread), in blocks of ROW_BLOCK rows: the block's dot
 * products first, then its scales, biases and stores (gemv_int8.c's rows_in_order, the order
 * the int8 weights walk in). */
#define ROW_BLOCK 16
static void rows_in_order(const int8_t *q, const Row *x, const void *scale, int scale_bf16,
                          const void *bias, int bias_bf16, void *y, int y_bf16, int64_t N,
                          int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < (N + ROW_BLOCK - 1) / ROW_BLOCK; block++) {
    const int64_t n0 = ROW_BLOCK * block, count = N - n0 < ROW_BLOCK ? N - n0 : ROW_BLOCK;
    float dots[ROW_BLOCK];
    for (int64_t j = 0; j < count; j++) row_dots(q + (n0 + j) * K, K, x, 1, dots + j);
    for (int64_t j = 0; j < count; j++) {
      const float b = bias ? value_at(bias, bias_bf16, n0 + j) : 0.f;
      const float product = dots[j] * x->d * value_at(scale, scale_bf16, n0 + j);
      store(y, y_bf16, n0 + j, bias ? product + b : product);
    }
  }
}

/* Tiles of four weight rows (the next four prefetched; 1 for the last N % 4) split across
 * threads, each against every row of x. */
static void tiles(const int8_t *q, const Row *x, const void *scale, int scale_bf16,
                  const void *bias, int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N,
                  int64_t K) {
  const int64_t quads = N / 4;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < quads + N % 4; r++) {
    const int64_t n = r < quads ? 4 * r : 4 * quads + (r - quads), count = r < quads ? 4 : 1;
    for (int64_t m = 0; m < M; m++) {
      float dots[4];
      if (count == 4)
        row_dots(q + n * K, K, x + m, 4, dots);
      else
        row_dots(q + n * K, K, x + m, 1, dots);
      for (int64_t j = 0; j < count; j++) {
        const float b = bias ? value_at(bias, bias_bf16, n + j) : 0.f;
        const float product = dots[j] * x[m].d * value_at(scale, scale_bf16, n + j);
        store(y, y_bf16, m * N + n + j, bias ? product + b : product);
      }
    }
  }
}

/* x: (M, K) with row stride x_stride, fp32 or bf16, quantized in spans of AG channels (AG =
 * K: a scale a row; else AG % 4 == 0 and K % AG == 0, the caller checks); q: (N, K) int8
 * contiguous, |q| <= 127; scale: (N,) and bias (N,) or NULL, fp32 or bf16; y: (M, N)
 * contiguous, fp32 or bf16. One row walks the weight rows in order as the int8 weights do
 * (in_order: the layer's kernel plan); harness gemv_stack.c compares it with the tiles and
 * the weight-only int8 kernel. */
void kvlab_gemv_w8a8(const void *x, int x_bf16, int64_t x_stride, const int8_t *q,
                     const void *scale, int scale_bf16, int64_t AG, const void *bias,
                     int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                     int in_order) {
  const int grouped = AG < K;
  /* a row's buffers, each row's from a cache line on (a 64-byte load then reads one line) */
  const int64_t span = (2 * K + (grouped ? sizeof(float) * (K / 4) : 0) + 63) / 64 * 64;
  char *buffer = aligned_alloc(64, (size_t)(M * span + 64));
  Row *rows = malloc(sizeof(Row) * (size_t)(M > 0 ? M : 1));
  for (int64_t m = 0; m < M; m++) {
    Row *r = &rows[m];
    r->steps = grouped ? (float *)(buffer + m * span) : NULL;
    r->xq = (int8_t *)(buffer + m * span + (grouped ? sizeof(float) * (K / 4) : 0));
    r->xu = (uint8_t *)r->xq + K;
    quantize_row(x, x_bf16, m * x_stride, K, grouped ? AG : K, r);
  }
  if (M == 1 && in_order)
    rows_in_order(q, rows, scale, scale_bf16, bias, bias_bf16, y, y_bf16, N, K);
  else
    tiles(q, rows, scale, scale_bf16, bias, bias_bf16, y, y_bf16, M, N, K);
  free(rows);
  free(buffer);
}

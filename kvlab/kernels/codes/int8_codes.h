/* Activations quantized to int8 as torch quantizes them (kvlab.kernels.linear.w8a8.quantize_rows):
 * d = max|x| / 127 over a span, codes round(x / d) by IEEE division and rounding to nearest
 * even, 0 where d is 0. For gemv_w8a8.c (a span a row) and gemv_w4a8.c (a span a weight
 * group); only for sources built without fast-math (build.py's EXACT), which would turn the
 * division into a reciprocal's product. */
#ifndef KVLAB_INT8_CODES_H
#define KVLAB_INT8_CODES_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* max|x| over x[at .. at + n) (fp32 or bf16). */
static inline float max_abs(const void *x, int x_bf16, int64_t at, int64_t n) {
  float top = 0.f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 tops = _mm512_setzero_ps();
  for (; k + 16 <= n; k += 16) tops = _mm512_max_ps(tops, _mm512_abs_ps(vload(x, x_bf16, at + k)));
  top = _mm512_reduce_max_ps(tops);
#endif
  for (; k < n; k++) {
    const float a = fabsf(value_at(x, x_bf16, at + k));
    top = a > top ? a : top;
  }
  return top;
}

/* codes[k] = round(x[at + k] / d) for k < n (0 where d is 0). */
static inline void int8_codes(const void *x, int x_bf16, int64_t at, int64_t n, float d,
                              int8_t *codes) {
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 dv = _mm512_set1_ps(d);
  for (; d > 0.f && k + 16 <= n; k += 16) {
    const __m512 scaled = _mm512_roundscale_ps(_mm512_div_ps(vload(x, x_bf16, at + k), dv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(codes + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(scaled)));
  }
#endif
  for (; k < n; k++) codes[k] = d > 0.f ? (int8_t)nearbyintf(value_at(x, x_bf16, at + k) / d) : 0;
}

#endif

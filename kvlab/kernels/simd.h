/* The widest fp32 vector the CPU has, for kvlab's linear and attention kernels: ``vec`` of
 * LANES floats (16 on AVX-512, 8 on AVX2 + FMA; LANES undefined without either), its zero,
 * fused multiply-add, broadcast, horizontal sum, store, and loads of fp32 or bf16 (widened)
 * values. */
#ifndef KVLAB_SIMD_H
#define KVLAB_SIMD_H

#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static inline vec vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec a) { _mm512_storeu_ps(p, a); }
static inline vec vload_bf16(const uint16_t *p) {
  const __m256i h = _mm256_loadu_si256((const __m256i *)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
static inline vec vload_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec a) { _mm256_storeu_ps(p, a); }
static inline vec vload_bf16(const uint16_t *p) {
  const __m128i h = _mm_loadu_si128((const __m128i *)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#endif

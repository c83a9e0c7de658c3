/* The widest fp32 vector the CPU has, for kvlab's linear and attention kernels: ``vec`` of
 * LANES floats (16 on AVX-512, 8 on AVX2 + FMA; LANES undefined without either), its zero,
 * fused multiply-add, broadcast, horizontal sums (of one vector; of four, as one __m128),
 * store, and loads of fp32 or bf16 (widened) values. */
#ifndef KVLAB_SIMD_H
#define KVLAB_SIMD_H

#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* The CPU multiplies bf16 pairs into fp32 sums (vdpbf16ps; every AVX512-BF16 CPU has
 * AVX512-BW too, which the kernels around those products use): the one test of it. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVLAB_BF16_DOT 1
#endif

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
/* The four sums of a0..a3, in that order. */
static inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
  /* x: a0 then a1 folded to 256 bits; y: a2, a3; z: all four folded to 128 bits */
  const __m512 x =
      _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 y =
      _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  z = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));
  z = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4E)); /* each 128-bit lane: one sum, four times */
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, z));
}
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
/* The four sums of a0..a3, in that order. */
static inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
static inline vec vload_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec a) { _mm256_storeu_ps(p, a); }
static inline vec vload_bf16(const uint16_t *p) {
  const __m128i h = _mm_loadu_si128((const __m128i *)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#ifdef LANES
/* LANES fp32 (bf16 = 0) or bf16 (bf16 = 1) values from element k of p, as fp32. */
static inline vec vload(const void *p, const int bf16, int64_t k) {
  return bf16 ? vload_bf16((const uint16_t *)p + k) : vload_f32((const float *)p + k);
}
#endif

#if defined(__AVX512F__)
/* exp(x) for x <= 0 (Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial
 * in r, times 2^k by scalef, which underflows to 0 as glibc's does): at most 1.24 ulp over
 * [-104, 0] against a double exp. It replaces libmvec's 16-lane expf, whose range checks
 * this domain never needs (harness int4_attention.c compares them). */
static inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f)); /* exp(-104) is 0 in fp32 */
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}
#endif

#endif

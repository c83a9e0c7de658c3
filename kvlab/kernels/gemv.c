/* kvlab's CPU matrix-vector product for decode: y (M, N) = x (M, K) W (N, K)^T (+ bias) for
 * the rows of a decode step (one token per sequence), fp32 or bf16 weights and activations,
 * fp32 accumulation. Decode is memory-bound: the kernel streams each weight row from memory
 * once for all M rows, output rows split across threads. Rows are taken in blocks of up to
 * 8 whose size is a compile-time constant, so each row's accumulators stay in registers
 * (a runtime row count kept them in memory: 2x slower at M = 8); the blocks after the first
 * re-read the weight row from L1. On the AMD EPYC here one row reads ~17.5 GB/s where MKL's
 * sgemv reads ~9 and oneDNN's packed kernel ~10.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MAX_M 8

static inline float bf16_value(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float out;
  memcpy(&out, &bits, sizeof(out));
  return out;
}

static inline uint16_t to_bf16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(bits >> 16);
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const void *p, int bf16, int64_t k) {
  if (!bf16) return _mm256_loadu_ps((const float *)p + k);
  const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#endif

static inline float value_at(const void *p, int bf16, int64_t i) {
  return bf16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX2__) && defined(__FMA__)
/* Dot products of one weight row with ROWS rows of x (ROWS a constant after inlining):
 * two accumulators per row (16 channels a step) up to 4 rows, one (8 a step) above, so the
 * independent FMA chains cover the FMA latency without spilling. Returns the channels done. */
static inline __attribute__((always_inline)) int64_t dot_block(
    const void *row, int w_bf16, const void *x, int x_bf16, int64_t x_stride, int64_t K,
    const int ROWS, float *acc) {
  __m256 a[8], b[8];
  for (int m = 0; m < ROWS; m++) a[m] = b[m] = _mm256_setzero_ps();
  int64_t k0 = 0;
  if (ROWS == 1) { /* one row: four independent chains */
    __m256 c = a[0], d = a[0];
    for (; k0 + 32 <= K; k0 += 32) {
      a[0] = _mm256_fmadd_ps(load8(row, w_bf16, k0), load8(x, x_bf16, k0), a[0]);
      b[0] = _mm256_fmadd_ps(load8(row, w_bf16, k0 + 8), load8(x, x_bf16, k0 + 8), b[0]);
      c = _mm256_fmadd_ps(load8(row, w_bf16, k0 + 16), load8(x, x_bf16, k0 + 16), c);
      d = _mm256_fmadd_ps(load8(row, w_bf16, k0 + 24), load8(x, x_bf16, k0 + 24), d);
    }
    a[0] = _mm256_add_ps(a[0], _mm256_add_ps(c, d));
  } else if (ROWS <= 4) {
    for (; k0 + 16 <= K; k0 += 16) {
      const __m256 w0 = load8(row, w_bf16, k0), w1 = load8(row, w_bf16, k0 + 8);
      for (int m = 0; m < ROWS; m++) {
        a[m] = _mm256_fmadd_ps(w0, load8(x, x_bf16, m * x_stride + k0), a[m]);
        b[m] = _mm256_fmadd_ps(w1, load8(x, x_bf16, m * x_stride + k0 + 8), b[m]);
      }
    }
  } else {
    for (; k0 + 8 <= K; k0 += 8) {
      const __m256 w0 = load8(row, w_bf16, k0);
      for (int m = 0; m < ROWS; m++)
        a[m] = _mm256_fmadd_ps(w0, load8(x, x_bf16, m * x_stride + k0), a[m]);
    }
  }
  for (int m = 0; m < ROWS; m++) acc[m] = hsum(_mm256_add_ps(a[m], b[m]));
  return k0;
}

static int64_t dot_rows(const void *row, int w_bf16, const void *x, int x_bf16,
                        int64_t x_stride, int64_t K, int64_t rows, float *acc) {
  switch (rows) {
    case 1: return dot_block(row, w_bf16, x, x_bf16, x_stride, K, 1, acc);
    case 2: return dot_block(row, w_bf16, x, x_bf16, x_stride, K, 2, acc);
    case 3: return dot_block(row, w_bf16, x, x_bf16, x_stride, K, 3, acc);
    case 4: return dot_block(row, w_bf16, x, x_bf16, x_stride, K, 4, acc);
    case 5: return dot_block(row, w_bf16, x, x_bf16, x_stride, K, 5, acc);
    case 6: return dot_block(row, w_bf16, x, x_bf16, x_stride, K, 6, acc);
    case 7: return dot_block(row, w_bf16, x, x_bf16, x_stride, K, 7, acc);
    default: return dot_block(row, w_bf16, x, x_bf16, x_stride, K, 8, acc);
  }
}
#endif

static inline const void *row_at(const void *p, int bf16, int64_t index) {
  return bf16 ? (const void *)((const uint16_t *)p + index) : (const void *)((const float *)p + index);
}

/* x: (M, K) with row stride x_stride; w: (N, K) contiguous; y: (M, N) contiguous. */
void kvlab_gemv(const void *x, int x_bf16, int64_t x_stride, const void *w, int w_bf16,
                const void *bias, int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N,
                int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const void *row = row_at(w, w_bf16, n * K);
    const float b = bias ? value_at(bias, bias_bf16, n) : 0.f;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
      const int64_t rows = M - m0 < MAX_M ? M - m0 : MAX_M;
      const void *xs = row_at(x, x_bf16, m0 * x_stride);
      float acc[MAX_M] = {0};
      int64_t k0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
      k0 = dot_rows(row, w_bf16, xs, x_bf16, x_stride, K, rows, acc);
#endif
      for (int64_t k = k0; k < K; k++) {
        const float wk = value_at(row, w_bf16, k);
        for (int64_t m = 0; m < rows; m++) acc[m] += wk * value_at(xs, x_bf16, m * x_stride + k);
      }
      for (int64_t m = 0; m < rows; m++) {
        const int64_t at = (m0 + m) * N + n;
        if (y_bf16)
          ((uint16_t *)y)[at] = to_bf16(acc[m] + b);
        else
          ((float *)y)[at] = acc[m] + b;
      }
    }
  }
}

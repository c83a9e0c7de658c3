/* kvlab's CPU matrix-vector product for decode: y (M, N) = x (M, K) W (N, K)^T (+ bias) for the few
 * rows of a decode or verification step, fp32 or bf16 weights and activations, fp32 accumulation.
 * Decode is memory-bound: the kernel streams each weight row from memory once for all M rows, tiles
 * of weight rows split across threads (see "tiles"), the next tile prefetched into L2 while one is
 * read (into L1, each prefetch would hold one of the core's few L1 miss buffers until its line
 * came; the int8 and int4 kernels prefetch the same way). Every tile size is a compile-time
 * constant, so the accumulators stay in registers (a runtime row count keeps them in memory).
 * Where the CPU has AVX512-BF16, bf16 weights and rows are multiplied by vdpbf16ps without
 * widening. One row of x walks the weight rows one after another instead (row_dot) where the
 * kernel plan says so (in_order). scripts/bench_verify_step.py times it against MKL's sgemv.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

static inline const void *row_at(const void *p, int bf16, int64_t index) {
  return bf16 ? (const void *)((const uint16_t *)p + index)
              : (const void *)((const float *)p + index);
}

/* The generic path: a tile of R consecutive weight rows against M rows of x, R * M
 * accumulators in registers, so every weight vector loaded from memory serves M rows and
 * R memory streams run at once (where the hardware prefetchers do not keep one stream
 * ahead, several at once read faster). Widest vectors the CPU has: 16 lanes on AVX-512, 8 on AVX2.
 * Tile sizes keep accumulators, weight vectors and one x vector within the register file
 * (32 zmm / 16 ymm): AVX-512 R = 4 with M <= 6 (8 chains when M = 1); AVX2 R = 4 for
 * M <= 2, R = 2 for M <= 5. More rows of x are taken in chunks, re-reading the tile's
 * weights from L1. */
#if defined(__AVX512F__)
#define MAX_TILE_M 6
#define TILE_R(M) 4
#define TILE_M(R) 6
#elif defined(LANES)
#define MAX_TILE_M 5
#define TILE_R(M) ((M) <= 2 ? 4 : 2)
#define TILE_M(R) ((R) == 4 ? 2 : 5)
#else
#define MAX_TILE_M 4
#define TILE_R(M) 4
#define TILE_M(R) 4
#endif

/* acc[r * M + m] = weight row r . x row m over the channels the vectors cover; returns
 * how many channels that is (the rest are the caller's). R, M, WB, XB are constants after
 * inlining. With M = 1 each weight row gets two chains, so 8 FMAs are in flight. */
static inline __attribute__((always_inline)) int64_t tile_dots(
    const void *w, const int WB, int64_t K, const void *x, const int XB, int64_t x_stride,
    const int R, const int M, float *acc) {
  int64_t k0 = 0;
#ifdef LANES
  vec a[4][MAX_TILE_M], b[4];
  for (int r = 0; r < R; r++) {
    b[r] = vzero();
    for (int m = 0; m < M; m++) a[r][m] = vzero();
  }
  if (M == 1) {
    for (; k0 + 2 * LANES <= K; k0 += 2 * LANES) {
      const vec x0 = vload(x, XB, k0), x1 = vload(x, XB, k0 + LANES);
      for (int r = 0; r < R; r++) {
        __builtin_prefetch(row_at(w, WB, (R + r) * K + k0), 0, 2);
        __builtin_prefetch(row_at(w, WB, (R + r) * K + k0 + LANES), 0, 2);
        a[r][0] = vfma(vload(w, WB, r * K + k0), x0, a[r][0]);
        b[r] = vfma(vload(w, WB, r * K + k0 + LANES), x1, b[r]);
      }
    }
  }
  for (; k0 + LANES <= K; k0 += LANES) {
    vec wv[4];
    for (int r = 0; r < R; r++) {
      __builtin_prefetch(row_at(w, WB, (R + r) * K + k0), 0, 2);
      wv[r] = vload(w, WB, r * K + k0);
    }
    for (int m = 0; m < M; m++) {
      const vec xv = vload(x, XB, m * x_stride + k0);
      for (int r = 0; r < R; r++) a[r][m] = vfma(wv[r], xv, a[r][m]);
    }
  }
  for (int r = 0; r < R; r++) {
    a[r][0] = a[r][0] + b[r];
    for (int m = 0; m < M; m++) acc[r * M + m] = vsum(a[r][m]);
  }
#else
  (void)w; (void)WB; (void)K; (void)x; (void)XB; (void)x_stride; (void)R;
  for (int i = 0; i < 4 * M; i++) acc[i] = 0.f;
#endif
  return k0;
}

#if defined(KVLAB_BF16_DOT)
/* tile_dots for bf16 weights and rows where the CPU has AVX512-BF16: vdpbf16ps multiplies
 * 32 channel pairs exactly and sums them in fp32, so neither operand is widened. */
static inline __attribute__((always_inline)) int64_t tile_dots_bf16(
    const uint16_t *w, int64_t K, const uint16_t *x, int64_t x_stride, const int R,
    const int M, float *acc) {
  __m512 a[4][MAX_TILE_M], b[4];
  for (int r = 0; r < R; r++) {
    b[r] = vzero();
    for (int m = 0; m < M; m++) a[r][m] = vzero();
  }
  int64_t k0 = 0;
  if (M == 1) {
    for (; k0 + 64 <= K; k0 += 64) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + k0);
      const __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + k0 + 32);
      for (int r = 0; r < R; r++) {
        __builtin_prefetch(w + (R + r) * K + k0, 0, 2);
        __builtin_prefetch(w + (R + r) * K + k0 + 32, 0, 2);
        a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512(w + r * K + k0), x0);
        b[r] = _mm512_dpbf16_ps(b[r], (__m512bh)_mm512_loadu_si512(w + r * K + k0 + 32), x1);
      }
    }
  }
  for (; k0 + 32 <= K; k0 += 32) {
    __m512bh wv[4];
    for (int r = 0; r < R; r++) {
      __builtin_prefetch(w + (R + r) * K + k0, 0, 2);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k0);
    }
    for (int m = 0; m < M; m++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k0);
      for (int r = 0; r < R; r++) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv[r], xv);
    }
  }
  for (int r = 0; r < R; r++) {
    a[r][0] = a[r][0] + b[r];
    for (int m = 0; m < M; m++) acc[r * M + m] = vsum(a[r][m]);
  }
  return k0;
}
#endif

/* Weight row w . x over K channels, four chains. One row after another is one memory stream
 * per thread, which the hardware prefetchers follow without help: where they do, it reads
 * as fast as a streaming sum (experiments/engine_vs_llamacpp/harness/gemv_stack.c compares
 * the walks). */
static inline __attribute__((always_inline)) float row_dot(const void *w, const int WB,
                                                           const void *x, const int XB,
                                                           int64_t K) {
  int64_t k = 0;
  float sum = 0.f;
#if defined(KVLAB_BF16_DOT)
  if (WB && XB) {
    const uint16_t *wb = w, *xb = x;
    __m512 a[4] = {vzero(), vzero(), vzero(), vzero()};
    for (; k + 128 <= K; k += 128)
      for (int c = 0; c < 4; c++)
        a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)_mm512_loadu_si512(wb + k + 32 * c),
                                (__m512bh)_mm512_loadu_si512(xb + k + 32 * c));
    for (; k + 32 <= K; k += 32)
      a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)_mm512_loadu_si512(wb + k),
                              (__m512bh)_mm512_loadu_si512(xb + k));
    sum = vsum((a[0] + a[1]) + (a[2] + a[3]));
  } else
#endif
  {
#ifdef LANES
    vec a[4] = {vzero(), vzero(), vzero(), vzero()};
    for (; k + 4 * LANES <= K; k += 4 * LANES)
      for (int c = 0; c < 4; c++)
        a[c] = vfma(vload(w, WB, k + c * LANES), vload(x, XB, k + c * LANES), a[c]);
    for (; k + LANES <= K; k += LANES) a[0] = vfma(vload(w, WB, k), vload(x, XB, k), a[0]);
    sum = vsum((a[0] + a[1]) + (a[2] + a[3]));
#endif
  }
  for (; k < K; k++) sum += value_at(w, WB, k) * value_at(x, XB, k);
  return sum;
}

/* One tile: R weight rows from row n against rows m0.. m0 + M - 1 of x, finished in scalar
 * code past the vectors, bias added, stored to y (M_total, N). */
static inline __attribute__((always_inline)) void tile(
    const void *w, const int WB, const void *x, const int XB, int64_t x_stride,
    const void *bias, int bias_bf16, void *y, int y_bf16, int64_t N, int64_t K, int64_t n,
    int64_t m0, const int R, const int M) {
  float acc[4 * MAX_TILE_M];
  const void *wn = row_at(w, WB, n * K), *xm = row_at(x, XB, m0 * x_stride);
#if defined(KVLAB_BF16_DOT)
  const int64_t k0 = WB && XB ? tile_dots_bf16(wn, K, xm, x_stride, R, M, acc)
                              : tile_dots(wn, WB, K, xm, XB, x_stride, R, M, acc);
#else
  const int64_t k0 = tile_dots(wn, WB, K, xm, XB, x_stride, R, M, acc);
#endif
  for (int r = 0; r < R; r++) {
    const float b = bias ? value_at(bias, bias_bf16, n + r) : 0.f;
    for (int m = 0; m < M; m++) {
      float sum = acc[r * M + m];
      for (int64_t k = k0; k < K; k++)
        sum += value_at(wn, WB, r * K + k) * value_at(xm, XB, m * x_stride + k);
      store(y, y_bf16, (m0 + m) * N + n + r, sum + b);
    }
  }
}

#define TILE_CASE(MM)                                                               \
  case MM:                                                                          \
    if (rows == 4)                                                                  \
      tile(w, WB, x, XB, xs, bias, bb, y, yb, N, K, n, m0, 4, MM);                  \
    else if (rows == 2)                                                             \
      tile(w, WB, x, XB, xs, bias, bb, y, yb, N, K, n, m0, 2, MM);                  \
    else                                                                            \
      tile(w, WB, x, XB, xs, bias, bb, y, yb, N, K, n, m0, 1, MM);                  \
    break;

/* Tiles of TILE_R(M) weight rows (1 for the last N % TILE_R) split across threads, each
 * against all M rows of x in chunks of at most TILE_M(R), so the weights stream from memory
 * once; WB, XB: weights / x in bf16. */
static inline __attribute__((always_inline)) void tiles(
    const void *x, const int XB, int64_t xs, const void *w, const int WB, const void *bias,
    int bb, void *y, int yb, int64_t M, int64_t N, int64_t K, int in_order) {
  if (M == 1 && in_order) { /* one stream: row_dot */
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
      store(y, yb, n, row_dot(row_at(w, WB, n * K), WB, x, XB, K) +
                          (bias ? value_at(bias, bb, n) : 0.f));
    return;
  }
  const int64_t R = TILE_R(M), chunk_max = TILE_M(R), full = N / R * R;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < full / R + N % R; t++) {
    const int64_t n = t < full / R ? t * R : full + (t - full / R);
    const int64_t rows = n < full ? R : 1;
    for (int64_t m0 = 0; m0 < M; m0 += chunk_max) {
      switch (M - m0 < chunk_max ? M - m0 : chunk_max) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
        TILE_CASE(4)
#if MAX_TILE_M >= 5
        TILE_CASE(5)
#endif
#if MAX_TILE_M >= 6
        TILE_CASE(6)
#endif
      }
    }
  }
}

/* One specialisation per (x, weights) precision pair, so each inlines its own loads. */
#define TILES_FOR(NAME, XB, WB)                                                        \
  static void NAME(const void *x, int64_t xs, const void *w, const void *bias, int bb, \
                   void *y, int yb, int64_t M, int64_t N, int64_t K, int in_order) {   \
    tiles(x, XB, xs, w, WB, bias, bb, y, yb, M, N, K, in_order);                       \
  }
TILES_FOR(tiles_ff, 0, 0)
TILES_FOR(tiles_bb, 1, 1)
TILES_FOR(tiles_fb, 0, 1)
TILES_FOR(tiles_bf, 1, 0)

/* x: (M, K) with row stride x_stride; w: (N, K) contiguous; y: (M, N) contiguous.
 * in_order: one row of x walks the weight rows one after another (row_dot), else in
 * tiles; the caller's kernel plan says which (kvlab.kernels.plan). */
void kvlab_gemv(const void *x, int x_bf16, int64_t x_stride, const void *w, int w_bf16,
                const void *bias, int bias_bf16, void *y, int y_bf16, int64_t M, int64_t N,
                int64_t K, int in_order) {
  void (*run)(const void *, int64_t, const void *, const void *, int, void *, int, int64_t,
              int64_t, int64_t, int) =
      w_bf16 ? (x_bf16 ? tiles_bb : tiles_fb) : (x_bf16 ? tiles_bf : tiles_ff);
  run(x, x_stride, w, bias, bias_bf16, y, y_bf16, M, N, K, in_order);
}

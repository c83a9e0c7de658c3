/* kvlab's CPU prefill attention: a chunk of T query tokens of each row attending causally
 * over the row's context, bf16 in and out, every sum in fp32: FlashAttention-2's tiling and
 * online softmax (Dao, arXiv 2307.08691) over blocks of QB query tokens x KB keys, the
 * products by AVX512-BF16's pair dot products (vdpbf16ps).
 *
 * Shapes. Query token i of row b sits at position offsets[b] + i and sees the keys at
 * positions 0 .. offsets[b] + i (those below L): q (B, H, T, D), k and v (B, H_kv, L, D),
 * each addressed by its strides (row, head, token; D contiguous), out (B, T, H, D)
 * contiguous. Query head h reads key head h / (H / H_kv) (grouped-query attention): a work
 * item is one row, one key head and QB query tokens, so the G = H / H_kv query heads of
 * the group share every key and value block the item packs.
 *
 * Per item and key block: K packed in pairs of channels (kp[c][j] holds channels 2c, 2c + 1
 * of key j), V in pairs of keys (vp[p][d] holds keys 2p, 2p + 1 of channel d), so each
 * vdpbf16ps is 16 lanes x 2 products against a broadcast pair of the query (scores) or of
 * the softmax weights (output). Weights are rounded to bf16 before they meet V, as
 * torch's CPU flash attention rounds them; the running max, sum and output stay fp32.
 * Blocks past a query block's last position are never read; only the blocks that cross
 * the diagonal are masked.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_job.h"
#include "simd.h"

#define QB 32 /* query tokens an item holds */
#define KB 32 /* keys a block holds: two vectors of scores */

/* Whether this build has the kernel (the CPU multiplies bf16 pairs). */
int kvlab_prefill_attention_available(void) {
#if defined(KVLAB_BF16_DOT)
  return 1;
#else
  return 0;
#endif
}

#if defined(KVLAB_BF16_DOT)
static inline __m512 pair_dot(__m512 acc, uint32_t pair, __m512i block) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)pair), (__m512bh)block);
}

/* Pack keys [0, n) of a block (the rest zero): kp[c * KB + j] = channels 2c, 2c + 1 of
 * key j. */
static void pack_keys(const uint16_t *k, int64_t stride, int n, int D, uint32_t *kp) {
  memset(kp, 0, sizeof(uint32_t) * (D / 2) * KB);
  for (int j = 0; j < n; j++) {
    const uint32_t *row = (const uint32_t *)(k + j * stride);
    for (int c = 0; c < D / 2; c++) kp[c * KB + j] = row[c];
  }
}

/* Pack values [0, n) of a block (the rest zero): vp[p * D + d] = channel d of keys 2p and
 * 2p + 1, the first in the low half. */
static void pack_values(const uint16_t *v, int64_t stride, int n, int D, uint32_t *vp) {
  for (int p = 0; p < KB / 2; p++) {
    const uint16_t *a = v + (2 * p) * stride, *b = v + (2 * p + 1) * stride;
    const int has_a = 2 * p < n, has_b = 2 * p + 1 < n;
    for (int d = 0; d < D; d++) {
      const uint32_t lo = has_a ? a[d] : 0, hi = has_b ? b[d] : 0;
      vp[p * D + d] = lo | (hi << 16);
    }
  }
}

/* Row r's scores s0 (keys 0..15 of the block), s1 (16..31) become its bf16 weights in wp
 * (masked past its position `pos` and past the block's n keys when `masked`), its running
 * max and sum move on, and its output is rescaled to the new max. */
static inline void update_row(__m512 s0, __m512 s1, int r, __m512 scale_v, int masked,
                              int64_t pos, int64_t j0, int n, float *m, float *l, uint32_t *wp,
                              float *o, int D) {
  s0 = _mm512_mul_ps(s0, scale_v), s1 = _mm512_mul_ps(s1, scale_v);
  if (masked) {
    const int64_t seen = pos - j0 + 1 < n ? pos - j0 + 1 : n;
    const uint32_t bits = seen >= 32 ? 0xFFFFFFFFu : seen <= 0 ? 0u : (1u << seen) - 1u;
    s0 = _mm512_mask_mov_ps(_mm512_set1_ps(EMPTY), (__mmask16)(bits & 0xFFFF), s0);
    s1 = _mm512_mask_mov_ps(_mm512_set1_ps(EMPTY), (__mmask16)(bits >> 16), s1);
  }
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
  const float most = top > m[r] ? top : m[r];
  const __m512 shift = _mm512_set1_ps(most);
  const __m512 w0 = exp_nonpositive(_mm512_sub_ps(s0, shift));
  const __m512 w1 = exp_nonpositive(_mm512_sub_ps(s1, shift));
  /* weights rounded to bf16, paired by neighbouring keys: w0 holds keys 0..15 */
  _mm256_storeu_si256((__m256i *)(wp + (int64_t)r * (KB / 2)), (__m256i)_mm512_cvtneps_pbh(w0));
  _mm256_storeu_si256((__m256i *)(wp + (int64_t)r * (KB / 2) + 8),
                      (__m256i)_mm512_cvtneps_pbh(w1));
  const float alpha = m[r] == EMPTY ? 0.f : expf(m[r] - most);
  l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(w0, w1));
  m[r] = most;
  float *orow = o + (int64_t)r * D;
  const __m512 a = _mm512_set1_ps(alpha);
  for (int d = 0; d < D; d += 16)
    _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), a));
}

/* One item: query tokens [t0, t0 + nq) of row b, the G heads of key head hk. */
static void attend_block(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                         int64_t T, int64_t L, int64_t H, int64_t D, int G, const int64_t *qs,
                         const int64_t *ks, const int64_t *vs, int64_t offset, float scale,
                         int64_t b, int64_t hk, int64_t t0, int nq, uint32_t *work) {
  const int R = nq * G; /* rows: token i, head g at r = i * G + g */
  uint32_t *qp = work;                           /* R x D/2 query pairs */
  uint32_t *kp = qp + (int64_t)QB * G * (D / 2); /* D/2 x KB */
  uint32_t *vp = kp + (D / 2) * KB;              /* KB/2 x D */
  uint32_t *wp = vp + (KB / 2) * D;              /* R x KB/2 weight pairs */
  float *o = (float *)(wp + (int64_t)QB * G * (KB / 2)); /* R x D */
  float *m = o + (int64_t)QB * G * D, *l = m + QB * G;
  for (int i = 0; i < nq; i++)
    for (int g = 0; g < G; g++) {
      const uint16_t *src = q + b * qs[0] + (hk * G + g) * qs[1] + (t0 + i) * qs[2];
      memcpy(qp + (int64_t)(i * G + g) * (D / 2), src, sizeof(uint16_t) * D);
    }
  memset(o, 0, sizeof(float) * R * D);
  for (int r = 0; r < R; r++) m[r] = EMPTY, l[r] = 0.f;
  const int64_t first = offset + t0, last = offset + t0 + nq - 1; /* positions */
  const int64_t end = last + 1 < L ? last + 1 : L;                 /* keys read */
  const uint16_t *kb0 = k + b * ks[0] + hk * ks[1], *vb0 = v + b * vs[0] + hk * vs[1];
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < end; j0 += KB) {
    const int n = end - j0 < KB ? (int)(end - j0) : KB;
    pack_keys(kb0 + j0 * ks[2], ks[2], n, (int)D, kp);
    pack_values(vb0 + j0 * vs[2], vs[2], n, (int)D, vp);
    const int masked = n < KB || j0 + KB - 1 > first;
    for (int r0 = 0; r0 < R; r0 += 4) { /* scores of four rows share each key load */
      const int rows = R - r0 < 4 ? R - r0 : 4;
      __m512 s[4][2];
      for (int e = 0; e < 4; e++) s[e][0] = s[e][1] = _mm512_setzero_ps();
      const uint32_t *q0 = qp + (int64_t)r0 * (D / 2);
      for (int c = 0; c < D / 2; c++) {
        const __m512i k0 = _mm512_loadu_si512(kp + c * KB);
        const __m512i k1 = _mm512_loadu_si512(kp + c * KB + 16);
        for (int e = 0; e < 4; e++) { /* rows past R read row r0's pairs: never used */
          const uint32_t pair = q0[(e < rows ? e : 0) * (D / 2) + c];
          s[e][0] = pair_dot(s[e][0], pair, k0), s[e][1] = pair_dot(s[e][1], pair, k1);
        }
      }
      for (int e = 0; e < rows; e++)
        update_row(s[e][0], s[e][1], r0 + e, scale_v, masked, offset + t0 + (r0 + e) / G, j0, n,
                   m, l, wp, o, (int)D);
    }
    const int pairs = (n + 1) / 2;
    for (int r0 = 0; r0 < R; r0 += 2) { /* out += weights x values, two rows a value load */
      const int second = r0 + 1 < R;
      float *o0 = o + (int64_t)r0 * D, *o1 = second ? o0 + D : o0;
      const uint32_t *w0 = wp + (int64_t)r0 * (KB / 2), *w1 = second ? w0 + KB / 2 : w0;
      for (int d = 0; d < D; d += 64) {
        __m512 a[2][4];
        for (int x = 0; x < 4; x++)
          a[0][x] = _mm512_loadu_ps(o0 + d + 16 * x), a[1][x] = _mm512_loadu_ps(o1 + d + 16 * x);
        for (int p = 0; p < pairs; p++) {
          const uint32_t *row = vp + (int64_t)p * D + d;
          for (int x = 0; x < 4; x++) {
            const __m512i vv = _mm512_loadu_si512(row + 16 * x);
            a[0][x] = pair_dot(a[0][x], w0[p], vv), a[1][x] = pair_dot(a[1][x], w1[p], vv);
          }
        }
        for (int x = 0; x < 4; x++) _mm512_storeu_ps(o0 + d + 16 * x, a[0][x]);
        if (second)
          for (int x = 0; x < 4; x++) _mm512_storeu_ps(o1 + d + 16 * x, a[1][x]);
      }
    }
  }
  for (int i = 0; i < nq; i++)
    for (int g = 0; g < G; g++) {
      const int r = i * G + g;
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      uint16_t *dst = out + ((b * T + t0 + i) * H + hk * G + g) * D;
      for (int d = 0; d < D; d += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * D + d), inv);
        _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
      }
    }
}
#endif

/* The attention of every row's chunk (see the top of this file), where this build has the
 * kernel (kvlab_prefill_attention_available), D is a multiple of 64 up to 512 and H a
 * multiple of H_kv: the caller checks. q_b, q_h, q_t: q's strides (elements) over rows,
 * heads and tokens; the same for k and v. */
void kvlab_prefill_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                            uint16_t *out, int64_t B, int64_t T, int64_t L, int64_t H,
                            int64_t H_kv, int64_t D, int64_t q_b, int64_t q_h, int64_t q_t,
                            int64_t k_b, int64_t k_h, int64_t k_t, int64_t v_b, int64_t v_h,
                            int64_t v_t, const int64_t *offsets, float scale) {
#if defined(KVLAB_BF16_DOT)
  const int64_t q_strides[3] = {q_b, q_h, q_t}, k_strides[3] = {k_b, k_h, k_t};
  const int64_t v_strides[3] = {v_b, v_h, v_t};
  const int G = (int)(H / H_kv);
  const int64_t blocks = (T + QB - 1) / QB, items = B * H_kv * blocks;
  const int64_t words = (int64_t)QB * G * (D / 2) + (D / 2) * KB + (KB / 2) * D +
                        (int64_t)QB * G * (KB / 2) + (int64_t)QB * G * D + 2 * QB * G;
#pragma omp parallel
  {
    uint32_t *work = aligned_alloc(64, ((sizeof(uint32_t) * words + 63) / 64) * 64);
    /* the latest query blocks read the most keys: every row's and head's go first */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
      const int64_t qb = blocks - 1 - item / (B * H_kv), rest = item % (B * H_kv);
      const int64_t hk = rest % H_kv, b = rest / H_kv, t0 = qb * QB;
      const int nq = T - t0 < QB ? (int)(T - t0) : QB;
      attend_block(q, k, v, out, T, L, H, D, G, q_strides, k_strides, v_strides, offsets[b],
                   scale, b, hk, t0, nq, work);
    }
    free(work);
  }
#else
  (void)q, (void)k, (void)v, (void)out, (void)B, (void)T, (void)L, (void)H, (void)H_kv;
  (void)D, (void)q_b, (void)q_h, (void)q_t, (void)k_b, (void)k_h, (void)k_t, (void)v_b;
  (void)v_h, (void)v_t, (void)offsets, (void)scale;
#endif
}

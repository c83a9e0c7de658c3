/* Decode attention straight from integer codes (KIVI, arXiv 2402.02750: keys per channel
 * over groups of tokens, values per token in groups of channels), with the scales folded
 * out of the rows so no row is dequantized:
 *
 *   keys:   q . (c * s + z) = (q * s) . c + q . z    (s, z: one scale row per key group)
 *   values: sum_i p_i (c_i * a_i + z_i) = sum_i (p_i a_i) c_i + sum_i p_i z_i
 *                                          (a_i, z_i: token i's scale and zero per group)
 *
 * Keys in token codes (HF's QuantizedCache, kv_bits storage) scale their codes by the
 * token's group scale in registers, and add sum_groups z * (the group's query sum).
 * So a key run costs one scaled query per scale row and each row only its codes widened to
 * floats (shift, mask, convert) and multiplied in registers; the zero terms are one dot
 * product per run (keys) and one sum per value group. On AVX-512, channel-code keys are
 * scored sixteen rows at a time with the rows across the lanes (rows16_scores), which
 * drops the horizontal sums. The dequantize-into-L1 path of decode_attention.c spends
 * more than twice the instructions a row on the same work, and is compute-bound where
 * this path is bound by memory.
 *
 * Codes are planar uint32 words (see decode_attention.c): channel k * W + j is bits
 * k * bits.. of word j, W = D * bits / 32. A vector of LANES consecutive channels c0.. is
 * LANES words from c0 % W under one shift where W >= LANES, or the row's W words repeated
 * under one shift per plane where W < LANES.
 */
#include <stdint.h>

#include "attention_job.h"
#include "simd.h"

#if defined(LANES)
#define MAX_VECS 16 /* vectors of a row (D / LANES) */

#if LANES == 16
typedef __m512i ivec;
static inline ivec iset(int x) { return _mm512_set1_epi32(x); }
static inline ivec iload(const uint32_t *p) { return _mm512_loadu_si512(p); }
static inline ivec iload_lanes(const int32_t *p) { return _mm512_loadu_si512(p); }
/* The row's W < LANES words repeated across the vector (W = 4 or 8). */
static inline ivec repeat_words(const uint32_t *w, int W) {
  return W == 8 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w))
                : _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)w));
}
static inline vec widen(ivec words, ivec shift, ivec mask) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shift), mask));
}
#define KEY_HEADS 4     /* query heads a key pass scores at once (4 rows each) */
#define VALUE_ACCUMULATORS 24
#else
typedef __m256i ivec;
static inline ivec iset(int x) { return _mm256_set1_epi32(x); }
static inline ivec iload(const uint32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec iload_lanes(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec repeat_words(const uint32_t *w, int W) {
  (void)W; /* 4: the only W below 8 lanes */
  return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w));
}
static inline vec widen(ivec words, ivec shift, ivec mask) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, shift), mask));
}
#define KEY_HEADS 2
#define VALUE_ACCUMULATORS 12
#endif

/* How a row's codes become vectors: vector v is channels v * LANES.., read from word
 * offset[v] (W >= LANES) or from the repeated words (W < LANES), shifted by shift[v]. */
typedef struct {
  int C, W, repeat, offset[MAX_VECS];
  int32_t shift[MAX_VECS][LANES];
  ivec mask;
} Unpack;

/* Whether rows of `s` (integer codes) can be read as vectors of LANES channels. */
static int unpackable(const Store *s, int D) {
  if (s->format != FMT_CHANNEL_CODES && s->format != FMT_TOKEN_CODES) return 0;
  if (32 % s->bits || D % LANES || D / LANES > MAX_VECS) return 0;
  const int W = D * s->bits / 32;
  return W >= LANES ? W % LANES == 0 : (W == 4 || W == 8) && LANES % W == 0;
}

static void unpack_plan(const Store *s, int D, Unpack *u) {
  u->C = D / LANES, u->W = D * s->bits / 32, u->repeat = u->W < LANES;
  u->mask = iset((int)((1u << s->bits) - 1u));
  for (int v = 0; v < u->C; v++) {
    u->offset[v] = u->repeat ? 0 : (v * LANES) % u->W;
    for (int l = 0; l < LANES; l++) u->shift[v][l] = (v * LANES + l) / u->W * s->bits;
  }
}

static inline vec codes_vec(const Unpack *u, const uint32_t *w, ivec repeated, int v) {
  const ivec words = u->repeat ? repeated : iload(w + u->offset[v]);
  return widen(words, iload_lanes(u->shift[v]), u->mask);
}

/* Scores of n rows (words w, slot stride ws) for query heads g0.. g0 + GH - 1 of qs (scaled
 * queries, D each): GH * 4 accumulators in registers. Channel codes (TOKEN = 0): qs carries
 * the key scales, and bias[g] is added to every row. Token codes (TOKEN = 1): row i's codes
 * are scaled by rs[i * groups + their group] in registers, and rb[g * TILE + i] added. */
static inline __attribute__((always_inline)) void code_scores(
    const Unpack *u, const uint32_t *w, int64_t ws, int n, const float *qs, const float *bias,
    const int TOKEN, const float *rs, const float *rb, int per_group, int groups, int g0,
    const int GH, float *scores, int stride) {
  const int C = u->C;
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    vec acc[KEY_HEADS][4];
    ivec rep[4];
    for (int r = 0; r < 4; r++) {
      for (int g = 0; g < GH; g++) acc[g][r] = vzero();
      rep[r] = u->repeat ? repeat_words(w + (i + r) * ws, u->W) : iset(0);
    }
    for (int v = 0; v < C; v++) {
      vec qv[KEY_HEADS];
      for (int g = 0; g < GH; g++) qv[g] = vload_f32(qs + ((g0 + g) * C + v) * LANES);
      for (int r = 0; r < 4; r++) {
        vec c = codes_vec(u, w + (i + r) * ws, rep[r], v);
        if (TOKEN) c = c * vset1(rs[(i + r) * groups + v / per_group]);
        for (int g = 0; g < GH; g++) acc[g][r] = vfma(qv[g], c, acc[g][r]);
      }
    }
    for (int g = 0; g < GH; g++) {
      const __m128 s = vsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      const __m128 add =
          TOKEN ? _mm_loadu_ps(rb + (g0 + g) * TILE + i) : _mm_set1_ps(bias[g0 + g]);
      _mm_storeu_ps(scores + (g0 + g) * stride + i, _mm_add_ps(s, add));
    }
  }
  for (; i < n; i++) {
    const ivec rep = u->repeat ? repeat_words(w + i * ws, u->W) : iset(0);
    vec acc[KEY_HEADS];
    for (int g = 0; g < GH; g++) acc[g] = vzero();
    for (int v = 0; v < C; v++) {
      vec c = codes_vec(u, w + i * ws, rep, v);
      if (TOKEN) c = c * vset1(rs[i * groups + v / per_group]);
      for (int g = 0; g < GH; g++)
        acc[g] = vfma(vload_f32(qs + ((g0 + g) * C + v) * LANES), c, acc[g]);
    }
    for (int g = 0; g < GH; g++)
      scores[(g0 + g) * stride + i] =
          vsum(acc[g]) + (TOKEN ? rb[(g0 + g) * TILE + i] : bias[g0 + g]);
  }
}

#if LANES == 16
/* Channel-code keys sixteen rows at a time with the rows across a vector's lanes: vector j
 * holds word j of the 16 rows (an in-register transpose of their W = 8 or 16 words), so
 * channel k * W + j of all 16 rows is one shift, mask and convert, times head g's scaled
 * query channel broadcast, into one accumulator per head: no horizontal sums (code_scores
 * spends a quarter of its work on them) and the shifts are immediates. W = 8 leaves the
 * rows in the lane order 0 2 4 6 1 3 5 7, 8 10 .. (put back once per head); W = 16 in order. */
static const int32_t ROWS_8_INVERSE[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};

/* Words j of rows 0..15 (slot stride ws) as vectors t[j], j < 8: rows 2p, 2p + 1 loaded
 * as one vector, unpacked by 32 and 64 bits within 128-bit lanes, then lanes chosen. */
static inline void words_of_16_rows_8(const uint32_t *w, int64_t ws, ivec *t) {
  ivec x[2][4];
  for (int half = 0; half < 2; half++) {
    ivec a[4];
    for (int p = 0; p < 4; p++) {
      const uint32_t *r = w + (half * 8 + 2 * p) * ws;
      a[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r)),
                                _mm256_loadu_si256((const __m256i *)(r + ws)), 1);
    }
    const ivec u0 = _mm512_unpacklo_epi32(a[0], a[1]), u1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const ivec u2 = _mm512_unpacklo_epi32(a[2], a[3]), u3 = _mm512_unpackhi_epi32(a[2], a[3]);
    x[half][0] = _mm512_unpacklo_epi64(u0, u2), x[half][1] = _mm512_unpackhi_epi64(u0, u2);
    x[half][2] = _mm512_unpacklo_epi64(u1, u3), x[half][3] = _mm512_unpackhi_epi64(u1, u3);
  }
  for (int m = 0; m < 4; m++) { /* lane l of x[.][m]: word m (l even) or 4 + m (l odd) */
    t[m] = _mm512_shuffle_i32x4(x[0][m], x[1][m], 0x88);
    t[4 + m] = _mm512_shuffle_i32x4(x[0][m], x[1][m], 0xDD);
  }
}

/* The same for W = 16 words a row: rows in order. */
static inline void words_of_16_rows_16(const uint32_t *w, int64_t ws, ivec *t) {
  ivec z[4][4]; /* z[q][m], lane l: word 4 l + m of rows 4 q .. 4 q + 3 */
  for (int q = 0; q < 4; q++) {
    ivec a[4];
    for (int r = 0; r < 4; r++) a[r] = iload(w + (4 * q + r) * ws);
    const ivec u0 = _mm512_unpacklo_epi32(a[0], a[1]), u1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const ivec u2 = _mm512_unpacklo_epi32(a[2], a[3]), u3 = _mm512_unpackhi_epi32(a[2], a[3]);
    z[q][0] = _mm512_unpacklo_epi64(u0, u2), z[q][1] = _mm512_unpackhi_epi64(u0, u2);
    z[q][2] = _mm512_unpacklo_epi64(u1, u3), z[q][3] = _mm512_unpackhi_epi64(u1, u3);
  }
  for (int m = 0; m < 4; m++) {
    const ivec t0 = _mm512_shuffle_i32x4(z[0][m], z[1][m], 0x44);
    const ivec t1 = _mm512_shuffle_i32x4(z[0][m], z[1][m], 0xEE);
    const ivec t2 = _mm512_shuffle_i32x4(z[2][m], z[3][m], 0x44);
    const ivec t3 = _mm512_shuffle_i32x4(z[2][m], z[3][m], 0xEE);
    t[m] = _mm512_shuffle_i32x4(t0, t2, 0x88), t[4 + m] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
    t[8 + m] = _mm512_shuffle_i32x4(t1, t3, 0x88), t[12 + m] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
  }
}

/* scores[g * stride + i] = qs_g . codes of row i + bias[g] for the rows of n in whole
 * blocks of 16 (channel codes of W words, BITS each; GH heads of qs, D = 32 W / BITS);
 * two accumulators a head (even and odd planes) so the FMA chains overlap. Returns the
 * rows done. */
static inline __attribute__((always_inline)) int rows16_scores(
    const uint32_t *w, int64_t ws, int n, const float *qs, const float *bias, const int GH,
    const int W, const int BITS, float *scores, int stride) {
  const int planes = 32 / BITS, D = W * planes;
  const ivec mask = iset((1 << BITS) - 1);
  const ivec undo = iload_lanes(ROWS_8_INVERSE);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    ivec t[16];
    if (W == 8) words_of_16_rows_8(w + i * ws, ws, t);
    else words_of_16_rows_16(w + i * ws, ws, t);
    vec acc[4][2];
    for (int g = 0; g < GH; g++) acc[g][0] = acc[g][1] = vzero();
    for (int j = 0; j < W; j++)
      for (int k = 0; k < planes; k++) {
        ivec c = k ? _mm512_srli_epi32(t[j], k * BITS) : t[j];
        if (k < planes - 1) c = _mm512_and_si512(c, mask);
        const vec code = _mm512_cvtepi32_ps(c);
        for (int g = 0; g < GH; g++)
          acc[g][k & 1] = vfma(vset1(qs[g * D + k * W + j]), code, acc[g][k & 1]);
      }
    for (int g = 0; g < GH; g++) {
      vec sum = acc[g][0] + acc[g][1];
      if (W == 8) sum = _mm512_permutexvar_ps(undo, sum);
      vstore(scores + g * stride + i, sum + vset1(bias[g]));
    }
  }
  return i;
}

/* rows16_scores for a run of channel codes where it applies (W = 8 or 16), else none. */
static int channel_rows16(const Unpack *u, int bits, const uint32_t *w, int64_t ws, int n,
                          const float *qs, const float *bias, int gn, float *scores,
                          int stride) {
#define ROWS16(GH, WORDS, BITS)                 \
  if (gn == GH && u->W == WORDS && bits == BITS) \
    return rows16_scores(w, ws, n, qs, bias, GH, WORDS, BITS, scores, stride);
#define ROWS16_HEADS(WORDS, BITS) \
  ROWS16(1, WORDS, BITS) ROWS16(2, WORDS, BITS) ROWS16(3, WORDS, BITS) ROWS16(4, WORDS, BITS)
  ROWS16_HEADS(8, 4) ROWS16_HEADS(16, 8) ROWS16_HEADS(16, 4)
#undef ROWS16_HEADS
#undef ROWS16
  return 0;
}
#endif

/* qs[g] = scale * q_g * s and bias[g] = scale * q_g . z for the key scale row at z_at. */
static void scale_queries(const Store *st, int64_t z_at, const float *q, int gn, int D,
                          float scale, float *qs, float *bias) {
  for (int g = 0; g < gn; g++) {
    vec dot = vzero();
    for (int d = 0; d < D; d += LANES) {
      const vec qd = vload_f32(q + g * D + d) * vset1(scale);
      vstore(qs + g * D + d, qd * vload(st->scale, st->scale_bf16, z_at + d));
      dot = vfma(qd, vload(st->zero, st->scale_bf16, z_at + d), dot);
    }
    bias[g] = vsum(dot);
  }
}

int kvlab_codes_keys_apply(const Job *job) {
  const Store *s = &job->k;
  if (!unpackable(s, job->D)) return 0;
  return s->format == FMT_CHANNEL_CODES || s->group % LANES == 0;
}

#define SCORE_ROWS(TOKEN, GH)                                                            \
  code_scores(&u, w + done * s->s_slot, s->s_slot, run - done, heads, bias, TOKEN, rs, rb, \
              per_group, groups, k, GH, out + done, n)
#define SCORES_CASES(TOKEN)                 \
  switch (gh) {                             \
    case 1: SCORE_ROWS(TOKEN, 1); break;    \
    KEY_CASES_3_4(TOKEN)                    \
    default: SCORE_ROWS(TOKEN, 2); break;   \
  }
#if KEY_HEADS >= 4
#define KEY_CASES_3_4(TOKEN)             \
  case 3: SCORE_ROWS(TOKEN, 3); break;   \
  case 4: SCORE_ROWS(TOKEN, 4); break;
#else
#define KEY_CASES_3_4(TOKEN)
#endif

/* Token-code keys of a run: rs (row i, group) their scales, rb (head g, row i) each
 * row's zero terms, sum over groups of zero * the group's query sum (qsum, G * groups). */
static void token_key_terms(const Store *s, int64_t z_at, int run, int gn, int groups,
                            const float *qsum, float *rs, float *rb) {
  for (int i = 0; i < run; i++) {
    for (int g = 0; g < gn; g++) rb[g * TILE + i] = 0.f;
    for (int k = 0; k < groups; k++) {
      rs[i * groups + k] = value_at(s->scale, s->scale_bf16, z_at + i * s->z_row + k);
      const float z = value_at(s->zero, s->scale_bf16, z_at + i * s->z_row + k);
      for (int g = 0; g < gn; g++) rb[g * TILE + i] += z * qsum[g * groups + k];
    }
  }
}

/* scores[g * n + t - t0] = scale * q_g . key t for t0 <= t < t1 of row b, head h, keys in
 * channel codes (each run from next_run lies within one scale row) or token codes. */
void kvlab_codes_key_scores(const Job *job, int b, int h, int64_t t0, int64_t t1,
                            const float *q, float *scores, int n) {
  const Store *s = &job->k;
  const int G = job->G, D = job->D, token = s->format == FMT_TOKEN_CODES;
  const int groups = token ? D / s->group : 1, per_group = token ? s->group / LANES : 1;
  Unpack u;
  unpack_plan(s, D, &u);
  float qs[4 * MAX_D], bias[4], rs[TILE * MAX_D / LANES], rb[4 * TILE];
  float q_scaled[token ? G * D : 1], qsum[token ? G * groups : 1]; /* token codes: per chunk */
  for (int g = 0; token && g < G; g++)
    for (int k = 0; k < groups; k++) {
      float sum = 0.f;
      for (int d = k * s->group; d < (k + 1) * s->group; d++)
        sum += (q_scaled[g * D + d] = q[g * D + d] * job->scale);
      qsum[g * groups + k] = sum;
    }
  for (int64_t t = t0; t < t1;) {
    int64_t block, slot;
    const int run = next_run(job, b, t, t1, &block, &slot);
    const int64_t z_at = block * s->z_block + h * s->z_head +
                         (token ? slot : slot / s->group) * s->z_row;
    const uint32_t *w = (const uint32_t *)s->data + block * s->s_block + h * s->s_head +
                        slot * s->s_slot;
    kvlab_prefetch_rows(job, &job->v, b, h, t, t + run);
    kvlab_prefetch_rows(job, s, b, h, t + run, t + 2 * run < t1 ? t + 2 * run : t1);
    for (int g0 = 0; g0 < G; g0 += 4) { /* four query heads at a time */
      const int gn = G - g0 < 4 ? G - g0 : 4;
      float *out = scores + (int64_t)g0 * n + (t - t0);
      if (token) {
        token_key_terms(s, z_at, run, gn, groups, qsum + g0 * groups, rs, rb);
      } else {
        scale_queries(s, z_at, q + g0 * D, gn, D, job->scale, qs, bias);
      }
      const float *heads = token ? q_scaled + g0 * D : qs; /* the block's scaled queries */
      int done = 0; /* rows scored sixteen at a time (channel codes, AVX-512) */
#if LANES == 16
      if (!token) done = channel_rows16(&u, s->bits, w, s->s_slot, run, qs, bias, gn, out, n);
#endif
      for (int k = 0; k < gn; k += KEY_HEADS) {
        const int gh = gn - k < KEY_HEADS ? gn - k : KEY_HEADS;
        if (token) {
          SCORES_CASES(1)
        } else {
          SCORES_CASES(0)
        }
      }
    }
    t += run;
  }
}

#define VALUE_TILE 128 /* value rows weighted at a time */

/* w[i] = p[i] a[i Z] and *zero_share += sum_i p[i] z[i Z] for a group's fp32 scales and
 * zeros Z apart: with Z a constant, vectorized with the loads deinterleaved. */
static inline __attribute__((always_inline)) void group_weights(
    const float *a, const float *z, const int Z, int n, const float *p, float *w,
    float *zero_share) {
  float share = 0.f;
  for (int i = 0; i < n; i++) w[i] = p[i] * a[i * Z], share += p[i] * z[i * Z];
  *zero_share += share;
}

/* A run's value weights, before its rows are read: wts[(g * groups + k) * VALUE_TILE + i] =
 * p_g,i a_i,k (row i's scale of channel group k folded into head g's softmax weight) and
 * sums[g][k] += sum_i p_g,i z_i,k (the zeros' share, added to the output once). Loops over
 * the run's rows, so the compiler vectorizes them; the row loop then only unpacks codes and
 * multiplies. fp32 scales are read where they lie (a copy written as floats and read back
 * as vectors stalls on store forwarding); bf16 ones through a widened copy. */
static inline __attribute__((always_inline)) void value_weights(
    const Store *s, int64_t z_at, int n, const float *p, int stride, const int G, int groups,
    float *wts, float *sums) {
  float a[VALUE_TILE], z[VALUE_TILE];
  for (int k = 0; k < groups; k++) {
    const float *ak = a, *zk = z;
    int Z = 1;
    if (s->scale_bf16) {
      for (int i = 0; i < n; i++) {
        a[i] = value_at(s->scale, s->scale_bf16, z_at + i * s->z_row + k);
        z[i] = value_at(s->zero, s->scale_bf16, z_at + i * s->z_row + k);
      }
    } else {
      ak = (const float *)s->scale + z_at + k, zk = (const float *)s->zero + z_at + k;
      Z = (int)s->z_row;
    }
    for (int g = 0; g < G; g++) {
      float *w = wts + (g * groups + k) * VALUE_TILE, *share = sums + g * groups + k;
      const float *pg = p + g * stride;
      if (Z == 1) group_weights(ak, zk, 1, n, pg, w, share);
      else if (Z == 2) group_weights(ak, zk, 2, n, pg, w, share);
      else group_weights(ak, zk, Z, n, pg, w, share);
    }
  }
}

/* acc[g][v] += (p_g a) c over the rows of tokens t0..t1 of row b, head h, in token codes,
 * sums[g][group] += p_g z: G heads and C = D / LANES vectors in registers for the whole
 * range, each row read once; REPEAT: the row's W < LANES words are repeated across a
 * vector (unpack_plan). */
static inline __attribute__((always_inline)) void token_values(
    const Job *job, const Unpack *u, int b, int h, int64_t t0, int64_t t1, const float *p,
    int stride, const int G, const int C, const int REPEAT, float *o, float *sums) {
  const Store *s = &job->v;
  const int groups = job->D / s->group, per_group = s->group / LANES;
  float wts[G * groups * VALUE_TILE];
  ivec shift[MAX_VECS];
  int offset[MAX_VECS];
  for (int v = 0; v < C; v++) shift[v] = iload_lanes(u->shift[v]), offset[v] = u->offset[v];
  const ivec mask = u->mask;
  vec acc[4][MAX_VECS];
  for (int g = 0; g < G; g++)
    for (int v = 0; v < C; v++) acc[g][v] = vload_f32(o + (g * C + v) * LANES);
  for (int64_t t = t0; t < t1;) {
    int64_t block, slot, run = block_run(job, b, t, t1, &block, &slot);
    const int n = run < VALUE_TILE ? (int)run : VALUE_TILE;
    const uint32_t *w = (const uint32_t *)s->data + block * s->s_block + h * s->s_head +
                        slot * s->s_slot;
    value_weights(s, block * s->z_block + h * s->z_head + slot * s->z_row, n, p + (t - t0),
                  stride, G, groups, wts, sums);
    for (int i = 0; i < n; i++) {
      const uint32_t *wi = w + i * s->s_slot;
      const ivec rep = REPEAT ? repeat_words(wi, u->W) : iset(0);
      for (int v = 0; v < C; v++) {
        const vec c = widen(REPEAT ? rep : iload(wi + offset[v]), shift[v], mask);
        for (int g = 0; g < G; g++)
          acc[g][v] = vfma(vset1(wts[(g * groups + v / per_group) * VALUE_TILE + i]), c,
                           acc[g][v]);
      }
    }
    t += n;
  }
  for (int g = 0; g < G; g++)
    for (int v = 0; v < C; v++) vstore(o + (g * C + v) * LANES, acc[g][v]);
}

int kvlab_codes_values_apply(const Job *job) {
  const Store *s = &job->v;
  if (s->format != FMT_TOKEN_CODES || !unpackable(s, job->D) || s->group % LANES) return 0;
  const int C = job->D / LANES;
  return (C == 4 || C == 8) && job->G <= 4 && job->G * C <= VALUE_ACCUMULATORS;
}

#define VALUES_CASE(GG, CC)                                                 \
  if (G == GG && C == CC) {                                                 \
    if (u->repeat)                                                          \
      token_values(job, u, b, h, t0, t1, p, n, GG, CC, 1, o, sums);         \
    else                                                                    \
      token_values(job, u, b, h, t0, t1, p, n, GG, CC, 0, o, sums);         \
    return;                                                                 \
  }

/* token_values for the job's G and C = D / LANES, compiled for each pair
 * kvlab_codes_values_apply admits. */
static void token_values_of(const Job *job, const Unpack *u, int b, int h, int64_t t0,
                            int64_t t1, const float *p, int n, float *o, float *sums) {
  const int G = job->G, C = job->D / LANES;
  VALUES_CASE(1, 4) VALUES_CASE(2, 4) VALUES_CASE(3, 4) VALUES_CASE(4, 4)
  VALUES_CASE(1, 8)
#if VALUE_ACCUMULATORS >= 16
  VALUES_CASE(2, 8)
#endif
#if VALUE_ACCUMULATORS >= 24
  VALUES_CASE(3, 8)
#endif
}

/* o[g] = sum_t p[g * n + t - t0] * value t for t0 <= t < t1 of row b, head h, values in
 * token codes (kvlab_codes_values_apply). */
void kvlab_codes_add_values(const Job *job, int b, int h, int64_t t0, int64_t t1,
                            const float *p, int n, float *o) {
  const Store *s = &job->v;
  const int G = job->G, D = job->D, groups = D / s->group;
  Unpack u;
  unpack_plan(s, D, &u);
  float sums[4 * MAX_D];
  memset(sums, 0, sizeof(float) * G * groups);
  token_values_of(job, &u, b, h, t0, t1, p, n, o, sums);
  for (int g = 0; g < G; g++) /* (no division per channel: a chunk's dozens of them cost
                                  a sixth of its value pass) */
    for (int k = 0; k < groups; k++)
      for (int d = k * s->group; d < (k + 1) * s->group; d++) o[g * D + d] += sums[g * groups + k];
}

#else /* no vectors: decode_attention.c dequantizes rows as before */
int kvlab_codes_keys_apply(const Job *job) { (void)job; return 0; }
int kvlab_codes_values_apply(const Job *job) { (void)job; return 0; }
void kvlab_codes_key_scores(const Job *job, int b, int h, int64_t t0, int64_t t1,
                            const float *q, float *scores, int n) {
  (void)job, (void)b, (void)h, (void)t0, (void)t1, (void)q, (void)scores, (void)n;
}
void kvlab_codes_add_values(const Job *job, int b, int h, int64_t t0, int64_t t1,
                            const float *p, int n, float *o) {
  (void)job, (void)b, (void)h, (void)t0, (void)t1, (void)p, (void)n, (void)o;
}
#endif

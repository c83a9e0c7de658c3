/* Top-k entry selection for compressed sparse attention (DeepSeek-V4's indexer, CSA): each
 * (row, KV head) pair scores its visible entries by q . k with its query heads' queries
 * summed, and keeps the top_k highest, in one pass over the entries' keys: no score tensor,
 * no masked fill, no sort. The scores are fp32 dot products; the k-th highest is found by
 * a radix select and the chosen entries are written in entry order (ties at the threshold to
 * the lowest entries), which is the order decode attention then reads them in. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"
#include "timers.h"

/* A score's bits as an unsigned key in the same order (a larger float, a larger key). */
static inline uint32_t order_key(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}

static inline float key_score(uint32_t key) {
  const uint32_t u = key & 0x80000000u ? key & 0x7FFFFFFFu : ~key;
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

/* The k-th highest (1 <= k <= n) of n scores, by their keys' bits 11, 11 and 10 at a time
 * (a radix select): each pass counts the candidates' next bits, walks the counts from the
 * top to the bucket that holds the k-th, and keeps only that bucket's candidates (in
 * `keys`, n of scratch). No branch depends on the data the way a quickselect's partition
 * does (it mispredicted about every other comparison). */
static float kth_highest(const float *scores, int64_t n, int64_t k, uint32_t *keys) {
  static const int widths[3] = {11, 11, 10};
  int64_t m = n, want = k;
  uint32_t prefix = 0;
  int shift = 32;
  for (int64_t j = 0; j < n; j++) keys[j] = order_key(scores[j]);
  for (int pass = 0; pass < 3; pass++) {
    const uint32_t buckets = 1u << widths[pass];
    shift -= widths[pass];
    int64_t count[1 << 11];
    memset(count, 0, sizeof(int64_t) * buckets);
    for (int64_t j = 0; j < m; j++) count[(keys[j] >> shift) & (buckets - 1)]++;
    uint32_t b = buckets - 1;
    while (count[b] < want) want -= count[b--];
    prefix |= b << shift;
    int64_t kept = 0; /* the candidates in bucket b, to the front */
    for (int64_t j = 0; j < m; j++) {
      keys[kept] = keys[j];
      kept += ((keys[j] >> shift) & (buckets - 1)) == b;
    }
    m = kept;
  }
  return key_score(prefix);
}

/* q . key over D channels, q in fp32, key fp32 or bf16. */
static float dot(const float *q, const void *key, int bf16, int64_t D) {
  int64_t d = 0;
  float sum = 0.f;
#ifdef LANES
  vec acc = vzero();
  for (; d + LANES <= D; d += LANES) acc = vfma(vload_f32(q + d), vload(key, bf16, d), acc);
  sum = vsum(acc);
#endif
  for (; d < D; d++) sum += q[d] * value_at(key, bf16, d);
  return sum;
}

/* scores[j] = q . key j for j0 <= j < j1, key j at element at + j * s_slot: four keys at a
 * time, each its own FMA chain, their four sums reduced together (vsum4, where one sum
 * a key spent more on its reduction than on its products). A sum depends only on its own
 * key's products, so an entry's score does not depend on the run it falls in. */
static void score_keys(const float *q, const void *keys, int bf16, int64_t at, int64_t s_slot,
                       int64_t j0, int64_t j1, int64_t D, float *scores) {
  int64_t j = j0;
#ifdef LANES
  for (; D % LANES == 0 && j < j1; j += 4) {
    const int64_t k0 = at + j * s_slot, k1 = k0 + s_slot, k2 = k1 + s_slot, k3 = k2 + s_slot;
    const int n = j1 - j < 4 ? (int)(j1 - j) : 4; /* the run's last keys: fewer chains */
    vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t d = 0; d < D; d += LANES) {
      const vec qd = vload_f32(q + d);
      a0 = vfma(qd, vload(keys, bf16, k0 + d), a0);
      if (n > 1) a1 = vfma(qd, vload(keys, bf16, k1 + d), a1);
      if (n > 2) a2 = vfma(qd, vload(keys, bf16, k2 + d), a2);
      if (n > 3) a3 = vfma(qd, vload(keys, bf16, k3 + d), a3);
    }
    if (n == 4) {
      _mm_storeu_ps(scores + j, vsum4(a0, a1, a2, a3));
    } else {
      float sums[4];
      _mm_storeu_ps(sums, vsum4(a0, a1, a2, a3));
      for (int e = 0; e < n; e++) scores[j + e] = sums[e];
    }
  }
#endif
  for (; j < j1; j++) {
    const int64_t element = at + j * s_slot;
    const void *key = bf16 ? (const void *)((const uint16_t *)keys + element)
                           : (const void *)((const float *)keys + element);
    scores[j] = dot(q, key, bf16, D);
  }
}

/* How many of the n scores are above `threshold` (sixteen compared at a time where the
 * CPU has AVX-512). */
static int64_t count_above(const float *scores, int64_t n, float threshold) {
  int64_t j = 0, above = 0;
#if LANES == 16
  for (; j + 16 <= n; j += 16)
    above += __builtin_popcount(
        _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + j), _mm512_set1_ps(threshold), _CMP_GT_OQ));
#endif
  for (; j < n; j++) above += scores[j] > threshold;
  return above;
}

/* The numbers of the entries scored above `threshold` and of the first `ties` scored equal
 * to it, in entry order, to kept[] (n of room); returns how many. With AVX-512 sixteen
 * entries a step: compare masks, the equal ones past `ties` cleared, the numbers compressed
 * in a register and stored whole (a compressing store to memory is microcoded on some
 * CPUs; the store stays within kept[j + 16], since at most j of the first j are kept);
 * else one entry a step without a branch (an entry's number is written at the count kept
 * so far and counts only where kept). */
static int64_t keep_entries(const float *scores, int64_t n, float threshold, int64_t ties,
                            uint32_t *kept) {
  int64_t j = 0, written = 0;
#if LANES == 16
  const __m512 t = _mm512_set1_ps(threshold);
  __m512i number = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= n; j += 16) {
    const __m512 s = _mm512_loadu_ps(scores + j);
    unsigned keep = _mm512_cmp_ps_mask(s, t, _CMP_GT_OQ);
    unsigned equal = ties > 0 ? _mm512_cmp_ps_mask(s, t, _CMP_EQ_OQ) : 0;
    for (; equal && ties > 0; ties--) { /* the lowest equal ones, one by one */
      keep |= equal & -equal;
      equal &= equal - 1;
    }
    _mm512_storeu_si512(kept + written, _mm512_maskz_compress_epi32((__mmask16)keep, number));
    written += __builtin_popcount(keep);
    number = _mm512_add_epi32(number, _mm512_set1_epi32(16));
  }
#endif
  for (; j < n; j++) {
    const int equal = scores[j] == threshold;
    const int keep = (scores[j] > threshold) | (equal & (ties > 0));
    ties -= equal & keep;
    kept[written] = (uint32_t)j;
    written += keep;
  }
  return written;
}

/* The table of pair r (top_k entries, base + j of the chosen j in entry order; the rest
 * base, past hi: never read) from its n scores, `work` n floats of scratch. Entries above
 * the k-th highest score are kept, then those equal to it in entry order until k are
 * (keep_entries, into `work`). */
static void choose(const float *scores, int64_t n, int64_t top_k, int64_t base, float *work,
                   int64_t *table) {
  const int64_t k = n < top_k ? n : top_k;
  int64_t written = 0;
  if (k > 0) {
    uint32_t *kept = (uint32_t *)work;
    const float threshold = kth_highest(scores, n, k, kept);
    const int64_t ties = k - count_above(scores, n, threshold); /* equal ones to keep */
    written = keep_entries(scores, n, threshold, ties, kept);
    for (int64_t i = 0; i < written; i++) table[i] = base + kept[i];
  }
  for (; written < top_k; written++) table[written] = base;
}

#define SCORED 128 /* entries a thread scores at a time */

/* q: (R, G, D) queries of R = B * H (row, KV head) pairs, fp32 or bf16, contiguous; keys:
 * pair r's entry j at element (r / H) * s_row + (r % H) * s_head + j * s_slot, fp32 or
 * bf16, channels contiguous; seen: (B,) visible entries of each row (the first seen[b]);
 * base: (R,) each pair's first entry in the flattened store. out: (R, top_k) table entries
 * base[r] + j of the chosen entries, the first min(seen, top_k) filled. One parallel
 * region: the pairs' queries summed, their entries scored SCORED at a time (a decode step
 * has a few pairs, too few to share two threads pair by pair), then each pair's choice. */
static void top_k_entries(const void *q, int q_bf16, int64_t R, int64_t H, int64_t G, int64_t D,
                          const void *keys, int k_bf16, int64_t s_row, int64_t s_head,
                          int64_t s_slot, const int64_t *seen, const int64_t *base,
                          int64_t top_k, int64_t *out) {
  int64_t most = 1;
  for (int64_t r = 0; r < R; r++) most = seen[r / H] > most ? seen[r / H] : most;
  const int64_t blocks = (most + SCORED - 1) / SCORED;
  float *summed = malloc(sizeof(float) * (R * D + 2 * R * most)), *scores = summed + R * D;
  float *work = scores + R * most;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) /* each pair's queries summed in head order, as torch */
      for (int64_t d = 0; d < D; d++) {
        float sum = value_at(q, q_bf16, r * G * D + d);
        for (int64_t g = 1; g < G; g++) sum += value_at(q, q_bf16, (r * G + g) * D + d);
        summed[r * D + d] = sum;
      }
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < R; r++)
      for (int64_t block = 0; block < blocks; block++) {
        const int64_t n = seen[r / H], at = r / H * s_row + r % H * s_head;
        const int64_t end = (block + 1) * SCORED < n ? (block + 1) * SCORED : n;
        score_keys(summed + r * D, keys, k_bf16, at, s_slot, block * SCORED, end, D,
                   scores + r * most);
      }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++)
      choose(scores + r * most, seen[r / H], top_k, base[r], work + r * most, out + r * top_k);
  }
  free(summed);
}

void kvlab_top_k_entries(const void *q, int q_bf16, int64_t R, int64_t H, int64_t G, int64_t D,
                         const void *keys, int k_bf16, int64_t s_row, int64_t s_head,
                         int64_t s_slot, const int64_t *seen, const int64_t *base,
                         int64_t top_k, int64_t *out) {
  TIMED(TIMER_INDEXER, top_k_entries(q, q_bf16, R, H, G, D, keys, k_bf16, s_row, s_head, s_slot,
                                     seen, base, top_k, out));
}

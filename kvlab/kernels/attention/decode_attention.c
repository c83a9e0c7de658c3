/* kvlab's CPU decode attention: one query token per sequence over K/V as the cache stores
 * them (fp32, bf16, or packed integer codes with scales), read in place through a block
 * table, in chunks whose partial softmax results are merged at the end (flash-decoding,
 * Dao et al. 2023). Quantized rows are dequantized one token at a time into a buffer that
 * stays in L1, as llama.cpp's CPU flash attention does: the history is never
 * materialised. Integer codes (keys in channel or token codes, values in token codes) are
 * read without dequantizing where the CPU's vectors fit them: attention_codes.c folds
 * their scales into the query, the codes in registers and the softmax weights instead.
 * bf16 rows are read in place and widened in registers on AVX-512 (bf16_in_place), which
 * saves the copy into the buffer; against a bf16 model's query (bf16 values) they meet it
 * by vdpbf16ps where the CPU has AVX512-BF16 (key_scores_dot). Everything is computed in
 * fp32.
 *
 * Addressing. Logical token t of row b (lo[b] <= t < hi[b]) sits at slot u = t % ring
 * (ring > 0) or u = t; its block is table[b * table_stride + u / block_size] and its slot
 * in the block u % block_size. Element i of head h of that token is at
 *   data + block * s_block + h * s_head + slot * s_slot + i.
 * Codes are uint32 words, planar: word j holds the codes of channels j, j + W, j + 2W, ...
 * at bit offsets 0, bits, 2 bits, ... (W = D * bits / 32), so unpacking reads contiguous
 * words. Token codes have a scale and zero per `group` channels of each token; channel
 * codes (KIVI keys) one per channel for each `group` consecutive slots of a block. FP8
 * rows are one byte a channel, decoded through the format's 256-entry table (built by
 * torch, so the decoding is torch's), times a scale per token and group of channels. FP4
 * rows are e2m1 codes two a byte with a scale byte per token and group, both read through
 * one table (16 code values, then the scale byte's 256 values).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_job.h"
#include "simd.h"
#include "timers.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Decode fp4 bytes c[j..end) eight at a time (16 channels, out[2j..]) times `a`. AVX-512:
 * one permute over all 16 values times `a`. AVX2: the codes' magnitudes through one
 * permute over the table's first 8 values (e2m1 is sign-symmetric: entry 8 + k is -entry
 * k), the sign bit moved into place. Returns the first byte left for the scalar loop. */
static int fp4_bytes_8(const float *values, const uint8_t *c, int j, int end, float a,
                       float *out) {
#if defined(__AVX512F__)
  /* sixteen codes a step in channel order: each byte twice, the low nibble in even
     lanes and the high one in odd lanes, looked up in the 16 values times `a` */
  const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(values), _mm512_set1_ps(a));
  const __m512i nibble_shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  const __m512i low_four = _mm512_set1_epi32(15);
  for (; j + 8 <= end; j += 8) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(c + j));
    const __m512i twice = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
    const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(twice, nibble_shift), low_four);
    _mm512_storeu_ps(out + 2 * j, _mm512_permutexvar_ps(code, scaled));
  }
#else
  const __m256 magnitudes = _mm256_loadu_ps(values), scale = _mm256_set1_ps(a);
  const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8);
  const __m256i fifteen = _mm256_set1_epi32(15);
  for (; j + 8 <= end; j += 8) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + j)));
    __m256 half[2];
    for (int k = 0; k < 2; k++) {
      const __m256i code = k ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, fifteen);
      const __m256 magnitude =
          _mm256_permutevar8x32_ps(magnitudes, _mm256_and_si256(code, seven));
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, eight), 28);
      half[k] = _mm256_mul_ps(_mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign)), scale);
    }
    const __m256 even_odd_lo = _mm256_unpacklo_ps(half[0], half[1]);  /* 0 1 2 3 | 8 9 10 11 */
    const __m256 even_odd_hi = _mm256_unpackhi_ps(half[0], half[1]);  /* 4 5 6 7 | 12 .. 15 */
    _mm256_storeu_ps(out + 2 * j, _mm256_permute2f128_ps(even_odd_lo, even_odd_hi, 0x20));
    _mm256_storeu_ps(out + 2 * j + 8, _mm256_permute2f128_ps(even_odd_lo, even_odd_hi, 0x31));
  }
#endif
  return j;
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* Decode fp8 bytes c[d..end) 16 (AVX-512) or 8 at a time times `a`: each byte widened to
 * the fp16 whose sign, exponent and mantissa fields hold the byte's, converted by the F16C unit
 * (fp16 subnormals included, so every finite code is exact). e5m2 is fp16's top byte;
 * e4m3's fields sit 3 bits lower (an exponent bias of 7 for fp16's 15), which is the fp16
 * value times 2^8, carried by the scale. Returns the first byte left for the table loop. */
static int fp8_bytes_8(const uint8_t *c, int d, int end, int exponent_bits, float a,
                       float *out) {
  const float factor = exponent_bits == 4 ? a * 256.0f : a;
#if defined(__AVX512F__)
  const __m512 scale16 = _mm512_set1_ps(factor);
  const __m256i sign16 = _mm256_set1_epi16(0x80), rest16 = _mm256_set1_epi16(0x7F);
  for (; d + 16 <= end; d += 16) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + d)));
    const __m256i h = exponent_bits == 5
                          ? _mm256_slli_epi16(x, 8)
                          : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, sign16), 8),
                                            _mm256_slli_epi16(_mm256_and_si256(x, rest16), 7));
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_cvtph_ps(h), scale16));
  }
#endif
  const __m256 scale = _mm256_set1_ps(factor);
  const __m128i sign = _mm_set1_epi16(0x80), rest = _mm_set1_epi16(0x7F);
  for (; d + 8 <= end; d += 8) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(c + d)));
    const __m128i h = exponent_bits == 5
                          ? _mm_slli_epi16(x, 8)
                          : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, sign), 8),
                                         _mm_slli_epi16(_mm_and_si128(x, rest), 7));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(h), scale));
  }
  return d;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Channels c0..c0+7 (c0 % 8 == 0) of a row of integer codes as floats. Channel c = k * W + j
 * holds bits k*bits.. of word j, so eight channels are eight words under one shift (W >= 8)
 * or four words under two (W == 4: 2-bit codes of a 64-channel head), never a plane of W
 * words at a time (16 planes of 4 words made 2-bit codes twice as slow as 4-bit ones). */
static inline __m256 codes_8(const uint32_t *w, int W, int bits, __m256i mask, int c0) {
  __m256i words, shifts;
  if (W >= 8) {
    words = _mm256_loadu_si256((const __m256i *)(w + c0 % W));
    shifts = _mm256_set1_epi32(c0 / W * bits);
  } else {
    const int lo = c0 / 4 * bits, hi = lo + bits;
    words = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w));
    shifts = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
  }
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, shifts), mask));
}
#endif

/* A row of integer codes as floats with a scale and zero per channel, one word plane at a
 * time (channel k * W + j: bits k*bits.. of word j); where codes_8 does not apply. */
static void codes_scalar(const uint32_t *w, int W, int bits, const float *sc, const float *ze,
                         float *out) {
  const uint32_t mask = (1u << bits) - 1u;
  for (int k = 0; k < 32 / bits; k++)
    for (int j = 0; j < W; j++)
      out[k * W + j] = (float)((w[j] >> (k * bits)) & mask) * sc[k * W + j] + ze[k * W + j];
}

#if defined(__AVX2__) && defined(__FMA__)
/* True where codes_8 can decode rows of `s` (every preset on a head of 64 or 128). */
static int codes_in_eights(const Store *s, int D) {
  const int W = D * s->bits / 32;
  return D % 8 == 0 && (W == 4 || (W >= 8 && W % 8 == 0));
}
#endif

/* Decode `count` consecutive slots of head h in `block` (within one scale row for channel
 * codes): rows[i] points at slot + i as D floats, either into fp32 storage or into `tile`;
 * with `raw`, bf16 rows stay where they are (rows[i] then points at D bf16 values, read
 * only by the row walks' BF16 variants, see bf16_in_place). */
/* The little-endian word of a codebook row's codes from d (bits each, LSB first: code d at
 * bit d * bits; d * bits a multiple of 8), its higher bits those of the codes after them
 * (the callers mask each code): 8 bytes read in one load from within the row's
 * `row_bytes`, shifted where they end at the row's end: a copy of fewer bytes into a
 * zeroed word would stall store-to-load forwarding every 16 channels. */
static inline uint64_t codebook_word(const uint8_t *c, int d, int bits, int row_bytes) {
  const int at = d * bits / 8;
  uint64_t word = 0;
  if (at + 8 <= row_bytes) {
    memcpy(&word, c + at, 8);
  } else if (row_bytes >= 8) {
    memcpy(&word, c + row_bytes - 8, 8);
    word >>= 8 * (at + 8 - row_bytes);
  } else {
    memcpy(&word, c + at, (size_t)(row_bytes - at));
  }
  return word;
}

#if defined(__AVX512F__)
/* Sixteen codes of `word` as int32 lanes: 16 * bits <= 64 bits, so a code may straddle a
 * 32-bit boundary; each lane shifts the whole word. */
static inline __m512i codebook_16(uint64_t word, int bits) {
  const __m512i first = _mm512_setr_epi64(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits,
                                           6 * bits, 7 * bits);
  const __m512i lanes = _mm512_set1_epi64((long long)word);
  const __m256i lo = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(lanes, first));
  const __m256i hi = _mm512_cvtepi64_epi32(
      _mm512_srlv_epi64(lanes, _mm512_add_epi64(first, _mm512_set1_epi64(8 * bits))));
  const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_and_si512(codes, _mm512_set1_epi32((1 << bits) - 1));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Eight codes of `word` (8 * bits <= 32 bits) looked up in a table of up to 16 values held
 * as its halves `lo` (entries 0-7) and `hi` (8-15): a permute of each, picked by bit 3. */
static inline __m256 codebook_8(uint32_t word, int bits, __m256 lo, __m256 hi) {
  const __m256i shifts = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits,
                                           6 * bits, 7 * bits);
  const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts),
                                         _mm256_set1_epi32((1 << bits) - 1));
  const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, codes),
                          _mm256_permutevar8x32_ps(hi, codes), high);
}
#endif

/* FMT_CODEBOOK: `bits` (1 to 4) a channel, LSB first along the row (code d at bit d * bits;
 * 4 bits: fp4's nibbles), indexing the table of 2^bits values in `zero`, times the scale of
 * its token and group of channels (`scale`, fp32 or bf16): the table is scaled once a group
 * and looked up by a permute, 16 channels a step (8 with AVX2); `bits` a constant. */
static inline __attribute__((always_inline)) void codebook_rows_of(
    const Store *s, int64_t block, int h, int64_t slot, int count, int D, float *restrict tile,
    const int bits) {
  const float *table = (const float *)s->zero;
  const int groups = D / s->group, mask = (1 << bits) - 1;
  const int64_t at = block * s->s_block + h * s->s_head + slot * s->s_slot;
  float padded[16] = {0};
  memcpy(padded, table, sizeof(float) * (size_t)(1 << bits));
#if defined(__AVX512F__)
  const __m512 values = _mm512_loadu_ps(padded);
  const int row_bytes = D * bits / 8;
#elif defined(__AVX2__) && defined(__FMA__)
  const int row_bytes = D * bits / 8;
  const __m256 values_lo = _mm256_loadu_ps(padded), values_hi = _mm256_loadu_ps(padded + 8);
#endif
  for (int i = 0; i < count; i++) {
    const uint8_t *c = (const uint8_t *)s->data + at + i * s->s_slot;
    const int64_t z_at = block * s->z_block + h * s->z_head + (slot + i) * s->z_row;
    float *out = tile + i * D;
    for (int g = 0; g < groups; g++) {
      const float a = value_at(s->scale, s->scale_bf16, z_at + g);
      const int end = (g + 1) * s->group;
      int d = g * s->group;
#if defined(__AVX512F__)
      const __m512 scaled = _mm512_mul_ps(values, _mm512_set1_ps(a));
      for (; d % 8 == 0 && d + 16 <= end; d += 16) {
        const __m512i codes = codebook_16(codebook_word(c, d, bits, row_bytes), bits);
        _mm512_storeu_ps(out + d, _mm512_permutexvar_ps(codes, scaled));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 lo = _mm256_mul_ps(values_lo, _mm256_set1_ps(a));
      const __m256 hi = _mm256_mul_ps(values_hi, _mm256_set1_ps(a));
      for (; d % 8 == 0 && d + 8 <= end; d += 8)
        _mm256_storeu_ps(out + d,
                         codebook_8((uint32_t)codebook_word(c, d, bits, row_bytes), bits, lo, hi));
#endif
      for (; d < end; d++) {
        const int bit = d * bits, first = bit >> 3, shift = bit & 7;
        int word = c[first];
        if (shift + bits > 8) word |= c[first + 1] << 8;
        out[d] = table[(word >> shift) & mask] * a;
      }
    }
  }
}

static void codebook_rows(const Store *s, int64_t block, int h, int64_t slot, int count, int D,
                          float *restrict tile) {
  switch (s->bits) { /* each width its own loop, its shifts and masks constants */
    case 1: codebook_rows_of(s, block, h, slot, count, D, tile, 1); break;
    case 2: codebook_rows_of(s, block, h, slot, count, D, tile, 2); break;
    case 3: codebook_rows_of(s, block, h, slot, count, D, tile, 3); break;
    default: codebook_rows_of(s, block, h, slot, count, D, tile, 4); break;
  }
}

static void load_rows(const Store *s, int64_t block, int h, int64_t slot, int count, int D,
                      float *restrict tile, const float **rows, int raw) {
  const int64_t at = block * s->s_block + h * s->s_head + slot * s->s_slot;
  if (s->format == FMT_F32) {
    for (int i = 0; i < count; i++) rows[i] = (const float *)s->data + at + i * s->s_slot;
    return;
  }
  if (raw && s->format == FMT_BF16) {
    for (int i = 0; i < count; i++)
      rows[i] = (const float *)((const uint16_t *)s->data + at + i * s->s_slot);
    return;
  }
  for (int i = 0; i < count; i++) rows[i] = tile + i * D;
  if (s->format == FMT_BF16) { /* a bf16 value is the top half of its fp32 */
    for (int i = 0; i < count; i++) {
      const uint16_t *p = (const uint16_t *)s->data + at + i * s->s_slot;
      float *out = tile + i * D;
      int d = 0;
#if defined(__AVX512F__)
      for (; d + 16 <= D; d += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + d)));
        _mm512_storeu_ps(out + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
      }
#elif defined(__AVX2__)
      for (; d + 8 <= D; d += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + d)));
        _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
      }
#endif
      for (; d < D; d++) out[d] = bf16_value(p[d]);
    }
    return;
  }
  if (s->format == FMT_FP8) { /* one byte a channel, a scale per token and group of channels;
                                `bits`: the format's exponent bits (4: e4m3, 5: e5m2) where
                                F16C converts, else through its 256-entry table (`zero`) */
    const float *table = (const float *)s->zero;
    const int groups = D / s->group;
    for (int i = 0; i < count; i++) {
      const uint8_t *c = (const uint8_t *)s->data + at + i * s->s_slot;
      const int64_t z_at = block * s->z_block + h * s->z_head + (slot + i) * s->z_row;
      float *out = tile + i * D;
      for (int g = 0; g < groups; g++) {
        const float a = value_at(s->scale, s->scale_bf16, z_at + g);
        int d = g * s->group;
#if defined(__AVX2__) && defined(__F16C__)
        if (s->bits == 4 || s->bits == 5)
          d = fp8_bytes_8(c, d, (g + 1) * s->group, s->bits, a, out);
#endif
        for (; d < (g + 1) * s->group; d++) out[d] = table[c[d]] * a;
      }
    }
    return;
  }
  if (s->format == FMT_FP4) { /* e2m1 codes two a byte (even channel low), a scale byte per
                                token and group; `zero`: the 16 code values, then the scale
                                byte's 256 values */
    const float *values = (const float *)s->zero, *scales = values + 16;
    const int groups = D / s->group, half = s->group / 2;
    for (int i = 0; i < count; i++) {
      const uint8_t *c = (const uint8_t *)s->data + at + i * s->s_slot;
      const uint8_t *sb = (const uint8_t *)s->scale + block * s->z_block + h * s->z_head +
                          (slot + i) * s->z_row;
      float *out = tile + i * D;
      for (int g = 0; g < groups; g++) {
        const float a = scales[sb[g]];
        int j = g * half;
#if defined(__AVX2__) && defined(__FMA__)
        j = fp4_bytes_8(values, c, j, (g + 1) * half, a, out);
#endif
        for (; j < (g + 1) * half; j++) {
          out[2 * j] = values[c[j] & 15] * a;
          out[2 * j + 1] = values[c[j] >> 4] * a;
        }
      }
    }
    return;
  }
  if (s->format == FMT_CODEBOOK) {
    codebook_rows(s, block, h, slot, count, D, tile);
    return;
  }
  const int bits = s->bits, W = D * bits / 32;
#if defined(__AVX2__) && defined(__FMA__)
  const int eights = codes_in_eights(s, D);
  const __m256i mask8 = _mm256_set1_epi32((1 << bits) - 1);
#endif
  if (s->format == FMT_CHANNEL_CODES) { /* one scale row for the whole run */
    float sc[MAX_D], ze[MAX_D];
    const int64_t z_at = block * s->z_block + h * s->z_head + (slot / s->group) * s->z_row;
    for (int d = 0; d < D; d++) {
      sc[d] = value_at(s->scale, s->scale_bf16, z_at + d);
      ze[d] = value_at(s->zero, s->scale_bf16, z_at + d);
    }
    for (int i = 0; i < count; i++) {
      const uint32_t *w = (const uint32_t *)s->data + at + i * s->s_slot;
      float *out = tile + i * D;
#if defined(__AVX2__) && defined(__FMA__)
      if (eights) {
        for (int c = 0; c < D; c += 8)
          _mm256_storeu_ps(out + c, _mm256_fmadd_ps(codes_8(w, W, bits, mask8, c),
                                                    _mm256_loadu_ps(sc + c),
                                                    _mm256_loadu_ps(ze + c)));
        continue;
      }
#endif
      codes_scalar(w, W, bits, sc, ze, out);
    }
    return;
  }
  const int groups = D / s->group;
#if defined(__AVX2__) && defined(__FMA__)
  if (eights && s->group % 8 == 0) { /* eight channels share a group's scale and zero */
    for (int i = 0; i < count; i++) {
      const uint32_t *w = (const uint32_t *)s->data + at + i * s->s_slot;
      const int64_t z_at = block * s->z_block + h * s->z_head + (slot + i) * s->z_row;
      float *out = tile + i * D;
      for (int g = 0; g < groups; g++) {
        const __m256 a = _mm256_set1_ps(value_at(s->scale, s->scale_bf16, z_at + g));
        const __m256 z = _mm256_set1_ps(value_at(s->zero, s->scale_bf16, z_at + g));
        for (int c = g * s->group; c < (g + 1) * s->group; c += 8)
          _mm256_storeu_ps(out + c, _mm256_fmadd_ps(codes_8(w, W, bits, mask8, c), a, z));
      }
    }
    return;
  }
#endif
  for (int i = 0; i < count; i++) {
    const uint32_t *w = (const uint32_t *)s->data + at + i * s->s_slot;
    const int64_t z_at = block * s->z_block + h * s->z_head + (slot + i) * s->z_row;
    float sc[MAX_D], ze[MAX_D];
    for (int g = 0; g < groups; g++) {
      const float a = value_at(s->scale, s->scale_bf16, z_at + g);
      const float z = value_at(s->zero, s->scale_bf16, z_at + g);
      for (int d = 0; d < s->group; d++) sc[g * s->group + d] = a, ze[g * s->group + d] = z;
    }
    float *out = tile + i * D;
    codes_scalar(w, W, bits, sc, ze, out);
  }
}

/* Whether every logical token of the job is a block of its own (a table of single slots,
 * as a top-k of pooled entries per head, Segment.per_head): then next_run's runs are one
 * token long, and the row walks below take a row per table entry instead of paying a
 * run's setup for each token (scripts/bench_attention_builds.py --cases topk measures it). */
static inline int single_slots(const Job *job) {
  return job->block_size == 1 && job->ring == 0 && job->k.format != FMT_CHANNEL_CODES &&
         job->v.format != FMT_CHANNEL_CODES;
}

/* Rows of logical tokens t.. (< end) into rows[0..], across runs and blocks, up to TILE
 * (decoded ones into tile); returns how many. */
static int fill_rows(const Job *job, const Store *s, int b, int h, int64_t t, int64_t end,
                     float *restrict tile, const float **rows, int raw) {
  int filled = 0;
  int64_t block, slot;
  if (single_slots(job)) { /* one table lookup a row */
    const int64_t *table = job->table + b * job->table_stride;
    const int n = end - t < TILE ? (int)(end - t) : TILE;
    for (int i = 0; i < n; i++)
      load_rows(s, table[t + i], h, 0, 1, job->D, tile + i * job->D, rows + i, raw);
    return n;
  }
  while (filled < TILE && t < end) {
    int run = next_run(job, b, t, end, &block, &slot);
    if (run > TILE - filled) run = TILE - filled;
    load_rows(s, block, h, slot, run, job->D, tile + filled * job->D, rows + filled, raw);
    filled += run;
    t += run;
  }
  return filled;
}

/* Bytes from `p` on, a cache line at a time, into L2 (locality 2: prefetcht1), not L1: an
 * L1 prefetch holds one of the core's few L1 miss buffers until its line arrives, so a
 * chunk's burst of them stalls the loads behind it (a profile shows the prefetch
 * instructions themselves taking the samples). */
static inline void prefetch_bytes(const char *p, int64_t bytes) {
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(p + byte, 0, 2);
}

/* Ask for the rows of logical tokens t.. (< end) of a store, with their scales, ahead of
 * their use: the K pass prefetches its chunk's value rows and its next run of keys, so the
 * V pass and the next run find them in cache instead of waiting on memory (the codes
 * paths are compute-heavy enough that the hardware prefetcher alone falls behind). */
void kvlab_prefetch_rows(const Job *job, const Store *s, int b, int h, int64_t t,
                         int64_t end) {
  const int D = job->D;
  const int codes = s->format == FMT_TOKEN_CODES || s->format == FMT_CHANNEL_CODES;
  const int64_t element = s->format == FMT_BF16 ? 2 : (s->format >= FMT_FP8 ? 1 : 4);
  const int64_t row = codes ? D * s->bits / 32
                            : (s->format == FMT_FP4 ? D / 2
                                                    : (s->format == FMT_CODEBOOK ? D * s->bits / 8
                                                                                 : D));
  const int64_t scale_element = s->format == FMT_FP4 ? 1 : (s->scale_bf16 ? 2 : 4);
  int64_t block, slot;
  if (single_slots(job) && s->scale == NULL) {
    const int64_t *table = job->table + b * job->table_stride;
    for (; t < end; t++)
      prefetch_bytes((const char *)s->data + (table[t] * s->s_block + h * s->s_head) * element,
                     row * element);
    return;
  }
  while (t < end) {
    const int run = next_run(job, b, t, end, &block, &slot);
    const int64_t at = block * s->s_block + h * s->s_head + slot * s->s_slot;
    const char *p = (const char *)s->data + at * element;
    if (s->s_slot == row) {
      prefetch_bytes(p, run * row * element);
    } else {
      for (int i = 0; i < run; i++) prefetch_bytes(p + i * s->s_slot * element, row * element);
    }
    if (s->scale != NULL) { /* token rows: their scales (and zeros); channel codes: the row */
      const int channel = s->format == FMT_CHANNEL_CODES;
      const int64_t z_at = block * s->z_block + h * s->z_head +
                           (channel ? slot / s->group : slot) * s->z_row;
      const int64_t bytes = (channel ? D : run * s->z_row) * scale_element;
      prefetch_bytes((const char *)s->scale + z_at * scale_element, bytes);
      if (codes) prefetch_bytes((const char *)s->zero + z_at * scale_element, bytes);
    }
    t += run;
  }
}

#if defined(__AVX512F__)
/* Where the AVX-512 row walks hold every accumulator in registers: keys four rows at a time
 * for up to 4 query heads (key_scores_4), values row by row at D = 64 for up to 4 heads or
 * D = 128 for up to 3 (add_values_rows). bf16_in_place reads bf16 rows in place only there. */
static inline int keys_in_registers(int G, int D) { return D % 16 == 0 && G <= 4; }
static inline int values_in_registers(int G, int D) {
  return (D == 64 && G <= 4) || (D == 128 && G <= 3);
}

/* key_scores for four rows at a time and a compile-time G (inlined per G): each row's
 * 16-channel slices loaded once for all G query heads, 4 * G chains in registers.
 * Returns the rows done. */
static inline __attribute__((always_inline)) int key_scores_4(
    const float *q, const float **rows, int n, const int G, int D, float scale,
    float *scores, int stride, const int BF16) {
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    __m512 a[4][4];
    for (int g = 0; g < G; g++)
      for (int r = 0; r < 4; r++) a[g][r] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16)
      for (int r = 0; r < 4; r++) {
        const __m512 k = BF16 ? vload_bf16((const uint16_t *)rows[i + r] + d)
                              : _mm512_loadu_ps(rows[i + r] + d);
        for (int g = 0; g < G; g++)
          a[g][r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), k, a[g][r]);
      }
    for (int g = 0; g < G; g++)
      _mm_storeu_ps(scores + g * stride + i,
                    _mm_mul_ps(vsum4(a[g][0], a[g][1], a[g][2], a[g][3]), _mm_set1_ps(scale)));
  }
  return i;
}
#endif

#if defined(KVLAB_BF16_DOT)
/* key_scores_4 for bf16 rows of 64 channels and a query whose values are bf16 (a bf16
 * model's, widened), by vdpbf16ps: 32 products an instruction, 2 a (row, query head)
 * against 4 FMAs after 4 widenings. The product of two bf16 values is exact in fp32, so
 * the scores are fp32 sums of the same products as key_scores_4's, in another order
 * (values below 2^-126 flushed, as vdpbf16ps does). Returns the rows done. */
static inline __attribute__((always_inline)) int key_scores_dot(const float *q,
                                                                const float **rows, int n,
                                                                const int G, float scale,
                                                                float *scores, int stride) {
  __m512bh qs[4][2];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < 2; c++)
      qs[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * 64 + c * 32 + 16),
                                     _mm512_loadu_ps(q + g * 64 + c * 32));
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    __m512 a[4][4];
    for (int g = 0; g < G; g++)
      for (int r = 0; r < 4; r++) a[g][r] = _mm512_setzero_ps();
    for (int c = 0; c < 2; c++)
      for (int r = 0; r < 4; r++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512((const uint16_t *)rows[i + r] + c * 32);
        for (int g = 0; g < G; g++) a[g][r] = _mm512_dpbf16_ps(a[g][r], qs[g][c], k);
      }
    for (int g = 0; g < G; g++)
      _mm_storeu_ps(scores + g * stride + i,
                    _mm_mul_ps(vsum4(a[g][0], a[g][1], a[g][2], a[g][3]), _mm_set1_ps(scale)));
  }
  return i;
}
#endif

/* Whether key_scores takes bf16 keys of D channels against a bf16 query by vdpbf16ps
 * (any query group: four heads at a time), reading the rows in place. */
static inline int bf16_dot_keys(int D) {
#if defined(KVLAB_BF16_DOT)
  return D == 64;
#else
  (void)D;
  return 0;
#endif
}

/* Whether n fp32 values are all bf16 values (their low 16 bits zero); one pass without an
 * early exit, which the compiler vectorizes (a bf16 query, the case it is asked for, is
 * read whole either way). */
static int bf16_exact(const float *x, int n) {
  uint32_t low = 0;
  for (int i = 0; i < n; i++) {
    uint32_t bits;
    memcpy(&bits, x + i, sizeof(bits));
    low |= bits & 0xFFFFu;
  }
  return low == 0;
}

#define KEY_SCORES_4(BF16)                                                            \
  switch (G) {                                                                        \
    case 1: i = key_scores_4(q, rows, n, 1, D, scale, scores, stride, BF16); break;  \
    case 2: i = key_scores_4(q, rows, n, 2, D, scale, scores, stride, BF16); break;  \
    case 3: i = key_scores_4(q, rows, n, 3, D, scale, scores, stride, BF16); break;  \
    default: i = key_scores_4(q, rows, n, 4, D, scale, scores, stride, BF16); break; \
  }

#define KEY_SCORES_DOT(Q, SCORES, GROUP)                                               \
  switch (GROUP) {                                                                       \
    case 1: i = key_scores_dot(Q, rows, n, 1, scale, SCORES, stride); break;             \
    case 2: i = key_scores_dot(Q, rows, n, 2, scale, SCORES, stride); break;             \
    case 3: i = key_scores_dot(Q, rows, n, 3, scale, SCORES, stride); break;             \
    default: i = key_scores_dot(Q, rows, n, 4, scale, SCORES, stride); break;            \
  }

/* scores[g][i] = scale * q_g . rows[i] for a run of n rows (bf16: rows in place as bf16,
 * where bf16_in_place admits them or, with q_bf16, a query of bf16 values meets them by
 * vdpbf16ps). */
static void key_scores(const float *q, const float **rows, int n, int G, int D, float scale,
                       float *scores, int stride, int bf16, int q_bf16) {
  int i = 0;
#if defined(KVLAB_BF16_DOT)
  if (bf16 && q_bf16 && D == 64 && G <= 4) {
    KEY_SCORES_DOT(q, scores, G)
  } else if (bf16 && q_bf16 && D == 64) { /* wider groups (MQA): four query heads at a time,
                                              the rows in L1 */
    for (int g0 = 0; g0 < G; g0 += 4) KEY_SCORES_DOT(q + g0 * 64, scores + g0 * stride, G - g0)
  } else
#else
  (void)q_bf16;
#endif
#if defined(__AVX512F__)
  if (keys_in_registers(G, D)) {
    if (bf16) {
      KEY_SCORES_4(1)
    } else {
      KEY_SCORES_4(0)
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0 && !bf16) {
    for (; i + 8 <= n; i += 8) { /* 8 tokens at once: independent FMA chains, one reduction */
      for (int g = 0; g < G; g++) {
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + g * D + d);
          for (int r = 0; r < 8; r++)
            a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[i + r] + d), a[r]);
        }
        const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
        const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
        const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);
        const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                                          _mm256_permute2f128_ps(s03, s47, 0x31));
        _mm256_storeu_ps(scores + g * stride + i, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
      }
    }
  }
#endif
  for (; i < n; i++)
    for (int g = 0; g < G; g++) {
      float acc = 0.f;
      for (int d = 0; d < D; d++)
        acc += q[g * D + d] * (bf16 ? bf16_value(((const uint16_t *)rows[i])[d]) : rows[i][d]);
      scores[g * stride + i] = acc * scale;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* add_values for 16 channels at a time and a compile-time G (inlined per G): 2 * G
 * independent FMA chains held in registers. */
static inline __attribute__((always_inline)) void add_values_16(
    const float *weights, int stride, const float **rows, int n, const int G, int D,
    float *out) {
  for (int d = 0; d < D; d += 16) {
    __m256 lo[4], hi[4];
    for (int g = 0; g < G; g++) {
      lo[g] = _mm256_loadu_ps(out + g * D + d);
      hi[g] = _mm256_loadu_ps(out + g * D + d + 8);
    }
    for (int i = 0; i < n; i++) {
      const __m256 v0 = _mm256_loadu_ps(rows[i] + d), v1 = _mm256_loadu_ps(rows[i] + d + 8);
      for (int g = 0; g < G; g++) {
        const __m256 w = _mm256_set1_ps(weights[g * stride + i]);
        lo[g] = _mm256_fmadd_ps(w, v0, lo[g]);
        hi[g] = _mm256_fmadd_ps(w, v1, hi[g]);
      }
    }
    for (int g = 0; g < G; g++) {
      _mm256_storeu_ps(out + g * D + d, lo[g]);
      _mm256_storeu_ps(out + g * D + d + 8, hi[g]);
    }
  }
}
#endif

#if defined(__AVX512F__)
/* add_values row by row for a compile-time G and C = D / 16: all G * C accumulators in
 * registers, so each row is read once, whole and in order (sweeping the rows once per
 * 16 channels read every row four times at D = 64, in a stride the prefetcher follows
 * badly: half the bandwidth from memory). */
static inline __attribute__((always_inline)) void add_values_rows(
    const float *weights, int stride, const float **rows, int n, const int G, const int C,
    float *out, const int BF16) {
  __m512 acc[4][8];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < C; c++) acc[g][c] = _mm512_loadu_ps(out + (g * C + c) * 16);
  for (int i = 0; i < n; i++)
    for (int c = 0; c < C; c++) {
      const __m512 v = BF16 ? vload_bf16((const uint16_t *)rows[i] + c * 16)
                            : _mm512_loadu_ps(rows[i] + c * 16);
      for (int g = 0; g < G; g++)
        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[g * stride + i]), v, acc[g][c]);
    }
  for (int g = 0; g < G; g++)
    for (int c = 0; c < C; c++) _mm512_storeu_ps(out + (g * C + c) * 16, acc[g][c]);
}
#endif

#define VALUE_ROWS(GG, CC)                                           \
  if (G == GG && D == 16 * CC) {                                     \
    if (bf16) add_values_rows(weights, stride, rows, n, GG, CC, out, 1); \
    else add_values_rows(weights, stride, rows, n, GG, CC, out, 0);      \
    return;                                                          \
  }

/* out[g] += sum_i weights[g][i] * rows[i] for a run of n rows (bf16: rows in place as bf16,
 * where bf16_in_place admits them). */
static void add_values(const float *weights, int stride, const float **rows, int n, int G,
                       int D, float *out, int bf16) {
#if defined(__AVX512F__)
  if (values_in_registers(G, D)) {
    VALUE_ROWS(1, 4) VALUE_ROWS(2, 4) VALUE_ROWS(3, 4) VALUE_ROWS(4, 4)
    VALUE_ROWS(1, 8) VALUE_ROWS(2, 8) VALUE_ROWS(3, 8)
  }
#else
  (void)bf16; /* bf16_in_place admits bf16 rows only where the AVX-512 walks above take them */
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 16 == 0 && G <= 4) { /* a constant G keeps the accumulators in registers */
    switch (G) {
      case 1: add_values_16(weights, stride, rows, n, 1, D, out); return;
      case 2: add_values_16(weights, stride, rows, n, 2, D, out); return;
      case 3: add_values_16(weights, stride, rows, n, 3, D, out); return;
      default: add_values_16(weights, stride, rows, n, 4, D, out); return;
    }
  }
  if (D % 8 == 0) { /* query heads 8 at a time (MQA groups are larger than 8) */
    for (int g0 = 0; g0 < G; g0 += 8) {
      const int gn = G - g0 < 8 ? G - g0 : 8;
      const float *w = weights + g0 * stride;
      float *o = out + g0 * D;
      for (int d = 0; d < D; d += 8) {
        __m256 acc[8];
        for (int g = 0; g < gn; g++) acc[g] = _mm256_loadu_ps(o + g * D + d);
        for (int i = 0; i < n; i++) {
          const __m256 v = _mm256_loadu_ps(rows[i] + d);
          for (int g = 0; g < gn; g++)
            acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(w[g * stride + i]), v, acc[g]);
        }
        for (int g = 0; g < gn; g++) _mm256_storeu_ps(o + g * D + d, acc[g]);
      }
    }
    return;
  }
#endif
  for (int i = 0; i < n; i++)
    for (int g = 0; g < G; g++) {
      const float w = weights[g * stride + i];
      for (int d = 0; d < D; d++) out[g * D + d] += w * rows[i][d];
    }
}

/* Whether a store's bf16 rows are read in place and widened in registers rather than
 * widened into an fp32 tile first (a store and a load a row saved): on AVX-512, where the
 * row walks keep their accumulators in registers. The same products in the same order. */
static int bf16_in_place(const Store *s, int G, int D, int values) {
#if defined(__AVX512F__)
  if (s->format != FMT_BF16) return 0;
  return values ? values_in_registers(G, D) : keys_in_registers(G, D);
#else
  (void)s, (void)G, (void)D, (void)values;
  return 0;
#endif
}

/* A chunk's scores of one query head become their softmax weights exp(s - max): sets *top
 * to the max and *sum to the weights' sum. */
static void softmax_weights(float *s, int n, float *top, float *sum) {
  float most = EMPTY, total = 0.f;
  for (int i = 0; i < n; i++) most = s[i] > most ? s[i] : most;
  int i = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(most);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 w = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
    _mm512_storeu_ps(s + i, w);
    acc = _mm512_add_ps(acc, w);
  }
  if (i < n) {
    const __mmask16 rest = (__mmask16)((1u << (n - i)) - 1u);
    const __m512 w = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, s + i), shift));
    _mm512_mask_storeu_ps(s + i, rest, w);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(rest, w));
    i = n;
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; i++) total += (s[i] = expf(s[i] - most));
  *top = most, *sum = total;
}

/* One chunk of one (row, KV head): partial max, sum of exponentials and weighted values of
 * the G query heads of the group. */
static void attend_chunk(const Job *job, int b, int h, int c) {
  const int G = job->G, D = job->D;
  const int64_t P = job->partial_total, p = job->partial_offset + c;
  float *m = job->m + ((int64_t)(b * job->H + h) * P + p) * G;
  float *l = job->l + ((int64_t)(b * job->H + h) * P + p) * G;
  float *o = job->o + (((int64_t)(b * job->H + h) * P + p) * G) * D;
  const int64_t t0 = job->lo[b] + (int64_t)c * job->chunk;
  int64_t t1 = t0 + job->chunk;
  if (t1 > job->hi[b]) t1 = job->hi[b];
  for (int g = 0; g < G; g++) m[g] = EMPTY, l[g] = 0.f;
  memset(o, 0, sizeof(float) * G * D);
  if (t0 >= t1) return;
  const int n = (int)(t1 - t0);
  const float *q = job->q + (int64_t)(b * job->H + h) * G * D;
  float scores[G * n];
  float tile[TILE * D];
  const float *rows[TILE];
  /* bf16 keys against a bf16 model's query: by vdpbf16ps where key_scores has it */
  const int q_bf16 = job->k.format == FMT_BF16 && bf16_dot_keys(D) && bf16_exact(q, G * D);
  const int raw_keys = bf16_in_place(&job->k, G, D, 0) || q_bf16;
  const int raw_values = bf16_in_place(&job->v, G, D, 1);
  if (kvlab_codes_keys_apply(job)) {
    kvlab_codes_key_scores(job, b, h, t0, t1, q, scores, n);
  } else {
    for (int64_t t = t0; t < t1;) {
      const int run = fill_rows(job, &job->k, b, h, t, t1, tile, rows, raw_keys);
      /* prefetches spread between eight rows' scores at a time: one burst per run stalls
         the scores behind it */
      for (int j = 0; j < run; j += 8) {
        const int m = run - j < 8 ? run - j : 8;
        const int64_t ahead = t + run + j, ahead_end = ahead + m < t1 ? ahead + m : t1;
        kvlab_prefetch_rows(job, &job->v, b, h, t + j, t + j + m);
        if (ahead < t1) kvlab_prefetch_rows(job, &job->k, b, h, ahead, ahead_end);
        key_scores(q, rows + j, m, G, D, job->scale, scores + (t - t0) + j, n, raw_keys,
                   q_bf16);
      }
      t += run;
    }
  }
  for (int g = 0; g < G; g++) softmax_weights(scores + g * n, n, m + g, l + g);
  if (kvlab_codes_values_apply(job)) {
    kvlab_codes_add_values(job, b, h, t0, t1, scores, n, o);
    return;
  }
  for (int64_t t = t0; t < t1;) {
    const int run = fill_rows(job, &job->v, b, h, t, t1, tile, rows, raw_values);
    add_values(scores + (t - t0), n, rows, run, G, D, o, raw_values);
    t += run;
  }
}

/* Merge P partials of (row, KV head) r per query head into its attention output (G, D),
 * fp32 or bf16 (out_bf16); a row with nothing visible gets zeros. `sinks` (B, H, G), where
 * not NULL: one more logit per query head in the softmax, of value 0 (learned attention
 * sinks, sinks.py). */
static void combine_row(const float *m, const float *l, const float *o, int64_t r, int64_t P,
                        int64_t G, int64_t D, void *out, int out_bf16, const float *sinks) {
  for (int64_t g = 0; g < G; g++) {
    float top = EMPTY, den = 0.f, acc[MAX_D];
    for (int64_t p = 0; p < P; p++) {
      const float mp = m[(r * P + p) * G + g];
      top = mp > top ? mp : top;
    }
    if (sinks) {
      const float sink = sinks[r * G + g];
      top = sink > top ? sink : top;
      den = expf(sink - top);
    }
    for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
    if (top > 0.5f * EMPTY) {
      for (int64_t p = 0; p < P; p++) {
        const float mp = m[(r * P + p) * G + g];
        const float w = expf(mp - top);
        den += w * l[(r * P + p) * G + g];
        const float *op = o + ((r * P + p) * G + g) * D;
        for (int64_t d = 0; d < D; d++) acc[d] += w * op[d];
      }
      for (int64_t d = 0; d < D; d++) acc[d] /= den;
    }
    const int64_t at = (r * G + g) * D;
    if (out_bf16) {
      uint16_t *dst = (uint16_t *)out + at;
      for (int64_t d = 0; d < D; d++) {
        uint32_t bits;
        memcpy(&bits, &acc[d], sizeof(bits));
        bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
        dst[d] = (uint16_t)(bits >> 16);
      }
    } else {
      memcpy((float *)out + at, acc, sizeof(float) * D);
    }
  }
}

/* Every job's partials (each job's m, l, o point at its slice of shared buffers with
 * partial_total slots per (row, head)), then their merge into `out`, in one parallel
 * region: the chunks of all jobs are one pool of work (a pooling layer's per-head jobs
 * have a few chunks each, too few to share two threads job by job), then the rows. */
static void decode_attention(const Job *jobs, int n_jobs, void *out, int out_bf16,
                             const float *sinks) {
  int64_t starts[n_jobs + 1]; /* job j's chunks are items starts[j] .. starts[j + 1] - 1 */
  starts[0] = 0;
  for (int j = 0; j < n_jobs; j++)
    starts[j + 1] = starts[j] + (int64_t)jobs[j].B * jobs[j].H * jobs[j].n_chunks;
  const Job *first = &jobs[0];
  const int64_t BH = (int64_t)first->B * first->H, total = starts[n_jobs];
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < total; i++) {
      int j = 0;
      while (i >= starts[j + 1]) j++;
      const Job *job = &jobs[j];
      const int64_t at = i - starts[j], C = job->n_chunks;
      attend_chunk(job, (int)(at / C / job->H), (int)(at / C % job->H), (int)(at % C));
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < BH; r++)
      combine_row(first->m, first->l, first->o, r, first->partial_total, first->G, first->D,
                  out, out_bf16, sinks);
  }
}

void kvlab_decode_attention(const Job *jobs, int n_jobs, void *out, int out_bf16,
                            const float *sinks) {
  TIMED(TIMER_ATTENTION, decode_attention(jobs, n_jobs, out, out_bf16, sinks));
}

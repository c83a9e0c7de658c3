/* Quantization codes in one call per tensor: per-token codes (kvlab.cache.codec.TokenCodes
 * on the CPU: each row of D values gets a scale and zero per `group` channels) and
 * per-channel codes over groups of tokens (ChannelCodes, KIVI's keys), asymmetric min/max
 * over `bits`, packed planar into uint32 words (word j holds channels j, j + W, ... at bit
 * offsets 0, bits, ...); fp8 and fp4 bytes. Arithmetic is the torch path's, in fp32, and
 * this file is compiled without fast-math so the codes are bit-identical to it (round
 * half to even, true division). Replaces ~20-40 small torch ops per write.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float load_value(const void *p, int bf16, int64_t i) {
  if (!bf16) return ((const float *)p)[i];
  uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
  float out;
  memcpy(&out, &bits, sizeof(out));
  return out;
}

static inline void store_value(void *p, int bf16, int64_t i, float value) {
  if (!bf16) {
    ((float *)p)[i] = value;
    return;
  }
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) { /* NaN stays a quiet NaN */
    ((uint16_t *)p)[i] = (uint16_t)((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
  ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

/* Row x[at .. at + D) in token codes: its W = D * bits / 32 words at `words`, its scale
 * and zero per `group` channels at scale_at .. + D / group of scale and zero. */
static void token_row(const void *x, int x_bf16, int64_t at, int64_t D, int64_t group,
                      int bits, uint32_t *words, void *scale, void *zero, int64_t scale_at,
                      int scale_bf16) {
  const int64_t W = D * bits / 32, groups = D / group;
  const float levels = (float)((1 << bits) - 1);
  uint8_t codes[1024]; /* D <= 1024: codes.py (MAX_DIM) takes the torch path above it */
  for (int64_t g = 0; g < groups; g++) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t c = g * group; c < (g + 1) * group; c++) {
      const float v = load_value(x, x_bf16, at + c);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    const float step = (hi - lo) / levels;
    const float safe = step > 0.f ? step : 1.f;
    for (int64_t c = g * group; c < (g + 1) * group; c++) {
      float q = nearbyintf((load_value(x, x_bf16, at + c) - lo) / safe);
      q = q < 0.f ? 0.f : (q > levels ? levels : q);
      codes[c] = (uint8_t)q;
    }
    store_value(scale, scale_bf16, scale_at + g, step);
    store_value(zero, scale_bf16, scale_at + g, lo);
  }
  for (int64_t j = 0; j < W; j++) {
    uint32_t word = 0;
    for (int k = 0; k < 32 / bits; k++) word |= (uint32_t)codes[k * W + j] << (k * bits);
    words[j] = word;
  }
}

/* The `group` rows of x at element offsets rows_at[i] in channel codes: a scale and zero
 * per channel (D of each at scale_at of scale and zero) over the rows, row i's W words at
 * words + i * W. */
static void channel_group(const void *x, int x_bf16, const int64_t *rows_at, int64_t group,
                          int64_t D, int bits, uint32_t *words, void *scale, void *zero,
                          int64_t scale_at, int scale_bf16) {
  const int64_t W = D * bits / 32;
  const float levels = (float)((1 << bits) - 1);
  float lo[1024], hi[1024], safe[1024]; /* D <= 1024 (codes.py's MAX_DIM) */
  uint8_t codes[1024];
  for (int64_t c = 0; c < D; c++) lo[c] = INFINITY, hi[c] = -INFINITY;
  for (int64_t i = 0; i < group; i++)
    for (int64_t c = 0; c < D; c++) {
      const float v = load_value(x, x_bf16, rows_at[i] + c);
      lo[c] = v < lo[c] ? v : lo[c];
      hi[c] = v > hi[c] ? v : hi[c];
    }
  for (int64_t c = 0; c < D; c++) {
    const float step = (hi[c] - lo[c]) / levels;
    safe[c] = step > 0.f ? step : 1.f;
    store_value(scale, scale_bf16, scale_at + c, step);
    store_value(zero, scale_bf16, scale_at + c, lo[c]);
  }
  for (int64_t i = 0; i < group; i++) {
    for (int64_t c = 0; c < D; c++) {
      float q = nearbyintf((load_value(x, x_bf16, rows_at[i] + c) - lo[c]) / safe[c]);
      q = q < 0.f ? 0.f : (q > levels ? levels : q);
      codes[c] = (uint8_t)q;
    }
    for (int64_t j = 0; j < W; j++) {
      uint32_t word = 0;
      for (int k = 0; k < 32 / bits; k++) word |= (uint32_t)codes[k * W + j] << (k * bits);
      words[i * W + j] = word;
    }
  }
}

/* x: (n, D) rows with stride x_stride (elements); words: (n, D * bits / 32); scale, zero:
 * (n, D / group) contiguous. */
void kvlab_encode_token_codes(const void *x, int x_bf16, int64_t x_stride, int64_t n,
                              int64_t D, int64_t group, int bits, uint32_t *words,
                              void *scale, void *zero, int scale_bf16) {
  const int64_t W = D * bits / 32, groups = D / group;
#pragma omp parallel for schedule(static) if (n > 64)
  for (int64_t r = 0; r < n; r++)
    token_row(x, x_bf16, r * x_stride, D, group, bits, words + r * W, scale, zero,
              r * groups, scale_bf16);
}

/* Per-channel codes over groups of `group` consecutive tokens (KIVI's keys,
 * kvlab.kernels.codes.int_codes.ChannelCodes on the CPU): x: n_groups * group rows of D values
 * with stride x_stride, a group's rows consecutive; words: a row's D * bits / 32 planar
 * words; scale, zero: (n_groups, D), a row of channels per group. The torch path's
 * arithmetic in fp32, so its codes bit for bit (~40 small torch ops per call before). */
void kvlab_encode_channel_codes(const void *x, int x_bf16, int64_t x_stride, int64_t n_groups,
                                int64_t group, int64_t D, int bits, uint32_t *words,
                                void *scale, void *zero, int scale_bf16) {
  const int64_t W = D * bits / 32;
#pragma omp parallel for schedule(static) if (n_groups * group > 256)
  for (int64_t g = 0; g < n_groups; g++) {
    int64_t rows_at[group];
    for (int64_t i = 0; i < group; i++) rows_at[i] = (g * group + i) * x_stride;
    channel_group(x, x_bf16, rows_at, group, D, bits, words + g * group * W, scale, zero,
                  g * D, scale_bf16);
  }
}

/* A staged store's groups of `group` tokens encoded from its exact rings into its codes,
 * every layer in one call (kvlab.cache.stores.staged: a decode step's commit, KIVI, Liu et
 * al., arXiv 2402.02750), as its torch path gathers and encodes them layer by layer:
 * for layer l, row b, group m and KV head h, ring slots sources[b, m G + i] % ring of the
 * key and value rings go to token slots groups[b, m] G + i of the codes, the keys in
 * channel codes (key_channel; else token codes) and the values in token codes.
 * layers: (L, 8) addresses per layer (key ring, value ring, key words, scale, zero, value
 * words, scale, zero); rings (B, H, ring + 1, D) and scales in one dtype (bf16 or fp32),
 * all layers of one layout. shape: L, B, H, D, M, group, bits, key_channel, bf16, ring and
 * the (b, h, slot) element strides of the rings, the words, the key scales (their slot: a
 * group of tokens where key_channel) and the value scales. Words rows are contiguous. */
void kvlab_encode_ring_groups(const int64_t *layers, const int64_t *shape, const int64_t *groups,
                              const int64_t *sources) {
  const int64_t L = shape[0], B = shape[1], H = shape[2], D = shape[3], M = shape[4];
  const int64_t G = shape[5], ring = shape[9];
  const int bits = (int)shape[6], key_channel = (int)shape[7], bf16 = (int)shape[8];
  const int64_t *rs = shape + 10, *ws = shape + 13, *ks = shape + 16, *vs = shape + 19;
  const int64_t items = L * B * M * H, W = D * bits / 32;
#pragma omp parallel for schedule(static) if (items > 1)
  for (int64_t item = 0; item < items; item++) {
    const int64_t h = item % H, m = item / H % M, b = item / H / M % B, l = item / H / M / B;
    const int64_t *at = layers + l * 8;
    const void *key_ring = (const void *)at[0], *value_ring = (const void *)at[1];
    uint32_t *key_words = (uint32_t *)at[2], *value_words = (uint32_t *)at[5];
    void *key_scale = (void *)at[3], *key_zero = (void *)at[4];
    void *value_scale = (void *)at[6], *value_zero = (void *)at[7];
    const int64_t first = groups[b * M + m] * G; /* the group's first token slot */
    int64_t rows_at[G];
    for (int64_t i = 0; i < G; i++) {
      const int64_t slot = ((sources[b * M * G + m * G + i] % ring) + ring) % ring;
      rows_at[i] = b * rs[0] + h * rs[1] + slot * rs[2];
    }
    const int64_t words_at = b * ws[0] + h * ws[1] + first * ws[2];
    if (key_channel)
      channel_group(key_ring, bf16, rows_at, G, D, bits, key_words + words_at, key_scale,
                    key_zero, b * ks[0] + h * ks[1] + groups[b * M + m] * ks[2], bf16);
    for (int64_t i = 0; i < G; i++) {
      if (!key_channel)
        token_row(key_ring, bf16, rows_at[i], D, G, bits, key_words + words_at + i * W,
                  key_scale, key_zero, b * ks[0] + h * ks[1] + (first + i) * ks[2], bf16);
      token_row(value_ring, bf16, rows_at[i], D, G, bits, value_words + words_at + i * W,
                value_scale, value_zero, b * vs[0] + h * vs[1] + (first + i) * vs[2], bf16);
    }
  }
}

/* The largest |x[at + c]| of `count` consecutive values (a block's maximum). */
static inline float largest_magnitude(const void *x, int x_bf16, int64_t at, int64_t count) {
  float amax = 0.f;
  for (int64_t c = 0; c < count; c++) {
    const float v = fabsf(load_value(x, x_bf16, at + c));
    amax = v > amax ? v : amax;
  }
  return amax;
}

/* fp32 -> an 8-bit float with `mantissa` bits and exponent `bias` (e4m3fn: 3, 7; e5m2: 2,
 * 15), round to nearest even, for |x| within the format's range (the caller clamps): c10's
 * conversion, so the bytes are torch's. Subnormals step by 2^(1 - bias - mantissa). */
static inline uint8_t float_to_fp8(float x, int mantissa, int bias) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  float magnitude;
  memcpy(&magnitude, &bits, sizeof(magnitude));
  uint32_t code;
  if (bits < (uint32_t)(128 - bias) << 23) { /* below the smallest normal, 2^(1 - bias) */
    code = (uint32_t)nearbyintf(ldexpf(magnitude, bias - 1 + mantissa));
  } else {
    const int shift = 23 - mantissa;
    bits += ((uint32_t)(bias - 127) << 23) + ((1u << (shift - 1)) - 1u) + ((bits >> shift) & 1u);
    code = bits >> shift;
  }
  return (uint8_t)(code | (sign >> 24));
}

/* Fp8Codec.encode on the CPU: x (n, D) rows with stride x_stride; for each row and group of
 * `group` channels a scale amax / largest, rounded to the stored dtype (scale: (n, D /
 * group)), and the bytes of x / scale clamped to +-largest (codes: (n, D)). */
void kvlab_encode_fp8(const void *x, int x_bf16, int64_t x_stride, int64_t n, int64_t D,
                      int64_t group, int mantissa, int bias, float largest, uint8_t *codes,
                      void *scale, int scale_bf16) {
  const int64_t groups = D / group;
#pragma omp parallel for schedule(static) if (n > 64)
  for (int64_t r = 0; r < n; r++) {
    for (int64_t g = 0; g < groups; g++) {
      const float amax = largest_magnitude(x, x_bf16, r * x_stride + g * group, group);
      store_value(scale, scale_bf16, r * groups + g, amax / largest);
      const float stored = load_value(scale, scale_bf16, r * groups + g);
      const float safe = stored > 0.f ? stored : 1.f;
      for (int64_t c = g * group; c < (g + 1) * group; c++) {
        float y = load_value(x, x_bf16, r * x_stride + c) / safe;
        y = y < -largest ? -largest : (y > largest ? largest : y);
        codes[r * D + c] = float_to_fp8(y, mantissa, bias);
      }
    }
  }
}

/* Fp4Codec.encode on the CPU: x (n, D) rows with stride x_stride; per block of `group`
 * channels a scale byte (mx: the e8m0 exponent floor(log2 amax) - 2; else NVFP4's e4m3 of
 * amax / 6 / tensor_scale) whose value is scales[byte], and e2m1 codes of x / scale, two a
 * byte with the even channel low (codes: (n, D / 2), scale_codes: (n, D / group)). The
 * nearest e2m1 magnitude, a tie going to the smaller one (torch.bucketize's side). */
void kvlab_encode_fp4(const void *x, int x_bf16, int64_t x_stride, int64_t n, int64_t D,
                      int64_t group, int mx, float tensor_scale, const float *scales,
                      uint8_t *codes, uint8_t *scale_codes) {
  static const float midpoints[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const int64_t groups = D / group;
#pragma omp parallel for schedule(static) if (n > 64)
  for (int64_t r = 0; r < n; r++) {
    uint8_t row[1024]; /* D <= 1024 (codes.py's MAX_DIM) */
    for (int64_t g = 0; g < groups; g++) {
      const float amax = largest_magnitude(x, x_bf16, r * x_stride + g * group, group);
      uint8_t byte;
      if (mx) {
        int exponent;
        frexpf(amax > 0x1p-127f ? amax : 0x1p-127f, &exponent); /* amax = m 2^e, m in [.5, 1) */
        int shared = exponent - 1 - 2;
        shared = shared < -127 ? -127 : (shared > 127 ? 127 : shared);
        byte = (uint8_t)(shared + 127);
      } else {
        float wanted = amax / 6.0f / tensor_scale;
        wanted = wanted > 448.f ? 448.f : wanted;
        byte = float_to_fp8(wanted, 3, 7);
      }
      scale_codes[r * groups + g] = byte;
      const float safe = scales[byte] > 0.f ? scales[byte] : 1.f;
      for (int64_t c = g * group; c < (g + 1) * group; c++) {
        const float y = load_value(x, x_bf16, r * x_stride + c) / safe;
        const float magnitude = fabsf(y) < 6.f ? fabsf(y) : 6.f;
        uint8_t index = 0;
        while (index < 7 && midpoints[index] < magnitude) index++;
        row[c] = (uint8_t)(index + (y < 0.f ? 8 : 0));
      }
    }
    for (int64_t j = 0; j < D / 2; j++)
      codes[r * (D / 2) + j] = (uint8_t)(row[2 * j] | (row[2 * j + 1] << 4));
  }
}

/* CodebookCodec.encode on the CPU: x (n, D) rows with stride x_stride; per group of `group`
 * channels a scale, rounded to the stored dtype (scale: (n, D / group)): the group's norm
 * (`norm`: the root of its sum of squares taken in double, rounded to fp32, then to the
 * stored dtype) or its largest magnitude over `largest` (the table's); then each channel's
 * code, the number of the table's `count` - 1 midpoints below x / scale (torch.bucketize's
 * side), `bits` a channel packed LSB first along the row (codes: (n, D * bits / 8)). */
void kvlab_encode_codebook(const void *x, int x_bf16, int64_t x_stride, int64_t n, int64_t D,
                           int64_t group, int bits, int norm, float largest,
                           const float *midpoints, int count, uint8_t *codes, void *scale,
                           int scale_bf16) {
  const int64_t groups = D / group, width = D * bits / 8;
#pragma omp parallel for schedule(static) if (n > 64)
  for (int64_t r = 0; r < n; r++) {
    uint8_t *row = codes + r * width;
    memset(row, 0, (size_t)width);
    for (int64_t g = 0; g < groups; g++) {
      const int64_t at = r * x_stride + g * group;
      float wanted;
      if (norm) {
        double squares = 0.0;
        for (int64_t c = 0; c < group; c++) {
          const double v = load_value(x, x_bf16, at + c);
          squares += v * v;
        }
        wanted = (float)sqrt(squares);
      } else {
        wanted = largest_magnitude(x, x_bf16, at, group) / largest;
      }
      store_value(scale, scale_bf16, r * groups + g, wanted);
      const float stored = load_value(scale, scale_bf16, r * groups + g);
      const float safe = stored > 0.f ? stored : 1.f;
      for (int64_t c = 0; c < group; c++) {
        const float y = load_value(x, x_bf16, at + c) / safe;
        int code = 0;
        while (code < count - 1 && midpoints[code] < y) code++;
        const int64_t bit = (g * group + c) * bits;
        row[bit >> 3] |= (uint8_t)(code << (bit & 7));
        if ((bit & 7) + bits > 8) row[(bit >> 3) + 1] |= (uint8_t)(code >> (8 - (bit & 7)));
      }
    }
  }
}

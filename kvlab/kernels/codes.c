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

/* x: (n, D) rows with stride x_stride (elements); words: (n, D * bits / 32); scale, zero:
 * (n, D / group) contiguous. */
void kvlab_encode_token_codes(const void *x, int x_bf16, int64_t x_stride, int64_t n,
                              int64_t D, int64_t group, int bits, uint32_t *words,
                              void *scale, void *zero, int scale_bf16) {
  const int64_t W = D * bits / 32, groups = D / group;
  const float levels = (float)((1 << bits) - 1);
#pragma omp parallel for schedule(static) if (n > 64)
  for (int64_t r = 0; r < n; r++) {
    uint8_t codes[1024]; /* D <= 1024: codes.py (MAX_DIM) takes the torch path above it */
    for (int64_t g = 0; g < groups; g++) {
      float lo = INFINITY, hi = -INFINITY;
      for (int64_t c = g * group; c < (g + 1) * group; c++) {
        const float v = load_value(x, x_bf16, r * x_stride + c);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
      }
      const float step = (hi - lo) / levels;
      const float safe = step > 0.f ? step : 1.f;
      for (int64_t c = g * group; c < (g + 1) * group; c++) {
        float q = nearbyintf((load_value(x, x_bf16, r * x_stride + c) - lo) / safe);
        q = q < 0.f ? 0.f : (q > levels ? levels : q);
        codes[c] = (uint8_t)q;
      }
      store_value(scale, scale_bf16, r * groups + g, step);
      store_value(zero, scale_bf16, r * groups + g, lo);
    }
    for (int64_t j = 0; j < W; j++) {
      uint32_t word = 0;
      for (int k = 0; k < 32 / bits; k++) word |= (uint32_t)codes[k * W + j] << (k * bits);
      words[r * W + j] = word;
    }
  }
}

/* Per-channel codes over groups of `group` consecutive tokens (KIVI's keys,
 * kvlab.kernels.int_codes.ChannelCodes on the CPU): x: n_groups * group rows of D values
 * with stride x_stride, a group's rows consecutive; words: a row's D * bits / 32 planar
 * words; scale, zero: (n_groups, D), a row of channels per group. The torch path's
 * arithmetic in fp32, so its codes bit for bit (~40 small torch ops per call before). */
void kvlab_encode_channel_codes(const void *x, int x_bf16, int64_t x_stride, int64_t n_groups,
                                int64_t group, int64_t D, int bits, uint32_t *words,
                                void *scale, void *zero, int scale_bf16) {
  const int64_t W = D * bits / 32;
  const float levels = (float)((1 << bits) - 1);
#pragma omp parallel for schedule(static) if (n_groups * group > 256)
  for (int64_t g = 0; g < n_groups; g++) {
    float lo[1024], hi[1024], safe[1024]; /* D <= 1024 (codes.py's MAX_DIM) */
    uint8_t codes[1024];
    const int64_t first = g * group;
    for (int64_t c = 0; c < D; c++) lo[c] = INFINITY, hi[c] = -INFINITY;
    for (int64_t t = first; t < first + group; t++)
      for (int64_t c = 0; c < D; c++) {
        const float v = load_value(x, x_bf16, t * x_stride + c);
        lo[c] = v < lo[c] ? v : lo[c];
        hi[c] = v > hi[c] ? v : hi[c];
      }
    for (int64_t c = 0; c < D; c++) {
      const float step = (hi[c] - lo[c]) / levels;
      safe[c] = step > 0.f ? step : 1.f;
      store_value(scale, scale_bf16, g * D + c, step);
      store_value(zero, scale_bf16, g * D + c, lo[c]);
    }
    for (int64_t t = first; t < first + group; t++) {
      for (int64_t c = 0; c < D; c++) {
        float q = nearbyintf((load_value(x, x_bf16, t * x_stride + c) - lo[c]) / safe[c]);
        q = q < 0.f ? 0.f : (q > levels ? levels : q);
        codes[c] = (uint8_t)q;
      }
      for (int64_t j = 0; j < W; j++) {
        uint32_t word = 0;
        for (int k = 0; k < 32 / bits; k++) word |= (uint32_t)codes[k * W + j] << (k * bits);
        words[t * W + j] = word;
      }
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

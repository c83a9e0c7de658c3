/* bf16 <-> fp32 for kvlab's C kernels: a bf16 value is the top half of its fp32. */
#ifndef KVLAB_BF16_H
#define KVLAB_BF16_H

#include <stdint.h>
#include <string.h>

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

/* Element i of an fp32 (bf16 = 0) or bf16 (bf16 = 1) array, as fp32. */
static inline float value_at(const void *p, int bf16, int64_t i) {
  return bf16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* out[at] = value, stored as fp32 (bf16 = 0) or rounded to bf16 (bf16 = 1). */
static inline void store(void *out, int bf16, int64_t at, float value) {
  if (bf16)
    ((uint16_t *)out)[at] = to_bf16(value);
  else
    ((float *)out)[at] = value;
}

#endif

/* RMSNorm (Zhang & Sennrich, arXiv 1910.07467) of rows of fp32 or bf16 values in one call,
 * as kvlab's model computes it in torch ops: the root mean square in fp32, the normalised
 * row rounded to the row's dtype, then times the weight in that dtype. A decode step
 * normalises one short row per sequence twice a layer, where the op-by-op version costs
 * about ten dispatches. Built without fast-math (build.py's EXACT): the root mean square is
 * a sum, a division, a square root and a reciprocal rounded as torch rounds them, so the
 * values are the same up to the order of the sum (torch's depends on the CPU's vector
 * width), and bit-identical wherever that sum is exact. */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* x, out: (rows, dim), rows `stride` elements apart in x; weight: (dim,). bf16 = 1: all
 * three bf16, else fp32. */
void kvlab_rms_norm(const void *x, int64_t stride, const void *weight, void *out, int bf16,
                    int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    float squares = 0.f;
    for (int64_t i = 0; i < dim; i++) {
      const float v = value_at(x, bf16, r * stride + i);
      squares += v * v;
    }
    const float inverse = 1.f / sqrtf(squares / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) {
      const float normed = value_at(x, bf16, r * stride + i) * inverse;
      const float rounded = bf16 ? bf16_value(to_bf16(normed)) : normed;  /* x's dtype */
      store(out, bf16, r * dim + i, value_at(weight, bf16, i) * rounded);
    }
  }
}

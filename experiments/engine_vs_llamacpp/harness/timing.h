/* What the harnesses here share: a monotonic clock, uniform random floats and a qsort
 * order for medians. */
#ifndef KVLAB_HARNESS_TIMING_H
#define KVLAB_HARNESS_TIMING_H

#include <stdlib.h>
#include <time.h>

static inline double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Uniform in [-0.5, 0.5]. */
static inline float uniform(void) { return rand() / (float)RAND_MAX - 0.5f; }

/* qsort's order for doubles, ascending. */
static inline int by_value(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#endif

/* The totals behind timers.h: seconds and calls per timer since the last reset. A build
 * without -DKVLAB_TIMERS reads zero calls, which tells a benchmark it was not timed. */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "timers.h"

static double timer_seconds[TIMERS];
static int64_t timer_calls[TIMERS];

#ifdef KVLAB_TIMERS
double kvlab_timer_now(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

void kvlab_timer_add(int which, double seconds) {
  timer_seconds[which] += seconds;
  timer_calls[which] += 1;
}
#endif

void kvlab_timers_reset(void) {
  memset(timer_seconds, 0, sizeof(timer_seconds));
  memset(timer_calls, 0, sizeof(timer_calls));
}

/* seconds[i], calls[i] for each of the TIMERS timers. */
void kvlab_timers_read(double *seconds, int64_t *calls) {
  memcpy(seconds, timer_seconds, sizeof(timer_seconds));
  memcpy(calls, timer_calls, sizeof(timer_calls));
}

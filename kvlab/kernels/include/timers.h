/* Wall time of kernel calls, for benchmarks that split a decode step (scripts/
 * bench_step_builds.py --timers): built in only with -DKVLAB_TIMERS, where TIMED adds two
 * clock reads (~50 ns) a call; otherwise TIMED is the call itself. Totals are per process,
 * read and reset through kvlab_timers_read / kvlab_timers_reset (timers.c); the timed
 * functions are called from one thread at a time, as kvlab calls them, so no atomics. */
#ifndef KVLAB_TIMERS_H
#define KVLAB_TIMERS_H

enum { TIMER_ATTENTION = 0, TIMER_INDEXER = 1, TIMER_LINEARS = 2, TIMER_LAYERS = 3, TIMERS = 4 };

#ifdef KVLAB_TIMERS
double kvlab_timer_now(void);
void kvlab_timer_add(int which, double seconds);
#define TIMED(which, call)                                \
  do {                                                    \
    const double timed_start_ = kvlab_timer_now();        \
    call;                                                 \
    kvlab_timer_add(which, kvlab_timer_now() - timed_start_); \
  } while (0)
#else
#define TIMED(which, call) call
#endif

#endif

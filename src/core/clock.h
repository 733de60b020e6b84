/*
 * core/clock.h — the one monotonic clock: seconds and nanoseconds since an arbitrary start that
 * never goes back (CLOCK_MONOTONIC), for durations and deadlines; and a deadline in that clock for
 * pthread_cond_timedwait on a condition variable set to CLOCK_MONOTONIC.
 */
#ifndef LLMEM_CORE_CLOCK_H
#define LLMEM_CORE_CLOCK_H

#include <stdint.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Monotonic seconds. */
double llmem_clock_s(void);
/* Monotonic nanoseconds. */
uint64_t llmem_clock_ns(void);
/* Now plus `seconds` (≥ 0) on the monotonic clock, as pthread_cond_timedwait takes it. */
struct timespec llmem_clock_deadline(double seconds);

#ifdef __cplusplus
}
#endif

#endif

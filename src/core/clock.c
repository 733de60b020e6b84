/*
 * core/clock.c — the monotonic clock (see core/clock.h).
 */
#include "core/clock.h"

static struct timespec now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts;
}

double llmem_clock_s(void) {
    struct timespec ts = now();
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t llmem_clock_ns(void) {
    struct timespec ts = now();
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

struct timespec llmem_clock_deadline(double seconds) {
    struct timespec ts = now();
    const int64_t ns = (int64_t)(seconds * 1e9);
    ts.tv_sec += (time_t)(ns / 1000000000);
    ts.tv_nsec += (long)(ns % 1000000000);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

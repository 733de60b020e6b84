/*
 * llmem/guard.h — the pressure guard's rules (SPEC §6.4): readings of the machine classified into
 * levels, and when to act on them.
 */
#ifndef LLMEM_GUARD_H
#define LLMEM_GUARD_H

#include <stdint.h>

#include "llmem/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * The pressure guard (SPEC §6.4)
 *
 * warning  — allocator active + cache ≥ 0.97 × the allocation limit, resident memory ≥ the trip,
 *            PSI "some" memory pressure ≥ LLMEM_GUARD_PSI_SOME % (avg10), or a rising `high`
 *            count in the cgroup's memory.events: shrink the session bank to half and release the
 *            allocator's cache;
 * critical — resident memory ≥ 0.95 × the ceiling, PSI "full" ≥ LLMEM_GUARD_PSI_FULL %, or a
 *            rising `max` or `oom` count in memory.events: empty the bank, release the cache, and
 *            admit no new request until it clears.
 * A level acts on its rising edge; while it stays up it acts again every 120 s (re-arm), and an
 * edge within 30 s of the last action of its level is a flap and waits for the re-arm. A warning
 * may wait up to 60 s while a request is mid-step; a critical never waits.
 * ------------------------------------------------------------------------------------------- */

#define LLMEM_GUARD_PSI_SOME 10.0
#define LLMEM_GUARD_PSI_FULL 5.0
#define LLMEM_GUARD_REARM_S  120.0
#define LLMEM_GUARD_FLAP_S   30.0
#define LLMEM_GUARD_DEFER_S  60.0

enum llmem_guard_level { LLMEM_GUARD_CLEAR = 0, LLMEM_GUARD_WARNING, LLMEM_GUARD_CRITICAL };

/* One look at the machine (sizes in bytes; LLMEM_SYS_UNKNOWN / −1 where unknown). */
struct llmem_guard_reading {
    int64_t allocator_bytes; /* active + cache */
    int64_t allocation_limit;
    int64_t resident_bytes;
    int64_t trip_bytes, ceiling_bytes;
    double psi_some, psi_full;                   /* avg10, % */
    int64_t cgroup_high, cgroup_max, cgroup_oom; /* memory.events counters (−1: unknown) */
    /* how much they grew since the previous reading (high; max + oom), from llmem_guard_events */
    int64_t cgroup_high_rise, cgroup_max_rise;
};

/* The level a reading signals, and which signal (a static string) when not clear. */
LLMEM_API enum llmem_guard_level llmem_guard_classify(const struct llmem_guard_reading *r,
                                                      const char **why);

struct llmem_guard {
    enum llmem_guard_level prev; /* the last reading's level */
    double last_action[3];       /* per level: when it last acted (−inf: never) */
    double deferred_since;       /* a warning waiting for the step to end (−1: none) */
    int64_t warnings, criticals, deferred, suppressed; /* actions taken, waits, flaps ignored */
    int64_t cgroup_high, cgroup_max, cgroup_oom;       /* the last counters seen (−1: none) */
};
LLMEM_API void llmem_guard_init(struct llmem_guard *g);
/* Sets r's cgroup rises from its counters and the previous reading's (0 for the first reading,
 * for an unknown counter, and when a counter went down: a new cgroup), and remembers them. */
LLMEM_API void llmem_guard_events(struct llmem_guard *g, struct llmem_guard_reading *r);
/* What to do now (seconds on any monotonic clock) about a reading: LLMEM_GUARD_CLEAR for
 * nothing, else the action's level (counted). */
LLMEM_API enum llmem_guard_level llmem_guard_decide(struct llmem_guard *g,
                                                    const struct llmem_guard_reading *r, double now,
                                                    int mid_step);

#ifdef __cplusplus
}
#endif

#endif

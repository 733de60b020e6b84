/*
 * engine/guard.c — the pressure guard's decisions (see llmem/engine.h): which level a reading
 * signals, and when a level acts — on its rising edge, again after the re-arm time while it stays
 * up, never twice within the flap time, a warning deferred at most the defer time while a request
 * is mid-step, a critical never deferred. Pure: time is an argument, so every rule is tested with
 * made-up clocks.
 */
#include <math.h>

#include "llmem/engine.h"
#include "llmem/sys.h"

/* A critical: resident memory at this share of the ceiling. A warning: the allocator's bytes
 * (active + cache) at this share of its limit. The reasons logged say the same in percent. */
#define RESIDENT_CRITICAL_SHARE 0.95
#define ALLOCATOR_WARNING_SHARE 0.97

enum llmem_guard_level llmem_guard_classify(const struct llmem_guard_reading *r, const char **why) {
    const char *w = NULL;
    enum llmem_guard_level level = LLMEM_GUARD_CLEAR;
    if (r->resident_bytes >= 0 && r->ceiling_bytes > 0 &&
        (double)r->resident_bytes >= RESIDENT_CRITICAL_SHARE * (double)r->ceiling_bytes) {
        level = LLMEM_GUARD_CRITICAL;
        w = "resident memory at 95 % of the ceiling";
    } else if (r->psi_full >= LLMEM_GUARD_PSI_FULL) {
        level = LLMEM_GUARD_CRITICAL;
        w = "memory pressure stalls every task (PSI full)";
    } else if (r->cgroup_max_rise > 0) {
        level = LLMEM_GUARD_CRITICAL;
        w = "the cgroup reached memory.max or invoked the OOM killer (memory.events)";
    } else if (r->allocation_limit > 0 &&
               (double)r->allocator_bytes >=
                   ALLOCATOR_WARNING_SHARE * (double)r->allocation_limit) {
        level = LLMEM_GUARD_WARNING;
        w = "the allocator at 97 % of its limit";
    } else if (r->resident_bytes >= 0 && r->trip_bytes > 0 && r->resident_bytes >= r->trip_bytes) {
        level = LLMEM_GUARD_WARNING;
        w = "resident memory past the trip";
    } else if (r->psi_some >= LLMEM_GUARD_PSI_SOME) {
        level = LLMEM_GUARD_WARNING;
        w = "memory pressure stalls some tasks (PSI some)";
    } else if (r->cgroup_high_rise > 0) {
        level = LLMEM_GUARD_WARNING;
        w = "the cgroup went over memory.high (memory.events)";
    }
    if (why != NULL)
        *why = w;
    return level;
}

void llmem_guard_init(struct llmem_guard *g) {
    *g = (struct llmem_guard){.prev = LLMEM_GUARD_CLEAR,
                              .deferred_since = -1,
                              .cgroup_high = -1,
                              .cgroup_max = -1,
                              .cgroup_oom = -1};
    for (int i = 0; i < 3; i++)
        g->last_action[i] = -INFINITY;
}

/* How much a counter grew; 0 when either reading is unknown or it went down. */
static int64_t rise(int64_t before, int64_t now) {
    return before >= 0 && now > before ? now - before : 0;
}

void llmem_guard_events(struct llmem_guard *g, struct llmem_guard_reading *r) {
    r->cgroup_high_rise = rise(g->cgroup_high, r->cgroup_high);
    r->cgroup_max_rise = rise(g->cgroup_max, r->cgroup_max) + rise(g->cgroup_oom, r->cgroup_oom);
    g->cgroup_high = r->cgroup_high;
    g->cgroup_max = r->cgroup_max;
    g->cgroup_oom = r->cgroup_oom;
}

/* Whether a level that is up now acts: on a rising edge outside the flap time, or while it stays
 * up once the re-arm time has passed. */
static int due(struct llmem_guard *g, enum llmem_guard_level level, int rising, double now) {
    double since = now - g->last_action[level];
    if (rising && since >= LLMEM_GUARD_FLAP_S)
        return 1;
    if (since >= LLMEM_GUARD_REARM_S)
        return 1;
    if (rising)
        g->suppressed++;
    return 0;
}

enum llmem_guard_level llmem_guard_decide(struct llmem_guard *g,
                                          const struct llmem_guard_reading *r, double now,
                                          int mid_step) {
    enum llmem_guard_level level = llmem_guard_classify(r, NULL), act = LLMEM_GUARD_CLEAR;
    if (level == LLMEM_GUARD_CRITICAL) {
        if (due(g, LLMEM_GUARD_CRITICAL, g->prev < LLMEM_GUARD_CRITICAL, now))
            act = LLMEM_GUARD_CRITICAL;
        g->deferred_since = -1; /* a critical covers any warning waiting */
    } else if (level == LLMEM_GUARD_WARNING) {
        int waiting = g->deferred_since >= 0;
        if (waiting || due(g, LLMEM_GUARD_WARNING, g->prev < LLMEM_GUARD_WARNING, now)) {
            if (mid_step && !waiting) {
                g->deferred_since = now;
                g->deferred++;
            } else if (!mid_step || now - g->deferred_since >= LLMEM_GUARD_DEFER_S) {
                act = LLMEM_GUARD_WARNING;
                g->deferred_since = -1;
            }
        }
    } else {
        g->deferred_since = -1; /* cleared before it acted */
    }
    g->prev = level;
    if (act != LLMEM_GUARD_CLEAR) {
        g->last_action[act] = now;
        if (act == LLMEM_GUARD_CRITICAL)
            g->criticals++;
        else
            g->warnings++;
    }
    return act;
}

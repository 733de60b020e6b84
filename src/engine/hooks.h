/*
 * engine/hooks.h — what tests put in place of the machine when they open an engine: the pressure
 * guard's readings and the spill store's free-disk probe. Not part of the public API.
 */
#ifndef LLMEM_ENGINE_HOOKS_H
#define LLMEM_ENGINE_HOOKS_H

#include "llmem/engine.h"

/* A source of readings for the engine's guard (tests fake pressure with one); the engine's own
 * reads the allocator, /proc/self/statm and /proc/pressure/memory. It may change any field of r. */
typedef void (*llmem_guard_source_fn)(void *arg, struct llmem_guard_reading *r);

struct llmem_engine_hooks {
    llmem_spill_free_fn spill_free_probe; /* (optional) the spill store's free-disk probe */
    void *spill_free_probe_arg;
    llmem_guard_source_fn guard_source; /* (optional) adjusts the machine's readings */
    void *guard_source_arg;
};

/* llmem_engine_open with hooks (NULL: none, as llmem_engine_open). */
int llmem_engine_open_hooked(const struct llmem_engine_config *config,
                             const struct llmem_engine_hooks *hooks, llmem_progress_fn progress,
                             void *progress_arg, struct llmem_engine **out);

#endif

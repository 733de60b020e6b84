/*
 * llmem/pool.h — a fixed thread pool for data-parallel loops: `run` hands out task indices
 * 0..n_tasks−1 to the workers and the calling thread, and returns when all are done.
 */
#ifndef LLMEM_POOL_H
#define LLMEM_POOL_H

#include "llmem/api.h"

#ifdef __cplusplus
extern "C" {
#endif

struct llmem_pool;

/* n_threads counts the caller: 1 runs everything inline (no threads are started); ≤ 0 means the
 * online CPUs. LLMEM_ENOMEM / LLMEM_EIO (logged) when threads cannot be started. */
LLMEM_API int llmem_pool_create(int n_threads, struct llmem_pool **out);
LLMEM_API void llmem_pool_destroy(struct llmem_pool *pool);
LLMEM_API int llmem_pool_threads(const struct llmem_pool *pool);

/* Calls fn(arg, task, thread) for every task in [0, n_tasks); `thread` in [0, threads) indexes
 * per-thread scratch. Runs called from several threads take turns (fn must not run the same
 * pool). */
LLMEM_API void llmem_pool_run(struct llmem_pool *pool, int n_tasks,
                              void (*fn)(void *arg, int task, int thread), void *arg);

#ifdef __cplusplus
}
#endif

#endif

/*
 * core/pool.c — the thread pool. A run bumps a generation counter, and every participant (the
 * caller included) takes task indices from one atomic counter until none are left. A worker joins
 * a run only while it is open; the caller closes it once every task is taken and waits for the
 * workers that joined, not for the others: a worker the OS has not run yet (more runnable threads
 * than CPUs, a sleeping worker's wake-up) delays no run, its tasks taken by those that came.
 *
 * Dispatch latency: a forward pass issues one run per operation, ~100 per decode step, so waking
 * workers through a condition variable alone (a futex wake and a reschedule, tens of µs) would
 * cost more than the small operations themselves. Workers therefore spin on the generation
 * counter for a short while after each run (POOL_SPIN_NS) before sleeping on the condition
 * variable, and the caller spins on the count of joined workers before sleeping on its own. After
 * POOL_YIELD_NS a spinning thread yields at every check, so that on an oversubscribed machine it
 * does not hold the CPU that the thread it waits for needs. The generation is published with
 * release order after the run's fields, and read with acquire, so the fields need no lock; the
 * mutex only guards the sleeping paths (a worker re-checks the generation under it before
 * waiting, and the caller bumps it under it, so no wake-up is lost).
 */
#include "llmem/pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#include "core/clock.h"
#include "core/log.h"

struct llmem_pool {
    int n_threads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t running; /* held by the run in progress: runs from several threads take turns */
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    _Atomic unsigned long generation;
    _Atomic int stopping;
    _Atomic uint64_t run; /* the current run: its generation's low 32 bits, RUN_CLOSED, and the
                           * workers in it (RUN_JOINED) */
    void (*fn)(void *, int, int);
    void *arg;
    int n_tasks;
    _Atomic int next;
};

struct worker_arg {
    struct llmem_pool *pool;
    int index;
};

static void take_tasks(struct llmem_pool *p, int thread) {
    for (;;) {
        int t = atomic_fetch_add(&p->next, 1);
        if (t >= p->n_tasks)
            return;
        p->fn(p->arg, t, thread);
    }
}

#define RUN_CLOSED ((uint64_t)1 << 31)
#define RUN_JOINED (RUN_CLOSED - 1)

/* How long a worker (or the waiting caller) spins before it sleeps. */
#define POOL_SPIN_NS  100000
#define POOL_YIELD_NS 5000

/* Spins until *cond_fn(p, arg) holds or POOL_SPIN_NS pass; returns whether it holds. */
static int spin_until(struct llmem_pool *p, int (*cond_fn)(struct llmem_pool *, unsigned long),
                      unsigned long arg) {
    uint64_t start = 0;
    for (unsigned i = 0;; i++) {
        if (cond_fn(p, arg))
            return 1;
        if ((i & 63) == 0) {
            uint64_t t = llmem_clock_ns();
            if (start == 0)
                start = t;
            else if (t - start > POOL_SPIN_NS)
                return 0;
            /* Past the first few µs the awaited thread is likely not running (more runnable
             * threads than CPUs): give the CPU away rather than burn the slice it needs. */
            else if (t - start > POOL_YIELD_NS)
                sched_yield();
        }
        cpu_relax();
    }
}

static int run_posted(struct llmem_pool *p, unsigned long seen) {
    return atomic_load_explicit(&p->stopping, memory_order_acquire) ||
           atomic_load_explicit(&p->generation, memory_order_acquire) != seen;
}

static int run_done(struct llmem_pool *p, unsigned long unused) {
    (void)unused;
    return (atomic_load_explicit(&p->run, memory_order_acquire) & RUN_JOINED) == 0;
}

/* A worker into run `generation` while it is open; whether it joined (its fields then stay as
 * they are until it leaves). */
static int join(struct llmem_pool *p, unsigned long generation) {
    uint64_t s = atomic_load_explicit(&p->run, memory_order_acquire);
    while ((uint32_t)(s >> 32) == (uint32_t)generation && !(s & RUN_CLOSED))
        if (atomic_compare_exchange_weak_explicit(&p->run, &s, s + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return 1;
    return 0;
}

static void *worker(void *a) {
    struct llmem_pool *p = ((struct worker_arg *)a)->pool;
    int index = ((struct worker_arg *)a)->index;
    free(a);
    unsigned long seen = 0;
    for (;;) {
        if (!spin_until(p, run_posted, seen)) {
            pthread_mutex_lock(&p->lock);
            while (!run_posted(p, seen))
                pthread_cond_wait(&p->wake, &p->lock);
            pthread_mutex_unlock(&p->lock);
        }
        if (atomic_load_explicit(&p->stopping, memory_order_acquire))
            break;
        seen = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (!join(p, seen))
            continue; /* (closed: every task taken without it) */
        take_tasks(p, index);
        const uint64_t s = atomic_fetch_sub_explicit(&p->run, 1, memory_order_acq_rel);
        if ((s & RUN_CLOSED) && (s & RUN_JOINED) == 1) { /* the last out of a closed run */
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->lock);
        }
    }
    return NULL;
}

int llmem_pool_create(int n_threads, struct llmem_pool **out) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    struct llmem_pool *p = calloc(1, sizeof(*p));
    if (p == NULL ||
        (n_threads > 1 && (p->threads = calloc((size_t)n_threads, sizeof(pthread_t))) == NULL)) {
        free(p);
        LLMEM_ERROR("out of memory creating a pool of %d threads", n_threads);
        return LLMEM_ENOMEM;
    }
    p->n_threads = n_threads;
    pthread_mutex_init(&p->running, NULL);
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 1; i < n_threads; i++) {
        struct worker_arg *a = malloc(sizeof(*a));
        if (a != NULL)
            *a = (struct worker_arg){p, i};
        if (a == NULL || pthread_create(&p->threads[i], NULL, worker, a) != 0) {
            free(a);
            p->n_threads = i; /* the ones started so far are joined by destroy */
            llmem_pool_destroy(p);
            LLMEM_ERROR("cannot start thread %d of %d", i, n_threads);
            return LLMEM_EIO;
        }
    }
    *out = p;
    return LLMEM_OK;
}

void llmem_pool_destroy(struct llmem_pool *p) {
    if (p == NULL)
        return;
    pthread_mutex_lock(&p->lock);
    atomic_store_explicit(&p->stopping, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->running);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->threads);
    free(p);
}

int llmem_pool_threads(const struct llmem_pool *p) {
    return p->n_threads;
}

void llmem_pool_run(struct llmem_pool *p, int n_tasks, void (*fn)(void *, int, int), void *arg) {
    if (n_tasks <= 0)
        return;
    if (p->n_threads == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(arg, t, 0);
        return;
    }
    pthread_mutex_lock(&p->running); /* (a task of its own is thread 0's too) */
    if (n_tasks == 1) {
        fn(arg, 0, 0);
        pthread_mutex_unlock(&p->running);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    const unsigned long generation = atomic_load_explicit(&p->generation, memory_order_relaxed) + 1;
    atomic_store_explicit(&p->run, (uint64_t)(uint32_t)generation << 32, memory_order_relaxed);
    pthread_mutex_lock(&p->lock);
    atomic_store_explicit(&p->generation, generation, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    take_tasks(p, 0);
    /* every task taken: closed to latecomers, then the joined ones' tasks awaited */
    if ((atomic_fetch_or_explicit(&p->run, RUN_CLOSED, memory_order_acq_rel) & RUN_JOINED) != 0 &&
        !spin_until(p, run_done, 0)) {
        pthread_mutex_lock(&p->lock);
        while (!run_done(p, 0))
            pthread_cond_wait(&p->done, &p->lock);
        pthread_mutex_unlock(&p->lock);
    }
    pthread_mutex_unlock(&p->running);
}

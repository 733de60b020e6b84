/*
 * core/pool.c — the thread pool. Workers sleep on a condition variable between runs; a run bumps
 * a generation counter, and every participant (the caller included) takes task indices from one
 * atomic counter until none are left. The caller waits until every worker has finished its part.
 */
#include "core/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"

struct llmem_pool {
    int n_threads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    unsigned long generation;
    int stopping;
    int busy; /* workers still in the current run */
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

static void *worker(void *a) {
    struct llmem_pool *p = ((struct worker_arg *)a)->pool;
    int index = ((struct worker_arg *)a)->index;
    free(a);
    unsigned long seen = 0;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->stopping && p->generation == seen)
            pthread_cond_wait(&p->wake, &p->lock);
        if (p->stopping)
            break;
        seen = p->generation;
        pthread_mutex_unlock(&p->lock);
        take_tasks(p, index);
        pthread_mutex_lock(&p->lock);
        if (--p->busy == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->lock);
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
    p->stopping = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
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
    if (p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(arg, t, 0);
        return;
    }
    pthread_mutex_lock(&p->lock);
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    p->busy = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    take_tasks(p, 0);
    pthread_mutex_lock(&p->lock);
    while (p->busy > 0)
        pthread_cond_wait(&p->done, &p->lock);
    pthread_mutex_unlock(&p->lock);
}

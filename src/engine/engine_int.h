/*
 * engine/engine_int.h — what the engine's files share: the engine itself, the session bank and
 * guard around a request (engine.c), and the request scheduler (sched.c).
 */
#ifndef LLMEM_ENGINE_INT_H
#define LLMEM_ENGINE_INT_H

#include <pthread.h>
#include <stdint.h>

#include "engine/hooks.h"
#include "llmem/engine.h"
#include "llmem/sys.h"

struct request;

struct llmem_engine {
    struct llmem_engine_config cfg;
    struct llmem_engine_hooks hooks; /* zeros: the machine's own readings and disk */
    struct llmem_plan plan;
    struct llmem_mem *mem;         /* the memory the plan governs: the host's, or the device's */
    struct llmem_mem *staging_mem; /* pinned host memory for the spill store's staging (CUDA) */
    struct llmem_mem *host_mem;    /* host memory: mem on the CPU; its own allocator with a device
                                    * (the logits the sampler reads; the spill store's staging
                                    * where none is pinned) */
    struct llmem_model *model;
    struct llmem_tokenizer *tok;
    struct llmem_pool *pool; /* the threads every kernel runs on */
    struct llmem_backend *be;
    struct llmem_kv *kv;
    struct llmem_bank *bank;   /* the RAM tier of the session bank (paged layout), or NULL */
    struct llmem_spill *spill; /* the bank's spill store, or NULL */
    uint8_t root[32];          /* the bank's chain root: the model's identity */
    int64_t ram_bytes;         /* this machine's RAM (for the spill store's default cap) */
    int64_t reused_ram_tokens, reused_disk_tokens; /* over all requests (scheduler thread) */
    struct llmem_guard guard;
    struct llmem_sys_pressure pressure; /* the last read of /proc, and when */
    double pressure_at;
    int refusing;              /* a critical is in effect: no new request is admitted */
    int64_t cache_limit_saved; /* the allocator's cache limit, set to 0 while refusing */
    struct llmem_forward *fwd;
    float *logits;     /* (max_sequences, vocab) tag scratch */
    int top_on_device; /* sample from the device's top k where it can (LLMEM_SAMPLE_ON_DEVICE) */
    int64_t vocab;
    int32_t eos[LLMEM_MAX_EOS + 1];
    int n_eos;

    /* The scheduler (sched.c). Everything under `mu` may be touched by any thread; the rest of
     * the engine only by the thread that steps it. */
    pthread_mutex_t mu;
    pthread_cond_t wake; /* work arrived, or stop */
    pthread_cond_t done; /* a cache clear finished */
    pthread_t thread;
    int serving, stopping;
    int64_t max_queue;
    struct request *incoming; /* submitted, not yet seen by the scheduler (under mu) */
    uint64_t *cancels;        /* ids to cancel (under mu) */
    int64_t n_cancels, cap_cancels;
    int64_t queued;           /* incoming + waiting (under mu) */
    int clear_requested;      /* under mu */
    int64_t clear_generation; /* bumped when a requested clear is done (under mu) */
    int64_t cleared_bytes;    /* what the last clear released (under mu) */
    uint64_t next_id;         /* under mu */
    struct request *waiting;  /* admission order; preempted requests go back to the head */
    struct request *running;  /* admission order, oldest first */
    int64_t n_running;
    /* A greedy decode step queued behind the step in flight, fed its tokens on the device
     * (llmem_forward_start_next; LLMEM_DECODE_AHEAD=0 turns it off): its requests (max_sequences
     * slots), how many, and where its ids and values go in logits (floats from the start). */
    int decode_ahead;
    struct request **ahead;
    int n_ahead;
    size_t ahead_at;
    int64_t admitted;                     /* admissions so far: a request's age */
    struct llmem_engine_metrics counters; /* the scheduler's own counts */
    struct llmem_engine_metrics snapshot; /* under mu: what llmem_engine_metrics returns */
};

/* The scheduler's state in a new engine, and its end (serving stopped, requests cancelled). */
void llmem_engine_sched_init(struct llmem_engine *e);
void llmem_engine_sched_fini(struct llmem_engine *e);

double llmem_engine_now_s(void);
/* Reads the pressure signals and acts on them (SPEC §6.4). */
void llmem_engine_guard_check(struct llmem_engine *e, int mid_step);
/* A new sequence holding the banked blocks that begin tokens[0, n) — at least the last token is
 * left to compute — and how many tokens they cover from the RAM tier and from the spill store. */
int llmem_engine_start_sequence(struct llmem_engine *e, const int32_t *tokens, int64_t n, int *seq,
                                int64_t *reused_ram, int64_t *reused_disk);
/* Holds the bank to its budget (SPEC §2.3) with `blocks` KV blocks in flight. */
void llmem_engine_bank_budget(struct llmem_engine *e, int64_t blocks);
/* The blocks seq still lacks to hold tokens [0, end), after evicting banked blocks while the pool
 * has fewer free blocks than that plus `extra` (paged layout; 0 for the others). */
int64_t llmem_engine_make_room(struct llmem_engine *e, int seq, int64_t end, int64_t extra);
/* Banks the full blocks of seq, whose KV holds tokens[0, n), and queues the chunks of them not on
 * disk yet for the spill store's writer (a copy of their bytes: it never reads the KV pool). */
void llmem_engine_bank_sequence(struct llmem_engine *e, int seq, const int32_t *tokens, int64_t n);
/* Empties the bank and the allocator's cache; the bytes released. Scheduler thread only. */
int64_t llmem_engine_release_caches(struct llmem_engine *e);

/* log-softmax(logits / temperature) (temperature ≤ 0: 1): the log-probability of id, and the n
 * most likely tokens with theirs (most likely first). */
void llmem_logprobs(const float *logits, int64_t vocab, double temperature, int32_t id, int n,
                    float *logprob, int32_t *top_ids, float *top_logprobs);

#endif

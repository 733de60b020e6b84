/*
 * engine/sched_int.h — the inside of the request scheduler, shared by sched.c (the requests, the
 * queue and the serving thread) and sched_step.c (the step policy). Fields under `mu` may be
 * touched by any thread; the rest only by the thread that steps the scheduler.
 */
#ifndef LLMEM_ENGINE_SCHED_INT_H
#define LLMEM_ENGINE_SCHED_INT_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "core/clock.h"
#include "engine/sched.h"
#include "llmem/grammar.h"
#include "llmem/pool.h"
#include "llmem/engine.h"
#include "llmem/model.h"

/* The generated text, and how much of it has been handed to the caller. */
struct stream {
    char *text;
    size_t len, cap, emitted;
};

struct request {
    struct request *next;
    uint64_t id;
    int32_t *toks; /* the prompt, then the generated tokens */
    int64_t n_toks, n_prompt, max_tokens;
    int64_t pos;                    /* tokens whose KV is written (0 while waiting) */
    int seq;                        /* −1 while waiting */
    int64_t age;                    /* admission order (preemption takes the newest) */
    struct llmem_generate_params p; /* stop strings and ids owned */
    struct llmem_request_events ev;
    struct llmem_sampler *sampler;
    struct llmem_detok *detok;
    struct stream s;
    int stop_string;
    int64_t reused_ram, reused_disk; /* prompt tokens taken from the bank at the first admission */
    double t_submit, t_admit, t_first, t_last;
    int64_t decode_tokens;
    /* The last token of toks, sampled and not yet handed to the client (hand_over), with its
     * log-probabilities when asked for (the logits are gone by then). */
    int pending;
    float lp;
    int32_t lp_ids[LLMEM_MAX_TOP_LOGPROBS];
    float lp_vals[LLMEM_MAX_TOP_LOGPROBS];
    const char *ending; /* why it ends once its pending token is handed over, or NULL */
    int ending_status;  /* and how (LLMEM_OK, or the error of an "error") */
    int in_flight;      /* passes started that it is part of (two with one queued ahead) */
    int prompt_banked;  /* its prompt's blocks are banked for the requests that follow it */
};

/* One entry of a step's batch: a request and how many of its tokens the pass computes. */
struct slot {
    struct request *r;
    int64_t n;
};

/* A row of a step's output: the logits, or on a device only their largest k (ids, vals). */
struct out_row {
    const float *logits;
    const int32_t *ids;
    const float *vals;
    int64_t k;
    int32_t drawn; /* the id drawn from the whole row already (on the pool); −1: none */
};

/* A whole row to draw from on the pool's threads, and the id drawn. */
struct draw {
    struct llmem_sampler *sampler;
    const float *logits;
    int32_t id;
};

/* Where a pass's top-k selection lands: ids and values, row after row. */
struct top_rows {
    int32_t *ids;
    float *vals;
};

struct llmem_sched {
    struct llmem_sched_config cfg;

    /* Shared with the other threads (under mu). */
    pthread_mutex_t mu;
    pthread_cond_t wake; /* work arrived, or stop */
    pthread_cond_t done; /* a cache clear finished */
    pthread_t thread;
    int serving, stopping;
    int64_t max_queue;
    struct request *incoming; /* submitted, not yet seen by the stepping thread */
    uint64_t *cancels;        /* ids to cancel */
    int64_t n_cancels, cap_cancels;
    int64_t queued; /* incoming + waiting */
    int clear_requested;
    int64_t clear_generation; /* bumped when a requested clear is done */
    int64_t cleared_bytes;    /* what the last clear released */
    uint64_t next_id;
    struct llmem_engine_metrics snapshot; /* what llmem_sched_metrics returns */

    /* The stepping thread's. */
    struct request *waiting; /* admission order; preempted requests go back to the head */
    struct request *running; /* admission order, oldest first */
    int64_t n_running;
    int64_t admitted; /* admissions so far: a request's age */
    int refusing;     /* the guard refuses new requests (its last check) */
    int64_t reused_ram_tokens, reused_disk_tokens; /* over all requests */
    struct llmem_engine_metrics counters;          /* the scheduler's own counts */

    /* A step's arrays, allocated with the scheduler. */
    float *logits;                /* (max_sequences, vocab) the rows a pass returns whole */
    int top_ok;                   /* a pass can return each row's top k instead (top_k_for) */
    struct top_rows top[2];       /* with top_ok: top[0] (max_sequences, LLMEM_TOP_K_MAX),
                                   * top[1] (max_sequences) for a greedy step queued ahead of one
                                   * whose results are in the other */
    struct slot *slots;           /* (max_sequences) the step's batch */
    struct llmem_sampler **masking; /* (max_sequences) the step's samplers under a grammar */
    struct llmem_grammar_walkers *walkers; /* a mask's walk split over the pool (NULL: 1 thread) */
    struct draw *drawing;           /* (max_sequences) the step's whole rows, by slot */
    struct llmem_batch_seq *seqs; /* (max_sequences) and its sequences */
    int32_t *tokens;              /* (max_batch_tokens) and their tokens, in order */
    /* A greedy decode step queued behind the step in flight, fed its tokens on the device
     * (llmem_forward_start_next): its requests, how many, and which of top its results go to. */
    struct request **ahead; /* (max_sequences) */
    int n_ahead;
    int ahead_top;
};

/* ---- request lists (singly linked through next) ---- */

static inline void request_list_append(struct request **head, struct request *r) {
    struct request **p = head;
    while (*p != NULL)
        p = &(*p)->next;
    r->next = NULL;
    *p = r;
}

static inline void request_list_remove(struct request **head, struct request *r) {
    for (struct request **p = head; *p != NULL; p = &(*p)->next) {
        if (*p == r) {
            *p = r->next;
            r->next = NULL;
            return;
        }
    }
}

static inline int64_t request_list_count(const struct request *r) {
    int64_t n = 0;
    for (; r != NULL; r = r->next)
        n++;
    return n;
}

/* ---- sched.c: requests and the queue ---- */

/* Ends a request: the held-back text flushed (unless a stop string cut it), its KV banked and
 * freed, on_done called with the result, the request freed. status ≠ LLMEM_OK: an error for the
 * client (message). */
void llmem_sched_finish(struct llmem_sched *s, struct request *r, const char *reason, int status,
                        const char *message);
/* Takes r out of the running set and ends it. */
void llmem_sched_finish_running(struct llmem_sched *s, struct request *r, const char *reason,
                                int status, const char *message);
/* Samples r's next token from its row of a step's output (see sched.c). */
const char *llmem_sched_sample(struct llmem_sched *s, struct request *r, struct out_row row,
                               int *status);
/* Hands r's pending token to the client; the reason r ends, or NULL (see sched.c). */
const char *llmem_sched_hand_over(struct llmem_sched *s, struct request *r, int *status);
/* What a request that ends with `status` tells its client: NULL when it is LLMEM_OK, "out of
 * memory", else the error logged last (a token the tokenizer does not have, say). */
const char *llmem_sched_status_message(int status);
/* Hands over the pending tokens of the requests on `list` (s->running or s->waiting) and ends
 * those that end; one in the pass in flight ends after it (r->ending). */
void llmem_sched_hand_over_all(struct llmem_sched *s, struct request **list);
/* Takes what the other threads queued: new requests and cancellations. */
void llmem_sched_intake(struct llmem_sched *s);
/* Refreshes the snapshot that llmem_sched_metrics returns. */
void llmem_sched_publish(struct llmem_sched *s);

/* ---- sched_step.c: the step ---- */

/* One step (see sched_step.c). Returns the requests still waiting or running. */
int64_t llmem_sched_step(struct llmem_sched *s);
/* The step queued ahead, waited for and dropped (its tokens not taken). */
void llmem_sched_drop_ahead(struct llmem_sched *s);

#endif

/*
 * engine/sched.h — the request scheduler as its owner sees it (SPEC §7). The engine creates it
 * with a table of the operations it calls back — the session bank around a request and the
 * pressure guard — and the objects it borrows: the KV cache, the forward pass, the tokenizer and
 * the host allocator of its logits. It never sees the engine itself: the dependency runs one way.
 *
 * The serving calls (submit, cancel, clear, metrics) are thread-safe; everything else, and every
 * operation of the table, runs on the one thread that steps the scheduler — its serving thread,
 * or the caller of llmem_sched_generate.
 */
#ifndef LLMEM_ENGINE_SCHED_H
#define LLMEM_ENGINE_SCHED_H

#include <stdint.h>

#include "llmem/engine.h"
#include "llmem/model.h"

/* What the scheduler asks of its owner. ctx is llmem_sched_config's. */
struct llmem_sched_ops {
    /* A new sequence holding the banked blocks that begin tokens[0, n) — at least the last token
     * is left to compute — and how many tokens they cover from the RAM tier and from the spill
     * store. LLMEM_ERANGE when every sequence slot is taken; other failures logged. */
    int (*start_sequence)(void *ctx, const int32_t *tokens, int64_t n, int *seq,
                          int64_t *reused_ram, int64_t *reused_disk);
    /* Banks the full blocks of seq, whose KV holds tokens[0, n) (the sequence stays the
     * scheduler's to free). */
    void (*bank_sequence)(void *ctx, int seq, const int32_t *tokens, int64_t n);
    /* The blocks seq still lacks to hold tokens [0, end), after evicting banked blocks while the
     * pool has fewer free blocks than that plus `extra` (paged layout; 0 for the others). */
    int64_t (*make_room)(void *ctx, int seq, int64_t end, int64_t extra);
    /* The KV blocks the bank holds: free for the taking by eviction. */
    int64_t (*banked_blocks)(void *ctx);
    /* Holds the bank to its budget (SPEC §2.3) with `blocks` KV blocks in flight. */
    void (*bank_budget)(void *ctx, int64_t blocks);
    /* After a step that failed to allocate: the bank halves (SPEC §6.5). */
    void (*shed_bank)(void *ctx);
    /* Reads the pressure signals and acts on them (SPEC §6.4); mid_step: requests are running.
     * Returns whether new requests are refused (a critical is in effect). */
    int (*guard_check)(void *ctx, int mid_step);
    /* Empties the bank and the allocator's cache; the bytes released. */
    int64_t (*release_caches)(void *ctx);
    /* The owner's part of a metrics snapshot: m->bank, the allocator's mem_* and guard_level. */
    void (*metrics)(void *ctx, struct llmem_engine_metrics *m);
};

struct llmem_sched_config {
    struct llmem_sched_ops ops;
    void *ctx;
    struct llmem_kv *kv;               /* borrowed: sequences are created through ops */
    struct llmem_forward *fwd;         /* borrowed */
    const struct llmem_tokenizer *tok; /* borrowed: the streamed text */
    const struct llmem_grammar_vocab *gvocab; /* borrowed: the matchers' vocabulary */
    struct llmem_mem *mem;             /* host memory for the logits and the top-k results */
    struct llmem_pool *pool;           /* borrowed: the grammars' masks, one a thread */
    int64_t max_sequences;             /* running requests at most */
    int64_t max_batch_tokens;          /* tokens of one forward pass at most */
    int64_t context;                   /* the context window: prompt + generated tokens */
    int64_t vocab;
    int paged;                      /* the KV layout is paged: admission counts blocks */
    int32_t eos[LLMEM_MAX_EOS + 1]; /* the ids that end generation (unless ignore_eos) */
    int n_eos;
    int top_on_device; /* sample from the device's top k where it can */
    int decode_ahead;  /* queue greedy decode steps behind the one in flight */
};

struct llmem_sched;

/* A scheduler with every per-step array allocated (none is allocated while it steps).
 * LLMEM_ENOMEM (logged). */
int llmem_sched_create(const struct llmem_sched_config *config, struct llmem_sched **out);
/* Stops serving and ends every request as cancelled, then frees. NULL is a no-op. */
void llmem_sched_free(struct llmem_sched *s);

/* The llmem_engine_* calls of the same names (llmem/engine.h). */
int llmem_sched_generate(struct llmem_sched *s, const int32_t *prompt, int64_t n_prompt,
                         const struct llmem_generate_params *p, llmem_token_fn on_token, void *arg,
                         struct llmem_generate_result *result);
int llmem_sched_serve_start(struct llmem_sched *s, const struct llmem_serve_config *config);
void llmem_sched_serve_stop(struct llmem_sched *s);
int llmem_sched_submit(struct llmem_sched *s, const int32_t *prompt, int64_t n_prompt,
                       const struct llmem_generate_params *params,
                       const struct llmem_request_events *events, uint64_t *id);
void llmem_sched_cancel(struct llmem_sched *s, uint64_t id);
int64_t llmem_sched_clear_cache(struct llmem_sched *s);
void llmem_sched_metrics(struct llmem_sched *s, struct llmem_engine_metrics *m);

/* Prompt tokens that requests took from the bank at their first admission, over all requests
 * (stepping thread). */
void llmem_sched_reused_tokens(const struct llmem_sched *s, int64_t *ram, int64_t *disk);

#endif

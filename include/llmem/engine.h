/*
 * llmem/engine.h — the inference engine: a model opened inside its memory plan, and generation.
 *
 * Opening computes the plan first, from the model's real geometry and this machine (SPEC §2), and
 * refuses a model that does not fit before anything is loaded; then the allocator's limits are set
 * from the plan (SPEC §3.1), and the weights, tokenizer, backend, KV cache, session bank and
 * forward pass are created inside them. Generation takes the prompt's longest banked prefix —
 * from the RAM tier, then continued from the spill store on disk (llmem/spill.h) — prefills the
 * rest in chunks of max_batch_tokens, then decodes one token at a time with the sampler until EOS,
 * a stop string or max_tokens; the finished sequence's full blocks go to the bank (llmem/bank.h),
 * which yields its blocks to requests that need them, and the chunks of them not on disk yet are
 * queued for the spill store's writer.
 */
#ifndef LLMEM_ENGINE_H
#define LLMEM_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "llmem/api.h"
#include "llmem/backend.h"
#include "llmem/bank.h"
#include "llmem/forward.h"
#include "llmem/guard.h"
#include "llmem/kv.h"
#include "llmem/mem.h"
#include "llmem/model.h"
#include "llmem/plan.h"
#include "llmem/pool.h"
#include "llmem/sampler.h"
#include "llmem/spill.h"
#include "llmem/status.h"
#include "llmem/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * The engine
 * ------------------------------------------------------------------------------------------- */

struct llmem_engine_config {
    const char *model_dir;
    enum llmem_kv_layout kv_layout; /* paged */
    enum llmem_kv_format kv_format; /* f16 */
    int64_t context;                /* --context; 0: the plan's window */
    int64_t budget_bytes;           /* --budget; 0: none */
    int64_t memory_limit_bytes;     /* --memory-limit; 0: none */
    double util;                    /* --util; 0: none */
    int n_threads;                  /* --threads; ≤ 0: the online CPUs */
    int64_t max_batch_tokens;       /* 0: 512, on a device up to 8192 (within the plan) */
    int64_t max_sequences;          /* 1 */
    int64_t bank_max_bytes;         /* --bank-max: the RAM tier's cap; 0: the plan's ceiling */
    int no_bank;                    /* 1: no session bank (and no spill tier) */
    const char *bank_dir;           /* --bank-dir: the spill store; NULL: the default directory
                                     * (the store is a cache: one that cannot be opened, given
                                     * or default, turns spilling off with one warning) */
    int64_t spill_max_bytes;        /* --spill-max: the store's size cap; 0: the default */
    int no_spill;                   /* --no-spill: the bank stays in RAM */
    int no_mmap; /* --no-mmap: the weights read into (huge-page) memory instead of mapped */
    int load_dummy; /* --load-format dummy: seeded random bf16 weights made from config.json
                     * alone (LLMEM_MODEL_LOAD_DUMMY); no session bank (no weights to key it) */
    enum llmem_backend_kind backend;        /* --backend: cpu, or cuda (the whole pass on a GPU) */
    int device;                             /* --device: the CUDA device */
    enum llmem_backend_precision precision; /* --precision: fast or f32 */
    /* --experts-on-host: with --backend cuda, the MoE layers (the first ones) whose experts stay
     * in host memory and run on the CPU; -1 (the default): the plan's choice, the fewest with
     * which the model fits (llmem_plan_place_experts) */
    int64_t experts_on_host;
    /* --tensor-parallel: the model split over this many ranks (2, 4 or 8; 0 or 1: whole): with
     * --backend cuda on the devices device … device + N − 1, each holding its share and planned
     * as one of them, NCCL's all-reduce between them; on the CPU every share in host memory, each
     * rank's thread taking turns on the one thread pool (the split's results, for checking it) */
    int tensor_parallel;
    /* the plan's runtime baseline (SPEC §2.2: what the process holds outside the allocator):
     * LLMEM_ENGINE_BASELINE_MEASURE (the default) measures it at open, ≥ 0 takes it as given
     * (a test that pretends a smaller machine than its own process) */
    int64_t runtime_baseline_bytes;
    /* what the program around the engine holds outside the allocator at most, beyond what the
     * engine measures at open (llmem serve: its HTTP buffers); added to the baseline */
    int64_t runtime_reserve_bytes;
};
#define LLMEM_ENGINE_BASELINE_MEASURE (-1)
LLMEM_API void llmem_engine_config_default(struct llmem_engine_config *c);
/* What llmem_engine_open plans with, for a model of geometry g under configuration c on a machine
 * of total_bytes (ceiling_bytes: its hard ceiling, SPEC §1), the CPU backend on `threads`
 * threads: the forward pass's workspace and the backend's scratch, and a max_batch_tokens of 0
 * resolved as the engine resolves it (512; on a device the largest chunk up to 8192 whose
 * workspace fits the transient reserve the plan commits for 512). llmem plan prints the same. */
/* With a device and a mixture of experts, the experts placed first (llmem_plan_place_experts
 * with c's experts_on_host: out's weights are the device's share), the placement into
 * `placement` when it is not NULL. */
LLMEM_API void llmem_engine_plan_params(const struct llmem_engine_config *c,
                                        const struct llmem_model_geometry *g, int64_t total_bytes,
                                        int64_t ceiling_bytes, int threads,
                                        struct llmem_plan_params *out,
                                        struct llmem_expert_placement *placement);
/* The runtime baseline of SPEC §2.2 (what the process holds outside the allocator) for an engine
 * of configuration c, a model of `vocab` tokens, on `threads` threads: c's runtime_baseline_bytes
 * when given, else measured now (call it with the configuration, the tokenizer and its grammar
 * vocabulary loaded, and no weights): the resident memory, the code that the first steps still
 * page in, the worker threads' stacks and a constrained output's grammar for each of c's
 * max_sequences (llmem_grammar_request_bytes); plus c's runtime_reserve_bytes. */
LLMEM_API int64_t llmem_engine_runtime_baseline(const struct llmem_engine_config *c, int64_t vocab,
                                                int threads);

struct llmem_engine;

/* Plans, then loads. A model that does not fit (or a --context above the machine's fit) is refused
 * before loading with LLMEM_ENOMEM and the plan's explanation logged; otherwise as
 * llmem_model_load, llmem_tokenizer_load, llmem_kv_create. progress (optional) follows the load. */
LLMEM_API int llmem_engine_open(const struct llmem_engine_config *config,
                                llmem_progress_fn progress, void *progress_arg,
                                struct llmem_engine **out);
LLMEM_API void llmem_engine_close(struct llmem_engine *e);

LLMEM_API const struct llmem_plan *llmem_engine_plan(const struct llmem_engine *e);
/* Where the engine's mixture of experts lives (moe_layers 0: a dense model, or the CPU). */
LLMEM_API const struct llmem_expert_placement *
llmem_engine_expert_placement(const struct llmem_engine *e);
/* The configuration it was opened with (defaults applied: max_batch_tokens, max_sequences). */
LLMEM_API const struct llmem_engine_config *llmem_engine_get_config(const struct llmem_engine *e);
LLMEM_API struct llmem_mem *llmem_engine_mem(struct llmem_engine *e);
LLMEM_API struct llmem_kv *llmem_engine_kv(struct llmem_engine *e);
LLMEM_API struct llmem_model *llmem_engine_model(struct llmem_engine *e);
LLMEM_API struct llmem_forward *llmem_engine_forward(struct llmem_engine *e);
/* The backend the forward pass runs on. */
LLMEM_API struct llmem_backend *llmem_engine_backend(struct llmem_engine *e);
/* The engine's pressure guard (its counters). */
LLMEM_API const struct llmem_guard *llmem_engine_guard(const struct llmem_engine *e);
/* The session bank's RAM tier (NULL without one: no_bank or a layout other than paged). */
LLMEM_API struct llmem_bank *llmem_engine_bank(struct llmem_engine *e);
/* The spill store (NULL without one: no bank, no_spill, or a directory that could not be
 * opened). */
LLMEM_API struct llmem_spill *llmem_engine_spill(struct llmem_engine *e);

/* Everything the session bank did, in one struct: the RAM tier, the spill store, the guard's
 * actions, and the tokens requests took from each tier. */
struct llmem_engine_bank_stats {
    struct llmem_bank_stats ram;                   /* zeros without a bank */
    struct llmem_spill_stats spill;                /* zeros without a spill store */
    int spill_on;                                  /* a spill store is open (owned or not) */
    int64_t reused_ram_tokens, reused_disk_tokens; /* over all requests */
    int64_t guard_warnings, guard_criticals, guard_deferred, guard_suppressed;
};
/* Not while serving (the scheduler thread owns the bank then): llmem_engine_metrics has them. */
LLMEM_API void llmem_engine_bank_stats(struct llmem_engine *e,
                                       struct llmem_engine_bank_stats *stats);
/* The threads the engine's kernels run on (for work that must not compete with them). */
LLMEM_API struct llmem_pool *llmem_engine_pool(struct llmem_engine *e);
LLMEM_API const struct llmem_tokenizer *llmem_engine_tokenizer(const struct llmem_engine *e);
/* The limits applied, as one line ("memory limit 12.0G (util 0.50 × ceiling 24.0G), trip 13.2G,
 * cache limit 1.5G, KV f16 paged, context 32768"), for the log line of SPEC §3.1. */
LLMEM_API void llmem_engine_limits_line(const struct llmem_engine *e, char *buf, size_t size);

/* ---------------------------------------------------------------------------------------------
 * Generation
 * ------------------------------------------------------------------------------------------- */

/* Called with each new piece of text (possibly empty while a character or a possible stop string
 * is incomplete) and the token it came with; return non-zero to stop. */
typedef int (*llmem_token_fn)(void *arg, int32_t id, const char *text, size_t len);

struct llmem_generate_params {
    int64_t max_tokens; /* 0: up to the context */
    struct llmem_sampling sampling;
    const char *const *stop; /* stop strings (not included in the output) */
    int n_stop;
    const int32_t *stop_ids; /* more ids that end generation (a chat template's end of turn) */
    int n_stop_ids;
    int ignore_eos;
    int keep_special; /* special tokens written into the text (Mistral's [TOOL_CALLS]) */
    int logprobs; /* per token, the log-probability and this many alternatives (0–20); −1: none */
    llmem_progress_fn prefill_progress; /* (optional) prompt tokens done of total */
    void *progress_arg;
    /* (serving) the id of a request submitted before with the same prompt (n > 1): this one is
     * admitted once that one's prompt is in its KV cache, whose blocks it then shares through
     * the session bank instead of computing them again; 0: none */
    uint64_t follow;
};
LLMEM_API void llmem_generate_params_default(struct llmem_generate_params *p);

struct llmem_generate_result {
    int32_t *ids; /* generated ids (malloc'ed; free with llmem_generate_result_free) */
    int64_t n_ids;
    char *text; /* their text, up to a stop string (malloc'ed) */
    size_t text_len;
    const char *finish_reason; /* "stop" (EOS, a stop id or string), "length", "cancelled" */
    int64_t prompt_tokens;
    int64_t reused_tokens; /* of them, taken from the session bank instead of prefilled: */
    int64_t reused_ram_tokens, reused_disk_tokens; /* from its RAM tier, from the spill store */
    double ttft_ms; /* prompt in → first token out (the bank's lookup and loads included) */
    double prefill_s, decode_s;
    int64_t decode_tokens; /* tokens produced by decode steps (the first comes from prefill) */
};
LLMEM_API void llmem_generate_result_free(struct llmem_generate_result *r);

/* Generates a continuation of the prompt on a fresh sequence (freed at the end). LLMEM_EINVAL
 * (logged) for an empty prompt, an id outside the vocabulary, or a prompt longer than the
 * context; LLMEM_ENOMEM when the KV cache cannot grow (the request ends; the engine stays
 * usable). */
LLMEM_API int llmem_engine_generate(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt,
                                    const struct llmem_generate_params *params,
                                    llmem_token_fn on_token, void *arg,
                                    struct llmem_generate_result *result);

/* ---------------------------------------------------------------------------------------------
 * Serving: many requests at once (SPEC §7)
 *
 * A scheduler thread keeps a waiting queue and a running set (at most max_sequences). Each step
 * runs one forward pass that mixes chunked prefill (up to max_batch_tokens prompt tokens, the
 * oldest waiting requests first) with one decode token for every running sequence, on the shared
 * paged KV. A request whose KV blocks run out while others run is preempted — the newest first:
 * its blocks go to the session bank and it waits again at the head of the queue, resuming from
 * the bank — instead of failing; a request that can never fit is refused before its prefill
 * (status LLMEM_ENOMEM, with the plan's numbers in the message). Cancelling a request (or its
 * on_token returning non-zero) frees its blocks at the next step.
 *
 * Callbacks run on the scheduler thread: they must return quickly and must not call back into
 * the engine (submit and cancel excepted).
 * ------------------------------------------------------------------------------------------- */

#define LLMEM_MAX_TOP_LOGPROBS 20

/* One generated token (or, with id = −1, the text held back until the end). */
struct llmem_token_event {
    int32_t id;
    const char *text; /* the new text (possibly empty while a character or stop string is open) */
    size_t len;
    float logprob;          /* log-probability of id under the model (temperature applied) */
    int n_top;              /* the `logprobs` most likely tokens and their log-probabilities */
    const int32_t *top_ids; /* most likely first */
    const float *top_logprobs;
};

struct llmem_request_events {
    /* Each token; non-zero cancels the request (its finish_reason is then "cancelled"). */
    int (*on_token)(void *arg, const struct llmem_token_event *ev);
    /* Exactly once, last: status LLMEM_OK with the result (ids, text, finish_reason, counts,
     * timings; valid during the call only), or an error with a message for the client (a memory
     * refusal: LLMEM_ENOMEM with the fit and the advice; a bad request: LLMEM_EINVAL). */
    void (*on_done)(void *arg, int status, const struct llmem_generate_result *result,
                    const char *message);
    void *arg;
};

struct llmem_serve_config {
    int64_t max_queue; /* waiting requests beyond which submit says LLMEM_EBUSY (0: 256) */
};

/* Starts the scheduler thread. LLMEM_EINVAL if it runs already; LLMEM_ENOMEM. */
LLMEM_API int llmem_engine_serve_start(struct llmem_engine *e,
                                       const struct llmem_serve_config *config);
/* Stops the thread, then ends every request still queued or running as cancelled (on_done). */
LLMEM_API void llmem_engine_serve_stop(struct llmem_engine *e);

/* Queues a request (prompt copied; params' strings copied) and returns its id. LLMEM_EBUSY when
 * the queue is full, LLMEM_EINVAL (with the reason logged) for an empty prompt, an id outside the
 * vocabulary, a prompt that leaves no room in the context, or an engine that is not serving (not
 * started, or stopping); LLMEM_ENOMEM. Every request it accepts gets its on_done. Thread-safe. */
LLMEM_API int llmem_engine_submit(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt,
                                  const struct llmem_generate_params *params,
                                  const struct llmem_request_events *events, uint64_t *id);
/* Cancels a queued or running request; unknown or finished ids are ignored. Thread-safe. */
LLMEM_API void llmem_engine_cancel(struct llmem_engine *e, uint64_t id);
/* Releases the allocator's cache and empties the session bank (POST /admin/cache/clear);
 * returns the bytes released. Thread-safe. */
LLMEM_API int64_t llmem_engine_clear_cache(struct llmem_engine *e);

/* Histograms for Prometheus: counts[i] = observations ≤ bounds[i] (cumulative), then +Inf. */
#define LLMEM_HIST_BUCKETS 12
struct llmem_histogram {
    double bounds[LLMEM_HIST_BUCKETS]; /* seconds, ascending */
    int64_t counts[LLMEM_HIST_BUCKETS];
    int64_t count;
    double sum;
};

/* A consistent snapshot, refreshed after every scheduler step. Thread-safe. */
struct llmem_engine_metrics {
    int64_t requests_ok, requests_cancelled, requests_refused, requests_failed;
    int64_t prompt_tokens, generated_tokens, reused_tokens;
    int64_t running, waiting, preemptions, steps;
    int64_t ahead_steps;    /* greedy decode steps queued behind the one in flight, their tokens
                             * fed on the device (of steps) */
    int64_t masked_steps;   /* steps on a device with grammars' masks (made while it computes a
                             * replayed decode step, before the pass otherwise) */
    int64_t masks_late;     /* of which the device finished first (the masks made it wait) */
    double step_seconds;    /* in scheduler steps, all told */
    double forward_seconds; /* of which in forward passes (on a device: until its results) */
    int64_t prefill_steps;  /* steps whose batch held a prompt's chunk (not only decodes) */
    double prefill_forward_seconds;           /* their forward passes' part of forward_seconds */
    struct llmem_histogram ttft, inter_token; /* seconds */
    int64_t kv_blocks_used, kv_blocks_free, kv_block_bytes;
    struct llmem_engine_bank_stats bank;                /* RAM tier, spill store, guard actions */
    int64_t mem_active, mem_peak, mem_cache, mem_limit; /* the allocator (llmem_mem_stats) */
    /* a model split over devices (--tensor-parallel with cuda): each rank's device allocator,
     * rank 0's the one above; n_devices 0 otherwise */
    int n_devices;
    struct llmem_engine_device_mem {
        int device;
        int64_t active, peak, limit;
    } devices[8];
    enum llmem_guard_level guard_level;                 /* the guard's last reading */
    int refusing; /* a critical memory pressure is in effect */
};
LLMEM_API void llmem_engine_metrics(struct llmem_engine *e, struct llmem_engine_metrics *m);

#ifdef __cplusplus
}
#endif

#endif

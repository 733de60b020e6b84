/*
 * engine/sched.c — requests: continuous batching over the shared paged KV (SPEC §7).
 *
 * A request is its tokens (the prompt, then what it generated) and how many of them have KV
 * written (`pos`). A step gives every running request its next tokens in one forward pass: a
 * request whose KV lacks only its last token decodes (one token), one that lacks more prefills a
 * chunk of them, within max_batch_tokens in all; a request whose tokens are all written samples
 * its next token from the logits of its last one. Preempting a request banks its full blocks and
 * sets pos back to 0, so on resumption it takes them back from the bank and recomputes only the
 * rest — the same path as a prompt with a cached prefix. llmem_engine_generate is one request
 * stepped on the caller's thread; serving steps many on a scheduler thread.
 *
 * Text is streamed through the detokenizer; a stop string ends generation and is cut from the
 * text, and text that might be the start of a stop string is held back until it is not.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "engine/engine_int.h"
#include "llmem/bank.h"
#include "llmem/size.h"
#include "llmem/tokenizer.h"

/* Waiting requests beyond which submit says LLMEM_EBUSY, unless llmem_serve_config sets it. */
#define QUEUE_DEFAULT 256

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
};

static const double TTFT_BOUNDS[LLMEM_HIST_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                       0.5,   1,    2.5,   5,    10,  30};
static const double ITL_BOUNDS[LLMEM_HIST_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.05,
                                                      0.1,   0.2,    0.5,   1,    2,    5};

static void observe(struct llmem_histogram *h, double v) {
    for (int i = 0; i < LLMEM_HIST_BUCKETS; i++)
        if (v <= h->bounds[i])
            h->counts[i]++;
    h->count++;
    h->sum += v;
}

void llmem_engine_sched_init(struct llmem_engine *e) {
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->done, NULL);
    e->max_queue = QUEUE_DEFAULT;
    e->next_id = 1;
    memcpy(e->counters.ttft.bounds, TTFT_BOUNDS, sizeof(TTFT_BOUNDS));
    memcpy(e->counters.inter_token.bounds, ITL_BOUNDS, sizeof(ITL_BOUNDS));
    e->snapshot = e->counters;
}

/* ---- parameters and text ------------------------------------------------------------------- */

void llmem_generate_params_default(struct llmem_generate_params *p) {
    memset(p, 0, sizeof(*p));
    llmem_sampling_default(&p->sampling);
    p->logprobs = -1;
}

void llmem_generate_result_free(struct llmem_generate_result *r) {
    if (r == NULL)
        return;
    free(r->ids);
    free(r->text);
    memset(r, 0, sizeof(*r));
}

static int stream_append(struct stream *s, const char *piece) {
    size_t n = strlen(piece);
    if (s->len + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 256;
        while (cap < s->len + n + 1)
            cap *= 2;
        char *t = realloc(s->text, cap);
        if (t == NULL)
            return LLMEM_ENOMEM;
        s->text = t;
        s->cap = cap;
    }
    memcpy(s->text + s->len, piece, n + 1);
    s->len += n;
    return LLMEM_OK;
}

/* Where a stop string starts in the text (searching only where a new one can be), or −1; and
 * through *safe how much of the text can be emitted without splitting a possible stop string. */
static int64_t find_stop(const struct stream *s, const struct llmem_generate_params *p,
                         size_t *safe) {
    *safe = s->len;
    for (int i = 0; i < p->n_stop; i++) {
        size_t n = strlen(p->stop[i]);
        if (n == 0)
            continue;
        const char *hit = strstr(s->text + s->emitted, p->stop[i]);
        if (hit != NULL)
            return hit - s->text;
        /* the longest tail of the text that begins the stop string */
        for (size_t k = n - 1; k > 0; k--) {
            if (k <= s->len - s->emitted && memcmp(s->text + s->len - k, p->stop[i], k) == 0) {
                if (s->len - k < *safe)
                    *safe = s->len - k;
                break;
            }
        }
    }
    return -1;
}

static int is_stop_id(const struct llmem_engine *e, const struct llmem_generate_params *p,
                      int32_t id) {
    for (int i = 0; !p->ignore_eos && i < e->n_eos; i++)
        if (e->eos[i] == id)
            return 1;
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] == id)
            return 1;
    return 0;
}

static void publish(struct llmem_engine *e);

/* ---- a request's life ------------------------------------------------------------------------ */

static void request_free(struct request *r) {
    if (r == NULL)
        return;
    for (int i = 0; i < r->p.n_stop; i++)
        free((char *)r->p.stop[i]);
    free((void *)r->p.stop);
    free((void *)r->p.stop_ids);
    free(r->toks);
    free(r->s.text);
    llmem_detok_free(r->detok);
    llmem_sampler_free(r->sampler);
    free(r);
}

/* A request for the prompt, checked: LLMEM_EINVAL (logged) for an empty prompt, a prompt without
 * room in the context or an id outside the vocabulary; LLMEM_ENOMEM. */
static int request_new(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt,
                       const struct llmem_generate_params *p, const struct llmem_request_events *ev,
                       struct request **out) {
    const int64_t context = e->plan.context_window_resolved;
    if (n_prompt <= 0 || n_prompt >= context) {
        LLMEM_ERROR("the prompt has %" PRId64 " tokens; it must have 1 to %" PRId64
                    " (the context window is %" PRId64 ")",
                    n_prompt, context - 1, context);
        return LLMEM_EINVAL;
    }
    for (int64_t i = 0; i < n_prompt; i++) {
        if (prompt[i] < 0 || prompt[i] >= e->vocab) {
            LLMEM_ERROR("token %" PRId64 " of the prompt is %d, outside the vocabulary (0 to "
                        "%" PRId64 ")",
                        i, prompt[i], e->vocab - 1);
            return LLMEM_EINVAL;
        }
    }
    if (p->logprobs > LLMEM_MAX_TOP_LOGPROBS) {
        LLMEM_ERROR("logprobs is %d; at most %d alternatives per token", p->logprobs,
                    LLMEM_MAX_TOP_LOGPROBS);
        return LLMEM_EINVAL;
    }
    struct request *r = calloc(1, sizeof(*r));
    if (r == NULL)
        goto oom;
    r->seq = -1;
    r->p = *p;
    r->p.stop = NULL, r->p.n_stop = 0, r->p.stop_ids = NULL, r->p.n_stop_ids = 0;
    if (ev != NULL)
        r->ev = *ev;
    r->max_tokens = context - n_prompt;
    if (p->max_tokens > 0 && p->max_tokens < r->max_tokens)
        r->max_tokens = p->max_tokens;
    r->toks = malloc((size_t)(n_prompt + r->max_tokens) * sizeof(int32_t));
    if (r->toks == NULL)
        goto oom;
    memcpy(r->toks, prompt, (size_t)n_prompt * sizeof(int32_t));
    r->n_toks = r->n_prompt = n_prompt;
    if (p->n_stop > 0) {
        const char **stop = calloc((size_t)p->n_stop, sizeof(*stop));
        if (stop == NULL)
            goto oom;
        r->p.stop = stop;
        for (; r->p.n_stop < p->n_stop; r->p.n_stop++)
            if ((stop[r->p.n_stop] = strdup(p->stop[r->p.n_stop])) == NULL)
                goto oom;
    }
    if (p->n_stop_ids > 0) {
        int32_t *ids = malloc((size_t)p->n_stop_ids * sizeof(int32_t));
        if (ids == NULL)
            goto oom;
        memcpy(ids, p->stop_ids, (size_t)p->n_stop_ids * sizeof(int32_t));
        r->p.stop_ids = ids;
        r->p.n_stop_ids = p->n_stop_ids;
    }
    int status = llmem_sampler_create(&p->sampling, e->vocab, &r->sampler);
    if (status == LLMEM_OK)
        status = llmem_detok_create(e->tok, 1, &r->detok);
    if (status != LLMEM_OK) {
        request_free(r);
        return status;
    }
    r->t_submit = llmem_engine_now_s();
    *out = r;
    return LLMEM_OK;
oom:
    request_free(r);
    LLMEM_ERROR("out of memory");
    return LLMEM_ENOMEM;
}

/* Ends a request: the held-back text flushed (unless a stop string cut it), its KV banked and
 * freed, on_done called with the result, the request freed. status ≠ LLMEM_OK: an error for the
 * client (message). */
static void request_finish(struct llmem_engine *e, struct request *r, const char *reason,
                           int status, const char *message) {
    struct llmem_generate_result res = {0};
    double now = llmem_engine_now_s();
    if (status == LLMEM_OK && !r->stop_string) {
        char *rest = NULL;
        if ((status = llmem_detok_finish(r->detok, &rest)) == LLMEM_OK) {
            status = stream_append(&r->s, rest);
            free(rest);
        }
        if (status == LLMEM_OK && r->s.emitted < r->s.len && r->ev.on_token != NULL) {
            struct llmem_token_event ev = {
                .id = -1, .text = r->s.text + r->s.emitted, .len = r->s.len - r->s.emitted};
            r->ev.on_token(r->ev.arg, &ev);
        }
        r->s.emitted = r->s.len;
        if (status != LLMEM_OK)
            message = "out of memory";
    }
    if (status == LLMEM_OK && r->s.text == NULL)
        status = stream_append(&r->s, "");
    if (r->seq >= 0) {
        llmem_engine_bank_sequence(e, r->seq, r->toks, r->pos);
        llmem_kv_seq_free(e->kv, r->seq);
        r->seq = -1;
    }
    if (status != LLMEM_OK && message != NULL && strcmp(message, llmem_last_error()) != 0)
        LLMEM_ERROR("%s", message); /* once: a message already logged is the last error */
    struct llmem_engine_metrics *c = &e->counters;
    if (status == LLMEM_OK) {
        res.n_ids = r->n_toks - r->n_prompt;
        res.ids = r->toks + r->n_prompt;
        res.text = r->s.text;
        res.text_len = r->s.len;
        res.finish_reason = reason;
        res.prompt_tokens = r->n_prompt;
        res.reused_tokens = r->reused_ram + r->reused_disk;
        res.reused_ram_tokens = r->reused_ram;
        res.reused_disk_tokens = r->reused_disk;
        res.ttft_ms = r->t_first > 0 ? (r->t_first - r->t_submit) * 1e3 : 0;
        res.prefill_s = r->t_first > 0 ? r->t_first - r->t_admit : now - r->t_admit;
        res.decode_s = r->t_first > 0 ? now - r->t_first : 0;
        res.decode_tokens = r->decode_tokens;
        if (strcmp(reason, "cancelled") == 0)
            c->requests_cancelled++;
        else
            c->requests_ok++;
    } else if (status == LLMEM_ENOMEM && r->t_first == 0) {
        c->requests_refused++;
    } else {
        c->requests_failed++;
    }
    publish(e); /* the metrics count it before its client hears */
    if (r->ev.on_done != NULL)
        r->ev.on_done(r->ev.arg, status, status == LLMEM_OK ? &res : NULL, message);
    request_free(r);
}

/* A row of a step's output: the logits, or on a device only their largest k (ids, vals). */
struct out_row {
    const float *logits;
    const int32_t *ids;
    const float *vals;
    int64_t k;
};

/* The time of r's next token (the first, or one more of its decode). */
static void token_time(struct llmem_engine *e, struct request *r) {
    double now = llmem_engine_now_s();
    if (r->t_first == 0) {
        r->t_first = now;
        observe(&e->counters.ttft, now - r->t_submit);
    } else {
        observe(&e->counters.inter_token, now - r->t_last);
        r->decode_tokens++;
    }
    r->t_last = now;
}

/* Samples r's next token: appended to toks and pending (hand_over gives it to the client),
 * r->ending set when it is the last one ("length"). Returns "stop" for an end-of-sequence id
 * (nothing appended, the request ends now), else NULL. */
static const char *request_sample(struct llmem_engine *e, struct request *r, struct out_row row) {
    const float *logits = row.logits;
    int32_t id = logits != NULL ? llmem_sampler_sample(r->sampler, logits)
                                : llmem_sampler_sample_top(r->sampler, row.ids, row.vals, row.k);
    if (is_stop_id(e, &r->p, id)) {
        token_time(e, r);
        return "stop";
    }
    if (r->p.logprobs >= 0) /* (the whole row came back: top_k_for) */
        llmem_logprobs(logits, e->vocab, r->p.sampling.temperature, id, r->p.logprobs, &r->lp,
                       r->lp_ids, r->lp_vals);
    r->toks[r->n_toks++] = id;
    e->counters.generated_tokens++;
    r->pending = 1;
    if (r->n_toks - r->n_prompt == r->max_tokens)
        r->ending = "length";
    return NULL;
}

/* Hands r's pending token to the client: its text (held back while it may start a stop string)
 * through on_token. Returns the reason r ends (`status` says how): a stop string, a cancel by
 * the client, an error, or r->ending; NULL while it goes on. */
static const char *hand_over(struct llmem_engine *e, struct request *r, int *status) {
    *status = LLMEM_OK;
    r->pending = 0;
    token_time(e, r);
    const int32_t id = r->toks[r->n_toks - 1];
    char *piece = NULL;
    if ((*status = llmem_detok_push(r->detok, id, &piece)) == LLMEM_OK) {
        *status = stream_append(&r->s, piece);
        free(piece);
    }
    if (*status != LLMEM_OK)
        return "error";
    size_t safe = 0;
    int64_t stop_at = find_stop(&r->s, &r->p, &safe);
    if (stop_at >= 0) {
        r->s.len = (size_t)stop_at;
        r->s.text[r->s.len] = '\0';
        safe = r->s.len;
        r->stop_string = 1;
    }
    int cancel = 0;
    if (r->ev.on_token != NULL) {
        struct llmem_token_event ev = {
            .id = id, .text = r->s.text + r->s.emitted, .len = safe - r->s.emitted};
        if (r->p.logprobs >= 0) {
            ev.logprob = r->lp;
            ev.n_top = r->p.logprobs;
            ev.top_ids = r->lp_ids;
            ev.top_logprobs = r->lp_vals;
        }
        cancel = r->ev.on_token(r->ev.arg, &ev);
    }
    r->s.emitted = safe;
    if (stop_at >= 0)
        return "stop";
    if (cancel)
        return "cancelled";
    return r->ending;
}

/* ---- the running set ------------------------------------------------------------------------- */

static void list_remove(struct request **head, struct request *r) {
    for (struct request **p = head; *p != NULL; p = &(*p)->next) {
        if (*p == r) {
            *p = r->next;
            r->next = NULL;
            return;
        }
    }
}

static void list_append(struct request **head, struct request *r) {
    struct request **p = head;
    while (*p != NULL)
        p = &(*p)->next;
    r->next = NULL;
    *p = r;
}

/* Takes r out of the running set and ends it. */
static void finish_running(struct llmem_engine *e, struct request *r, const char *reason,
                           int status, const char *message) {
    list_remove(&e->running, r);
    e->n_running--;
    request_finish(e, r, reason, status, message);
}

/* Takes r out of the running set, its KV banked: it waits again at the head of the queue and
 * resumes from the bank. */
static void preempt(struct llmem_engine *e, struct request *r) {
    list_remove(&e->running, r);
    e->n_running--;
    llmem_engine_bank_sequence(e, r->seq, r->toks, r->pos);
    llmem_kv_seq_free(e->kv, r->seq);
    r->seq = -1;
    r->pos = 0;
    r->next = e->waiting;
    e->waiting = r;
    e->counters.preemptions++;
}

static struct request *newest_running(struct llmem_engine *e) {
    struct request *n = NULL;
    for (struct request *r = e->running; r != NULL; r = r->next)
        if (n == NULL || r->age > n->age)
            n = r;
    return n;
}

static int64_t blocks_of(const struct llmem_engine *e, int64_t tokens) {
    const int64_t bs = llmem_kv_block_size(e->kv);
    return (tokens + bs - 1) / bs;
}

/* Admits waiting requests while there is room: a sequence from the bank, then the blocks of its
 * first chunk. A request that cannot fit even alone in the pool is refused before its prefill;
 * one that only lacks room now waits for the running ones. */
static void admit(struct llmem_engine *e) {
    const int paged = e->cfg.kv_layout == LLMEM_KV_LAYOUT_PAGED;
    while (e->waiting != NULL && e->n_running < e->cfg.max_sequences) {
        struct request *r = e->waiting;
        if (e->refusing) {
            e->waiting = r->next;
            request_finish(e, r, "error", LLMEM_ENOMEM,
                           "refused: the machine is under critical memory pressure; no new "
                           "request is admitted until it clears");
            continue;
        }
        int64_t footprint = blocks_of(e, r->n_prompt + r->max_tokens);
        int64_t pool = paged ? llmem_kv_blocks_free(e->kv) : 0;
        for (struct request *q = e->running; paged && q != NULL; q = q->next)
            pool += blocks_of(e, llmem_kv_seq_length(e->kv, q->seq));
        if (paged && e->bank != NULL) {
            struct llmem_bank_stats bs;
            llmem_bank_stats(e->bank, &bs);
            pool += bs.blocks;
        }
        if (paged) { /* banked blocks a running request shares are counted twice above */
            struct llmem_kv_stats ks;
            llmem_kv_stats(e->kv, &ks);
            pool = pool < ks.n_blocks ? pool : ks.n_blocks;
        }
        if (paged && footprint > pool) {
            char msg[512], b1[32], b2[32];
            int64_t bb = llmem_kv_block_bytes(e->kv);
            snprintf(msg, sizeof(msg),
                     "refused before prefill: the request needs %" PRId64 " KV blocks (%s: %" PRId64
                     " prompt tokens + up to %" PRId64 " generated) but the pool holds %" PRId64
                     " (%s); shorten the prompt or max_tokens, or quantize the KV (--kv-format q8)",
                     footprint, llmem_size_format_short(footprint * bb, b1, sizeof(b1)),
                     r->n_prompt, r->max_tokens, pool,
                     llmem_size_format_short(pool * bb, b2, sizeof(b2)));
            e->waiting = r->next;
            request_finish(e, r, "error", LLMEM_ENOMEM, msg);
            continue;
        }
        /* Not even a block beyond the running requests' headroom could be freed: wait, without a
         * bank lookup (and a disk load) that would only be undone. */
        if (paged && e->n_running > 0) {
            int64_t reclaimable = llmem_kv_blocks_free(e->kv);
            if (e->bank != NULL) {
                struct llmem_bank_stats bs;
                llmem_bank_stats(e->bank, &bs);
                reclaimable += bs.blocks;
            }
            if (reclaimable < e->n_running + 1)
                break;
        }
        int seq = -1;
        int64_t from_ram = 0, from_disk = 0;
        int status =
            llmem_engine_start_sequence(e, r->toks, r->n_toks, &seq, &from_ram, &from_disk);
        const int64_t reused = from_ram + from_disk;
        if (status == LLMEM_ERANGE && e->n_running > 0)
            break; /* every sequence slot is taken (an embedder holds some): wait */
        if (status != LLMEM_OK) {
            e->waiting = r->next;
            request_finish(e, r, "error", status, llmem_last_error());
            continue;
        }
        int64_t first = r->n_toks - reused;
        if (first > e->cfg.max_batch_tokens)
            first = e->cfg.max_batch_tokens;
        /* Room for its first chunk, and a block of headroom for each running request (the next
         * block its decoding needs), or the newcomer would soon be preempted again. */
        const int64_t headroom = e->n_running;
        if (paged && llmem_engine_make_room(e, seq, reused + first, headroom) + headroom >
                         llmem_kv_blocks_free(e->kv)) {
            /* no room yet: the running requests go first */
            llmem_kv_seq_free(e->kv, seq);
            if (e->n_running == 0) { /* cannot happen: with nothing running the pool is free */
                e->waiting = r->next;
                request_finish(e, r, "error", LLMEM_ENOMEM, "out of KV blocks");
                continue;
            }
            break;
        }
        e->waiting = r->next;
        r->seq = seq;
        r->pos = reused;
        r->age = e->admitted++;
        if (r->t_admit == 0) {
            r->t_admit = llmem_engine_now_s();
            r->reused_ram = from_ram, r->reused_disk = from_disk;
            e->reused_ram_tokens += from_ram;
            e->reused_disk_tokens += from_disk;
            e->counters.reused_tokens += reused;
            e->counters.prompt_tokens += r->n_prompt;
        }
        list_append(&e->running, r);
        e->n_running++;
    }
}

/* One entry of the step's batch. */
struct slot {
    struct request *r;
    int64_t n;
};

/* The step's batch: decodes first (one token each, oldest first), then prefill chunks in
 * admission order within max_batch_tokens; blocks for all of it are made free by evicting banked
 * blocks, then by preempting the newest requests (never the last one: its blocks fit the pool, as
 * admission checked, unless something else holds blocks — its step then fails and it ends).
 * Returns the slots filled. */
static int plan_batch(struct llmem_engine *e, struct slot *slots, int32_t *tokens,
                      struct llmem_batch_seq *seqs) {
    const int paged = e->cfg.kv_layout == LLMEM_KV_LAYOUT_PAGED;
    for (;;) {
        int n = 0;
        int64_t budget = e->cfg.max_batch_tokens, need = 0;
        for (int pass = 0; pass < 2; pass++) {
            for (struct request *r = e->running; r != NULL; r = r->next) {
                int64_t left = r->n_toks - r->pos;
                if ((pass == 0) != (left == 1) || budget == 0)
                    continue;
                int64_t take = left < budget ? left : budget;
                slots[n] = (struct slot){r, take};
                budget -= take;
                if (paged)
                    need += llmem_engine_make_room(e, r->seq, r->pos + take, need);
                n++;
            }
        }
        if (!paged || need <= llmem_kv_blocks_free(e->kv) || e->n_running == 1) {
            int64_t at = 0;
            for (int i = 0; i < n; i++) {
                struct request *r = slots[i].r;
                memcpy(tokens + at, r->toks + r->pos, (size_t)slots[i].n * sizeof(int32_t));
                seqs[i] =
                    (struct llmem_batch_seq){.seq = r->seq, .pos = r->pos, .n_tokens = slots[i].n};
                at += slots[i].n;
            }
            return n;
        }
        preempt(e, newest_running(e));
    }
}

/* Takes what the other threads queued: new requests and cancellations. */
static void intake(struct llmem_engine *e) {
    pthread_mutex_lock(&e->mu);
    struct request *in = e->incoming;
    e->incoming = NULL;
    uint64_t cancels[64];
    int64_t n_cancels = e->n_cancels < 64 ? e->n_cancels : 64;
    if (n_cancels > 0) { /* e->cancels is NULL until the first cancel */
        memcpy(cancels, e->cancels, (size_t)n_cancels * sizeof(uint64_t));
        memmove(e->cancels, e->cancels + n_cancels,
                (size_t)(e->n_cancels - n_cancels) * sizeof(uint64_t));
        e->n_cancels -= n_cancels;
    }
    pthread_mutex_unlock(&e->mu);
    while (in != NULL) {
        struct request *next = in->next;
        list_append(&e->waiting, in);
        in = next;
    }
    for (int64_t i = 0; i < n_cancels; i++) {
        for (struct request *r = e->waiting; r != NULL; r = r->next)
            if (r->id == cancels[i]) {
                list_remove(&e->waiting, r);
                request_finish(e, r, "cancelled", LLMEM_OK, NULL);
                break;
            }
        for (struct request *r = e->running; r != NULL; r = r->next)
            if (r->id == cancels[i]) {
                if (r->in_flight) /* (in the pass queued ahead) */
                    r->ending = "cancelled", r->ending_status = LLMEM_OK;
                else
                    finish_running(e, r, "cancelled", LLMEM_OK, NULL);
                break;
            }
    }
}

static int64_t count(const struct request *r) {
    int64_t n = 0;
    for (; r != NULL; r = r->next)
        n++;
    return n;
}

/* Refreshes the snapshot that llmem_engine_metrics returns. */
static void publish(struct llmem_engine *e) {
    struct llmem_engine_metrics m = e->counters;
    m.running = e->n_running;
    m.waiting = count(e->waiting);
    if (e->cfg.kv_layout == LLMEM_KV_LAYOUT_PAGED) {
        struct llmem_kv_stats ks;
        llmem_kv_stats(e->kv, &ks);
        m.kv_blocks_free = ks.n_blocks_free;
        m.kv_blocks_used = ks.n_blocks_used;
        m.kv_block_bytes = llmem_kv_block_bytes(e->kv);
    }
    llmem_engine_bank_stats(e, &m.bank);
    struct llmem_mem_stats st;
    llmem_mem_stats(e->mem, &st);
    m.mem_active = st.active_bytes, m.mem_peak = st.peak_bytes, m.mem_cache = st.cache_bytes;
    m.mem_limit = st.memory_limit_bytes;
    m.guard_level = e->guard.prev;
    m.refusing = e->refusing;
    pthread_mutex_lock(&e->mu);
    m.waiting += count(e->incoming);
    e->snapshot = m;
    pthread_mutex_unlock(&e->mu);
}

/* On a device, how many of each row's largest logits the step needs when every request that
 * samples in it can do with at most LLMEM_TOP_K_MAX of them and wants no log-probabilities; else 0
 * (the whole rows; also with LLMEM_SAMPLE_ON_DEVICE=0). The top path's ids and values go to the
 * logits buffer, which holds them when vocab ≥ 2 × LLMEM_TOP_K_MAX. */
static int top_k_for(const struct llmem_engine *e, const struct slot *slots, int n) {
    if (!e->top_on_device || !llmem_forward_has_top(e->fwd) || e->vocab < 2 * LLMEM_TOP_K_MAX)
        return 0;
    int64_t k = 1;
    for (int i = 0; i < n; i++) {
        const struct request *r = slots[i].r;
        if (r->pos + slots[i].n < r->n_toks) /* a prefill chunk with more to come */
            continue;
        int64_t need = llmem_sampling_top_needed(&r->p.sampling);
        if (need < 1 || need > LLMEM_TOP_K_MAX || r->p.logprobs >= 0)
            return 0;
        k = need > k ? need : k;
    }
    return (int)k;
}

/* Whether the step just started (slots, k = 1) can have the next one queued behind it, its tokens
 * fed on the device: it holds every running request, each decoding greedily with more tokens to
 * come after this step's, none ending; none waits for admission, and each could take a new block
 * without evicting banked ones. */
static int can_go_ahead(const struct llmem_engine *e, const struct slot *slots, int n) {
    if (!e->decode_ahead || n != e->n_running || e->waiting != NULL ||
        !llmem_forward_has_next(e->fwd) ||
        (e->cfg.kv_layout == LLMEM_KV_LAYOUT_PAGED && llmem_kv_blocks_free(e->kv) < n))
        return 0;
    for (int i = 0; i < n; i++) {
        const struct request *r = slots[i].r;
        if (slots[i].n != 1 || r->pos + 1 != r->n_toks || r->ending != NULL || r->in_flight != 1 ||
            r->n_toks + 1 - r->n_prompt >= r->max_tokens)
            return 0;
    }
    return 1;
}

/* The step queued ahead, waited for and dropped (its tokens not taken). */
static void drop_ahead(struct llmem_engine *e) {
    if (e->n_ahead == 0)
        return;
    (void)llmem_forward_wait(e->fwd); /* (a failure restored the lengths) */
    for (int i = 0; i < e->n_ahead; i++) {
        struct request *r = e->ahead[i];
        r->in_flight--;
        llmem_kv_set_length(e->kv, r->seq, r->pos);
    }
    e->n_ahead = 0;
}

/* Hands over the pending tokens of the requests on `list` (e->running or e->waiting) and ends
 * those that end; one in the pass in flight ends after it (r->ending). */
static void hand_over_all(struct llmem_engine *e, struct request **list) {
    for (struct request *r = *list, *next; r != NULL; r = next) {
        next = r->next;
        if (!r->pending)
            continue;
        int st;
        const char *reason = hand_over(e, r, &st);
        if (reason == NULL)
            continue;
        if (r->in_flight) {
            r->ending = reason, r->ending_status = st;
            continue;
        }
        if (list == &e->running) {
            finish_running(e, r, reason, st, st == LLMEM_OK ? NULL : "out of memory");
        } else {
            list_remove(list, r);
            request_finish(e, r, reason, st, st == LLMEM_OK ? NULL : "out of memory");
        }
    }
}

/* One scheduler step: intake, the requests that ended last step finished, admission, one forward
 * pass started; while the device computes it, the tokens sampled last step handed to the clients
 * (detokenized, stop strings, on_token; before the pass when it prefills); then the pass's tokens
 * sampled. A request whose stop string or cancel shows while it is in the pass ends after it (the
 * pass's token discarded). Returns the requests still waiting or running. */
static int64_t sched_step(struct llmem_engine *e) {
    const double t_step = llmem_engine_now_s();
    intake(e);
    for (struct request *r = e->running, *next; r != NULL; r = next) {
        next = r->next;
        if (r->ending != NULL && !r->in_flight) { /* its last token, then the end */
            int st = LLMEM_OK;
            const char *reason = r->pending ? hand_over(e, r, &st) : r->ending;
            finish_running(e, r, reason, st, st == LLMEM_OK ? NULL : "out of memory");
        }
    }
    llmem_engine_guard_check(e, e->n_running > 0);
    admit(e);
    /* The last step's tokens are handed over while the device computes this one when it is a
     * replayed decode step. Other passes queue their launches one by one (and a recording
     * instantiates a graph), which takes the host long enough: the tokens go first. */
    int overlap = e->n_running > 0 && llmem_forward_replays(e->fwd, (int)e->n_running);
    for (struct request *r = e->running; r != NULL; r = r->next)
        overlap &= r->n_toks - r->pos <= 1;
    overlap |= e->n_ahead > 0; /* (queued already) */
    if (!overlap) {
        hand_over_all(e, &e->running);
        hand_over_all(e, &e->waiting);
    }
    if (e->n_running > 0) {
        struct slot slots[e->n_running];
        double t_forward = llmem_engine_now_s();
        int n, k, status = LLMEM_OK;
        size_t at = 0;        /* where the step's ids and values go in e->logits */
        if (e->n_ahead > 0) { /* queued during the last step */
            n = e->n_ahead, k = 1, at = e->ahead_at;
            for (int i = 0; i < n; i++)
                slots[i] = (struct slot){e->ahead[i], 1};
            e->n_ahead = 0;
        } else {
            struct llmem_batch_seq seqs[e->n_running];
            int32_t *tokens = malloc((size_t)e->cfg.max_batch_tokens * sizeof(int32_t));
            n = tokens != NULL ? plan_batch(e, slots, tokens, seqs) : 0;
            k = n > 0 ? top_k_for(e, slots, n) : 0;
            status = n <= 0  ? LLMEM_ENOMEM
                     : k > 0 ? llmem_forward_start_top(e->fwd, tokens, seqs, n, k,
                                                       (int32_t *)(void *)e->logits,
                                                       e->logits + (size_t)n * (size_t)k)
                             : llmem_forward_run(e->fwd, tokens, seqs, n, e->logits);
            free(tokens);
            for (int i = 0; i < n; i++) /* (queued or not: a request of the batch ends after it) */
                slots[i].r->in_flight = 1;
        }
        int32_t *top_ids = (int32_t *)(void *)(e->logits + at);
        float *top_vals = e->logits + at + (size_t)n * (size_t)k;
        if (status == LLMEM_OK && k == 1 && can_go_ahead(e, slots, n)) {
            /* the next step queued now, its ids and values beside this one's */
            const size_t next_at = at == 0 ? 2 * (size_t)n : 0;
            if (llmem_forward_start_next(e->fwd, (int32_t *)(void *)(e->logits + next_at),
                                         e->logits + next_at + n) == LLMEM_OK) {
                for (int i = 0; i < n; i++) {
                    e->ahead[i] = slots[i].r;
                    slots[i].r->in_flight++;
                }
                e->n_ahead = n, e->ahead_at = next_at;
                e->counters.ahead_steps++;
            }
        }
        double forward_s = llmem_engine_now_s() - t_forward;
        hand_over_all(e, &e->running); /* (none pending if they went first) */
        hand_over_all(e, &e->waiting);
        t_forward = llmem_engine_now_s();
        if (status == LLMEM_OK)
            status = llmem_forward_wait(e->fwd);
        forward_s += llmem_engine_now_s() - t_forward;
        e->counters.forward_seconds += forward_s;
        e->counters.steps++;
        for (int i = 0; i < n; i++)
            if (slots[i].r->pos < slots[i].r->n_toks - 1 || slots[i].n > 1) {
                e->counters.prefill_steps++;
                e->counters.prefill_forward_seconds += forward_s;
                break;
            }
        if (status != LLMEM_OK && e->n_ahead > 0) { /* the step queued ahead failed with it */
            for (int i = 0; i < e->n_ahead; i++)
                e->ahead[i]->in_flight--;
            e->n_ahead = 0;
        }
        for (int i = 0; i < n; i++) { /* the pass done: KV written (OK) or lengths restored */
            struct request *r = slots[i].r;
            r->in_flight--;
            if (status == LLMEM_OK && r->pos + slots[i].n <= r->n_toks)
                r->pos += slots[i].n;
            else if (status == LLMEM_OK) /* fed on the device a token it did not take (a stop) */
                llmem_kv_set_length(e->kv, r->seq, r->pos);
            if (r->ending != NULL && !r->in_flight) {
                slots[i].r = NULL;
                finish_running(e, r, r->ending, r->ending_status,
                               r->ending_status == LLMEM_OK ? NULL : "out of memory");
            }
        }
        if (status != LLMEM_OK) {
            /* An allocation failure: the bank halves and the newest request ends (SPEC §6.5). */
            struct llmem_bank_stats bs = {0};
            if (e->bank != NULL) {
                llmem_bank_stats(e->bank, &bs);
                llmem_bank_trim(e->bank, bs.bytes / 2);
            }
            struct request *r = newest_running(e);
            if (r != NULL)
                finish_running(e, r, "error", status,
                               status == LLMEM_ENOMEM ? "out of memory during the request"
                                                      : llmem_last_error());
        } else {
            for (int i = 0; i < n; i++) {
                struct request *r = slots[i].r;
                if (r == NULL || r->pos < r->n_toks || r->ending != NULL)
                    continue;
                struct out_row row = {.logits = e->logits + (size_t)i * (size_t)e->vocab};
                if (k > 0)
                    row = (struct out_row){.ids = top_ids + (size_t)i * (size_t)k,
                                           .vals = top_vals + (size_t)i * (size_t)k,
                                           .k = k};
                const char *reason = request_sample(e, r, row);
                if (reason != NULL && r->in_flight) /* in the step queued ahead: after it */
                    r->ending = reason, r->ending_status = LLMEM_OK;
                else if (reason != NULL)
                    finish_running(e, r, reason, LLMEM_OK, NULL);
            }
        }
    }
    /* the bank's budget at the working set now in flight (SPEC §2.3, §6.2) */
    int64_t blocks = 0;
    for (struct request *r = e->running; r != NULL; r = r->next)
        blocks += blocks_of(e, r->n_toks);
    llmem_engine_bank_budget(e, blocks);
    e->counters.step_seconds += llmem_engine_now_s() - t_step;
    publish(e);
    return e->n_running + count(e->waiting);
}

/* ---- one request on the caller's thread ------------------------------------------------------ */

struct sync_call {
    llmem_token_fn on_token;
    void *arg;
    llmem_progress_fn progress;
    void *progress_arg;
    struct llmem_generate_result *out;
    int status;
    int done;
};

static int sync_token(void *arg, const struct llmem_token_event *ev) {
    struct sync_call *c = arg;
    return c->on_token != NULL ? c->on_token(c->arg, ev->id, ev->text, ev->len) : 0;
}

static void sync_done(void *arg, int status, const struct llmem_generate_result *r,
                      const char *message) {
    (void)message;
    struct sync_call *c = arg;
    c->status = status;
    c->done = 1;
    if (status != LLMEM_OK)
        return;
    *c->out = *r;
    c->out->ids = malloc((size_t)(r->n_ids > 0 ? r->n_ids : 1) * sizeof(int32_t));
    c->out->text = malloc(r->text_len + 1);
    if (c->out->ids == NULL || c->out->text == NULL) {
        llmem_generate_result_free(c->out);
        c->status = LLMEM_ENOMEM;
        return;
    }
    memcpy(c->out->ids, r->ids, (size_t)r->n_ids * sizeof(int32_t));
    memcpy(c->out->text, r->text, r->text_len + 1);
}

int llmem_engine_generate(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt,
                          const struct llmem_generate_params *p, llmem_token_fn on_token, void *arg,
                          struct llmem_generate_result *result) {
    memset(result, 0, sizeof(*result));
    LLMEM_ASSERT(!e->serving);
    struct sync_call call = {.on_token = on_token, .arg = arg, .out = result};
    struct llmem_request_events ev = {.on_token = sync_token, .on_done = sync_done, .arg = &call};
    struct request *r = NULL;
    int status = request_new(e, prompt, n_prompt, p, &ev, &r);
    if (status != LLMEM_OK)
        return status;
    list_append(&e->waiting, r);
    while (!call.done) {
        if (p->prefill_progress != NULL && e->running == r)
            p->prefill_progress(p->progress_arg, r->pos, r->n_prompt);
        sched_step(e);
    }
    if (call.status == LLMEM_ENOMEM)
        LLMEM_ERROR("the request ends: out of memory");
    return call.status;
}

/* ---- serving --------------------------------------------------------------------------------- */

/* Ends every request as cancelled (the scheduler is not running). */
static void cancel_all(struct llmem_engine *e) {
    drop_ahead(e);
    intake(e);
    while (e->running != NULL) {
        struct request *r = e->running;
        e->running = r->next;
        e->n_running--;
        request_finish(e, r, "cancelled", LLMEM_OK, NULL);
    }
    while (e->waiting != NULL) {
        struct request *r = e->waiting;
        e->waiting = r->next;
        request_finish(e, r, "cancelled", LLMEM_OK, NULL);
    }
    pthread_mutex_lock(&e->mu);
    e->queued = 0;
    pthread_mutex_unlock(&e->mu);
    publish(e);
}

static void *sched_thread(void *arg) {
    struct llmem_engine *e = arg;
    int64_t active = 0;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stopping && active == 0 && e->incoming == NULL && e->n_cancels == 0 &&
               !e->clear_requested) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 1; /* the guard looks at least once a second */
            if (pthread_cond_timedwait(&e->wake, &e->mu, &until) != 0)
                break;
        }
        int stopping = e->stopping, clear = e->clear_requested;
        pthread_mutex_unlock(&e->mu);
        if (stopping)
            break;
        if (clear) {
            int64_t bytes = llmem_engine_release_caches(e);
            publish(e); /* whoever asked sees the emptied bank in the metrics */
            pthread_mutex_lock(&e->mu);
            e->clear_requested = 0;
            e->cleared_bytes = bytes;
            e->clear_generation++;
            pthread_cond_broadcast(&e->done);
            pthread_mutex_unlock(&e->mu);
        }
        if (active == 0)
            llmem_engine_guard_check(e, 0);
        active = sched_step(e);
        pthread_mutex_lock(&e->mu);
        e->queued = active + count(e->incoming);
        pthread_mutex_unlock(&e->mu);
    }
    return NULL;
}

int llmem_engine_serve_start(struct llmem_engine *e, const struct llmem_serve_config *config) {
    if (e->serving) {
        LLMEM_ERROR("the engine is serving already");
        return LLMEM_EINVAL;
    }
    e->max_queue = config != NULL && config->max_queue > 0 ? config->max_queue : QUEUE_DEFAULT;
    pthread_mutex_lock(&e->mu);
    e->stopping = 0;
    e->serving = 1; /* before the thread runs: submit reads it under mu */
    pthread_mutex_unlock(&e->mu);
    if (pthread_create(&e->thread, NULL, sched_thread, e) != 0) {
        pthread_mutex_lock(&e->mu);
        e->serving = 0;
        pthread_mutex_unlock(&e->mu);
        LLMEM_ERROR("cannot start the scheduler thread");
        return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

void llmem_engine_serve_stop(struct llmem_engine *e) {
    if (!e->serving)
        return;
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    pthread_mutex_lock(&e->mu);
    e->serving = 0;
    pthread_cond_broadcast(&e->done); /* a cache clear the thread left undone waits no more */
    pthread_mutex_unlock(&e->mu);
    cancel_all(e);
}

void llmem_engine_sched_fini(struct llmem_engine *e) {
    llmem_engine_serve_stop(e);
    if (e->kv != NULL && e->mem != NULL) /* an engine that opened */
        cancel_all(e);
    free(e->cancels);
    free(e->ahead);
    pthread_cond_destroy(&e->done);
    pthread_cond_destroy(&e->wake);
    pthread_mutex_destroy(&e->mu);
}

int llmem_engine_submit(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt,
                        const struct llmem_generate_params *params,
                        const struct llmem_request_events *events, uint64_t *id) {
    struct request *r = NULL;
    int status = request_new(e, prompt, n_prompt, params, events, &r);
    if (status != LLMEM_OK)
        return status;
    pthread_mutex_lock(&e->mu);
    if (!e->serving || e->stopping) {
        /* nothing would ever step it: the scheduler thread is not running or has taken its
         * last intake */
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        LLMEM_ERROR("the engine is not serving");
        return LLMEM_EINVAL;
    }
    if (e->queued >= e->max_queue + e->cfg.max_sequences) {
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        LLMEM_ERROR("the queue is full (%" PRId64 " requests waiting)", e->max_queue);
        return LLMEM_EBUSY;
    }
    r->id = e->next_id++;
    *id = r->id;
    list_append(&e->incoming, r);
    e->queued++;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    return LLMEM_OK;
}

void llmem_engine_cancel(struct llmem_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    if (e->n_cancels == e->cap_cancels) {
        int64_t cap = e->cap_cancels ? 2 * e->cap_cancels : 16;
        uint64_t *c = realloc(e->cancels, (size_t)cap * sizeof(uint64_t));
        if (c == NULL) {
            pthread_mutex_unlock(&e->mu);
            return; /* the request then runs to its end */
        }
        e->cancels = c;
        e->cap_cancels = cap;
    }
    e->cancels[e->n_cancels++] = id;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

int64_t llmem_engine_clear_cache(struct llmem_engine *e) {
    if (!e->serving)
        return llmem_engine_release_caches(e);
    pthread_mutex_lock(&e->mu);
    int64_t gen = e->clear_generation;
    e->clear_requested = 1;
    pthread_cond_signal(&e->wake);
    while (e->clear_generation == gen && e->serving)
        pthread_cond_wait(&e->done, &e->mu);
    int64_t bytes = e->cleared_bytes;
    pthread_mutex_unlock(&e->mu);
    return bytes;
}

void llmem_engine_metrics(struct llmem_engine *e, struct llmem_engine_metrics *m) {
    pthread_mutex_lock(&e->mu);
    *m = e->snapshot;
    pthread_mutex_unlock(&e->mu);
}

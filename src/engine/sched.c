/*
 * engine/sched.c — the requests and the queue of the scheduler (SPEC §7); the step policy is in
 * sched_step.c.
 *
 * A request is its tokens (the prompt, then what it generated) and how many of them have KV
 * written (`pos`). Other threads submit and cancel under a mutex; the stepping thread takes both
 * in at the start of each step (intake), and from then on a request is touched by it alone.
 * Serving steps on a thread of the scheduler's own, which also looks at the pressure guard at
 * least once a second while idle; llmem_sched_generate is one request stepped on the caller's
 * thread. A metrics snapshot is published under the mutex after every step and before every
 * request's on_done, so a client that hears of its end finds it counted.
 *
 * Text is streamed through the detokenizer; a stop string ends generation and is cut from the
 * text, and text that might be the start of a stop string is held back until it is not. Every
 * request accepted gets exactly one on_done, whatever ends it: its end, a cancel, a refusal, an
 * error, or the scheduler stopping.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "engine/sampler.h"
#include "engine/sched_int.h"
#include "llmem/kv.h"
#include "llmem/tokenizer.h"
#include "tok/tok_int.h"

/* Waiting requests beyond which submit says LLMEM_EBUSY, unless llmem_serve_config sets it. */
#define QUEUE_DEFAULT 256

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

/* Where the earliest stop string starts in the text (searching only where a new one can be), or
 * −1; and through *safe how much of the text can be emitted without splitting a possible stop
 * string. */
static int64_t find_stop(const struct stream *s, const struct llmem_generate_params *p,
                         size_t *safe) {
    *safe = s->len;
    int64_t first = -1; /* the earliest match of any of them, not the first listed that matches */
    for (int i = 0; i < p->n_stop; i++) {
        size_t n = strlen(p->stop[i]);
        if (n == 0)
            continue;
        const char *hit = memmem(s->text + s->emitted, s->len - s->emitted, p->stop[i], n);
        if (hit != NULL && (first < 0 || hit - s->text < first))
            first = hit - s->text;
        /* the longest tail of the text that begins the stop string */
        for (size_t k = n - 1; k > 0; k--) {
            if (k <= s->len - s->emitted && memcmp(s->text + s->len - k, p->stop[i], k) == 0) {
                if (s->len - k < *safe)
                    *safe = s->len - k;
                break;
            }
        }
    }
    return first;
}

/* An end-of-sequence id ends the output unless ignore_eos; under a grammar always (it comes only
 * where the output is complete: with ignore_eos, only where nothing else may). */
static int is_stop_id(const struct llmem_sched *s, const struct llmem_generate_params *p,
                      int32_t id) {
    for (int i = 0; (!p->ignore_eos || p->sampling.grammar != NULL) && i < s->cfg.n_eos; i++)
        if (s->cfg.eos[i] == id)
            return 1;
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] == id)
            return 1;
    return 0;
}

/* ---- a request's life ------------------------------------------------------------------------ */

static void request_free(struct request *r) {
    if (r == NULL)
        return;
    for (int i = 0; i < r->p.n_stop; i++)
        free((char *)r->p.stop[i]);
    free((void *)r->p.stop);
    free((void *)r->p.stop_ids);
    free((void *)r->p.sampling.end_ids);
    free(r->toks);
    free(r->s.text);
    llmem_detok_free(r->detok);
    llmem_sampler_free(r->sampler);
    free(r);
}

/* A request for the prompt, checked: LLMEM_EINVAL (logged) for an empty prompt, a prompt without
 * room in the context or an id outside the vocabulary; LLMEM_ENOMEM. */
static int request_new(struct llmem_sched *s, const int32_t *prompt, int64_t n_prompt,
                       const struct llmem_generate_params *p, const struct llmem_request_events *ev,
                       struct request **out) {
    const int64_t context = s->cfg.context;
    if (n_prompt <= 0 || n_prompt >= context) {
        LLMEM_ERROR("the prompt has %" PRId64 " tokens; it must have 1 to %" PRId64
                    " (the context window is %" PRId64 ")",
                    n_prompt, context - 1, context);
        return LLMEM_EINVAL;
    }
    for (int64_t i = 0; i < n_prompt; i++) {
        if (prompt[i] < 0 || prompt[i] >= s->cfg.vocab) {
            LLMEM_ERROR("token %" PRId64 " of the prompt is %d, outside the vocabulary (0 to "
                        "%" PRId64 ")",
                        i, prompt[i], s->cfg.vocab - 1);
            return LLMEM_EINVAL;
        }
    }
    if (p->logprobs > LLMEM_MAX_TOP_LOGPROBS) {
        LLMEM_ERROR("logprobs is %d; at most %d alternatives per token", p->logprobs,
                    LLMEM_MAX_TOP_LOGPROBS);
        return LLMEM_EINVAL;
    }
    if (p->max_tokens < 0 || p->n_stop < 0 || p->n_stop_ids < 0 ||
        (p->n_stop > 0 && p->stop == NULL) || (p->n_stop_ids > 0 && p->stop_ids == NULL)) {
        LLMEM_ERROR("bad generate parameters: max_tokens %" PRId64 " (≥ 0), %d stop strings and "
                    "%d stop ids (≥ 0, with their arrays)",
                    p->max_tokens, p->n_stop, p->n_stop_ids);
        return LLMEM_EINVAL;
    }
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= s->cfg.vocab) {
            LLMEM_ERROR("stop id %d is %d, outside the vocabulary (0 to %" PRId64 ")", i + 1,
                        p->stop_ids[i], s->cfg.vocab - 1);
            return LLMEM_EINVAL;
        }
    for (int i = 0; i < p->n_stop; i++) { /* the text it is looked for in is valid UTF-8 */
        if (p->stop[i] == NULL) {
            LLMEM_ERROR("stop string %d is NULL", i + 1);
            return LLMEM_EINVAL;
        }
        size_t n = strlen(p->stop[i]);
        if (llmem_tok_utf8_check(p->stop[i], n) != n) {
            LLMEM_ERROR("stop string %d is not valid UTF-8: it could never match", i + 1);
            return LLMEM_EINVAL;
        }
    }
    struct request *r = calloc(1, sizeof(*r));
    if (r == NULL)
        goto oom;
    r->seq = -1;
    r->p = *p;
    r->p.stop = NULL, r->p.n_stop = 0, r->p.stop_ids = NULL, r->p.n_stop_ids = 0;
    r->p.sampling.end_ids = NULL, r->p.sampling.n_end_ids = 0;
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
    int status = LLMEM_OK;
    if (p->sampling.grammar != NULL) { /* the output ends at an end id the grammar allows */
        int32_t *end = malloc((size_t)(s->cfg.n_eos + p->n_stop_ids + 1) * sizeof(int32_t));
        if (end == NULL && status == LLMEM_OK)
            status = LLMEM_ENOMEM;
        for (int i = 0; end != NULL && i < s->cfg.n_eos; i++)
            end[r->p.sampling.n_end_ids++] = s->cfg.eos[i];
        r->p.sampling.end_last = p->ignore_eos;
        for (int i = 0; end != NULL && i < p->n_stop_ids; i++)
            end[r->p.sampling.n_end_ids++] = p->stop_ids[i];
        r->p.sampling.end_ids = end;
        r->p.sampling.grammar_vocab = s->cfg.gvocab;
        r->p.sampling.max_tokens = r->max_tokens;
    }
    if (status == LLMEM_OK)
        status = llmem_sampler_create(&r->p.sampling, s->cfg.vocab, &r->sampler);
    if (status == LLMEM_OK) {
        llmem_sampler_prompt(r->sampler, prompt, n_prompt); /* (for repetition_penalty) */
        r->p.sampling.logit_bias = NULL; /* the caller's: the sampler holds a copy */
        status = llmem_detok_create(s->cfg.tok, !r->p.keep_special, &r->detok);
    }
    if (status != LLMEM_OK) {
        request_free(r);
        return status;
    }
    r->t_submit = llmem_clock_s();
    *out = r;
    return LLMEM_OK;
oom:
    request_free(r);
    LLMEM_ERROR("out of memory");
    return LLMEM_ENOMEM;
}

void llmem_sched_finish(struct llmem_sched *s, struct request *r, const char *reason, int status,
                        const char *message) {
    struct llmem_generate_result res = {0};
    double now = llmem_clock_s();
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
            message = llmem_sched_status_message(status);
    }
    if (status == LLMEM_OK && r->s.text == NULL)
        status = stream_append(&r->s, "");
    if (r->seq >= 0) {
        s->cfg.ops.bank_sequence(s->cfg.ctx, r->seq, r->toks, r->pos);
        llmem_kv_seq_free(s->cfg.kv, r->seq);
        r->seq = -1;
    }
    if (status != LLMEM_OK && message != NULL && strcmp(message, llmem_last_error()) != 0)
        LLMEM_ERROR("%s", message); /* once: a message already logged is the last error */
    struct llmem_engine_metrics *c = &s->counters;
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
    llmem_sched_publish(s); /* the metrics count it before its client hears */
    if (r->ev.on_done != NULL)
        r->ev.on_done(r->ev.arg, status, status == LLMEM_OK ? &res : NULL, message);
    request_free(r);
}

void llmem_sched_finish_running(struct llmem_sched *s, struct request *r, const char *reason,
                                int status, const char *message) {
    request_list_remove(&s->running, r);
    s->n_running--;
    llmem_sched_finish(s, r, reason, status, message);
}

/* ---- a request's tokens ---------------------------------------------------------------------- */

/* The time of r's next token (the first, or one more of its decode). */
static void token_time(struct llmem_sched *s, struct request *r) {
    double now = llmem_clock_s();
    if (r->t_first == 0) {
        r->t_first = now;
        observe(&s->counters.ttft, now - r->t_submit);
    } else {
        observe(&s->counters.inter_token, now - r->t_last);
        r->decode_tokens++;
    }
    r->t_last = now;
}

/* Whether the row the token was drawn from is finite where it matters: the drawn id's logit of a
 * whole row (a NaN anywhere in a pass spreads to every logit, and a row of NaN draws id 0), every
 * value of a top-k row. */
static int row_finite(struct out_row row, int32_t id) {
    if (row.logits != NULL)
        return isfinite(row.logits[id]);
    for (int64_t i = 0; i < row.k; i++)
        if (!isfinite(row.vals[i]))
            return 0;
    return 1;
}

/* Samples r's next token from its row: appended to toks and pending (hand_over gives it to the
 * client), r->ending set when it is the last one ("length"). Returns "stop" for an
 * end-of-sequence id (nothing appended, the request ends now), "error" with *status
 * LLMEM_ERANGE (logged) when the model's logits are not finite, else NULL. */
const char *llmem_sched_sample(struct llmem_sched *s, struct request *r, struct out_row row,
                               int *status) {
    const float *logits = row.logits;
    *status = LLMEM_OK;
    int32_t id = row.drawn >= 0   ? row.drawn
                 : logits != NULL ? llmem_sampler_sample(r->sampler, logits)
                                  : llmem_sampler_sample_top(r->sampler, row.ids, row.vals, row.k);
    if (!row_finite(row, id)) {
        LLMEM_ERROR("the model's logits are not finite (NaN or infinity) at position %" PRId64
                    ": its weights hold NaN or infinity, or its activations overflowed",
                    r->n_toks);
        *status = LLMEM_ERANGE;
        return "error";
    }
    if ((*status = llmem_sampler_status(r->sampler)) != LLMEM_OK) {
        LLMEM_ERROR("the output's grammar ran out of memory or of its planned %" PRId64
                    " bytes of parse stacks (a schema of many alternatives alike)",
                    LLMEM_GRAMMAR_STACK_BYTES);
        return "error";
    }
    if (is_stop_id(s, &r->p, id)) {
        token_time(s, r);
        return "stop";
    }
    if (r->p.logprobs >= 0) /* (the whole row came back: top_k_for) */
        llmem_logprobs(logits, s->cfg.vocab, r->p.sampling.temperature, id, r->p.logprobs, &r->lp,
                       r->lp_ids, r->lp_vals);
    r->toks[r->n_toks++] = id;
    llmem_sampler_accept(r->sampler, id);
    s->counters.generated_tokens++;
    r->pending = 1;
    if (llmem_sampler_must_end(r->sampler)) /* complete, and only an end could follow */
        r->ending = "stop";
    else if (r->n_toks - r->n_prompt == r->max_tokens)
        r->ending = "length";
    return NULL;
}

/* Hands r's pending token to the client: its text (held back while it may start a stop string)
 * through on_token. Returns the reason r ends (`status` says how): a stop string, a cancel by
 * the client, an error, or r->ending; NULL while it goes on. */
const char *llmem_sched_hand_over(struct llmem_sched *s, struct request *r, int *status) {
    *status = LLMEM_OK;
    r->pending = 0;
    token_time(s, r);
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

const char *llmem_sched_status_message(int status) {
    return status == LLMEM_OK       ? NULL
           : status == LLMEM_ENOMEM ? "out of memory"
                                    : llmem_last_error();
}

void llmem_sched_hand_over_all(struct llmem_sched *s, struct request **list) {
    for (struct request *r = *list, *next; r != NULL; r = next) {
        next = r->next;
        if (!r->pending)
            continue;
        int st;
        const char *reason = llmem_sched_hand_over(s, r, &st);
        if (reason == NULL)
            continue;
        if (r->in_flight) {
            r->ending = reason, r->ending_status = st;
            continue;
        }
        if (list == &s->running) {
            llmem_sched_finish_running(s, r, reason, st, llmem_sched_status_message(st));
        } else {
            request_list_remove(list, r);
            llmem_sched_finish(s, r, reason, st, llmem_sched_status_message(st));
        }
    }
}

/* ---- the queue ------------------------------------------------------------------------------- */

/* Takes what the other threads queued: new requests and cancellations. */
void llmem_sched_intake(struct llmem_sched *s) {
    pthread_mutex_lock(&s->mu);
    struct request *in = s->incoming;
    s->incoming = NULL;
    uint64_t cancels[64];
    int64_t n_cancels = s->n_cancels < 64 ? s->n_cancels : 64;
    if (n_cancels > 0) { /* s->cancels is NULL until the first cancel */
        memcpy(cancels, s->cancels, (size_t)n_cancels * sizeof(uint64_t));
        memmove(s->cancels, s->cancels + n_cancels,
                (size_t)(s->n_cancels - n_cancels) * sizeof(uint64_t));
        s->n_cancels -= n_cancels;
    }
    pthread_mutex_unlock(&s->mu);
    while (in != NULL) {
        struct request *next = in->next;
        request_list_append(&s->waiting, in);
        in = next;
    }
    for (int64_t i = 0; i < n_cancels; i++) {
        for (struct request *r = s->waiting; r != NULL; r = r->next)
            if (r->id == cancels[i]) {
                request_list_remove(&s->waiting, r);
                llmem_sched_finish(s, r, "cancelled", LLMEM_OK, NULL);
                break;
            }
        for (struct request *r = s->running; r != NULL; r = r->next)
            if (r->id == cancels[i]) {
                if (r->in_flight) /* (in the pass queued ahead) */
                    r->ending = "cancelled", r->ending_status = LLMEM_OK;
                else
                    llmem_sched_finish_running(s, r, "cancelled", LLMEM_OK, NULL);
                break;
            }
    }
}

/* Refreshes the snapshot that llmem_sched_metrics returns. */
void llmem_sched_publish(struct llmem_sched *s) {
    struct llmem_engine_metrics m = s->counters;
    m.running = s->n_running;
    m.waiting = request_list_count(s->waiting);
    if (s->cfg.paged) {
        struct llmem_kv_stats ks;
        llmem_kv_stats(s->cfg.kv, &ks);
        m.kv_blocks_free = ks.n_blocks_free;
        m.kv_blocks_used = ks.n_blocks_used;
        m.kv_block_bytes = llmem_kv_block_bytes(s->cfg.kv);
    }
    s->cfg.ops.metrics(s->cfg.ctx, &m); /* the bank, the allocator, the guard's level */
    m.refusing = s->refusing;
    pthread_mutex_lock(&s->mu);
    m.waiting += request_list_count(s->incoming);
    s->snapshot = m;
    pthread_mutex_unlock(&s->mu);
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

int llmem_sched_generate(struct llmem_sched *s, const int32_t *prompt, int64_t n_prompt,
                         const struct llmem_generate_params *p, llmem_token_fn on_token, void *arg,
                         struct llmem_generate_result *result) {
    memset(result, 0, sizeof(*result));
    if (s->serving) {
        LLMEM_ERROR("the engine is serving: its requests go through llmem_engine_submit");
        return LLMEM_EINVAL;
    }
    struct sync_call call = {.on_token = on_token, .arg = arg, .out = result};
    struct llmem_request_events ev = {.on_token = sync_token, .on_done = sync_done, .arg = &call};
    struct request *r = NULL;
    int status = request_new(s, prompt, n_prompt, p, &ev, &r);
    if (status != LLMEM_OK)
        return status;
    request_list_append(&s->waiting, r);
    while (!call.done) {
        if (p->prefill_progress != NULL && s->running == r)
            p->prefill_progress(p->progress_arg, r->pos, r->n_prompt);
        llmem_sched_step(s);
    }
    if (call.status == LLMEM_ENOMEM)
        LLMEM_ERROR("the request ends: out of memory");
    return call.status;
}

/* ---- serving --------------------------------------------------------------------------------- */

/* Ends every request as cancelled (the scheduler is not running). */
static void cancel_all(struct llmem_sched *s) {
    llmem_sched_drop_ahead(s);
    llmem_sched_intake(s);
    while (s->running != NULL) {
        struct request *r = s->running;
        s->running = r->next;
        s->n_running--;
        llmem_sched_finish(s, r, "cancelled", LLMEM_OK, NULL);
    }
    while (s->waiting != NULL) {
        struct request *r = s->waiting;
        s->waiting = r->next;
        llmem_sched_finish(s, r, "cancelled", LLMEM_OK, NULL);
    }
    pthread_mutex_lock(&s->mu);
    s->queued = 0;
    pthread_mutex_unlock(&s->mu);
    llmem_sched_publish(s);
}

static void *sched_thread(void *arg) {
    struct llmem_sched *s = arg;
    int64_t active = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stopping && active == 0 && s->incoming == NULL && s->n_cancels == 0 &&
               !s->clear_requested) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 1; /* the guard looks at least once a second */
            if (pthread_cond_timedwait(&s->wake, &s->mu, &until) != 0)
                break;
        }
        int stopping = s->stopping, clear = s->clear_requested;
        pthread_mutex_unlock(&s->mu);
        if (stopping)
            break;
        if (clear) {
            int64_t bytes = s->cfg.ops.release_caches(s->cfg.ctx);
            llmem_sched_publish(s); /* whoever asked sees the emptied bank in the metrics */
            pthread_mutex_lock(&s->mu);
            s->clear_requested = 0;
            s->cleared_bytes = bytes;
            s->clear_generation++;
            pthread_cond_broadcast(&s->done);
            pthread_mutex_unlock(&s->mu);
        }
        if (active == 0)
            s->refusing = s->cfg.ops.guard_check(s->cfg.ctx, 0);
        active = llmem_sched_step(s);
        pthread_mutex_lock(&s->mu);
        s->queued = active + request_list_count(s->incoming);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

int llmem_sched_serve_start(struct llmem_sched *s, const struct llmem_serve_config *config) {
    if (s->serving) {
        LLMEM_ERROR("the engine is serving already");
        return LLMEM_EINVAL;
    }
    s->max_queue = config != NULL && config->max_queue > 0 ? config->max_queue : QUEUE_DEFAULT;
    pthread_mutex_lock(&s->mu);
    s->stopping = 0;
    s->serving = 1; /* before the thread runs: submit reads it under mu */
    pthread_mutex_unlock(&s->mu);
    if (pthread_create(&s->thread, NULL, sched_thread, s) != 0) {
        pthread_mutex_lock(&s->mu);
        s->serving = 0;
        pthread_mutex_unlock(&s->mu);
        LLMEM_ERROR("cannot start the scheduler thread");
        return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

void llmem_sched_serve_stop(struct llmem_sched *s) {
    if (!s->serving)
        return;
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_cond_broadcast(&s->wake);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_mutex_lock(&s->mu);
    s->serving = 0;
    pthread_cond_broadcast(&s->done); /* a cache clear the thread left undone waits no more */
    pthread_mutex_unlock(&s->mu);
    cancel_all(s);
}

int llmem_sched_submit(struct llmem_sched *s, const int32_t *prompt, int64_t n_prompt,
                       const struct llmem_generate_params *params,
                       const struct llmem_request_events *events, uint64_t *id) {
    struct request *r = NULL;
    int status = request_new(s, prompt, n_prompt, params, events, &r);
    if (status != LLMEM_OK)
        return status;
    pthread_mutex_lock(&s->mu);
    if (!s->serving || s->stopping) {
        /* nothing would ever step it: the scheduler thread is not running or has taken its
         * last intake */
        pthread_mutex_unlock(&s->mu);
        request_free(r);
        LLMEM_ERROR("the engine is not serving");
        return LLMEM_EINVAL;
    }
    if (s->queued >= s->max_queue + s->cfg.max_sequences) {
        pthread_mutex_unlock(&s->mu);
        request_free(r);
        LLMEM_ERROR("the queue is full (%" PRId64 " requests waiting)", s->max_queue);
        return LLMEM_EBUSY;
    }
    r->id = s->next_id++;
    *id = r->id;
    request_list_append(&s->incoming, r);
    s->queued++;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
    return LLMEM_OK;
}

void llmem_sched_cancel(struct llmem_sched *s, uint64_t id) {
    pthread_mutex_lock(&s->mu);
    /* only a submitted request can be cancelled by id: another (0 is a synchronous generate's,
     * which its callback cancels) would wait for a request that never comes */
    if (id == 0 || id >= s->next_id || !s->serving) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    if (s->n_cancels == s->cap_cancels) {
        int64_t cap = s->cap_cancels ? 2 * s->cap_cancels : 16;
        uint64_t *c = realloc(s->cancels, (size_t)cap * sizeof(uint64_t));
        if (c == NULL) {
            pthread_mutex_unlock(&s->mu);
            return; /* the request then runs to its end */
        }
        s->cancels = c;
        s->cap_cancels = cap;
    }
    s->cancels[s->n_cancels++] = id;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
}

int64_t llmem_sched_clear_cache(struct llmem_sched *s) {
    if (!s->serving)
        return s->cfg.ops.release_caches(s->cfg.ctx);
    pthread_mutex_lock(&s->mu);
    int64_t gen = s->clear_generation;
    s->clear_requested = 1;
    pthread_cond_signal(&s->wake);
    while (s->clear_generation == gen && s->serving)
        pthread_cond_wait(&s->done, &s->mu);
    int64_t bytes = s->cleared_bytes;
    pthread_mutex_unlock(&s->mu);
    return bytes;
}

void llmem_sched_metrics(struct llmem_sched *s, struct llmem_engine_metrics *m) {
    pthread_mutex_lock(&s->mu);
    *m = s->snapshot;
    pthread_mutex_unlock(&s->mu);
}

void llmem_sched_reused_tokens(const struct llmem_sched *s, int64_t *ram, int64_t *disk) {
    *ram = s->reused_ram_tokens;
    *disk = s->reused_disk_tokens;
}

/* ---- the scheduler's life -------------------------------------------------------------------- */

/* Frees what create allocated (nothing queued, no thread). */
static void destroy(struct llmem_sched *s) {
    free(s->cancels);
    free(s->tokens);
    free(s->ahead);
    free(s->seqs);
    free(s->slots);
    free(s->masking);
    llmem_grammar_walkers_free(s->walkers);
    free(s->drawing);
    for (int i = 0; i < 2; i++) {
        llmem_mem_free(s->cfg.mem, s->top[i].vals);
        llmem_mem_free(s->cfg.mem, s->top[i].ids);
    }
    llmem_mem_free(s->cfg.mem, s->logits);
    pthread_cond_destroy(&s->done);
    pthread_cond_destroy(&s->wake);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int llmem_sched_create(const struct llmem_sched_config *config, struct llmem_sched **out) {
    *out = NULL;
    struct llmem_sched *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    s->cfg = *config;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->wake, NULL);
    pthread_cond_init(&s->done, NULL);
    s->max_queue = QUEUE_DEFAULT;
    s->next_id = 1;
    memcpy(s->counters.ttft.bounds, TTFT_BOUNDS, sizeof(TTFT_BOUNDS));
    memcpy(s->counters.inter_token.bounds, ITL_BOUNDS, sizeof(ITL_BOUNDS));
    s->snapshot = s->counters;
    /* Every array a step needs, now. The logits rows are the host's (tag scratch); the top-k
     * rows only where a pass can select them on the device — and the vocabulary has at least
     * 2 × LLMEM_TOP_K_MAX tokens: a smaller one comes back whole, which costs little. */
    const size_t rows = (size_t)s->cfg.max_sequences;
    s->top_ok = s->cfg.top_on_device && llmem_forward_has_top(s->cfg.fwd) &&
                s->cfg.vocab >= 2 * LLMEM_TOP_K_MAX;
    s->logits =
        llmem_mem_alloc(s->cfg.mem, rows * (size_t)s->cfg.vocab * sizeof(float), LLMEM_TAG_SCRATCH);
    if (s->logits == NULL)
        goto fail; /* (logged) */
    if (s->top_ok) {
        const size_t top_rows[2] = {rows * LLMEM_TOP_K_MAX, rows};
        for (int i = 0; i < 2; i++) {
            s->top[i].ids =
                llmem_mem_alloc(s->cfg.mem, top_rows[i] * sizeof(int32_t), LLMEM_TAG_SCRATCH);
            s->top[i].vals =
                llmem_mem_alloc(s->cfg.mem, top_rows[i] * sizeof(float), LLMEM_TAG_SCRATCH);
            if (s->top[i].ids == NULL || s->top[i].vals == NULL)
                goto fail; /* (logged) */
        }
    }
    s->slots = malloc(rows * sizeof(*s->slots));
    s->masking = malloc(rows * sizeof(*s->masking));
    s->drawing = malloc(rows * sizeof(*s->drawing));
    s->seqs = malloc(rows * sizeof(*s->seqs));
    s->ahead = malloc(rows * sizeof(*s->ahead));
    s->tokens = malloc((size_t)s->cfg.max_batch_tokens * sizeof(*s->tokens));
    if (s->slots == NULL || s->masking == NULL || s->drawing == NULL || s->seqs == NULL ||
        s->ahead == NULL || s->tokens == NULL) {
        LLMEM_ERROR("out of memory");
        goto fail;
    }
    const int threads = s->cfg.pool != NULL ? llmem_pool_threads(s->cfg.pool) : 1;
    if (threads > 1 && llmem_grammar_walkers_create(threads, &s->walkers) != LLMEM_OK)
        goto fail; /* (logged) */
    *out = s;
    return LLMEM_OK;
fail:
    destroy(s);
    return LLMEM_ENOMEM;
}

void llmem_sched_free(struct llmem_sched *s) {
    if (s == NULL)
        return;
    llmem_sched_serve_stop(s);
    cancel_all(s);
    destroy(s);
}

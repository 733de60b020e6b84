/*
 * engine/sched_step.c — the scheduler's step policy: continuous batching over the shared paged KV
 * (SPEC §7).
 *
 * A step gives every running request its next tokens in one forward pass: a request whose KV
 * lacks only its last token decodes (one token), one that lacks more prefills a chunk of them,
 * within max_batch_tokens in all — decodes first, oldest first, then prefill chunks in admission
 * order. A request whose tokens are all written samples its next token from the logits of its
 * last one. Admission takes waiting requests in order while the pool has room for a request's
 * first chunk plus a block of headroom for each running one; a request that could not fit even
 * alone is refused before its prefill. When a step's blocks do not fit, banked blocks are evicted,
 * then the newest requests preempted: preempting banks a request's full blocks and sets pos back
 * to 0, so on resumption it takes them back from the bank and recomputes only the rest — the same
 * path as a prompt with a cached prefix.
 *
 * On a device, a pass can return only each row's top k (sampling on the host from those), and a
 * greedy decode step can be queued behind the one in flight, fed its tokens on the device. Every
 * array a step uses was allocated with the scheduler: a step allocates nothing of its own.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "core/log.h"
#include "engine/sched_int.h"
#include "llmem/kv.h"
#include "llmem/size.h"

/* The grammars' masks for the tokens this step's rows give, on the pool's threads: while a
 * device computes a replayed decode step, before any other pass (which the host queues kernel by
 * kernel, or records, for longer than a step takes the device): ready before the rows are.
 * Several: a thread a mask; one: its walk over the vocabulary split over the threads. */
static void prepare_one(void *arg, int task, int thread) {
    (void)thread;
    llmem_sampler_prepare(((struct llmem_sampler **)arg)[task]);
}

static int prepare_masks(struct llmem_sched *s, const struct slot *slots, int n) {
    int k = 0;
    for (int i = 0; i < n; i++) {
        const struct request *r = slots[i].r;
        if (r->p.sampling.grammar != NULL && r->ending == NULL && r->pos + slots[i].n >= r->n_toks)
            s->masking[k++] = r->sampler;
    }
    if (k == 1) /* one mask: its walk on the pool's threads (walkers planned: engine.c) */
        llmem_sampler_prepare_on(s->masking[0], s->walkers, s->cfg.pool);
    else if (s->cfg.pool != NULL)
        llmem_pool_run(s->cfg.pool, k, prepare_one, s->masking);
    else
        for (int i = 0; i < k; i++)
            prepare_one(s->masking, i, 0);
    return k;
}

/* Whole rows are drawn from on the pool's threads, several at a time (a row of a 131,072-token
 * vocabulary at a temperature takes about a millisecond): into s->drawing, by slot. */
static void draw_one(void *arg, int task, int thread) {
    (void)thread;
    struct draw *d = &((struct draw *)arg)[task];
    d->id = d->sampler != NULL ? llmem_sampler_sample(d->sampler, d->logits) : -1;
}

static void draw_rows(struct llmem_sched *s, const struct slot *slots, int n) {
    int m = 0;
    for (int i = 0; i < n; i++) {
        const struct request *r = slots[i].r;
        const int draws = r != NULL && r->pos >= r->n_toks && r->ending == NULL;
        s->drawing[i] = (struct draw){draws ? r->sampler : NULL,
                                      s->logits + (size_t)i * (size_t)s->cfg.vocab, -1};
        m += draws;
    }
    if (m > 1)
        llmem_pool_run(s->cfg.pool, n, draw_one, s->drawing);
}

/* ---- the running set ------------------------------------------------------------------------- */

/* Takes r out of the running set, its KV banked: it waits again at the head of the queue and
 * resumes from the bank. */
static void preempt(struct llmem_sched *s, struct request *r) {
    request_list_remove(&s->running, r);
    s->n_running--;
    s->cfg.ops.bank_sequence(s->cfg.ctx, r->seq, r->toks, r->pos);
    llmem_kv_seq_free(s->cfg.kv, r->seq);
    r->seq = -1;
    r->pos = 0;
    r->next = s->waiting;
    s->waiting = r;
    s->counters.preemptions++;
}

static struct request *newest_running(struct llmem_sched *s) {
    struct request *n = NULL;
    for (struct request *r = s->running; r != NULL; r = r->next)
        if (n == NULL || r->age > n->age)
            n = r;
    return n;
}

static int64_t blocks_of(const struct llmem_sched *s, int64_t tokens) {
    const int64_t bs = llmem_kv_block_size(s->cfg.kv);
    return (tokens + bs - 1) / bs;
}

/* ---- admission ------------------------------------------------------------------------------- */

/* Admits waiting requests while there is room: a sequence from the bank, then the blocks of its
 * first chunk. A request that cannot fit even alone in the pool is refused before its prefill;
 * one that only lacks room now waits for the running ones. */
static void admit(struct llmem_sched *s) {
    const struct llmem_sched_ops *ops = &s->cfg.ops;
    struct llmem_kv *kv = s->cfg.kv;
    const int paged = s->cfg.paged;
    /* Under a critical memory pressure nothing new is admitted; a preempted request is not new
     * (its client has its first tokens): it waits for room as before. */
    for (struct request **at = &s->waiting; s->refusing && *at != NULL;) {
        struct request *r = *at;
        if (r->t_admit != 0) {
            at = &r->next;
            continue;
        }
        *at = r->next;
        llmem_sched_finish(s, r, "error", LLMEM_ENOMEM,
                           "refused: the machine is under critical memory pressure; no new "
                           "request is admitted until it clears");
    }
    while (s->waiting != NULL && s->n_running < s->cfg.max_sequences) {
        struct request *r = s->waiting;
        if (r->p.follow != 0) { /* n > 1: after its leader's prompt is in the cache */
            struct request *lead = s->running;
            while (lead != NULL && lead->id != r->p.follow)
                lead = lead->next;
            if (lead != NULL && lead->pos < lead->n_prompt)
                break; /* the leader's prefill runs first */
            if (lead != NULL && !lead->prompt_banked) {
                ops->bank_sequence(s->cfg.ctx, lead->seq, lead->toks, lead->n_prompt);
                lead->prompt_banked = 1;
            }
        }
        int64_t footprint = blocks_of(s, r->n_prompt + r->max_tokens);
        int64_t pool = paged ? llmem_kv_blocks_free(kv) : 0;
        for (struct request *q = s->running; paged && q != NULL; q = q->next)
            pool += blocks_of(s, llmem_kv_seq_length(kv, q->seq));
        if (paged) {
            pool += ops->banked_blocks(s->cfg.ctx);
            /* banked blocks a running request shares are counted twice above */
            struct llmem_kv_stats ks;
            llmem_kv_stats(kv, &ks);
            pool = pool < ks.n_blocks ? pool : ks.n_blocks;
        }
        if (paged && footprint > pool) {
            char msg[512], b1[32], b2[32];
            int64_t bb = llmem_kv_block_bytes(kv);
            snprintf(msg, sizeof(msg),
                     "refused before prefill: the request needs %" PRId64 " KV blocks (%s: %" PRId64
                     " prompt tokens + up to %" PRId64 " generated) but the pool holds %" PRId64
                     " (%s); shorten the prompt or max_tokens, or quantize the KV (--kv-format q8)",
                     footprint, llmem_size_format_short(footprint * bb, b1, sizeof(b1)),
                     r->n_prompt, r->max_tokens, pool,
                     llmem_size_format_short(pool * bb, b2, sizeof(b2)));
            s->waiting = r->next;
            llmem_sched_finish(s, r, "error", LLMEM_ENOMEM, msg);
            continue;
        }
        /* Not even a block beyond the running requests' headroom could be freed: wait, without a
         * bank lookup (and a disk load) that would only be undone. */
        if (paged && s->n_running > 0) {
            int64_t reclaimable = llmem_kv_blocks_free(kv) + ops->banked_blocks(s->cfg.ctx);
            if (reclaimable < s->n_running + 1)
                break;
        }
        int seq = -1;
        int64_t from_ram = 0, from_disk = 0;
        int status =
            ops->start_sequence(s->cfg.ctx, r->toks, r->n_toks, &seq, &from_ram, &from_disk);
        const int64_t reused = from_ram + from_disk;
        if (status == LLMEM_ERANGE && s->n_running > 0)
            break; /* every sequence slot is taken (an embedder holds some): wait */
        if (status != LLMEM_OK) {
            s->waiting = r->next;
            llmem_sched_finish(s, r, "error", status, llmem_last_error());
            continue;
        }
        int64_t first = r->n_toks - reused;
        if (first > s->cfg.max_batch_tokens)
            first = s->cfg.max_batch_tokens;
        /* Room for its first chunk, and a block of headroom for each running request (the next
         * block its decoding needs), or the newcomer would soon be preempted again. */
        const int64_t headroom = s->n_running;
        if (paged && ops->make_room(s->cfg.ctx, seq, reused + first, headroom) + headroom >
                         llmem_kv_blocks_free(kv)) {
            /* no room yet: the running requests go first */
            llmem_kv_seq_free(kv, seq);
            if (s->n_running == 0) { /* cannot happen: with nothing running the pool is free */
                s->waiting = r->next;
                llmem_sched_finish(s, r, "error", LLMEM_ENOMEM, "out of KV blocks");
                continue;
            }
            break;
        }
        s->waiting = r->next;
        r->seq = seq;
        r->pos = reused;
        r->age = s->admitted++;
        if (r->t_admit == 0) {
            r->t_admit = llmem_clock_s();
            r->reused_ram = from_ram, r->reused_disk = from_disk;
            s->reused_ram_tokens += from_ram;
            s->reused_disk_tokens += from_disk;
            s->counters.reused_tokens += reused;
            s->counters.prompt_tokens += r->n_prompt;
        }
        request_list_append(&s->running, r);
        s->n_running++;
    }
}

/* ---- the batch ------------------------------------------------------------------------------- */

/* The step's batch into s->slots, s->tokens and s->seqs: decodes first (one token each, oldest
 * first), then prefill chunks in admission order within max_batch_tokens; blocks for all of it are
 * made free by evicting banked blocks, then by preempting the newest requests (never the last one:
 * its blocks fit the pool, as admission checked, unless something else holds blocks — its step
 * then fails and it ends). Returns the slots filled. */
static int plan_batch(struct llmem_sched *s) {
    struct slot *slots = s->slots;
    const int paged = s->cfg.paged;
    for (;;) {
        int n = 0;
        int64_t budget = s->cfg.max_batch_tokens, need = 0;
        for (int pass = 0; pass < 2; pass++) {
            for (struct request *r = s->running; r != NULL; r = r->next) {
                int64_t left = r->n_toks - r->pos;
                if ((pass == 0) != (left == 1) || budget == 0)
                    continue;
                int64_t take = left < budget ? left : budget;
                slots[n] = (struct slot){r, take};
                budget -= take;
                if (paged)
                    need += s->cfg.ops.make_room(s->cfg.ctx, r->seq, r->pos + take, need);
                n++;
            }
        }
        if (!paged || need <= llmem_kv_blocks_free(s->cfg.kv) || s->n_running == 1) {
            int64_t at = 0;
            for (int i = 0; i < n; i++) {
                struct request *r = slots[i].r;
                memcpy(s->tokens + at, r->toks + r->pos, (size_t)slots[i].n * sizeof(int32_t));
                s->seqs[i] =
                    (struct llmem_batch_seq){.seq = r->seq, .pos = r->pos, .n_tokens = slots[i].n};
                at += slots[i].n;
            }
            return n;
        }
        preempt(s, newest_running(s));
    }
}

/* On a device, how many of each row's largest logits the step needs when every request that
 * samples in it can do with at most LLMEM_TOP_K_MAX of them and wants no log-probabilities; else 0
 * (the whole rows; also with LLMEM_SAMPLE_ON_DEVICE=0). */
static int top_k_for(const struct llmem_sched *s, const struct slot *slots, int n) {
    if (!s->top_ok)
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

/* ---- the step queued ahead ------------------------------------------------------------------- */

/* Whether the step just started (slots, k = 1) can have the next one queued behind it, its tokens
 * fed on the device: it holds every running request, each decoding greedily with more tokens to
 * come after this step's, none ending; none waits for admission, and each could take a new block
 * without evicting banked ones. */
static int can_go_ahead(const struct llmem_sched *s, const struct slot *slots, int n) {
    if (!s->cfg.decode_ahead || n != s->n_running || s->waiting != NULL ||
        !llmem_forward_has_next(s->cfg.fwd) ||
        (s->cfg.paged && llmem_kv_blocks_free(s->cfg.kv) < n))
        return 0;
    for (int i = 0; i < n; i++) {
        const struct request *r = slots[i].r;
        if (slots[i].n != 1 || r->pos + 1 != r->n_toks || r->ending != NULL || r->in_flight != 1 ||
            r->n_toks + 1 - r->n_prompt >= r->max_tokens)
            return 0;
    }
    return 1;
}

void llmem_sched_drop_ahead(struct llmem_sched *s) {
    if (s->n_ahead == 0)
        return;
    (void)llmem_forward_wait(s->cfg.fwd); /* (a failure restored the lengths) */
    for (int i = 0; i < s->n_ahead; i++) {
        struct request *r = s->ahead[i];
        r->in_flight--;
        llmem_kv_set_length(s->cfg.kv, r->seq, r->pos);
    }
    s->n_ahead = 0;
}

/* ---- the step -------------------------------------------------------------------------------- */

/* One scheduler step: intake, the requests that ended last step finished, admission, one forward
 * pass started; while the device computes it, the grammars' masks for its rows made, then the
 * tokens sampled last step handed to the clients (detokenized, stop strings, on_token; both
 * before the pass when it is not a replayed decode step); then the pass's tokens sampled. A request
 * whose stop string or cancel shows while it is in the pass ends after it (the pass's token
 * discarded). Returns the requests still waiting or running. */
int64_t llmem_sched_step(struct llmem_sched *s) {
    struct llmem_forward *fwd = s->cfg.fwd;
    const double t_step = llmem_clock_s();
    llmem_sched_intake(s);
    for (struct request *r = s->running, *next; r != NULL; r = next) {
        next = r->next;
        if (r->ending != NULL && !r->in_flight) { /* its last token, then the end */
            int st = LLMEM_OK;
            const char *reason = r->pending ? llmem_sched_hand_over(s, r, &st) : r->ending;
            llmem_sched_finish_running(s, r, reason, st, llmem_sched_status_message(st));
        }
    }
    s->refusing = s->cfg.ops.guard_check(s->cfg.ctx, s->n_running > 0);
    admit(s);
    /* The last step's tokens are handed over while the device computes this one when it is a
     * replayed decode step. Other passes queue their launches one by one (and a recording
     * instantiates a graph), which takes the host long enough: the tokens go first. */
    int overlap = s->n_running > 0 && llmem_forward_replays(fwd, (int)s->n_running);
    for (struct request *r = s->running; r != NULL; r = r->next)
        overlap &= r->n_toks - r->pos <= 1;
    overlap |= s->n_ahead > 0; /* (queued already) */
    if (!overlap) {
        llmem_sched_hand_over_all(s, &s->running);
        llmem_sched_hand_over_all(s, &s->waiting);
    }
    if (s->n_running > 0) {
        struct slot *slots = s->slots;
        double t_forward = llmem_clock_s();
        int n, k, status = LLMEM_OK;
        int top = 0;          /* which of s->top the pass's ids and values go to */
        int early = 0;        /* the masks made before the pass started */
        if (s->n_ahead > 0) { /* queued during the last step */
            n = s->n_ahead, k = 1, top = s->ahead_top;
            for (int i = 0; i < n; i++)
                slots[i] = (struct slot){s->ahead[i], 1};
            s->n_ahead = 0;
        } else {
            n = plan_batch(s);
            k = n > 0 ? top_k_for(s, slots, n) : 0;
            if (!overlap && n > 0) { /* (queueing the pass takes the host longer than they do) */
                const double t_masks = llmem_clock_s();
                early = prepare_masks(s, slots, n) > 0;
                t_forward += llmem_clock_s() - t_masks;
            }
            status = n <= 0  ? LLMEM_ENOMEM
                     : k > 0 ? llmem_forward_start_top(fwd, s->tokens, s->seqs, n, k, s->top[0].ids,
                                                       s->top[0].vals)
                             : llmem_forward_start(fwd, s->tokens, s->seqs, n, s->logits);
            for (int i = 0; i < n; i++) /* (queued or not: a request of the batch ends after it) */
                slots[i].r->in_flight = 1;
        }
        if (status == LLMEM_OK && k == 1 && can_go_ahead(s, slots, n)) {
            /* the next step queued now, its ids and values in the other rows than this one's */
            const int next_top = 1 - top;
            if (llmem_forward_start_next(fwd, s->top[next_top].ids, s->top[next_top].vals) ==
                LLMEM_OK) {
                for (int i = 0; i < n; i++) {
                    s->ahead[i] = slots[i].r;
                    slots[i].r->in_flight++;
                }
                s->n_ahead = n, s->ahead_top = next_top;
                s->counters.ahead_steps++;
            }
        }
        double forward_s = llmem_clock_s() - t_forward;
        /* the masks first: the rows wait for them, the clients' tokens wait for nothing */
        if (status == LLMEM_OK && (early || prepare_masks(s, slots, n) > 0) && s->top_ok) {
            s->counters.masked_steps++; /* on a device: were the masks ready first? */
            s->counters.masks_late += !early && !llmem_forward_busy(fwd);
        }
        llmem_sched_hand_over_all(s, &s->running); /* (none pending if they went first) */
        llmem_sched_hand_over_all(s, &s->waiting);
        t_forward = llmem_clock_s();
        if (status == LLMEM_OK)
            status = llmem_forward_wait(fwd);
        forward_s += llmem_clock_s() - t_forward;
        s->counters.forward_seconds += forward_s;
        s->counters.steps++;
        for (int i = 0; i < n; i++)
            if (slots[i].r->pos < slots[i].r->n_toks - 1 || slots[i].n > 1) {
                s->counters.prefill_steps++;
                s->counters.prefill_forward_seconds += forward_s;
                break;
            }
        if (status != LLMEM_OK && s->n_ahead > 0) { /* the step queued ahead failed with it */
            for (int i = 0; i < s->n_ahead; i++)
                s->ahead[i]->in_flight--;
            s->n_ahead = 0;
        }
        for (int i = 0; i < n; i++) { /* the pass done: KV written (OK) or lengths restored */
            struct request *r = slots[i].r;
            r->in_flight--;
            if (status == LLMEM_OK && r->pos + slots[i].n <= r->n_toks)
                r->pos += slots[i].n;
            else if (status == LLMEM_OK) /* fed on the device a token it did not take (a stop) */
                llmem_kv_set_length(s->cfg.kv, r->seq, r->pos);
            if (r->ending != NULL && !r->in_flight) {
                slots[i].r = NULL;
                llmem_sched_finish_running(s, r, r->ending, r->ending_status,
                                           llmem_sched_status_message(r->ending_status));
            }
        }
        if (status != LLMEM_OK) {
            /* An allocation failure: the bank halves and the newest request ends (SPEC §6.5). */
            s->cfg.ops.shed_bank(s->cfg.ctx);
            struct request *r = newest_running(s);
            if (r != NULL)
                llmem_sched_finish_running(s, r, "error", status,
                                           status == LLMEM_ENOMEM
                                               ? "out of memory during the request"
                                               : llmem_last_error());
        } else {
            const struct top_rows *rows = &s->top[top];
            const int drawn = k == 0 && n > 1 && s->cfg.pool != NULL;
            if (drawn)
                draw_rows(s, slots, n);
            for (int i = 0; i < n; i++) {
                struct request *r = slots[i].r;
                if (r == NULL || r->pos < r->n_toks || r->ending != NULL)
                    continue;
                struct out_row row = {.logits = s->logits + (size_t)i * (size_t)s->cfg.vocab,
                                      .drawn = drawn ? s->drawing[i].id : -1};
                if (k > 0)
                    row = (struct out_row){.ids = rows->ids + (size_t)i * (size_t)k,
                                           .vals = rows->vals + (size_t)i * (size_t)k,
                                           .k = k,
                                           .drawn = -1};
                int st;
                const char *reason = llmem_sched_sample(s, r, row, &st);
                if (reason != NULL && r->in_flight) /* in the step queued ahead: after it */
                    r->ending = reason, r->ending_status = st;
                else if (reason != NULL)
                    llmem_sched_finish_running(s, r, reason, st,
                                               st == LLMEM_OK ? NULL : llmem_last_error());
            }
        }
    }
    /* the bank's budget at the working set now in flight (SPEC §2.3, §6.2) */
    int64_t blocks = 0;
    for (struct request *r = s->running; r != NULL; r = r->next)
        blocks += blocks_of(s, r->n_toks);
    s->cfg.ops.bank_budget(s->cfg.ctx, blocks);
    s->counters.step_seconds += llmem_clock_s() - t_step;
    llmem_sched_publish(s);
    return s->n_running + request_list_count(s->waiting);
}

/*
 * tests/test-sched.c — the engine's scheduler (SPEC §7) on pycoder: many requests served at once
 * give each exactly the greedy tokens of a single run; a pool too small for all of them preempts
 * (to the bank) and resumes instead of failing, and the KV is whole afterwards; cancelling a
 * request — from its own callback or from another thread — frees its blocks; a request that can
 * never fit is refused before its prefill; log-probabilities are those of the logits.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/hooks.h"
#include "llmem/engine.h"
#include "testutil.h"

#define PYCODER LLMEM_SOURCE_DIR "/models/pycoder"

enum { N_REQ = 8, GEN = 24 };

/* What one served request produced. */
struct outcome {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int *n_done;
    int32_t ids[256];
    int n_ids;
    int cancel_after; /* > 0: on_token asks to stop after this many tokens */
    int status;
    char reason[16];
    char message[512];
    int logprobs_ok; /* every event's log-probabilities were consistent */
    int drawn;       /* the tokens are drawn at a temperature, not the most likely ones */
    int logprob_events;
};

static int on_token(void *arg, const struct llmem_token_event *ev) {
    struct outcome *o = arg;
    if (ev->id < 0)
        return 0;
    if (o->n_ids < 256)
        o->ids[o->n_ids++] = ev->id;
    if (ev->n_top > 0) {
        o->logprob_events++;
        /* greedy: the token is the most likely one; alternatives sorted; a distribution */
        int ok = (o->drawn ||
                  (ev->top_ids[0] == ev->id && fabsf(ev->top_logprobs[0] - ev->logprob) < 1e-6f)) &&
                 ev->logprob <= 0;
        double mass = 0;
        for (int i = 0; i < ev->n_top; i++) {
            mass += exp(ev->top_logprobs[i]);
            if (i > 0 && ev->top_logprobs[i] > ev->top_logprobs[i - 1])
                ok = 0;
        }
        if (mass > 1.0 + 1e-5)
            ok = 0;
        if (!ok)
            o->logprobs_ok = 0;
    }
    return o->cancel_after > 0 && o->n_ids >= o->cancel_after;
}

static void on_done(void *arg, int status, const struct llmem_generate_result *r,
                    const char *message) {
    struct outcome *o = arg;
    pthread_mutex_lock(o->mu);
    o->status = status;
    if (r != NULL) {
        snprintf(o->reason, sizeof(o->reason), "%s", r->finish_reason);
        /* the result's ids are the streamed ones */
        if (r->n_ids != o->n_ids || memcmp(r->ids, o->ids, (size_t)r->n_ids * sizeof(int32_t)))
            o->n_ids = -1;
    }
    if (message != NULL)
        snprintf(o->message, sizeof(o->message), "%s", message);
    (*o->n_done)++;
    pthread_cond_broadcast(o->cv);
    pthread_mutex_unlock(o->mu);
}

static void prompt_of(int i, int32_t *p, int n) {
    for (int k = 0; k < n; k++)
        p[k] = (int32_t)(5 + (i * 131 + k * 17) % 3000);
}

/* (hooks: NULL, or the guard's source) */
static struct llmem_engine *open_hooked(int max_sequences, const struct llmem_engine_hooks *hooks) {
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.max_sequences = max_sequences;
    c.n_threads = 2;
    c.context = 1024;
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open_hooked(&c, hooks, NULL, NULL, &e), LLMEM_OK);
    return e;
}

static struct llmem_engine *open_pycoder(int max_sequences) {
    return open_hooked(max_sequences, NULL);
}

/* Request i's parameters: GEN tokens, greedy for even i, drawn at a temperature with a seed of
 * its own for odd i (the draws of a step's rows run on the pool's threads together). */
static void params_of(int i, struct llmem_generate_params *p) {
    llmem_generate_params_default(p);
    p->max_tokens = GEN;
    p->ignore_eos = 1;
    if (i % 2 == 1)
        p->sampling.temperature = 0.8, p->sampling.seed = 1000 + (uint64_t)i;
}

/* The tokens of a single run of prompt i (n tokens). */
static void single_run(struct llmem_engine *e, int i, int n, int32_t *ids, int *n_ids) {
    int32_t prompt[512];
    prompt_of(i, prompt, n);
    struct llmem_generate_params p;
    params_of(i, &p);
    struct llmem_generate_result r;
    assert_int_equal(llmem_engine_generate(e, prompt, n, &p, NULL, NULL, &r), LLMEM_OK);
    memcpy(ids, r.ids, (size_t)r.n_ids * sizeof(int32_t));
    *n_ids = (int)r.n_ids;
    llmem_generate_result_free(&r);
}

/* Serves N_REQ requests at once (prompt i of len[i] tokens, its events through tok), each one's
 * outcome into out[i], and the engine's metrics after them into m. */
static void serve_all(struct llmem_engine *e, const int *len, int logprobs,
                      int (*tok)(void *, const struct llmem_token_event *), struct outcome *out,
                      struct llmem_engine_metrics *m) {
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int n_done = 0;
    assert_int_equal(llmem_engine_serve_start(e, NULL), LLMEM_OK);
    for (int i = 0; i < N_REQ; i++) {
        int32_t prompt[512];
        prompt_of(i, prompt, len[i]);
        struct llmem_generate_params p;
        params_of(i, &p);
        out[i] = (struct outcome){.mu = &mu,
                                  .cv = &cv,
                                  .n_done = &n_done,
                                  .logprobs_ok = 1,
                                  .drawn = p.sampling.temperature > 0};
        p.logprobs = logprobs;
        struct llmem_request_events ev = {.on_token = tok, .on_done = on_done, .arg = &out[i]};
        uint64_t id;
        assert_int_equal(llmem_engine_submit(e, prompt, len[i], &p, &ev, &id), LLMEM_OK);
    }
    pthread_mutex_lock(&mu);
    while (n_done < N_REQ)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    llmem_engine_metrics(e, m);
    llmem_engine_serve_stop(e);
}

/* Serves N_REQ requests at once (prompt i of len[i] tokens) and checks each against its single
 * run (other_sequences: those the test holds itself). Returns the preemptions counted. */
static int64_t serve_and_compare(struct llmem_engine *e, const int *len, int logprobs,
                                 int64_t other_sequences) {
    int32_t want[N_REQ][GEN];
    int n_want[N_REQ];
    for (int i = 0; i < N_REQ; i++)
        single_run(e, i, len[i], want[i], &n_want[i]);
    llmem_engine_clear_cache(e); /* no bank hits from the single runs */
    struct outcome out[N_REQ];
    struct llmem_engine_metrics m;
    serve_all(e, len, logprobs, on_token, out, &m);
    for (int i = 0; i < N_REQ; i++) {
        if (out[i].status != LLMEM_OK)
            printf("  request %d: %s\n", i, out[i].message);
        assert_int_equal(out[i].status, LLMEM_OK);
        assert_string_equal(out[i].reason, "length");
        assert_int_equal(out[i].n_ids, n_want[i]);
        assert_memory_equal(out[i].ids, want[i], (size_t)n_want[i] * sizeof(int32_t));
        assert_true(out[i].logprobs_ok);
        assert_int_equal(out[i].logprob_events, logprobs > 0 ? GEN : 0);
    }
    assert_int_equal(m.requests_ok, 2 * N_REQ); /* the single runs count too */
    assert_int_equal(m.running, 0);
    assert_int_equal(m.waiting, 0);
    assert_true(m.ttft.count >= N_REQ && m.inter_token.count >= N_REQ * (GEN - 1));
    assert_true(m.steps > 0);
    struct llmem_kv_stats ks;
    llmem_kv_stats(llmem_engine_kv(e), &ks);
    assert_int_equal(ks.n_sequences, other_sequences); /* the requests' are gone */
    assert_int_equal(llmem_kv_check(llmem_engine_kv(e)), LLMEM_OK);
    return m.preemptions;
}

/* Eight requests of different lengths at once: continuous batching gives each exactly the tokens
 * of its single run (the forward pass is batch-invariant). */
static void test_concurrent_equals_single(void **state) {
    (void)state;
    struct llmem_engine *e = open_pycoder(N_REQ);
    const int len[N_REQ] = {7, 40, 130, 3, 64, 250, 17, 90};
    assert_int_equal(serve_and_compare(e, len, 3, 0), 0);
    llmem_engine_close(e);
}

/* A pool too small for all eight: the newest are preempted to the bank and resume, and every
 * request still gets its single-run tokens. */
static void test_preemption_resumes(void **state) {
    (void)state;
    struct llmem_engine *e = open_pycoder(N_REQ);
    struct llmem_kv *kv = llmem_engine_kv(e);
    /* leave 30 blocks to the requests: four fit their prompts (7 blocks each), and then grow
     * to 8 blocks each as they decode */
    int other;
    assert_int_equal(llmem_kv_seq_new(kv, &other), LLMEM_OK);
    assert_int_equal(llmem_kv_reserve(kv, other, (llmem_kv_blocks_free(kv) - 30) * 16), LLMEM_OK);
    const int len[N_REQ] = {100, 100, 100, 100, 100, 100, 100, 100};
    int64_t preemptions = serve_and_compare(e, len, 0, 1);
    printf("  %lld preemptions\n", (long long)preemptions);
    assert_true(preemptions > 0);
    llmem_kv_seq_free(kv, other);
    llmem_engine_close(e);
}

static int critical; /* 1: the guard's source reads critical memory pressure */

static void critical_guard(void *arg, struct llmem_guard_reading *r) {
    (void)arg;
    if (__atomic_load_n(&critical, __ATOMIC_SEQ_CST))
        r->resident_bytes = r->ceiling_bytes; /* ≥ 0.95 × the ceiling: critical */
    else
        r->resident_bytes = 0, r->psi_some = r->psi_full = 0;
}

/* Two tokens before its last, a request turns the machine's memory pressure critical. */
static int on_token_then_critical(void *arg, const struct llmem_token_event *ev) {
    const struct outcome *o = arg;
    if (o->n_ids + 1 >= GEN - 2)
        __atomic_store_n(&critical, 1, __ATOMIC_SEQ_CST);
    return on_token(arg, ev);
}

/* A critical memory pressure admits nothing new, but a preempted request is not new: in a pool
 * too small for the requests admitted, the pressure turns critical while the preempted requests
 * wait to resume; the requests never admitted are refused before their first token, and every
 * request that had tokens completes. */
static void test_critical_resumes_preempted(void **state) {
    (void)state;
    const struct llmem_engine_hooks hooks = {.guard_source = critical_guard};
    struct llmem_engine *e = open_hooked(N_REQ, &hooks);
    struct llmem_kv *kv = llmem_engine_kv(e);
    /* 34 blocks for the requests: four are admitted (7 blocks each for 110 tokens, a block of
     * headroom for each running one) and need 9 blocks each by their 18th token, so the newest
     * is preempted before the first of them turns the pressure critical at its 22nd */
    int other;
    assert_int_equal(llmem_kv_seq_new(kv, &other), LLMEM_OK);
    assert_int_equal(llmem_kv_reserve(kv, other, (llmem_kv_blocks_free(kv) - 34) * 16), LLMEM_OK);
    __atomic_store_n(&critical, 0, __ATOMIC_SEQ_CST);
    const int len[N_REQ] = {110, 110, 110, 110, 110, 110, 110, 110};
    struct outcome out[N_REQ];
    struct llmem_engine_metrics m;
    serve_all(e, len, 0, on_token_then_critical, out, &m);
    int ok = 0;
    for (int i = 0; i < N_REQ; i++) {
        if (out[i].status == LLMEM_OK) {
            assert_int_equal(out[i].n_ids, GEN);
            ok++;
        } else {
            assert_int_equal(out[i].status, LLMEM_ENOMEM);
            assert_int_equal(out[i].n_ids, 0); /* refused before its first token */
            assert_non_null(strstr(out[i].message, "critical memory pressure"));
        }
    }
    printf("  %lld preemptions, %d completed, %lld refused\n", (long long)m.preemptions, ok,
           (long long)m.requests_refused);
    assert_true(m.preemptions > 0);
    assert_int_equal(m.requests_failed, 0);
    assert_int_equal(m.requests_refused, N_REQ - ok);
    assert_true(m.requests_refused > 0);
    assert_int_equal(llmem_kv_check(kv), LLMEM_OK);
    llmem_kv_seq_free(kv, other);
    llmem_engine_close(e);
}

/* Cancelling: from the request's own callback, and from another thread while it waits or runs;
 * either way its blocks come back. A request larger than the whole pool is refused up front. */
static void test_cancel_and_refuse(void **state) {
    (void)state;
    struct llmem_engine *e = open_pycoder(4);
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int n_done = 0;
    struct outcome out[3];
    for (int i = 0; i < 3; i++)
        out[i] = (struct outcome){.mu = &mu, .cv = &cv, .n_done = &n_done, .logprobs_ok = 1};
    out[0].cancel_after = 5;
    assert_int_equal(llmem_engine_serve_start(e, NULL), LLMEM_OK);
    int32_t prompt[200];
    prompt_of(1, prompt, 200);
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 500;
    p.ignore_eos = 1;
    uint64_t ids[3];
    for (int i = 0; i < 2; i++) {
        struct llmem_request_events ev = {.on_token = on_token, .on_done = on_done, .arg = &out[i]};
        assert_int_equal(llmem_engine_submit(e, prompt, 200, &p, &ev, &ids[i]), LLMEM_OK);
    }
    llmem_engine_cancel(e, ids[1]);
    pthread_mutex_lock(&mu);
    while (n_done < 2)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    assert_int_equal(out[0].status, LLMEM_OK);
    assert_string_equal(out[0].reason, "cancelled");
    assert_int_equal(out[0].n_ids, 5);
    assert_int_equal(out[1].status, LLMEM_OK);
    assert_string_equal(out[1].reason, "cancelled");
    assert_true(out[1].n_ids < 500);

    llmem_engine_serve_stop(e);
    struct llmem_kv *kv = llmem_engine_kv(e);
    struct llmem_kv_stats ks;
    llmem_kv_stats(kv, &ks);
    assert_int_equal(ks.n_sequences, 0);
    int other;
    assert_int_equal(llmem_kv_seq_new(kv, &other), LLMEM_OK);
    llmem_engine_clear_cache(e);
    /* a request cannot exceed the context, so to be refused it must exceed the pool: take all
     * but 20 blocks away */
    assert_int_equal(llmem_kv_reserve(kv, other, (llmem_kv_blocks_free(kv) - 20) * 16), LLMEM_OK);
    assert_int_equal(llmem_engine_serve_start(e, NULL), LLMEM_OK);
    struct llmem_request_events ev = {.on_token = on_token, .on_done = on_done, .arg = &out[2]};
    assert_int_equal(llmem_engine_submit(e, prompt, 200, &p, &ev, &ids[2]), LLMEM_OK);
    pthread_mutex_lock(&mu);
    while (n_done < 3)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    assert_int_equal(out[2].status, LLMEM_ENOMEM);
    assert_int_equal(out[2].n_ids, 0);
    assert_non_null(strstr(out[2].message, "refused before prefill"));
    struct llmem_engine_metrics m;
    llmem_engine_metrics(e, &m);
    assert_int_equal(m.requests_cancelled, 2);
    assert_int_equal(m.requests_refused, 1);
    llmem_engine_serve_stop(e);
    llmem_kv_seq_free(kv, other);
    assert_int_equal(llmem_kv_check(kv), LLMEM_OK);
    llmem_engine_close(e);
}

/* A full queue says LLMEM_EBUSY; a bad request, or any request to an engine that is not serving,
 * is refused by submit itself; requests still running or queued when the engine closes end as
 * cancelled. */
static void test_submit_checks(void **state) {
    (void)state;
    struct llmem_engine *e = open_pycoder(1);
    int32_t prompt[4] = {5, 6, 7, 8};
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 900; /* long enough that none ends while the queue fills */
    p.ignore_eos = 1;
    uint64_t id;
    assert_int_equal(llmem_engine_submit(e, prompt, 4, &p, NULL, &id), LLMEM_EINVAL);
    struct llmem_serve_config sc = {.max_queue = 2};
    assert_int_equal(llmem_engine_serve_start(e, &sc), LLMEM_OK);
    assert_int_equal(llmem_engine_serve_start(e, &sc), LLMEM_EINVAL);
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int n_done = 0;
    struct outcome out[3];
    for (int i = 0; i < 3; i++) { /* max_queue waiting + max_sequences running */
        out[i] = (struct outcome){.mu = &mu, .cv = &cv, .n_done = &n_done, .logprobs_ok = 1};
        struct llmem_request_events ev = {.on_token = on_token, .on_done = on_done, .arg = &out[i]};
        assert_int_equal(llmem_engine_submit(e, prompt, 4, &p, &ev, &id), LLMEM_OK);
    }
    assert_int_equal(llmem_engine_submit(e, prompt, 4, &p, NULL, &id), LLMEM_EBUSY);
    int32_t bad[2] = {5, 1 << 30};
    assert_int_equal(llmem_engine_submit(e, bad, 2, &p, NULL, &id), LLMEM_EINVAL);
    assert_int_equal(llmem_engine_submit(e, prompt, 0, &p, NULL, &id), LLMEM_EINVAL);
    p.logprobs = LLMEM_MAX_TOP_LOGPROBS + 1;
    assert_int_equal(llmem_engine_submit(e, prompt, 4, &p, NULL, &id), LLMEM_EINVAL);
    p.logprobs = -1;
    struct llmem_generate_params q = p; /* parameters no request could have */
    q.max_tokens = -5;
    assert_int_equal(llmem_engine_submit(e, prompt, 4, &q, NULL, &id), LLMEM_EINVAL);
    q = p, q.n_stop = 3; /* and no strings */
    assert_int_equal(llmem_engine_submit(e, prompt, 4, &q, NULL, &id), LLMEM_EINVAL);
    const int32_t minus[1] = {-7};
    q = p, q.stop_ids = minus, q.n_stop_ids = 1;
    assert_int_equal(llmem_engine_submit(e, prompt, 4, &q, NULL, &id), LLMEM_EINVAL);
    /* a synchronous generate while serving is refused, not an assertion */
    struct llmem_generate_result r;
    assert_int_equal(llmem_engine_generate(e, prompt, 4, &p, NULL, NULL, &r), LLMEM_EINVAL);
    llmem_engine_close(e);
    assert_int_equal(n_done, 3);
    for (int i = 0; i < 3; i++)
        assert_string_equal(out[i].reason, "cancelled");

    /* a cancel of an id never submitted (0 is a synchronous generate's) is ignored: it does not
     * wait for the next generate and cancel that */
    e = open_pycoder(1);
    llmem_engine_cancel(e, 0);
    llmem_engine_cancel(e, 12345);
    p.max_tokens = 4;
    assert_int_equal(llmem_engine_generate(e, prompt, 4, &p, NULL, NULL, &r), LLMEM_OK);
    assert_string_equal(r.finish_reason, "length");
    assert_int_equal(r.n_ids, 4);
    llmem_generate_result_free(&r);
    llmem_engine_close(e);
}

/* A configuration no run could have is refused at open, naming the field, before anything is
 * loaded; NULL arguments alike. */
static void test_open_checks(void **state) {
    (void)state;
    struct llmem_engine *e = NULL;
    tu_count_errors(LLMEM_LOG_ERROR);
    tu_expect_failure(llmem_engine_open(NULL, NULL, NULL, &e), LLMEM_EINVAL, "config is NULL");
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    tu_expect_failure(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_EINVAL, "config->model_dir");
    c.model_dir = PYCODER;
    tu_expect_failure(llmem_engine_open(&c, NULL, NULL, NULL), LLMEM_EINVAL, "out is NULL");
    c.backend = (enum llmem_backend_kind)42;
    tu_expect_failure(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_EINVAL, "config->backend");
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.max_batch_tokens = -7;
    tu_expect_failure(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_EINVAL,
                      "config->max_batch_tokens");
    c.max_batch_tokens = 0, c.runtime_baseline_bytes = -12345;
    tu_expect_failure(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_EINVAL,
                      "config->runtime_baseline_bytes");
    c.runtime_baseline_bytes = LLMEM_ENGINE_BASELINE_MEASURE, c.n_threads = 100000;
    tu_expect_failure(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_EINVAL, "config->n_threads");
    tu_count_errors_stop();
    assert_null(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_concurrent_equals_single),
        cmocka_unit_test(test_preemption_resumes),
        cmocka_unit_test(test_critical_resumes_preempted),
        cmocka_unit_test(test_cancel_and_refuse),
        cmocka_unit_test(test_submit_checks),
        cmocka_unit_test(test_open_checks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

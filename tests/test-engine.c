/*
 * tests/test-engine.c — the engine: sampling (greedy, seeded draws, top-k/top-p/min-p), stop
 * strings and max tokens, the memory promise on pycoder at its full context (measured peaks per
 * tag against the plan, the computed workspace against the measured scratch peak), refusal of a
 * model that does not fit before anything is loaded, and a request that runs out of KV memory.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "llmem/bank.h"
#include "llmem/engine.h"
#include "llmem/tokenizer.h"
#include "testutil.h"

#define PYCODER LLMEM_SOURCE_DIR "/models/pycoder"

/* ---- error capture
 * -------------------------------------------------------------------------------- */

static int n_errors;
static char last_errors[4096];

static void capture(enum llmem_log_level level, const char *line, void *user) {
    (void)user;
    if (level != LLMEM_LOG_ERROR)
        return;
    n_errors++;
    size_t used = strlen(last_errors);
    snprintf(last_errors + used, sizeof(last_errors) - used, "%s\n", line);
}

/* ---- sampler -------------------------------------------------------------------------------- */

static void test_sampler(void **state) {
    (void)state;
    enum { V = 50 };
    float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = (float)(i % 7) * 0.5f - (float)i * 0.01f;
    logits[33] = 4.0f; /* the argmax */
    struct llmem_sampling p;
    llmem_sampling_default(&p);
    struct llmem_sampler *s = NULL;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_OK);
    for (int i = 0; i < 5; i++)
        assert_int_equal(llmem_sampler_sample(s, logits), 33);
    llmem_sampler_free(s);

    /* top_k = 3 at a high temperature: only the three best tokens ever come out. */
    p.temperature = 5.0;
    p.top_k = 3;
    p.seed = 42;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_OK);
    int seen[V] = {0};
    int32_t first[64];
    for (int i = 0; i < 2000; i++) {
        int32_t t = llmem_sampler_sample(s, logits);
        if (i < 64)
            first[i] = t;
        seen[t]++;
    }
    llmem_sampler_free(s);
    int distinct = 0;
    for (int i = 0; i < V; i++)
        distinct += seen[i] > 0;
    assert_int_equal(distinct, 3);
    assert_true(seen[33] > 0 && seen[6] > 0 && seen[13] > 0); /* 4.0, 3.0−0.06, 3.0−0.13 */
    /* The same seed gives the same draws; another seed others. */
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_OK);
    for (int i = 0; i < 64; i++)
        assert_int_equal(llmem_sampler_sample(s, logits), first[i]);
    llmem_sampler_free(s);

    /* min_p close to 1 keeps only the best token; top_p tiny too. */
    p.top_k = 0;
    p.min_p = 0.99;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_OK);
    for (int i = 0; i < 100; i++)
        assert_int_equal(llmem_sampler_sample(s, logits), 33);
    llmem_sampler_free(s);
    p.min_p = 0;
    p.top_p = 1e-6;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_OK);
    for (int i = 0; i < 100; i++)
        assert_int_equal(llmem_sampler_sample(s, logits), 33);
    llmem_sampler_free(s);

    /* The distribution follows softmax(logits / T): two tokens with logits 0 and ln 3. */
    float two[2] = {0.0f, logf(3.0f)};
    llmem_sampling_default(&p);
    p.temperature = 1.0;
    p.seed = 7;
    assert_int_equal(llmem_sampler_create(&p, 2, &s), LLMEM_OK);
    int ones = 0;
    for (int i = 0; i < 20000; i++)
        ones += llmem_sampler_sample(s, two);
    llmem_sampler_free(s);
    assert_true(fabs(ones / 20000.0 - 0.75) < 0.02);

    /* Bad parameters. */
    p.temperature = -1;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_EINVAL);
    p.temperature = 1;
    p.top_p = 0;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_EINVAL);
}

/* ---- generation ---------------------------------------------------------------------------------
 */

static struct llmem_engine *open_pycoder(int64_t context, enum llmem_kv_format format) {
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.context = context;
    c.kv_format = format;
    c.n_threads = 2;
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
    return e;
}

struct collect {
    char text[8192];
    size_t len;
    int calls, stop_after;
};

static int collect(void *arg, int32_t id, const char *text, size_t len) {
    (void)id;
    struct collect *c = arg;
    assert_true(c->len + len < sizeof(c->text));
    memcpy(c->text + c->len, text, len);
    c->len += len;
    c->text[c->len] = '\0';
    return ++c->calls == c->stop_after;
}

static void test_generate_stops(void **state) {
    (void)state;
    struct llmem_engine *e = open_pycoder(0, LLMEM_KV_FORMAT_F32);
    const struct llmem_tokenizer *tok = llmem_engine_tokenizer(e);
    const char *prompt = "def main():\n    parser = argparse.ArgumentParser(";
    int32_t *ids = NULL;
    int64_t n = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, prompt, strlen(prompt), &ids, &n), LLMEM_OK);

    /* max tokens, and the streamed text equals the result and the decode of the ids */
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 40;
    p.ignore_eos = 1;
    struct collect c = {0};
    struct llmem_generate_result full;
    assert_int_equal(llmem_engine_generate(e, ids, n, &p, collect, &c, &full), LLMEM_OK);
    assert_int_equal(full.n_ids, 40);
    assert_string_equal(full.finish_reason, "length");
    assert_string_equal(c.text, full.text);
    char *decoded = NULL;
    size_t len = 0;
    assert_int_equal(llmem_tokenizer_decode(tok, full.ids, full.n_ids, 1, &decoded, &len),
                     LLMEM_OK);
    assert_string_equal(decoded, full.text);
    free(decoded);

    /* a stop string taken from the middle of that text: the output ends right before it */
    const char *mid = full.text + full.text_len / 2;
    char stop[8];
    snprintf(stop, sizeof(stop), "%.4s", mid);
    const char *first = strstr(full.text, stop);
    const char *stops[] = {"never appears anywhere", stop};
    p.stop = stops;
    p.n_stop = 2;
    struct collect c2 = {0};
    struct llmem_generate_result r;
    assert_int_equal(llmem_engine_generate(e, ids, n, &p, collect, &c2, &r), LLMEM_OK);
    assert_string_equal(r.finish_reason, "stop");
    assert_int_equal(r.text_len, (size_t)(first - full.text));
    assert_memory_equal(r.text, full.text, r.text_len);
    assert_string_equal(c2.text, r.text); /* nothing of the stop string was streamed */
    llmem_generate_result_free(&r);

    /* a stop id, and cancellation from the callback */
    p.n_stop = 0;
    p.stop_ids = &full.ids[5];
    p.n_stop_ids = 1;
    assert_int_equal(llmem_engine_generate(e, ids, n, &p, NULL, NULL, &r), LLMEM_OK);
    assert_string_equal(r.finish_reason, "stop");
    assert_true(r.n_ids <= 5);
    llmem_generate_result_free(&r);
    p.n_stop_ids = 0;
    struct collect c3 = {.stop_after = 3};
    assert_int_equal(llmem_engine_generate(e, ids, n, &p, collect, &c3, &r), LLMEM_OK);
    assert_string_equal(r.finish_reason, "cancelled");
    assert_int_equal(r.n_ids, 3);
    llmem_generate_result_free(&r);
    llmem_generate_result_free(&full);

    /* bad requests */
    assert_int_equal(llmem_engine_generate(e, ids, 0, &p, NULL, NULL, &r), LLMEM_EINVAL);
    int32_t bad = 1 << 20;
    assert_int_equal(llmem_engine_generate(e, &bad, 1, &p, NULL, NULL, &r), LLMEM_EINVAL);
    struct llmem_kv_stats ks;
    llmem_kv_stats(llmem_engine_kv(e), &ks);
    assert_int_equal(ks.n_sequences, 0); /* every request freed its sequence */
    free(ids);
    llmem_engine_close(e);
}

/* ---- the session bank
 * ---------------------------------------------------------------------------- */

/* The same long prompt twice: the second request takes every full block of the first from the
 * bank, prefills only the rest, and generates the same tokens; a conversation's next turn reuses
 * the previous turn's prompt and answer. */
static void test_generate_reuses_prefix(void **state) {
    (void)state;
    struct llmem_engine *e = open_pycoder(0, LLMEM_KV_FORMAT_F16);
    int32_t prompt[1500];
    for (int i = 0; i < 1500; i++)
        prompt[i] = 20 + (i * 37) % 3900;
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 24;
    p.ignore_eos = 1;
    struct llmem_generate_result cold, warm;
    assert_int_equal(llmem_engine_generate(e, prompt, 1500, &p, NULL, NULL, &cold), LLMEM_OK);
    assert_int_equal(cold.reused_tokens, 0);
    assert_int_equal(llmem_engine_generate(e, prompt, 1500, &p, NULL, NULL, &warm), LLMEM_OK);
    assert_int_equal(warm.reused_tokens, 1499 / 16 * 16);
    assert_int_equal(warm.n_ids, cold.n_ids);
    assert_memory_equal(warm.ids, cold.ids, (size_t)cold.n_ids * sizeof(int32_t));
    printf("  1500-token prompt: ttft cold %.1f ms, from the bank %.1f ms (%lld tokens reused)\n",
           cold.ttft_ms, warm.ttft_ms, (long long)warm.reused_tokens);

    /* the next turn: prompt + answer + more, reuses through the answer's full blocks */
    int32_t turn[1600];
    memcpy(turn, prompt, sizeof(prompt));
    memcpy(turn + 1500, cold.ids, (size_t)cold.n_ids * sizeof(int32_t));
    for (int i = 1500 + (int)cold.n_ids; i < 1600; i++)
        turn[i] = 30 + i % 100;
    struct llmem_generate_result next;
    assert_int_equal(llmem_engine_generate(e, turn, 1600, &p, NULL, NULL, &next), LLMEM_OK);
    assert_int_equal(next.reused_tokens, (1500 + cold.n_ids - 1) / 16 * 16);
    struct llmem_bank_stats bs;
    llmem_bank_stats(llmem_engine_bank(e), &bs);
    assert_true(bs.hit_blocks >= 93 + (1500 + cold.n_ids - 1) / 16);
    assert_int_equal(llmem_kv_check(llmem_engine_kv(e)), LLMEM_OK);
    llmem_generate_result_free(&cold);
    llmem_generate_result_free(&warm);
    llmem_generate_result_free(&next);
    llmem_engine_close(e);
}

/* Admission: a request whose KV cannot fit the pool (here most of it taken by another sequence)
 * is refused before a single token of KV is written — even with every banked block evicted it
 * would not fit, so the bank keeps them. */
static void test_admission_refuses_before_writing(void **state) {
    (void)state;
    int32_t prompt[600];
    for (int i = 0; i < 600; i++)
        prompt[i] = 40 + i % 2000;
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 8;
    p.ignore_eos = 1;
    struct llmem_generate_result r;
    struct llmem_engine *e = NULL;
    struct llmem_kv *kv = NULL;
    int other;
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.max_sequences = 2;
    c.n_threads = 2;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
    kv = llmem_engine_kv(e);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    struct llmem_bank_stats bs;
    llmem_bank_stats(llmem_engine_bank(e), &bs);
    assert_true(bs.blocks > 0);
    assert_int_equal(llmem_kv_seq_new(kv, &other), LLMEM_OK);
    /* leave 5 blocks free: with the bank's, fewer than an 800-token request needs */
    assert_int_equal(llmem_kv_reserve(kv, other, (llmem_kv_blocks_free(kv) - 5) * 16), LLMEM_OK);
    assert_true(5 + bs.blocks < 800 / 16);
    struct llmem_kv_stats before, after;
    llmem_kv_stats(kv, &before);
    llmem_log_set_callback(capture, NULL, LLMEM_LOG_ERROR);
    last_errors[0] = '\0';
    int32_t other_prompt[800];
    for (int i = 0; i < 800; i++)
        other_prompt[i] = 3000 - i;
    assert_int_equal(llmem_engine_generate(e, other_prompt, 800, &p, NULL, NULL, &r), LLMEM_ENOMEM);
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
    assert_non_null(strstr(last_errors, "refused before prefill"));
    llmem_kv_stats(kv, &after);
    assert_int_equal(after.bytes_written, before.bytes_written); /* nothing was written */
    struct llmem_bank_stats kept;
    llmem_bank_stats(llmem_engine_bank(e), &kept);
    assert_int_equal(kept.blocks, bs.blocks); /* a request that cannot fit costs the bank nothing */
    /* with the other sequence gone, the same request runs */
    llmem_kv_seq_free(kv, other);
    assert_int_equal(llmem_engine_generate(e, other_prompt, 800, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    assert_int_equal(llmem_kv_check(kv), LLMEM_OK);
    llmem_engine_close(e);
}

/* ---- the pressure guard -----------------------------------------------------------------------
 */

static struct llmem_guard_reading quiet(void) {
    return (struct llmem_guard_reading){.allocator_bytes = 100,
                                        .allocation_limit = 1000,
                                        .resident_bytes = 200,
                                        .trip_bytes = 1100,
                                        .ceiling_bytes = 1200,
                                        .psi_some = 0,
                                        .psi_full = 0};
}

/* Levels by signal, and the edge, re-arm, flap and defer rules, with a made-up clock. */
static void test_guard_rules(void **state) {
    (void)state;
    struct llmem_guard_reading r = quiet(), w = quiet(), c = quiet();
    assert_int_equal(llmem_guard_classify(&r, NULL), LLMEM_GUARD_CLEAR);
    w.allocator_bytes = 980; /* 98 % of the allocation limit */
    assert_int_equal(llmem_guard_classify(&w, NULL), LLMEM_GUARD_WARNING);
    struct llmem_guard_reading x = quiet();
    x.resident_bytes = 1100; /* at the trip */
    assert_int_equal(llmem_guard_classify(&x, NULL), LLMEM_GUARD_WARNING);
    x = quiet();
    x.psi_some = 12;
    assert_int_equal(llmem_guard_classify(&x, NULL), LLMEM_GUARD_WARNING);
    c.resident_bytes = 1150; /* 96 % of the ceiling */
    const char *why = NULL;
    assert_int_equal(llmem_guard_classify(&c, &why), LLMEM_GUARD_CRITICAL);
    assert_non_null(strstr(why, "ceiling"));
    x = quiet();
    x.psi_full = 6;
    assert_int_equal(llmem_guard_classify(&x, NULL), LLMEM_GUARD_CRITICAL);
    x = quiet();
    x.resident_bytes = -1; /* unknown signals never fire */
    x.psi_some = x.psi_full = -1;
    assert_int_equal(llmem_guard_classify(&x, NULL), LLMEM_GUARD_CLEAR);

    struct llmem_guard g;
    llmem_guard_init(&g);
    assert_int_equal(llmem_guard_decide(&g, &r, 0, 0), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &w, 1, 0), LLMEM_GUARD_WARNING); /* rising edge */
    assert_int_equal(llmem_guard_decide(&g, &w, 2, 0), LLMEM_GUARD_CLEAR);   /* stays up */
    assert_int_equal(llmem_guard_decide(&g, &w, 120, 0), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &w, 121, 0), LLMEM_GUARD_WARNING); /* re-armed */
    assert_int_equal(llmem_guard_decide(&g, &r, 125, 0), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &w, 130, 0), LLMEM_GUARD_CLEAR); /* a flap */
    assert_int_equal(g.suppressed, 1);
    assert_int_equal(llmem_guard_decide(&g, &r, 140, 0), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &w, 152, 0), LLMEM_GUARD_WARNING); /* 31 s later */
    /* mid-step, a warning waits up to 60 s ... */
    assert_int_equal(llmem_guard_decide(&g, &r, 160, 0), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &w, 300, 1), LLMEM_GUARD_CLEAR);
    assert_int_equal(g.deferred, 1);
    assert_int_equal(llmem_guard_decide(&g, &w, 330, 1), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &w, 360, 1), LLMEM_GUARD_WARNING);
    /* ... or acts as soon as the step ends */
    assert_int_equal(llmem_guard_decide(&g, &r, 361, 0), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &w, 500, 1), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &w, 501, 0), LLMEM_GUARD_WARNING);
    /* a critical never waits, mid-step or not, and has its own edge and re-arm */
    assert_int_equal(llmem_guard_decide(&g, &c, 502, 1), LLMEM_GUARD_CRITICAL);
    assert_int_equal(llmem_guard_decide(&g, &c, 503, 1), LLMEM_GUARD_CLEAR);
    assert_int_equal(llmem_guard_decide(&g, &c, 623, 1), LLMEM_GUARD_CRITICAL);
    assert_int_equal(g.warnings, 5);
    assert_int_equal(g.criticals, 2);
}

struct fake_pressure {
    enum llmem_guard_level level;
};

static void fake_source(void *arg, struct llmem_guard_reading *r) {
    const struct fake_pressure *f = arg;
    if (f->level == LLMEM_GUARD_WARNING)
        r->psi_some = 50;
    else if (f->level == LLMEM_GUARD_CRITICAL)
        r->psi_full = 50;
    else
        r->psi_some = r->psi_full = 0;
}

/* The engine acts on what the guard decides: a warning halves the bank and releases the
 * allocator's cache; a critical empties the bank and refuses new requests until it clears. */
static void test_guard_actions(void **state) {
    (void)state;
    struct fake_pressure f = {LLMEM_GUARD_CLEAR};
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.n_threads = 2;
    c.guard_source = fake_source;
    c.guard_source_arg = &f;
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
    int32_t prompt[640];
    for (int i = 0; i < 640; i++)
        prompt[i] = 50 + (i * 13) % 3000;
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 4;
    p.ignore_eos = 1;
    struct llmem_generate_result r;
    assert_int_equal(llmem_engine_generate(e, prompt, 640, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    struct llmem_bank_stats bs;
    llmem_bank_stats(llmem_engine_bank(e), &bs);
    int64_t banked = bs.blocks;
    assert_true(banked >= 40);
    assert_true(llmem_mem_cache_size(llmem_engine_mem(e)) > 0);

    f.level = LLMEM_GUARD_WARNING;
    int32_t other[8] = {9, 8, 7, 6, 5, 4, 3, 2};
    assert_int_equal(llmem_engine_generate(e, other, 8, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    llmem_bank_stats(llmem_engine_bank(e), &bs);
    assert_int_equal(llmem_engine_guard(e)->warnings, 1);
    assert_true(bs.blocks <= banked - banked / 2 + 1);

    f.level = LLMEM_GUARD_CRITICAL;
    llmem_log_set_callback(capture, NULL, LLMEM_LOG_ERROR);
    last_errors[0] = '\0';
    assert_int_equal(llmem_engine_generate(e, other, 8, &p, NULL, NULL, &r), LLMEM_ENOMEM);
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
    assert_non_null(strstr(last_errors, "critical memory pressure"));
    llmem_bank_stats(llmem_engine_bank(e), &bs);
    assert_int_equal(bs.blocks, 0);
    assert_int_equal(llmem_mem_cache_size(llmem_engine_mem(e)), 0);
    assert_int_equal(llmem_engine_guard(e)->criticals, 1);

    f.level = LLMEM_GUARD_CLEAR; /* cleared: requests are admitted again */
    assert_int_equal(llmem_engine_generate(e, other, 8, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    llmem_engine_close(e);
}

/* ---- the memory promise -----------------------------------------------------------------------
 */

/* pycoder at its full context (2048): a prompt of 1900 tokens prefilled in chunks of 512, then
 * decoding to the end of the window. Each tag's measured peak stays within its planned bytes, and
 * the plan's computed workspace is the measured scratch peak within 10 %. */
static void test_memory_promise(void **state) {
    (void)state;
    for (int f = 0; f < 2; f++) {
        enum llmem_kv_format format = f == 0 ? LLMEM_KV_FORMAT_F16 : LLMEM_KV_FORMAT_Q8;
        struct llmem_engine *e = open_pycoder(0, format);
        const struct llmem_plan *plan = llmem_engine_plan(e);
        assert_int_equal(plan->context_window_resolved, 2048);
        int32_t prompt[1900];
        uint64_t x = 12345;
        for (int i = 0; i < 1900; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            prompt[i] = (int32_t)(5 + (x >> 33) % 4000);
        }
        struct llmem_generate_params p;
        llmem_generate_params_default(&p);
        p.ignore_eos = 1;
        struct llmem_generate_result r;
        assert_int_equal(llmem_engine_generate(e, prompt, 1900, &p, NULL, NULL, &r), LLMEM_OK);
        assert_int_equal(r.n_ids, 2048 - 1900);
        llmem_generate_result_free(&r);

        struct llmem_mem_stats st;
        llmem_mem_stats(llmem_engine_mem(e), &st);
        int64_t weights = st.tags[LLMEM_TAG_WEIGHTS].peak_bytes;
        int64_t kv = st.tags[LLMEM_TAG_KV].peak_bytes;
        int64_t scratch = st.tags[LLMEM_TAG_SCRATCH].peak_bytes;
        printf("  KV %-4s weights %lld / %lld planned, kv %lld / %lld, scratch %lld / %lld "
               "(computed workspace %lld), total peak %lld / %lld + cache limit %lld\n",
               llmem_kv_format_name(format), (long long)weights, (long long)plan->weights_bytes,
               (long long)kv, (long long)plan->kv_reserve_bytes, (long long)scratch,
               (long long)plan->runtime_transients_bytes, (long long)plan->computed_workspace_bytes,
               (long long)st.peak_bytes,
               (long long)(plan->weights_bytes + plan->kv_reserve_bytes +
                           plan->runtime_transients_bytes),
               (long long)st.cache_limit_bytes);
        /* weights: the mapped files (the tensors plus the JSON header) and the f32 copies of the
         * norm vectors: within 1 % of the tensor bytes the plan counts */
        assert_true(weights <= plan->weights_bytes + plan->weights_bytes / 100);
        assert_true(weights >= plan->weights_bytes);
        /* kv: the reserve, plus the allocator's size-class rounding (≤ 12.5 %, llmem/mem.h) */
        assert_true(kv >= plan->kv_reserve_bytes && kv <= plan->kv_reserve_bytes * 9 / 8);
        assert_true(scratch <= plan->runtime_transients_bytes);
        assert_true(st.peak_bytes <= plan->weights_bytes + plan->weights_bytes / 100 +
                                         plan->kv_reserve_bytes + plan->runtime_transients_bytes +
                                         st.cache_limit_bytes);
        double ratio = (double)plan->computed_workspace_bytes / (double)scratch;
        assert_true(ratio >= 0.9 && ratio <= 1.1);
        assert_int_equal(llmem_mem_check(llmem_engine_mem(e)), LLMEM_OK);
        llmem_engine_close(e);
    }
}

/* ---- refusals ---------------------------------------------------------------------------------
 */

static void test_refused_before_loading(void **state) {
    (void)state;
    llmem_log_set_callback(capture, NULL, LLMEM_LOG_ERROR);
    last_errors[0] = '\0';
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.budget_bytes = 8 << 20; /* 8 MiB: less than the weights */
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_ENOMEM);
    assert_null(e);
    assert_non_null(strstr(last_errors, "refused before loading"));
    assert_non_null(strstr(last_errors, "DOES NOT FIT"));

    /* the full context in f32 KV does not fit a 24 MiB budget either (named); in q8 a 32 MiB
     * budget fits it */
    last_errors[0] = '\0';
    c.budget_bytes = 24 << 20;
    c.context = 2048;
    c.kv_format = LLMEM_KV_FORMAT_F32;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_ENOMEM);
    assert_non_null(strstr(last_errors, "requested context 2048 exceeds the machine fit"));
    c.kv_format = LLMEM_KV_FORMAT_Q8;
    c.budget_bytes = 32 << 20;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
    llmem_engine_close(e);
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
}

/* A request that cannot get its attention workspace (the allocator's limit lowered to what is
 * active) ends with LLMEM_ENOMEM and frees its sequence; the engine serves the next request. */
static void test_request_out_of_memory(void **state) {
    (void)state;
    struct llmem_engine *e = open_pycoder(0, LLMEM_KV_FORMAT_F16);
    struct llmem_mem *mem = llmem_engine_mem(e);
    int32_t prompt[600];
    for (int i = 0; i < 600; i++)
        prompt[i] = 10 + i % 3000;
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 4;
    p.ignore_eos = 1;
    llmem_mem_clear_cache(mem);
    int64_t old = llmem_mem_set_memory_limit(mem, llmem_mem_active(mem));
    llmem_log_set_callback(capture, NULL, LLMEM_LOG_ERROR);
    struct llmem_generate_result r;
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &r), LLMEM_ENOMEM);
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
    llmem_mem_set_memory_limit(mem, old);
    assert_int_equal(llmem_kv_check(llmem_engine_kv(e)), LLMEM_OK);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &r), LLMEM_OK);
    assert_int_equal(r.n_ids, 4);
    llmem_generate_result_free(&r);
    llmem_engine_close(e);
}

/* An allocation attempt fails at every point of opening the engine and of one request: the n-th
 * attempt, for n = 1, 2, … until the whole sequence runs past the fault. A failure the allocator
 * cannot absorb (by releasing its cache and retrying) is a clean LLMEM_ENOMEM (the sanitizer build
 * checks that nothing leaks); one it absorbs leaves every invariant intact. */
static void test_out_of_memory_everywhere(void **state) {
    (void)state;
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.context = 64;
    c.n_threads = 2;
    int32_t prompt[40];
    for (int i = 0; i < 40; i++)
        prompt[i] = 100 + 7 * i;
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 8;
    p.ignore_eos = 1;
    llmem_log_set_callback(capture, NULL, LLMEM_LOG_ERROR);
    int open_failures = 0, request_failures = 0;
    for (int64_t n = 1; n < 10000; n++) {
        llmem_mem_fault_inject(n);
        struct llmem_engine *e = NULL;
        int status = llmem_engine_open(&c, NULL, NULL, &e);
        if (status != LLMEM_OK) {
            assert_int_equal(status, LLMEM_ENOMEM);
            assert_null(e);
            open_failures++;
            continue;
        }
        struct llmem_generate_result r;
        status = llmem_engine_generate(e, prompt, 40, &p, NULL, NULL, &r);
        int pending = llmem_mem_fault_pending();
        llmem_mem_fault_inject(0);
        if (status == LLMEM_OK) {
            assert_int_equal(r.n_ids, 8);
            llmem_generate_result_free(&r);
        } else {
            assert_int_equal(status, LLMEM_ENOMEM);
            request_failures++;
        }
        assert_int_equal(llmem_kv_check(llmem_engine_kv(e)), LLMEM_OK);
        assert_int_equal(llmem_mem_check(llmem_engine_mem(e)), LLMEM_OK);
        llmem_engine_close(e);
        if (pending)
            break; /* the fault never fired: every allocation was covered */
    }
    llmem_mem_fault_inject(0);
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
    printf("  %d failures while opening, %d during the request, all clean\n", open_failures,
           request_failures);
    assert_true(open_failures > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sampler),
        cmocka_unit_test(test_generate_stops),
        cmocka_unit_test(test_generate_reuses_prefix),
        cmocka_unit_test(test_admission_refuses_before_writing),
        cmocka_unit_test(test_guard_rules),
        cmocka_unit_test(test_guard_actions),
        cmocka_unit_test(test_memory_promise),
        cmocka_unit_test(test_refused_before_loading),
        cmocka_unit_test(test_request_out_of_memory),
        cmocka_unit_test(test_out_of_memory_everywhere),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

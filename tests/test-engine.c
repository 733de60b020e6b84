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
#include <sys/stat.h>

#include "core/log.h"
#include "engine/hooks.h"
#include "engine/sampler.h"
#include "llmem/bank.h"
#include "llmem/engine.h"
#include "llmem/grammar.h"
#include "llmem/spill.h"
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

/* Every line at WARN and above. */
static void capture_all(enum llmem_log_level level, const char *line, void *user) {
    (void)user;
    if (level > LLMEM_LOG_WARN)
        return;
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

/* The k largest of a row, by logit descending and equal logits by the lower id (the order of a
 * device's top_k). */
static void top_of(const float *logits, int V, int k, int32_t *ids, float *vals) {
    int used[512] = {0};
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < V; i++)
            if (!used[i] && (best < 0 || logits[i] > logits[best]))
                best = i;
        used[best] = 1;
        ids[j] = best;
        vals[j] = logits[best];
    }
}

/* Sampling from a row's top k gives the same tokens, draw for draw, as from the whole row: for
 * greedy, top_k alone and with temperature, top-p and min-p, on rows with ties. */
/* The penalties and biases on known logits, as llmem/sampler.h specifies them: repetition on the
 * prompt's and the output's tokens (positive ÷, negative ×), then count × frequency + presence
 * for the output's, then logit_bias; the distribution moves with them: −100 bans a token, +100
 * all but forces one, a frequency penalty stops greedy repeating itself. */
static void test_sampler_penalties(void **state) {
    (void)state;
    enum { V = 8 };
    const float logits[V] = {1.0f, 2.0f, -1.5f, 0.5f, 3.0f, 0.25f, -0.5f, 2.5f};
    const struct llmem_logit_bias bias[2] = {{3, 1.0f}, {6, -2.0f}};
    struct llmem_sampling p;
    llmem_sampling_default(&p);
    assert_int_equal(llmem_sampling_top_needed(&p), 1);
    p.presence_penalty = 0.25;
    p.frequency_penalty = 0.5;
    p.repetition_penalty = 2.0;
    p.logit_bias = bias;
    p.n_logit_bias = 2;
    assert_int_equal(llmem_sampling_top_needed(&p), 0); /* the whole row, always */
    struct llmem_sampler *s = NULL;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_OK);
    const int32_t prompt[3] = {1, 2, 1};
    llmem_sampler_prompt(s, prompt, 3);
    llmem_sampler_accept(s, 4);
    llmem_sampler_accept(s, 4);
    llmem_sampler_accept(s, 2);
    const float *a = llmem_sampler_adjusted(s, logits);
    const float want[V] = {
        1.0f,                     /* untouched */
        2.0f / 2,                 /* in the prompt: repetition only */
        -1.5f * 2 - 0.5f - 0.25f, /* prompt and once in the output */
        0.5f + 1.0f,              /* biased */
        3.0f / 2 - 2 * 0.5f - 0.25f, /* twice in the output */
        0.25f,
        -0.5f - 2.0f, /* biased */
        2.5f,
    };
    for (int i = 0; i < V; i++)
        assert_float_equal(a[i], want[i], 1e-6);
    /* greedy takes the adjusted row's best: 7 (2.5), not 4 (3.0 raw) */
    assert_int_equal(llmem_sampler_sample(s, logits), 7);
    llmem_sampler_free(s);

    /* −100 bans the argmax, +100 forces a token, at temperature 1 over 2,000 draws */
    float flat[V];
    for (int i = 0; i < V; i++)
        flat[i] = 0.1f * (float)i;
    for (int force = 0; force < 2; force++) {
        const struct llmem_logit_bias b = {force ? 2 : 7, force ? 100.0f : -100.0f};
        llmem_sampling_default(&p);
        p.temperature = 1.0;
        p.seed = 11;
        p.logit_bias = &b;
        p.n_logit_bias = 1;
        assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_OK);
        int hits = 0;
        for (int i = 0; i < 2000; i++)
            hits += llmem_sampler_sample(s, flat) == b.id;
        assert_int_equal(hits, force ? 2000 : 0);
        llmem_sampler_free(s);
    }

    /* a frequency penalty of 2 on a greedy row whose best two are 0.5 apart: it alternates */
    const float two[V] = {0, 0, 0, 3.0f, 2.5f, 0, 0, 0};
    llmem_sampling_default(&p);
    p.frequency_penalty = 2.0;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_OK);
    int32_t got[4];
    for (int i = 0; i < 4; i++)
        llmem_sampler_accept(s, got[i] = llmem_sampler_sample(s, two));
    assert_true(got[0] == 3 && got[1] == 4 && got[2] == 3 && got[3] == 4);
    llmem_sampler_free(s);

    /* out of range: refused by name */
    const struct llmem_logit_bias bad = {V, 1.0f};
    llmem_sampling_default(&p);
    p.logit_bias = &bad;
    p.n_logit_bias = 1;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_EINVAL);
    llmem_sampling_default(&p);
    p.repetition_penalty = -1;
    assert_int_equal(llmem_sampler_create(&p, V, &s), LLMEM_EINVAL);
}

static void test_sampler_top(void **state) {
    (void)state;
    enum { V = 300, K = 64 };
    float logits[V];
    uint64_t x = 12345;
    struct llmem_sampling p;
    const struct {
        double t;
        int64_t top_k;
        double top_p, min_p;
    } cases[] = {{0, 0, 1, 0},       {0.7, 1, 1, 0},      {1.0, 5, 1, 0}, {2.0, 40, 0.9, 0},
                 {0.8, 64, 1, 0.05}, {1.3, 17, 0.5, 0.1}, {5.0, 64, 1, 0}};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        llmem_sampling_default(&p);
        p.temperature = cases[c].t, p.top_k = cases[c].top_k;
        p.top_p = cases[c].top_p, p.min_p = cases[c].min_p, p.seed = 99 + c;
        int64_t need = llmem_sampling_top_needed(&p);
        assert_true(need >= 1 && need <= K);
        struct llmem_sampler *a = NULL, *b = NULL;
        assert_int_equal(llmem_sampler_create(&p, V, &a), LLMEM_OK);
        assert_int_equal(llmem_sampler_create(&p, V, &b), LLMEM_OK);
        for (int step = 0; step < 200; step++) {
            for (int i = 0; i < V; i++) { /* coarse values: many ties */
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                logits[i] = (float)((x >> 40) % 64) * 0.125f - 4.0f;
            }
            int32_t ids[K];
            float vals[K];
            top_of(logits, V, K, ids, vals);
            assert_int_equal(llmem_sampler_sample_top(b, ids, vals, K),
                             llmem_sampler_sample(a, logits));
        }
        llmem_sampler_free(a);
        llmem_sampler_free(b);
    }
    /* The whole row is needed without top_k at a temperature. */
    llmem_sampling_default(&p);
    p.temperature = 1.0;
    assert_int_equal(llmem_sampling_top_needed(&p), 0);
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
    c.no_spill = 1; /* these requests start cold: nothing of an earlier run is on disk */
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
    /* of several, the earliest match ends the text, whichever is listed first */
    char late[8], early[8];
    snprintf(late, sizeof(late), "%.3s", full.text + 3 * full.text_len / 4);
    snprintf(early, sizeof(early), "%.3s", full.text + full.text_len / 4);
    const char *at_late = strstr(full.text, late), *at_early = strstr(full.text, early);
    assert_true(at_early < at_late); /* the case tells the two rules apart */
    const char *two[] = {late, early};
    p.stop = two;
    assert_int_equal(llmem_engine_generate(e, ids, n, &p, NULL, NULL, &r), LLMEM_OK);
    assert_string_equal(r.finish_reason, "stop");
    assert_int_equal(r.text_len, (size_t)(at_early - full.text));
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

    /* under a grammar that allows nothing after a complete output, the output ends there as a
     * stop, also on its budget's last token */
    char why[128];
    struct llmem_grammar *g = NULL;
    assert_int_equal(llmem_grammar_compile("{\"const\": \"ok\"}", 15, why, sizeof(why), &g),
                     LLMEM_OK);
    struct llmem_generate_params gp;
    llmem_generate_params_default(&gp);
    gp.max_tokens = 64;
    gp.sampling.grammar = g;
    assert_int_equal(llmem_engine_generate(e, ids, n, &gp, NULL, NULL, &r), LLMEM_OK);
    assert_string_equal(r.text, "\"ok\"");
    assert_string_equal(r.finish_reason, "stop");
    gp.max_tokens = r.n_ids;
    llmem_generate_result_free(&r);
    assert_int_equal(llmem_engine_generate(e, ids, n, &gp, NULL, NULL, &r), LLMEM_OK);
    assert_string_equal(r.text, "\"ok\"");
    assert_string_equal(r.finish_reason, "stop");
    llmem_generate_result_free(&r);
    llmem_grammar_free(g);

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

    /* cgroup memory.events: a rising high count is a warning, a rising max or oom count a
     * critical; counts that stay, go unknown or go down (another cgroup) signal nothing */
    struct llmem_guard h;
    llmem_guard_init(&h);
    struct llmem_guard_reading e = quiet();
    e.cgroup_high = 10, e.cgroup_max = 3, e.cgroup_oom = 0;
    llmem_guard_events(&h, &e); /* the first reading is the baseline */
    assert_int_equal(e.cgroup_high_rise + e.cgroup_max_rise, 0);
    assert_int_equal(llmem_guard_classify(&e, NULL), LLMEM_GUARD_CLEAR);
    e.cgroup_high = 12;
    llmem_guard_events(&h, &e);
    assert_int_equal(e.cgroup_high_rise, 2);
    assert_int_equal(llmem_guard_classify(&e, &why), LLMEM_GUARD_WARNING);
    assert_non_null(strstr(why, "memory.high"));
    llmem_guard_events(&h, &e); /* the same count again: clear */
    assert_int_equal(llmem_guard_classify(&e, NULL), LLMEM_GUARD_CLEAR);
    e.cgroup_oom = 1;
    llmem_guard_events(&h, &e);
    assert_int_equal(llmem_guard_classify(&e, &why), LLMEM_GUARD_CRITICAL);
    assert_non_null(strstr(why, "memory.max"));
    e.cgroup_max = 4;
    llmem_guard_events(&h, &e);
    assert_int_equal(e.cgroup_max_rise, 1);
    assert_int_equal(llmem_guard_classify(&e, NULL), LLMEM_GUARD_CRITICAL);
    e.cgroup_max = 0; /* went down */
    llmem_guard_events(&h, &e);
    assert_int_equal(llmem_guard_classify(&e, NULL), LLMEM_GUARD_CLEAR);
    e.cgroup_high = e.cgroup_max = e.cgroup_oom = -1; /* unknown */
    llmem_guard_events(&h, &e);
    assert_int_equal(llmem_guard_classify(&e, NULL), LLMEM_GUARD_CLEAR);
    e.cgroup_high = 50; /* known again: a new baseline, not a rise */
    llmem_guard_events(&h, &e);
    assert_int_equal(llmem_guard_classify(&e, NULL), LLMEM_GUARD_CLEAR);
}

struct fake_pressure {
    enum llmem_guard_level level;
    int64_t high, max, oom; /* memory.events counters, when events is set */
    int events;
};

static void fake_source(void *arg, struct llmem_guard_reading *r) {
    const struct fake_pressure *f = arg;
    if (f->level == LLMEM_GUARD_WARNING)
        r->psi_some = 50;
    else if (f->level == LLMEM_GUARD_CRITICAL)
        r->psi_full = 50;
    else
        r->psi_some = r->psi_full = 0;
    r->resident_bytes = -1;
    if (f->events) {
        r->cgroup_high = f->high;
        r->cgroup_max = f->max;
        r->cgroup_oom = f->oom;
    }
}

/* The engine acts on what the guard decides: a warning halves the bank and releases the
 * allocator's cache; a critical empties the bank and refuses new requests until it clears. */
/* pycoder with its guard reading f, after a 640-token request (prompt ids 50 + i·stride mod
 * 3000) that left its blocks in the bank; *banked: how many (at least 40). */
static struct llmem_engine *open_banked(struct fake_pressure *f, int stride, int no_spill,
                                        int64_t *banked) {
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.n_threads = 2;
    c.no_spill = no_spill;
    struct llmem_engine_hooks h = {.guard_source = fake_source, .guard_source_arg = f};
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open_hooked(&c, &h, NULL, NULL, &e), LLMEM_OK);
    int32_t prompt[640];
    for (int i = 0; i < 640; i++)
        prompt[i] = 50 + (i * stride) % 3000;
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 4;
    p.ignore_eos = 1;
    struct llmem_generate_result r;
    assert_int_equal(llmem_engine_generate(e, prompt, 640, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    struct llmem_bank_stats bs;
    llmem_bank_stats(llmem_engine_bank(e), &bs);
    *banked = bs.blocks;
    assert_true(*banked >= 40);
    return e;
}

static void test_guard_actions(void **state) {
    (void)state;
    struct fake_pressure f = {.level = LLMEM_GUARD_CLEAR};
    int64_t banked = 0;
    struct llmem_engine *e = open_banked(&f, 13, 0, &banked);
    struct llmem_bank_stats bs;
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 4;
    p.ignore_eos = 1;
    struct llmem_generate_result r;
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
    assert_int_equal(llmem_engine_guard(e)->criticals, 1);
    /* what is freed while critical is not cached: the first request's spill writes end now */
    assert_int_equal(llmem_spill_flush(llmem_engine_spill(e), 10.0), 0);
    assert_int_equal(llmem_mem_cache_size(llmem_engine_mem(e)), 0);
    struct llmem_mem_stats ms;
    llmem_mem_stats(llmem_engine_mem(e), &ms);
    assert_int_equal(ms.cache_limit_bytes, 0);

    f.level = LLMEM_GUARD_CLEAR; /* cleared: requests are admitted again, the cache is back */
    assert_int_equal(llmem_engine_generate(e, other, 8, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    llmem_mem_stats(llmem_engine_mem(e), &ms);
    assert_true(ms.cache_limit_bytes > 0);
    assert_true(llmem_mem_cache_size(llmem_engine_mem(e)) > 0);
    llmem_engine_close(e);
}

/* ---- the spill tier ---------------------------------------------------------------------------
 */

static struct llmem_engine *open_with_store(const char *model, const char *bank_dir,
                                            int64_t spill_max, llmem_spill_free_fn probe,
                                            void *probe_arg) {
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = model;
    c.n_threads = 2;
    c.bank_dir = bank_dir;
    c.spill_max_bytes = spill_max;
    struct llmem_engine_hooks h = {.spill_free_probe = probe, .spill_free_probe_arg = probe_arg};
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open_hooked(&c, &h, NULL, NULL, &e), LLMEM_OK);
    return e;
}

/* A given --bank-dir that cannot be used (a regular file where the directory goes, a directory
 * where the manifest goes) is a cache that is not there: the engine opens without the spill tier
 * and says why in one warning naming the path. */
static void test_unusable_bank_dir(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *file = tu_write_file(dir, "not-a-dir", "x", -1);
    char store[4200], manifest[4300];
    snprintf(store, sizeof(store), "%s/store", dir);
    snprintf(manifest, sizeof(manifest), "%s/manifest.sqlite", store);
    assert_int_equal(mkdir(store, 0700), 0);
    assert_int_equal(mkdir(manifest, 0700), 0);
    const struct {
        const char *bank_dir, *phrase;
    } cases[] = {
        {file, "cannot create or open the spill directory"},
        {store, "manifest.sqlite: not a regular file (a directory)"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        n_errors = 0;
        last_errors[0] = '\0';
        llmem_log_set_callback(capture_all, NULL, LLMEM_LOG_WARN);
        struct llmem_engine *e = open_with_store(PYCODER, cases[i].bank_dir, 0, NULL, NULL);
        llmem_log_set_callback(NULL, NULL, LLMEM_LOG_ERROR);
        assert_non_null(llmem_engine_bank(e));
        assert_null(llmem_engine_spill(e));
        assert_non_null(strstr(last_errors, cases[i].phrase));
        assert_non_null(strstr(last_errors, cases[i].bank_dir));
        assert_non_null(strstr(last_errors, "runs without its spill tier"));
        /* one line: its newline is the last character */
        assert_ptr_equal(strchr(last_errors, '\n'), last_errors + strlen(last_errors) - 1);
        llmem_engine_close(e);
    }
    free(file);
    tu_rmtree(dir);
    free(dir);
}

static void long_prompt(int32_t *p, int n, int salt) {
    for (int i = 0; i < n; i++)
        p[i] = 20 + (i * 37 + salt * 101) % 3900;
}

/* A second engine on the same store (what a second process sees: an empty RAM tier, the store
 * on disk) restores the prompt's prefix from disk and generates the same tokens; a third request
 * then finds it in RAM. Prompts of 600 tokens: two whole chunks and a partial one. */
static void test_spill_restores_in_a_new_engine(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    int32_t prompt[600];
    long_prompt(prompt, 600, 0);
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 16;
    p.ignore_eos = 1;
    struct llmem_generate_result cold, disk, ram;
    struct llmem_engine *e = open_with_store(PYCODER, dir, 0, NULL, NULL);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &cold), LLMEM_OK);
    assert_int_equal(cold.reused_tokens, 0);
    llmem_engine_close(e); /* flushes the writes */

    e = open_with_store(PYCODER, dir, 0, NULL, NULL);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &disk), LLMEM_OK);
    assert_int_equal(disk.reused_disk_tokens, 599 / 16 * 16);
    assert_int_equal(disk.reused_ram_tokens, 0);
    assert_int_equal(disk.n_ids, cold.n_ids);
    assert_memory_equal(disk.ids, cold.ids, (size_t)cold.n_ids * sizeof(int32_t));
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &ram), LLMEM_OK);
    assert_int_equal(ram.reused_ram_tokens, 599 / 16 * 16);
    assert_int_equal(ram.reused_disk_tokens, 0);
    assert_memory_equal(ram.ids, cold.ids, (size_t)cold.n_ids * sizeof(int32_t));
    printf("  600-token prompt: ttft cold %.1f ms, from disk %.1f ms, from RAM %.1f ms\n",
           cold.ttft_ms, disk.ttft_ms, ram.ttft_ms);
    struct llmem_engine_bank_stats bs;
    llmem_engine_bank_stats(e, &bs);
    assert_true(bs.spill_on && bs.spill.owned);
    assert_int_equal(bs.reused_disk_tokens, 592);
    assert_int_equal(bs.reused_ram_tokens, 592);
    assert_int_equal(bs.spill.read_blocks, 37);
    assert_int_equal(bs.spill.written_chunks, 0); /* all of it was on disk already */
    assert_int_equal(llmem_kv_check(llmem_engine_kv(e)), LLMEM_OK);

    /* a prompt that shares 420 tokens, from a third engine: the chunk that agrees, then the
     * first blocks of the chunk where it leaves them */
    llmem_engine_close(e);
    e = open_with_store(PYCODER, dir, 0, NULL, NULL);
    int32_t other[560];
    memcpy(other, prompt, 420 * sizeof(int32_t));
    long_prompt(other + 420, 140, 9);
    struct llmem_generate_result r;
    p.max_tokens = 2;
    assert_int_equal(llmem_engine_generate(e, other, 560, &p, NULL, NULL, &r), LLMEM_OK);
    assert_int_equal(r.reused_disk_tokens, 420 / 16 * 16);
    llmem_generate_result_free(&r);
    llmem_engine_close(e);
    llmem_generate_result_free(&cold);
    llmem_generate_result_free(&disk);
    llmem_generate_result_free(&ram);
    tu_rmtree(dir);
    free(dir);
}

/* A copy of pycoder with the same config and header but one weight changed is another model:
 * on the same store it never takes the first one's KV, from RAM or disk. */
static void test_spill_other_weights(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *model = tu_mkdtemp();
    const char *files[] = {"config.json", "model.safetensors", "tokenizer.json",
                           "tokenizer_config.json", "generation_config.json"};
    for (int i = 0; i < 5; i++) {
        char cmd[2048];
        snprintf(cmd, sizeof(cmd), "cp '%s/%s' '%s/'", PYCODER, files[i], model);
        assert_int_equal(system(cmd), 0);
    }
    /* the low byte of a bf16 weight past the header: a mantissa bit, the same shapes */
    char weights[600];
    snprintf(weights, sizeof(weights), "%s/model.safetensors", model);
    FILE *f = fopen(weights, "r+b");
    assert_non_null(f);
    uint64_t header = 0;
    assert_int_equal(fread(&header, 8, 1, f), 1);
    long at = (long)(8 + header + 4096) & ~1L;
    fseek(f, at, SEEK_SET);
    int b = fgetc(f);
    fseek(f, at, SEEK_SET);
    fputc(b ^ 1, f);
    fclose(f);

    int32_t prompt[600];
    long_prompt(prompt, 600, 3);
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 4;
    p.ignore_eos = 1;
    struct llmem_generate_result r;
    struct llmem_engine *e = open_with_store(PYCODER, dir, 0, NULL, NULL);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    llmem_engine_close(e);
    e = open_with_store(model, dir, 0, NULL, NULL);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &r), LLMEM_OK);
    assert_int_equal(r.reused_tokens, 0);
    llmem_generate_result_free(&r);
    struct llmem_engine_bank_stats bs;
    llmem_engine_bank_stats(e, &bs);
    assert_int_equal(bs.spill.hit_chunks, 0);
    assert_int_equal(bs.spill.miss_absent, 1);
    llmem_engine_close(e);
    /* while the original still finds its own */
    e = open_with_store(PYCODER, dir, 0, NULL, NULL);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &r), LLMEM_OK);
    assert_int_equal(r.reused_disk_tokens, 599 / 16 * 16);
    llmem_generate_result_free(&r);
    llmem_engine_close(e);
    tu_rmtree(model);
    tu_rmtree(dir);
    free(model);
    free(dir);
}

static int64_t no_free_disk(void *arg, const char *dir) {
    (void)arg, (void)dir;
    return 64 << 20;
}

/* A full disk (the store's free-space probe forced under 1 GiB) and a cap too small for a chunk:
 * nothing is written, nothing fails, the output is the same. */
static void test_spill_full_disk(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    int32_t prompt[600];
    long_prompt(prompt, 600, 5);
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 12;
    p.ignore_eos = 1;
    struct llmem_generate_result want, r;
    struct llmem_engine *e = open_pycoder(0, LLMEM_KV_FORMAT_F16);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &want), LLMEM_OK);
    llmem_engine_close(e);
    for (int variant = 0; variant < 2; variant++) {
        e = variant == 0 ? open_with_store(PYCODER, dir, 0, no_free_disk, NULL)
                         : open_with_store(PYCODER, dir, 256 << 10, NULL, NULL);
        llmem_log_set_callback(capture, NULL, LLMEM_LOG_WARN);
        last_errors[0] = '\0';
        n_errors = 0;
        assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, NULL, NULL, &r), LLMEM_OK);
        assert_memory_equal(r.ids, want.ids, (size_t)want.n_ids * sizeof(int32_t));
        llmem_generate_result_free(&r);
        llmem_spill_flush(llmem_engine_spill(e), 10);
        struct llmem_engine_bank_stats bs;
        llmem_engine_bank_stats(e, &bs);
        llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
        assert_int_equal(n_errors, 0);
        assert_int_equal(bs.spill.written_chunks, 0);
        assert_int_equal(bs.spill.files, 0);
        if (variant == 0) /* 611 tokens of KV: 38 blocks, 3 chunks */
            assert_int_equal(bs.spill.skip_disk_low, 3);
        else
            assert_int_equal(bs.spill.skip_cap, 3);
        assert_true(bs.spill.bytes <= (variant == 0 ? (64 << 20) / 4 : 256 << 10));
        llmem_engine_close(e);
    }
    llmem_generate_result_free(&want);
    tu_rmtree(dir);
    free(dir);
}

/* ---- the RAM tier's ceiling ---------------------------------------------------------------- */

static void no_pressure(void *arg, struct llmem_guard_reading *r) {
    (void)arg;
    r->resident_bytes = -1;
    r->psi_some = r->psi_full = 0;
    r->allocator_bytes = 0;
}

struct ceiling_watch {
    struct llmem_engine *e;
    int64_t steps, worst_margin, min_ceiling, max_bank;
};

static void check_ceiling(struct ceiling_watch *w) {
    struct llmem_kv_stats ks;
    llmem_kv_stats(llmem_engine_kv(w->e), &ks);
    struct llmem_bank_stats bs;
    llmem_bank_stats(llmem_engine_bank(w->e), &bs);
    int64_t blocks = (ks.tokens + 15) / 16;
    int64_t ceiling = llmem_plan_bank_dynamic_ceiling(
        llmem_engine_plan(w->e), blocks * llmem_kv_block_bytes(llmem_engine_kv(w->e)), 0);
    assert_true(bs.bytes <= ceiling);
    int64_t margin = ceiling - bs.bytes;
    if (w->steps == 0 || margin < w->worst_margin)
        w->worst_margin = margin;
    if (w->steps == 0 || ceiling < w->min_ceiling)
        w->min_ceiling = ceiling;
    if (bs.bytes > w->max_bank)
        w->max_bank = bs.bytes;
    w->steps++;
}

static void ceiling_progress(void *arg, int64_t done, int64_t total) {
    (void)done, (void)total;
    check_ceiling(arg);
}

static int ceiling_token(void *arg, int32_t id, const char *text, size_t len) {
    (void)id, (void)text, (void)len;
    check_ceiling(arg);
    return 0;
}

/* The RAM bank stays within llmem_plan_bank_dynamic_ceiling at the live working set, checked
 * after every step (prefill chunks of 64 and every decoded token), while requests grow to the
 * window. Under a 26 MiB budget (context 768, two sequences) the pool is what the plan leaves for
 * KV, so a request alone can never push the bank past the ceiling; one that reuses a long banked
 * prefix can (its shared blocks count in the bank and in the working set), and there the ceiling
 * falls below the bank's size and the bank yields. */
static void test_bank_within_dynamic_ceiling(void **state) {
    (void)state;
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = PYCODER;
    c.n_threads = 2;
    c.budget_bytes = 26 << 20;
    c.runtime_baseline_bytes = 0; /* the 26 MiB machine is pretended: not this process */
    c.context = 768;
    c.max_sequences = 2;
    c.max_batch_tokens = 64;
    c.no_spill = 1;
    /* this test process's resident memory is not the 26 MiB machine the plan pretends: the
     * guard reads no pressure */
    struct llmem_engine_hooks h = {.guard_source = no_pressure};
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open_hooked(&c, &h, NULL, NULL, &e), LLMEM_OK);
    struct ceiling_watch w = {.e = e};
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.ignore_eos = 1;
    p.prefill_progress = ceiling_progress;
    p.progress_arg = &w;
    struct llmem_generate_result r;
    int32_t prompt[740];
    p.max_tokens = 8;
    for (int k = 0; k < 2; k++) { /* fill the bank */
        long_prompt(prompt, 500, 20 + k);
        assert_int_equal(llmem_engine_generate(e, prompt, 500, &p, ceiling_token, &w, &r),
                         LLMEM_OK);
        llmem_generate_result_free(&r);
    }
    long_prompt(prompt, 740, 30);
    assert_int_equal(llmem_engine_generate(e, prompt, 600, &p, ceiling_token, &w, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    struct llmem_bank_stats before;
    llmem_bank_stats(llmem_engine_bank(e), &before);
    p.max_tokens = 20;
    assert_int_equal(llmem_engine_generate(e, prompt, 740, &p, ceiling_token, &w, &r), LLMEM_OK);
    assert_int_equal(r.reused_ram_tokens, 592);
    llmem_generate_result_free(&r);
    check_ceiling(&w);
    printf("  %lld steps checked: bank up to %lld B, ceiling down to %lld B, smallest margin "
           "%lld B; %lld B banked before the long request\n",
           (long long)w.steps, (long long)w.max_bank, (long long)w.min_ceiling,
           (long long)w.worst_margin, (long long)before.bytes);
    assert_true(w.steps > 60);
    assert_true(w.min_ceiling < before.bytes); /* the ceiling did bind */
    assert_int_equal(llmem_kv_check(llmem_engine_kv(e)), LLMEM_OK);
    llmem_engine_close(e);
}

/* The engine's guard watches memory.events through its reading source: a rising high count
 * halves the bank, a rising oom count empties it and refuses requests until the count stops
 * rising. */
static void test_guard_cgroup_events(void **state) {
    (void)state;
    struct fake_pressure f = {.events = 1, .high = 7, .max = 0, .oom = 0};
    int64_t banked = 0;
    struct llmem_engine *e = open_banked(&f, 17, 1, &banked);
    struct llmem_bank_stats bs;
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 4;
    p.ignore_eos = 1;
    struct llmem_generate_result r;
    assert_int_equal(llmem_engine_guard(e)->warnings + llmem_engine_guard(e)->criticals, 0);

    f.high = 9; /* throttled over memory.high */
    int32_t other[8] = {9, 8, 7, 6, 5, 4, 3, 2};
    assert_int_equal(llmem_engine_generate(e, other, 8, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    assert_int_equal(llmem_engine_guard(e)->warnings, 1);
    llmem_bank_stats(llmem_engine_bank(e), &bs);
    assert_true(bs.blocks <= banked - banked / 2 + 1);

    f.oom = 1; /* the OOM killer ran in this cgroup */
    llmem_log_set_callback(capture_all, NULL, LLMEM_LOG_WARN);
    last_errors[0] = '\0';
    assert_int_equal(llmem_engine_generate(e, other, 8, &p, NULL, NULL, &r), LLMEM_ENOMEM);
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
    assert_non_null(strstr(last_errors, "memory.max or invoked the OOM killer"));
    assert_non_null(strstr(last_errors, "critical memory pressure"));
    assert_int_equal(llmem_engine_guard(e)->criticals, 1);
    llmem_bank_stats(llmem_engine_bank(e), &bs);
    assert_int_equal(bs.blocks, 0);
    /* the count no longer rises: admitted again */
    assert_int_equal(llmem_engine_generate(e, other, 8, &p, NULL, NULL, &r), LLMEM_OK);
    llmem_generate_result_free(&r);
    struct llmem_engine_bank_stats st;
    llmem_engine_bank_stats(e, &st);
    assert_int_equal(st.guard_warnings, 1);
    assert_int_equal(st.guard_criticals, 1);
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
    c.budget_bytes = 8 << 20;     /* 8 MiB: less than the weights */
    c.runtime_baseline_bytes = 0; /* the machine is pretended: not this process */
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_ENOMEM);
    assert_null(e);
    /* one line, with the reason: what does not fit, and what would */
    const char *nl = strchr(last_errors, '\n');
    assert_true(nl != NULL && nl[1] == '\0');
    assert_non_null(strstr(last_errors, "refused before loading"));
    assert_non_null(strstr(last_errors, "DOES NOT FIT: weights"));
    assert_non_null(strstr(last_errors, "a smaller model"));

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

/* The engine, the 40-token prompt and the 8 greedy tokens of the allocation-failure sweeps. */
static void oom_setup(const char *model, struct llmem_engine_config *c, int32_t prompt[40],
                      struct llmem_generate_params *p) {
    llmem_engine_config_default(c);
    c->model_dir = model;
    c->context = 64;
    c->n_threads = 2;
    for (int i = 0; i < 40; i++)
        prompt[i] = 100 + 7 * i;
    llmem_generate_params_default(p);
    p->max_tokens = 8;
    p->ignore_eos = 1;
}

/* One sweep of test_out_of_memory_everywhere: the n-th allocation attempt fails (count 1), or it
 * and every one after it until disarmed (LLMEM_MEM_FAULT_PERSIST), for n = 1, 2, … until the
 * whole sequence of opening the engine and one request runs past the fault. Each failure is a
 * clean LLMEM_ENOMEM with every invariant intact, and after disarming the same engine gives the
 * ids it gives without a fault. */
static void oom_sweep(const char *model, int64_t count, const int32_t *want, int *open_failures,
                      int *request_failures) {
    struct llmem_engine_config c;
    int32_t prompt[40];
    struct llmem_generate_params p;
    oom_setup(model, &c, prompt, &p);
    for (int64_t n = 1; n < 10000; n++) {
        llmem_mem_fault_inject_count(n, count);
        struct llmem_engine *e = NULL;
        int status = llmem_engine_open(&c, NULL, NULL, &e);
        if (status != LLMEM_OK) {
            llmem_mem_fault_inject(0);
            assert_int_equal(status, LLMEM_ENOMEM);
            assert_null(e);
            (*open_failures)++;
            continue;
        }
        struct llmem_generate_result r;
        status = llmem_engine_generate(e, prompt, 40, &p, NULL, NULL, &r);
        int pending = llmem_mem_fault_pending();
        llmem_mem_fault_inject(0);
        if (status == LLMEM_OK) {
            assert_int_equal(r.n_ids, 8);
            assert_memory_equal(r.ids, want, 8 * sizeof(*want));
            llmem_generate_result_free(&r);
        } else {
            assert_int_equal(status, LLMEM_ENOMEM);
            (*request_failures)++;
        }
        assert_int_equal(llmem_kv_check(llmem_engine_kv(e)), LLMEM_OK);
        assert_int_equal(llmem_mem_check(llmem_engine_mem(e)), LLMEM_OK);
        if (status != LLMEM_OK) { /* the engine serves on */
            assert_int_equal(llmem_engine_generate(e, prompt, 40, &p, NULL, NULL, &r), LLMEM_OK);
            assert_memory_equal(r.ids, want, 8 * sizeof(*want));
            llmem_generate_result_free(&r);
        }
        llmem_engine_close(e);
        if (pending)
            break; /* the fault never fired: every allocation was covered */
    }
    llmem_mem_fault_inject(0);
}

/* An allocation attempt fails at every point of opening the engine and of one request. A single
 * refusal the allocator mostly absorbs (it releases its cache and retries): the single-shot sweep
 * reaches the failures of its bookkeeping. The persistent sweep (every attempt from the n-th on
 * fails) reaches the request's own failure paths, and must see them. The sanitizer build checks
 * that nothing leaks. pycoder, and a mixture of experts (its router logits and experts' workspace,
 * the persistent sweep). */
static void test_out_of_memory_everywhere(void **state) {
    (void)state;
    static const char *const models[] = {PYCODER, LLMEM_TEST_DATA "/models/tiny-qwen3-moe"};
    for (size_t m = 0; m < 2; m++) {
        struct llmem_engine_config c;
        int32_t prompt[40];
        struct llmem_generate_params p;
        oom_setup(models[m], &c, prompt, &p);
        struct llmem_engine *e = NULL;
        assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
        struct llmem_generate_result r;
        assert_int_equal(llmem_engine_generate(e, prompt, 40, &p, NULL, NULL, &r), LLMEM_OK);
        assert_int_equal(r.n_ids, 8);
        int32_t want[8];
        memcpy(want, r.ids, sizeof(want));
        llmem_generate_result_free(&r);
        llmem_engine_close(e);

        llmem_log_set_callback(capture, NULL, LLMEM_LOG_ERROR);
        int open_once = 0, request_once = 0, open_persist = 0, request_persist = 0;
        if (m == 0)
            oom_sweep(models[m], 1, want, &open_once, &request_once);
        oom_sweep(models[m], LLMEM_MEM_FAULT_PERSIST, want, &open_persist, &request_persist);
        llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
        if (m == 0)
            printf("  single-shot: %d failures while opening, %d during the request, all clean\n",
                   open_once, request_once);
        printf("  %s persistent: %d failures while opening, %d during the request, all clean\n",
               m == 0 ? "pycoder" : "tiny-qwen3-moe", open_persist, request_persist);
        assert_true(m > 0 || open_once > 0);
        assert_true(open_persist > 0);
        assert_true(request_persist > 0);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sampler),
        cmocka_unit_test(test_sampler_penalties),
        cmocka_unit_test(test_sampler_top),
        cmocka_unit_test(test_generate_stops),
        cmocka_unit_test(test_generate_reuses_prefix),
        cmocka_unit_test(test_admission_refuses_before_writing),
        cmocka_unit_test(test_guard_rules),
        cmocka_unit_test(test_guard_actions),
        cmocka_unit_test(test_guard_cgroup_events),
        cmocka_unit_test(test_unusable_bank_dir),
        cmocka_unit_test(test_spill_restores_in_a_new_engine),
        cmocka_unit_test(test_spill_other_weights),
        cmocka_unit_test(test_spill_full_disk),
        cmocka_unit_test(test_bank_within_dynamic_ceiling),
        cmocka_unit_test(test_memory_promise),
        cmocka_unit_test(test_refused_before_loading),
        cmocka_unit_test(test_request_out_of_memory),
        cmocka_unit_test(test_out_of_memory_everywhere),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

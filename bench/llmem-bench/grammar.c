/*
 * bench/llmem-bench/grammar.c — `llmem-bench grammar MODEL`: how long constrained decoding's
 * masks take on a model's vocabulary, the host's share of every constrained token.
 *
 * Outputs under a JSON Schema are drawn token by token, each token uniformly among those the
 * grammar allows (seeded: the same outputs every run), with a budget of --tokens a output so
 * that each completes; every mask is timed. A mask the matcher has made before for the same
 * parse is a copy; the others walk the vocabulary's trie on the pool's threads. On a GPU the
 * step's device time is the mask's deadline (the masks are made while the device computes), so
 * the table gives the share of masks slower than a few such deadlines.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli/common.h"
#include "core/clock.h"
#include "core/file.h"
#include "core/rng.h"
#include "llmem/grammar.h"
#include "llmem/pool.h"
#include "llmem/status.h"
#include "llmem/tokenizer.h"

/* An object of a string, an array of strings, a number and a boolean: the schema of the serving
 * benchmarks' constrained runs (docs/BENCHMARKS.md, "CPU constrained decoding"). */
static const char default_schema[] =
    "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\"}, \"tags\": "
    "{\"type\": \"array\", \"items\": {\"type\": \"string\"}}, \"score\": {\"type\": "
    "\"number\"}, \"ok\": {\"type\": \"boolean\"}}, \"required\": [\"name\", \"tags\", "
    "\"score\", \"ok\"], \"additionalProperties\": false}";

static const char usage[] =
    "usage: llmem-bench grammar MODEL [options]\n"
    "\n"
    "The time a constrained token's mask takes on MODEL's vocabulary (a model directory or GGUF\n"
    "file; only its tokenizer is read): outputs drawn under a JSON Schema, each token uniformly\n"
    "among those allowed (seeded), every mask timed: the median, the 90th and 99th percentiles,\n"
    "the longest, and how many took longer than 0.5, 1 and 2 ms (a GPU step's device time is the\n"
    "deadline of a mask made while it runs).\n"
    "  --schema FILE   a JSON Schema (default: an object of a string, an array of strings, a\n"
    "                  number and a boolean); json_object: any JSON object\n"
    "  --outputs N     outputs drawn (default 20)\n"
    "  --tokens N      the budget of each output, in tokens (default 64)\n"
    "  --threads N     the pool's threads walking a mask (default: the online CPUs)\n"
    "  --seed S        the draws' seed (default 1)\n"
    "  --json          one JSON object on stdout\n";

enum { OPT_SCHEMA = 256, OPT_OUTPUTS, OPT_TOKENS, OPT_THREADS, OPT_SEED, OPT_JSON, OPT_HELP };

static const struct option options[] = {
    {"schema", required_argument, NULL, OPT_SCHEMA},
    {"outputs", required_argument, NULL, OPT_OUTPUTS},
    {"tokens", required_argument, NULL, OPT_TOKENS},
    {"threads", required_argument, NULL, OPT_THREADS},
    {"seed", required_argument, NULL, OPT_SEED},
    {"json", no_argument, NULL, OPT_JSON},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

/* Draws one output of at most `budget` tokens under s, timing each mask into ms[*n]. CLI_FAIL
 * when the matcher fails (it allows nothing before the output is complete). */
static int draw_output(struct llmem_grammar_state *s, struct llmem_grammar_walkers *w,
                       struct llmem_pool *pool, uint8_t *allowed, int32_t n_vocab, int budget,
                       uint64_t *rng, double *ms, int *n) {
    for (int t = 0; t < budget && !llmem_grammar_must_end(s); t++) {
        const double t0 = llmem_clock_s();
        const int64_t count = llmem_grammar_allowed_on(s, budget - t, allowed, w, pool);
        ms[(*n)++] = 1e3 * (llmem_clock_s() - t0);
        if (count == 0)
            return llmem_grammar_complete(s) ? CLI_OK : CLI_FAIL;
        int64_t pick = (int64_t)(llmem_splitmix64_next(rng) % (uint64_t)count);
        int32_t id = 0;
        for (; id < n_vocab; id++)
            if (allowed[id] && pick-- == 0)
                break;
        if (llmem_grammar_accept(s, id) != LLMEM_OK)
            return CLI_FAIL;
    }
    return CLI_OK;
}

int bench_grammar(int argc, char **argv) {
    const char *schema_path = NULL;
    int64_t outputs = 20, budget = 64, threads = 0, seed = 1;
    int json = 0;
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":h", options, NULL)) != -1) {
        switch (c) {
        case OPT_SCHEMA: schema_path = optarg; break;
        case OPT_OUTPUTS:
            if (cli_parse_int("--outputs", optarg, 1, 100000, &outputs) != CLI_OK)
                return CLI_USAGE;
            break;
        case OPT_TOKENS:
            if (cli_parse_int("--tokens", optarg, 1, 100000, &budget) != CLI_OK)
                return CLI_USAGE;
            break;
        case OPT_THREADS:
            if (cli_parse_int("--threads", optarg, 1, 1024, &threads) != CLI_OK)
                return CLI_USAGE;
            break;
        case OPT_SEED:
            if (cli_parse_int("--seed", optarg, 0, INT64_MAX, &seed) != CLI_OK)
                return CLI_USAGE;
            break;
        case OPT_JSON: json = 1; break;
        case 'h':
        case OPT_HELP: fputs(usage, stdout); return CLI_OK;
        case ':': return cli_usage_error("grammar", "%s needs a value", argv[optind - 1]);
        default: return cli_usage_error("grammar", "unknown option '%s'", argv[optind - 1]);
        }
    }
    if (argc - optind != 1) {
        fputs(usage, stderr);
        return CLI_USAGE;
    }
    const char *model = argv[optind];
    char *text = NULL;
    size_t len = 0;
    const int any_object = schema_path != NULL && strcmp(schema_path, "json_object") == 0;
    if (schema_path != NULL && !any_object &&
        llmem_file_read(schema_path, 1 << 20, &text, &len) != LLMEM_OK) {
        fprintf(stderr, "llmem-bench grammar: cannot read the schema %s (%s)\n", schema_path,
                llmem_last_error());
        return CLI_FAIL;
    }
    const char *schema = any_object ? NULL : text != NULL ? text : default_schema;
    len = schema == NULL ? 0 : text != NULL ? len : strlen(default_schema);

    struct llmem_tokenizer *tok = NULL;
    struct llmem_grammar_vocab *v = NULL;
    struct llmem_grammar *g = NULL;
    struct llmem_pool *pool = NULL;
    struct llmem_grammar_walkers *w = NULL;
    uint8_t *allowed = NULL;
    double *ms = NULL;
    int rc = CLI_FAIL;
    char why[256];
    if (llmem_tokenizer_load(model, &tok) != LLMEM_OK) {
        fprintf(stderr, "llmem-bench grammar: cannot read the tokenizer of %s (%s)\n", model,
                llmem_last_error());
        goto out;
    }
    const double t_vocab = llmem_clock_s();
    if (llmem_grammar_vocab_create(tok, &v) != LLMEM_OK)
        goto out;
    const double vocab_ms = 1e3 * (llmem_clock_s() - t_vocab);
    if (llmem_grammar_compile(schema, len, why, sizeof(why), &g) != LLMEM_OK) {
        fprintf(stderr, "llmem-bench grammar: the schema: %s\n", why);
        goto out;
    }
    const int32_t n_vocab = llmem_grammar_vocab_size(v);
    if (llmem_pool_create((int)threads, &pool) != LLMEM_OK ||
        llmem_grammar_walkers_create(llmem_pool_threads(pool), &w) != LLMEM_OK ||
        (allowed = malloc((size_t)n_vocab)) == NULL ||
        (ms = malloc((size_t)(outputs * budget) * sizeof(*ms))) == NULL) {
        fprintf(stderr, "llmem-bench grammar: out of memory\n");
        goto out;
    }
    uint64_t rng = (uint64_t)seed;
    int n = 0;
    for (int64_t o = 0; o < outputs; o++) {
        struct llmem_grammar_state *s = NULL;
        if (llmem_grammar_state_create(g, v, &s) != LLMEM_OK)
            goto out;
        const int st = draw_output(s, w, pool, allowed, n_vocab, (int)budget, &rng, ms, &n);
        llmem_grammar_state_free(s);
        if (st != CLI_OK) {
            fprintf(stderr,
                    "llmem-bench grammar: output %lld was cut: the matcher allowed no "
                    "token before it was complete\n",
                    (long long)o);
            goto out;
        }
    }
    double total = 0;
    int over[3] = {0, 0, 0};
    const double limits[3] = {0.5, 1.0, 2.0};
    for (int i = 0; i < n; i++) {
        total += ms[i];
        for (int k = 0; k < 3; k++)
            over[k] += ms[i] > limits[k];
    }
    bench_median(ms, n); /* (sorted) */
    const double p50 = ms[n / 2], p90 = ms[n * 9 / 10], p99 = ms[n * 99 / 100], max = ms[n - 1];
    if (json) {
        printf("{\"vocab\": %d, \"vocab_ms\": %.1f, \"threads\": %d, \"masks\": %d, "
               "\"mean_ms\": %.4f, \"p50_ms\": %.4f, \"p90_ms\": %.4f, \"p99_ms\": %.4f, "
               "\"max_ms\": %.4f, \"over_0_5_ms\": %d, \"over_1_ms\": %d, \"over_2_ms\": %d}\n",
               n_vocab, vocab_ms, llmem_pool_threads(pool), n, total / n, p50, p90, p99, max,
               over[0], over[1], over[2]);
    } else {
        printf("llmem-bench grammar: %s, %d tokens (trie built in %.0f ms), %d threads, %lld "
               "outputs of up to %lld tokens\n",
               model, n_vocab, vocab_ms, llmem_pool_threads(pool), (long long)outputs,
               (long long)budget);
        printf("%7s %9s %9s %9s %9s %9s %9s %9s %9s\n", "masks", "mean ms", "p50", "p90", "p99",
               "max", ">0.5 ms", ">1 ms", ">2 ms");
        printf("%7d %9.3f %9.3f %9.3f %9.3f %9.3f %8.1f%% %8.1f%% %8.1f%%\n", n, total / n, p50,
               p90, p99, max, 100.0 * over[0] / n, 100.0 * over[1] / n, 100.0 * over[2] / n);
    }
    rc = CLI_OK;
out:
    free(ms);
    free(allowed);
    llmem_grammar_walkers_free(w);
    llmem_pool_destroy(pool);
    llmem_grammar_free(g);
    llmem_grammar_vocab_free(v);
    llmem_tokenizer_free(tok);
    free(text);
    return rc;
}

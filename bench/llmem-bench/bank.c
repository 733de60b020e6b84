/*
 * bench/llmem-bench/bank.c — `llmem-bench bank MODEL`: time to first token with the session bank,
 * side by side in one run, medians over --reps:
 *   cold      the bank emptied and no spill store: the whole prompt is prefilled;
 *   RAM hit   the same prompt again in the same engine: all but its last block's worth of tokens
 *             come from the RAM tier;
 *   chat turn the prompt, its answer and a short new message (what `llmem chat` sends as the next
 *             turn): the first two come from the RAM tier;
 *   disk hit  the same prompt in a new engine (an empty RAM tier) on a spill store that holds it,
 *             what a new process sees: the prefix is loaded from disk.
 * The prompt is --prompt random token ids (seeded). Times include the bank's lookup and loads.
 */
#include <ftw.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bench.h"
#include "cli/common.h"
#include "core/json.h"
#include "core/options.h"
#include "llmem/engine.h"

#define MAX_REPS 32
#define N_GEN    16
#define N_TAIL   12

static const char usage[] =
    "usage: llmem-bench bank MODEL [options]\n"
    "\n"
    "Time to first token of one prompt: cold, from the session bank's RAM tier, as a chat's next\n"
    "turn, and from its spill store in a new engine.\n"
    "  --prompt N      prompt tokens (default 1500)\n"
    "  --reps N        runs of each case (default 5)\n"
    "  --threads N     CPU threads (default: the online CPUs)\n"
    "  --bank-dir DIR  the spill store for the disk case (default: a new temporary directory,\n"
    "                  removed afterwards)\n"
    "  --json          one JSON object: prompt_tokens, reps, and per case ttft_ms (the median),\n"
    "                  runs_ms, reused_tokens, fraction_of_cold\n";

struct bank_case {
    const char *name;
    double ms[MAX_REPS];
    int64_t reused;
};

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static int open_engine(const char *model, int threads, const char *dir, struct llmem_engine **e) {
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.model_dir = model;
    c.n_threads = threads;
    c.bank_dir = dir;
    c.no_spill = dir == NULL;
    if (llmem_engine_open(&c, NULL, NULL, e) != LLMEM_OK) {
        fprintf(stderr, "llmem-bench bank: cannot open %s\n", model);
        return CLI_FAIL;
    }
    return CLI_OK;
}

/* One request; its ttft and the tokens it reused (ids of the answer into answer when given). */
static int request(struct llmem_engine *e, const int32_t *prompt, int64_t n, int64_t max_tokens,
                   double *ms, int64_t *reused, int32_t *answer) {
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = max_tokens;
    p.ignore_eos = 1;
    struct llmem_generate_result r;
    if (llmem_engine_generate(e, prompt, n, &p, NULL, NULL, &r) != LLMEM_OK)
        return CLI_FAIL;
    *ms = r.ttft_ms;
    *reused = r.reused_tokens;
    if (answer != NULL)
        memcpy(answer, r.ids, (size_t)r.n_ids * sizeof(int32_t));
    int ok = answer == NULL || r.n_ids == max_tokens;
    llmem_generate_result_free(&r);
    return ok ? CLI_OK : CLI_FAIL;
}

int bench_bank(int argc, char **argv) {
    enum { OPT_PROMPT = 256, OPT_REPS, OPT_THREADS, OPT_DIR, OPT_JSON, OPT_HELP };
    static const struct option opts[] = {
        {"prompt", required_argument, NULL, OPT_PROMPT},
        {"reps", required_argument, NULL, OPT_REPS},
        {"threads", required_argument, NULL, OPT_THREADS},
        {"bank-dir", required_argument, NULL, OPT_DIR},
        {"json", no_argument, NULL, OPT_JSON},
        {"help", no_argument, NULL, OPT_HELP},
        {NULL, 0, NULL, 0},
    };
    int64_t n_prompt = 1500, reps = 5, threads = 0;
    const char *dir = NULL;
    int json = 0, c, rc = CLI_OK;
    optind = 1;
    opterr = 0;
    while (rc == CLI_OK && (c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case OPT_PROMPT: rc = cli_parse_int("--prompt", optarg, 32, 1 << 20, &n_prompt); break;
        case OPT_REPS: rc = cli_parse_int("--reps", optarg, 1, MAX_REPS, &reps); break;
        case OPT_THREADS: rc = cli_parse_int("--threads", optarg, 1, 1024, &threads); break;
        case OPT_DIR: dir = optarg; break;
        case OPT_JSON: json = 1; break;
        case 'h':
        case OPT_HELP: fputs(usage, stdout); return CLI_OK;
        case ':': rc = cli_usage_error("bank", "%s needs a value", argv[optind - 1]); break;
        default: rc = cli_usage_error("bank", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (rc != CLI_OK)
        return rc;
    if (optind != argc - 1)
        return cli_usage_error("bank", "needs one MODEL directory (see --help)");
    const char *model = argv[optind];

    char tmp[4096] = "";
    if (dir == NULL) {
        snprintf(tmp, sizeof(tmp), "%s/llmem-bench-bank-XXXXXX", llmem_tmp_dir());
        if (mkdtemp(tmp) == NULL) {
            fprintf(stderr, "llmem-bench bank: cannot make a temporary directory\n");
            return CLI_FAIL;
        }
        dir = tmp;
    }
    struct bank_case cases[4] = {
        {.name = "cold"}, {.name = "ram_hit"}, {.name = "chat_turn"}, {.name = "disk_hit"}};
    int64_t n_turn = n_prompt + N_GEN + N_TAIL;
    int32_t *turn = malloc((size_t)n_turn * sizeof(int32_t));
    struct llmem_engine *e = NULL;
    int64_t prog[2] = {0, reps * 4 + 1};
    rc = CLI_FAIL;
    if (turn == NULL || open_engine(model, (int)threads, NULL, &e) != CLI_OK)
        goto out;
    int64_t vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size;
    uint64_t x = 7;
    for (int64_t i = 0; i < n_turn; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        turn[i] = (int32_t)(5 + (int64_t)(x >> 33) % (vocab - 5));
    }
    if (n_prompt + N_GEN + 1 >= llmem_engine_plan(e)->context_window_resolved) {
        fprintf(stderr, "llmem-bench bank: --prompt %" PRId64 " leaves no room in the context\n",
                n_prompt);
        goto out;
    }
    for (int64_t r = 0; r < reps; r++) {
        llmem_bank_trim(llmem_engine_bank(e), 0);
        /* cold, with its answer put into the next turn; then the RAM hit and the next turn */
        if (request(e, turn, n_prompt, N_GEN, &cases[0].ms[r], &cases[0].reused, turn + n_prompt) !=
                CLI_OK ||
            request(e, turn, n_prompt, 1, &cases[1].ms[r], &cases[1].reused, NULL) != CLI_OK ||
            request(e, turn, n_turn, 1, &cases[2].ms[r], &cases[2].reused, NULL) != CLI_OK)
            goto out;
        prog[0] += 3;
        cli_progress("bench bank", prog[0], prog[1]);
    }
    llmem_engine_close(e);
    e = NULL;
    /* the store: written once, then read by a new engine each time */
    double ms;
    int64_t reused;
    if (open_engine(model, (int)threads, dir, &e) != CLI_OK ||
        request(e, turn, n_prompt, 1, &ms, &reused, NULL) != CLI_OK)
        goto out;
    llmem_engine_close(e);
    e = NULL;
    for (int64_t r = 0; r < reps; r++) {
        if (open_engine(model, (int)threads, dir, &e) != CLI_OK ||
            request(e, turn, n_prompt, 1, &cases[3].ms[r], &cases[3].reused, NULL) != CLI_OK)
            goto out;
        llmem_engine_close(e);
        e = NULL;
        cli_progress("bench bank", ++prog[0], prog[1]);
    }
    cli_progress_done();
    double med[4];
    for (int k = 0; k < 4; k++) {
        double sorted[MAX_REPS];
        memcpy(sorted, cases[k].ms, sizeof(sorted));
        med[k] = bench_median(sorted, (int)reps);
    }
    if (json) {
        cJSON *root = cJSON_CreateObject();
        int bad = root == NULL || llmem_json_add_string(root, "model", model) ||
                  llmem_json_add_int(root, "prompt_tokens", n_prompt) ||
                  llmem_json_add_int(root, "reps", reps);
        for (int k = 0; !bad && k < 4; k++) {
            cJSON *o = cJSON_AddObjectToObject(root, cases[k].name);
            cJSON *runs = o != NULL ? cJSON_AddArrayToObject(o, "runs_ms") : NULL;
            bad = runs == NULL || llmem_json_add_double(o, "ttft_ms", med[k]) ||
                  llmem_json_add_int(o, "reused_tokens", cases[k].reused) ||
                  llmem_json_add_double(o, "fraction_of_cold", med[k] / med[0]);
            for (int64_t r = 0; !bad && r < reps; r++)
                cJSON_AddItemToArray(runs, cJSON_CreateNumber(cases[k].ms[r]));
        }
        if (bad) {
            cJSON_Delete(root);
            goto out;
        }
        rc = cli_print_json(root);
    } else {
        printf("%s, a %" PRId64 "-token prompt, time to first token (median of %" PRId64 "):\n",
               model, n_prompt, reps);
        static const char *const what[4] = {
            "cold (whole prompt prefilled)", "RAM hit (same engine)",
            "chat turn (prompt + answer + new message)", "disk hit (new engine, spill store)"};
        for (int k = 0; k < 4; k++)
            printf("  %-42s %8.1f ms  %5.1f %% of cold  (%" PRId64 " tokens reused)\n", what[k],
                   med[k], 100.0 * med[k] / med[0], cases[k].reused);
        rc = CLI_OK;
    }
out:
    cli_progress_done();
    llmem_engine_close(e);
    free(turn);
    if (tmp[0] != '\0')
        nftw(tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return rc;
}

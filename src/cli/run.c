/*
 * cli/run.c — the commands that run a model: `llmem run`, `llmem chat`, `llmem tokenize` and
 * `llmem logits`, with one set of model, plan and KV options and one set of sampling options.
 *
 * stdout carries only the product (the generated text, or with --json exactly one object); the
 * plan line, the limits applied, progress bars (on a terminal) and --stats go to stderr, except
 * that with --json the stats are part of the object.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli/cli.h"
#include "core/file.h"
#include "core/json.h"
#include "core/npy.h"
#include "engine/stats_json.h"
#include "llmem/engine.h"
#include "llmem/size.h"
#include "llmem/sys.h"
#include "llmem/tokenizer.h"
#include "tok/tok_int.h"

enum {
    OPT_TEMPERATURE = CLI_OPT_ENGINE_END,
    OPT_TOP_K,
    OPT_TOP_P,
    OPT_MIN_P,
    OPT_REPETITION_PENALTY,
    OPT_PRESENCE_PENALTY,
    OPT_FREQUENCY_PENALTY,
    OPT_SEED,
    OPT_STOP,
    OPT_IGNORE_EOS,
    OPT_IDS,
    OPT_JSON,
    OPT_STATS,
    OPT_TEXT,
    OPT_TEXT_FILE,
    OPT_PROMPT_FILE,
    OPT_OUT,
    OPT_CHAT_TEMPLATE,
    OPT_SYSTEM,
    OPT_HELP,
};

static const struct option options[] = {
    CLI_ENGINE_OPTIONS,
    {"temperature", required_argument, NULL, OPT_TEMPERATURE},
    {"temp", required_argument, NULL, OPT_TEMPERATURE},
    {"top-k", required_argument, NULL, OPT_TOP_K},
    {"top-p", required_argument, NULL, OPT_TOP_P},
    {"min-p", required_argument, NULL, OPT_MIN_P},
    {"repetition-penalty", required_argument, NULL, OPT_REPETITION_PENALTY},
    {"presence-penalty", required_argument, NULL, OPT_PRESENCE_PENALTY},
    {"frequency-penalty", required_argument, NULL, OPT_FREQUENCY_PENALTY},
    {"seed", required_argument, NULL, OPT_SEED},
    {"stop", required_argument, NULL, OPT_STOP},
    {"ignore-eos", no_argument, NULL, OPT_IGNORE_EOS},
    {"max-tokens", required_argument, NULL, 'n'},
    {"prompt", required_argument, NULL, 'p'},
    {"prompt-file", required_argument, NULL, OPT_PROMPT_FILE},
    {"ids", required_argument, NULL, OPT_IDS},
    {"json", no_argument, NULL, OPT_JSON},
    {"stats", no_argument, NULL, OPT_STATS},
    {"text", required_argument, NULL, OPT_TEXT},
    {"text-file", required_argument, NULL, OPT_TEXT_FILE},
    {"out", required_argument, NULL, OPT_OUT},
    {"chat-template", required_argument, NULL, OPT_CHAT_TEMPLATE},
    {"system", required_argument, NULL, OPT_SYSTEM},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

#define MAX_STOP 16

struct run_args {
    const char *cmd;
    struct llmem_engine_config engine;
    struct llmem_generate_params gen;
    const char *stop[MAX_STOP];
    const char *prompt, *ids, *text, *out, *chat_template, *system;
    const char *prompt_file, *text_file; /* "-": stdin */
    int json, stats, help;
};

static const char sampling_help[] =
    "sampling options:\n"
    "  -n, --max-tokens N   tokens to generate at most (default 128)\n"
    "  --temperature T      0 is greedy (default)\n"
    "  --top-k K, --top-p P, --min-p P, --seed S\n"
    "  --repetition-penalty R  the logit of a token of the prompt or output divided by R\n"
    "                       when positive, multiplied when negative (1: off)\n"
    "  --presence-penalty P, --frequency-penalty F  in [-2, 2]: P once, F per time, taken\n"
    "                       from the logit of a token the output holds\n"
    "  --stop TEXT          end at TEXT (repeatable; not printed)\n"
    "  --ignore-eos         keep going after the end-of-sequence token\n";

static int parse(int argc, char **argv, struct run_args *a) {
    optind = 1;
    opterr = 0;
    int c, rc = CLI_OK;
    int64_t v = 0;
    double d = 0;
    while (rc == CLI_OK && (c = getopt_long(argc, argv, ":hp:n:", options, NULL)) != -1) {
        switch (c) {
        case OPT_TEMPERATURE:
            rc = cli_parse_double("--temperature", optarg, -1e-300, 100.0, &d);
            a->gen.sampling.temperature = d;
            break;
        case OPT_TOP_K:
            rc = cli_parse_int("--top-k", optarg, 0, 1 << 30, &a->gen.sampling.top_k);
            break;
        case OPT_TOP_P:
            rc = cli_parse_double("--top-p", optarg, 0.0, 1.0, &a->gen.sampling.top_p);
            break;
        case OPT_MIN_P:
            rc = cli_parse_double("--min-p", optarg, -1e-300, 1.0, &a->gen.sampling.min_p);
            break;
        case OPT_REPETITION_PENALTY:
            rc = cli_parse_double("--repetition-penalty", optarg, 0.0, 100.0,
                                  &a->gen.sampling.repetition_penalty);
            break;
        case OPT_PRESENCE_PENALTY:
            rc = cli_parse_double("--presence-penalty", optarg, -2.0 - 1e-12, 2.0,
                                  &a->gen.sampling.presence_penalty);
            break;
        case OPT_FREQUENCY_PENALTY:
            rc = cli_parse_double("--frequency-penalty", optarg, -2.0 - 1e-12, 2.0,
                                  &a->gen.sampling.frequency_penalty);
            break;
        case OPT_SEED:
            rc = cli_parse_int("--seed", optarg, 0, INT64_MAX, &v);
            a->gen.sampling.seed = (uint64_t)v;
            break;
        case OPT_STOP:
            if (a->gen.n_stop == MAX_STOP)
                rc = cli_usage_error(a->cmd, "at most %d --stop strings", MAX_STOP);
            else
                a->stop[a->gen.n_stop++] = optarg;
            break;
        case OPT_IGNORE_EOS: a->gen.ignore_eos = 1; break;
        case 'n':
            rc = cli_parse_int("--max-tokens", optarg, 1, (int64_t)1 << 40, &a->gen.max_tokens);
            break;
        case 'p': a->prompt = optarg; break;
        case OPT_IDS: a->ids = optarg; break;
        case OPT_JSON: a->json = 1; break;
        case OPT_STATS: a->stats = 1; break;
        case OPT_TEXT: a->text = optarg; break;
        case OPT_TEXT_FILE: a->text_file = optarg; break;
        case OPT_PROMPT_FILE: a->prompt_file = optarg; break;
        case OPT_OUT: a->out = optarg; break;
        case OPT_CHAT_TEMPLATE: a->chat_template = optarg; break;
        case OPT_SYSTEM: a->system = optarg; break;
        case 'h':
        case OPT_HELP: a->help = 1; break;
        case ':': rc = cli_usage_error(a->cmd, "%s needs a value", argv[optind - 1]); break;
        default:
            if ((rc = cli_engine_option(c, optarg, &a->engine)) < 0)
                rc = cli_usage_error(a->cmd, "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    a->gen.stop = a->stop;
    return rc;
}

/* "1,2,3" → ids (malloc'ed). */
static int parse_ids(const char *cmd, const char *s, int32_t **ids, int64_t *n) {
    size_t cap = 1;
    for (const char *q = s; *q; q++)
        cap += *q == ',';
    *ids = malloc(cap * sizeof(int32_t));
    *n = 0;
    if (*ids == NULL)
        return CLI_FAIL;
    const char *q = s;
    while (*q) {
        char *end = NULL;
        long long v = strtoll(q, &end, 10);
        if (end == q || v < 0 || v > INT32_MAX || (*end != ',' && *end != '\0')) {
            free(*ids);
            return cli_usage_error(cmd, "--ids: '%s' is not a comma-separated list of token ids",
                                   s);
        }
        (*ids)[(*n)++] = (int32_t)v;
        q = *end == ',' ? end + 1 : end;
    }
    if (*n == 0) {
        free(*ids);
        return cli_usage_error(cmd, "--ids: empty list");
    }
    return CLI_OK;
}

/* ---- the engine ------------------------------------------------------------------------------ */

static void prefill_progress(void *arg, int64_t done, int64_t total) {
    (void)arg;
    if (total >= 2048)
        cli_progress("prefill", done, total);
}

static int open_engine(const char *model, struct run_args *a, struct llmem_engine **e) {
    return cli_engine_open(a->cmd, model, &a->engine, 1, e);
}

/* Memory planned against measured, per tag, as JSON. */
static cJSON *memory_json(struct llmem_engine *e) {
    const struct llmem_plan *p = llmem_engine_plan(e);
    struct llmem_mem_stats st;
    llmem_mem_stats(llmem_engine_mem(e), &st);
    struct llmem_sys_resident rss;
    llmem_sys_resident_read(&rss);
    cJSON *m = cJSON_CreateObject();
    struct {
        const char *name;
        int64_t planned, peak;
    } rows[] = {
        {"weights", p->weights_bytes, st.tags[LLMEM_TAG_WEIGHTS].peak_bytes},
        {"kv", p->kv_reserve_bytes, st.tags[LLMEM_TAG_KV].peak_bytes},
        {"scratch", p->runtime_transients_bytes, st.tags[LLMEM_TAG_SCRATCH].peak_bytes},
        {"cache", st.cache_limit_bytes, st.cache_bytes},
    };
    int bad = m == NULL;
    for (size_t i = 0; !bad && i < sizeof(rows) / sizeof(rows[0]); i++) {
        cJSON *o = cJSON_AddObjectToObject(m, rows[i].name);
        bad = o == NULL || llmem_json_add_int(o, "planned_bytes", rows[i].planned) ||
              llmem_json_add_int(o, "measured_peak_bytes", rows[i].peak);
    }
    bad = bad || llmem_json_add_int(m, "computed_workspace_bytes", p->computed_workspace_bytes) ||
          llmem_json_add_int(m, "active_bytes", st.active_bytes) ||
          llmem_json_add_int(m, "peak_bytes", st.peak_bytes) ||
          llmem_json_add_int(m, "memory_limit_bytes", st.memory_limit_bytes) ||
          llmem_json_add_int(m, "runtime_baseline_bytes", p->runtime_baseline_bytes) ||
          llmem_json_add_int(m, "resident_peak_bytes", rss.peak_bytes) ||
          llmem_json_add_int(m, "trip_bytes", p->trip_bytes);
    if (bad) {
        cJSON_Delete(m);
        return NULL;
    }
    return m;
}

/* The session bank's stats with its pending spill writes done (bounded), so that the bytes
 * written are those of this process. */
static void bank_stats(struct llmem_engine *e, struct llmem_engine_bank_stats *bs) {
    llmem_spill_flush(llmem_engine_spill(e), LLMEM_SPILL_FLUSH_S);
    llmem_engine_bank_stats(e, bs);
}

static void print_stats(struct llmem_engine *e, const struct llmem_generate_result *r) {
    double prefill =
        r->prefill_s > 0 ? (double)(r->prompt_tokens - r->reused_tokens) / r->prefill_s : 0;
    double decode = r->decode_s > 0 ? (double)r->decode_tokens / r->decode_s : 0;
    struct llmem_mem_stats st;
    llmem_mem_stats(llmem_engine_mem(e), &st);
    struct llmem_engine_bank_stats bs;
    bank_stats(e, &bs);
    struct llmem_sys_resident rss;
    llmem_sys_resident_read(&rss);
    const struct llmem_plan *plan = llmem_engine_plan(e);
    char a[32], pk[32], c[32], kv[32], bb[32], sw[32], sr[32], sb[32], rp[32], bl[32], tr[32];
    fprintf(stderr,
            "\nllmem stats: prompt %" PRId64 " tokens (%" PRId64 " from the session bank: %" PRId64
            " from RAM, %" PRId64 " from disk), prefill %.1f tok/s, ttft %.1f ms; "
            "generated %" PRId64 " tokens, decode %.1f tok/s (%s)\n"
            "llmem memory: active %s, peak %s, cache %s, KV peak %s; resident peak %s"
            " (baseline %s, trip %s)\n",
            r->prompt_tokens, r->reused_tokens, r->reused_ram_tokens, r->reused_disk_tokens,
            prefill, r->ttft_ms, r->n_ids, decode, r->finish_reason,
            llmem_size_format_short(st.active_bytes, a, sizeof(a)),
            llmem_size_format_short(st.peak_bytes, pk, sizeof(pk)),
            llmem_size_format_short(st.cache_bytes, c, sizeof(c)),
            llmem_size_format_short(st.tags[LLMEM_TAG_KV].peak_bytes, kv, sizeof(kv)),
            rss.peak_bytes >= 0 ? llmem_size_format_short(rss.peak_bytes, rp, sizeof(rp))
                                : "unknown",
            llmem_size_format_short(plan->runtime_baseline_bytes, bl, sizeof(bl)),
            llmem_size_format_short(plan->trip_bytes, tr, sizeof(tr)));
    fprintf(stderr, "llmem bank: RAM %s in %" PRId64 " blocks (%" PRId64 " evicted)",
            llmem_size_format_short(bs.ram.bytes, bb, sizeof(bb)), bs.ram.blocks,
            bs.ram.evicted_blocks);
    if (!bs.spill_on)
        fprintf(stderr, "; no spill store\n");
    else if (!bs.spill.owned)
        fprintf(stderr, "; spill store %s in use by another process: not read or written\n",
                llmem_spill_dir(llmem_engine_spill(e)));
    else
        fprintf(stderr,
                "; spill %s: %" PRId64 " files, %s; written %s, read %s; %" PRId64
                " misses, %" PRId64 " writes skipped\n",
                llmem_spill_dir(llmem_engine_spill(e)), bs.spill.files,
                llmem_size_format_short(bs.spill.bytes, sb, sizeof(sb)),
                llmem_size_format_short(bs.spill.write_bytes, sw, sizeof(sw)),
                llmem_size_format_short(bs.spill.read_bytes, sr, sizeof(sr)),
                bs.spill.miss_absent + bs.spill.miss_identity + bs.spill.miss_format +
                    bs.spill.miss_corrupt + bs.spill.miss_truncated + bs.spill.miss_io +
                    bs.spill.miss_no_room + bs.spill.miss_no_memory,
                bs.spill.skip_cap + bs.spill.skip_disk_low + bs.spill.skip_budget +
                    bs.spill.skip_queue_full + bs.spill.skip_no_memory + bs.spill.skip_write_error +
                    bs.spill.skip_shutdown);
}

static int stream_stdout(void *arg, int32_t id, const char *text, size_t len) {
    (void)arg, (void)id;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return 0;
}

#define MAX_INPUT_BYTES ((int64_t)1 << 30)

/* The whole of a file, or of stdin for "-", every byte kept (NULs included). */
static int read_input(const char *cmd, const char *path, char **data, size_t *len) {
    if (strcmp(path, "-") != 0)
        return llmem_file_read(path, MAX_INPUT_BYTES, data, len) == LLMEM_OK ? CLI_OK : CLI_FAIL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf != NULL) {
        if (cap - n < 2) {
            char *grown = (int64_t)cap < MAX_INPUT_BYTES ? realloc(buf, cap * 2) : NULL;
            if (grown == NULL)
                break;
            buf = grown, cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, stdin);
        n += got;
        if (got == 0) {
            if (ferror(stdin))
                break;
            buf[n] = '\0';
            *data = buf, *len = n;
            return CLI_OK;
        }
    }
    free(buf);
    fprintf(stderr, "llmem %s: cannot read stdin (at most %" PRId64 " bytes)\n", cmd,
            MAX_INPUT_BYTES);
    return CLI_FAIL;
}

/* ---- llmem run ------------------------------------------------------------------------------- */

static const char run_usage[] =
    "usage: llmem run MODEL (-p TEXT | --prompt-file FILE | --ids 1,2,3) [options]\n"
    "\n"
    "Generates a continuation and streams it to stdout.\n"
    "  -p, --prompt TEXT    the prompt (encoded without a BOS token)\n"
    "  --prompt-file FILE   the prompt as the whole of FILE, every byte (- for stdin)\n"
    "  --ids LIST           the prompt as token ids\n"
    "  --stats              tokens/s, memory and the session bank on stderr\n"
    "  --json               stdout is one object: ids, text, finish_reason\n"
    "                       (and stats with --stats: reused_ram_tokens, reused_disk_tokens,\n"
    "                       ttft_ms, memory, bank)\n";

static int run_main(int argc, char **argv, struct run_args *a) {
    if (a->help) {
        printf("%s\n%s\n%s", run_usage, sampling_help, cli_engine_help);
        return CLI_OK;
    }
    if (optind != argc - 1)
        return cli_usage_error(a->cmd, "needs one MODEL directory (see --help)");
    if ((a->prompt != NULL) + (a->prompt_file != NULL) + (a->ids != NULL) != 1)
        return cli_usage_error(a->cmd, "give one of -p TEXT, --prompt-file FILE or --ids LIST");
    int32_t *ids = NULL;
    int64_t n = 0;
    if (a->ids != NULL && parse_ids(a->cmd, a->ids, &ids, &n) != CLI_OK)
        return CLI_USAGE;
    char *file_text = NULL;
    size_t text_len = a->prompt != NULL ? strlen(a->prompt) : 0;
    if (a->prompt_file != NULL &&
        read_input(a->cmd, a->prompt_file, &file_text, &text_len) != CLI_OK)
        return CLI_FAIL;
    const char *text = a->prompt_file != NULL ? file_text : a->prompt;
    struct llmem_engine *e = NULL;
    int rc = open_engine(argv[optind], a, &e);
    if (rc != CLI_OK)
        goto out;
    /* (a text longer than the context is refused once it is: its ids are never all made) */
    if (text != NULL && llmem_tokenizer_encode_max(llmem_engine_tokenizer(e), text, text_len,
                                                   llmem_engine_plan(e)->context_window_resolved,
                                                   &ids, &n) != LLMEM_OK) {
        rc = CLI_FAIL;
        goto out;
    }
    if (n == 0) {
        rc = cli_usage_error(a->cmd, text_len > 0 ? "the prompt encodes to no tokens"
                                                  : "the prompt is empty");
        goto out;
    }
    if (a->gen.max_tokens == 0)
        a->gen.max_tokens = 128;
    a->gen.prefill_progress = isatty(2) ? prefill_progress : NULL;
    struct llmem_generate_result r;
    int status =
        llmem_engine_generate(e, ids, n, &a->gen, a->json ? NULL : stream_stdout, NULL, &r);
    cli_progress_done();
    if (status != LLMEM_OK) {
        rc = CLI_FAIL;
        goto out;
    }
    if (a->json) {
        cJSON *root = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(root, "ids");
        for (int64_t i = 0; arr != NULL && i < r.n_ids; i++)
            cJSON_AddItemToArray(arr, cJSON_CreateNumber(r.ids[i]));
        cJSON_AddStringToObject(root, "text", r.text);
        cJSON_AddStringToObject(root, "finish_reason", r.finish_reason);
        if (a->stats) {
            cJSON *s = cJSON_AddObjectToObject(root, "stats");
            llmem_json_add_int(s, "prompt_tokens", r.prompt_tokens);
            llmem_json_add_int(s, "reused_ram_tokens", r.reused_ram_tokens);
            llmem_json_add_int(s, "reused_disk_tokens", r.reused_disk_tokens);
            llmem_json_add_int(s, "generated_tokens", r.n_ids);
            llmem_json_add_double(s, "ttft_ms", r.ttft_ms);
            llmem_json_add_double(
                s, "prefill_tokens_per_s",
                r.prefill_s > 0 ? (double)(r.prompt_tokens - r.reused_tokens) / r.prefill_s : 0);
            llmem_json_add_double(s, "decode_tokens_per_s",
                                  r.decode_s > 0 ? (double)r.decode_tokens / r.decode_s : 0);
            cJSON *m = memory_json(e);
            if (m != NULL)
                cJSON_AddItemToObject(s, "memory", m);
            struct llmem_engine_bank_stats bs;
            bank_stats(e, &bs);
            cJSON *b = llmem_engine_bank_stats_json(&bs);
            if (b != NULL)
                cJSON_AddItemToObject(s, "bank", b);
        }
        rc = cli_print_json(root);
    } else {
        printf("\n");
        if (a->stats)
            print_stats(e, &r);
    }
    llmem_generate_result_free(&r);
out:
    free(ids);
    free(file_text);
    llmem_engine_close(e);
    return rc;
}

/* ---- llmem chat ------------------------------------------------------------------------------ */

/* The conversation so far as the model saw it: the last turn's prompt ids and the ids it
 * generated, and the text they stand for (that prompt's rendering + the answer's text). The next
 * turn's rendering begins with that text whenever the template renders the answer as it was
 * generated; then its ids are these ids + the encoding of the rest (which starts at the template's
 * end-of-turn token), so the whole conversation is a prefix the session bank holds. Re-encoding
 * the whole text instead could split the answer into other tokens than those generated, and lose
 * the reuse from there on. */
struct conversation {
    int32_t *ids;
    int64_t n;
    char *text;      /* NUL-terminated, and may hold NULs of the messages */
    size_t text_len; /* its bytes */
};

static void conversation_free(struct conversation *c) {
    free(c->ids);
    free(c->text);
    memset(c, 0, sizeof(*c));
}

/* The ids of the rendered text: the conversation's ids + the rest encoded when the text
 * continues the conversation, else the whole text encoded; more than `max` in all: LLMEM_ERANGE
 * (logged). */
static int conversation_ids(const struct llmem_tokenizer *tok, const struct conversation *c,
                            const char *text, size_t text_len, int64_t max, int32_t **ids,
                            int64_t *n) {
    size_t len = c->text_len;
    if (c->text == NULL || len > text_len || memcmp(text, c->text, len) != 0)
        return llmem_tokenizer_encode_max(tok, text, text_len, max, ids, n);
    int32_t *rest = NULL;
    int64_t n_rest = 0;
    int status = llmem_tokenizer_encode_max(tok, text + len, text_len - len,
                                            max > c->n ? max - c->n : 0, &rest, &n_rest);
    if (status != LLMEM_OK)
        return status;
    *ids = malloc((size_t)(c->n + n_rest + 1) * sizeof(int32_t));
    if (*ids == NULL) {
        free(rest);
        return LLMEM_ENOMEM;
    }
    memcpy(*ids, c->ids, (size_t)c->n * sizeof(int32_t));
    memcpy(*ids + c->n, rest, (size_t)n_rest * sizeof(int32_t));
    *n = c->n + n_rest;
    free(rest);
    return LLMEM_OK;
}

/* Keeps prompt ids + generated ids (taking ownership of text and ids) when the generated ids
 * decode to exactly the answer's text (not when a stop string cut it); else forgets the
 * conversation, and the next turn encodes its whole text. */
static void conversation_keep(const struct llmem_tokenizer *tok, struct conversation *c, char *text,
                              size_t text_len, int32_t *ids, int64_t n,
                              const struct llmem_generate_result *r) {
    conversation_free(c);
    char *decoded = NULL;
    size_t len = 0;
    int32_t *all = realloc(ids, (size_t)(n + r->n_ids + 1) * sizeof(int32_t));
    char *joined = malloc(text_len + r->text_len + 1);
    int same = all != NULL && joined != NULL &&
               llmem_tokenizer_decode(tok, r->ids, r->n_ids, 1, &decoded, &len) == LLMEM_OK &&
               len == r->text_len && memcmp(decoded, r->text, len) == 0;
    free(decoded);
    if (all == NULL)
        all = ids;
    if (!same) {
        free(all);
        free(joined);
        free(text);
        return;
    }
    memcpy(all + n, r->ids, (size_t)r->n_ids * sizeof(int32_t));
    memcpy(joined, text, text_len);
    memcpy(joined + text_len, r->text, r->text_len);
    joined[text_len + r->text_len] = '\0';
    free(text);
    c->ids = all;
    c->n = n + r->n_ids;
    c->text = joined;
    c->text_len = text_len + r->text_len;
}

/* Room for `need` messages and their owned texts (doubling). */
static int grow_messages(struct llmem_chat_message **msgs, char ***owned, int *cap, int need) {
    if (need <= *cap)
        return CLI_OK;
    int n = *cap > 0 ? *cap : 16;
    while (n < need)
        n *= 2;
    struct llmem_chat_message *m = realloc(*msgs, (size_t)n * sizeof(*m));
    if (m != NULL)
        *msgs = m;
    char **o = m != NULL ? realloc(*owned, (size_t)n * sizeof(*o)) : NULL;
    if (o == NULL) {
        fprintf(stderr, "llmem chat: out of memory\n");
        return CLI_FAIL;
    }
    *owned = o;
    *cap = n;
    return CLI_OK;
}

static const char chat_usage[] =
    "usage: llmem chat MODEL [options]\n"
    "\n"
    "An interactive conversation on stdin/stdout with the model's chat template. An empty line or\n"
    "end of input ends it. Each turn continues the ids of the one before, so the whole\n"
    "conversation so far comes from the session bank and only the new message is prefilled.\n"
    "  --chat-template T    chatml, llama3 or mistral (default: recognized from the model)\n"
    "  --system TEXT        a system message\n"
    "  --stats              tokens/s and memory after each answer\n";

static int chat_main(int argc, char **argv, struct run_args *a) {
    if (a->help) {
        printf("%s\n%s\n%s", chat_usage, sampling_help, cli_engine_help);
        return CLI_OK;
    }
    if (optind != argc - 1)
        return cli_usage_error(a->cmd, "needs one MODEL directory (see --help)");
    enum llmem_chat_template tmpl = LLMEM_CHAT_NONE;
    if (a->chat_template != NULL && llmem_chat_template_parse(a->chat_template, &tmpl) != LLMEM_OK)
        return CLI_USAGE;
    struct llmem_engine *e = NULL;
    int rc = open_engine(argv[optind], a, &e);
    if (rc != CLI_OK)
        return rc;
    const struct llmem_tokenizer *tok = llmem_engine_tokenizer(e);
    if (tmpl == LLMEM_CHAT_NONE) {
        if (llmem_tokenizer_chat_template(tok, &tmpl) != LLMEM_OK) {
            llmem_engine_close(e);
            return CLI_FAIL;
        }
        if (tmpl == LLMEM_CHAT_NONE) {
            fprintf(stderr,
                    "llmem chat: %s has no chat template; pass --chat-template "
                    "chatml|llama3|mistral\n",
                    argv[optind]);
            llmem_engine_close(e);
            return CLI_FAIL;
        }
    }
    int32_t stop_ids[8];
    a->gen.n_stop_ids = llmem_chat_stop_ids(tok, tmpl, stop_ids, 8);
    a->gen.stop_ids = stop_ids;
    if (a->gen.max_tokens == 0)
        a->gen.max_tokens = 512;

    /* the messages so far (system, then user and assistant turns), grown as the turns come;
     * owned[i] is the text of msgs[i] where this loop allocated it, else NULL */
    const int64_t context = llmem_engine_plan(e)->context_window_resolved;
    struct llmem_chat_message *msgs = NULL;
    char **owned = NULL;
    int n_msgs = 0, cap = 0;
    struct conversation conv = {0};
    if (a->system != NULL) {
        if (grow_messages(&msgs, &owned, &cap, 1) != CLI_OK) {
            llmem_engine_close(e);
            return CLI_FAIL;
        }
        owned[n_msgs] = NULL;
        msgs[n_msgs++] = (struct llmem_chat_message){"system", a->system, 0};
    }
    /* A line is read whole, whatever its length, with every byte (a NUL is a character of the
     * message like any other, as in a request's content). */
    char *line = NULL;
    size_t line_cap = 0;
    int interactive = isatty(0);
    for (;;) {
        if (interactive)
            fprintf(stderr, "> ");
        ssize_t got = getline(&line, &line_cap, stdin);
        if (got < 0)
            break;
        size_t len = (size_t)got;
        if (len > 0 && line[len - 1] == '\n')
            line[--len] = '\0';
        if (len == 0)
            break;
        if (grow_messages(&msgs, &owned, &cap, n_msgs + 2) != CLI_OK) {
            rc = CLI_FAIL;
            break;
        }
        if (llmem_tok_utf8_check(line, len) != len) { /* the session goes on without it */
            fprintf(stderr, "llmem chat: that line is not valid UTF-8 (byte %zu); type it again\n",
                    llmem_tok_utf8_check(line, len) + 1);
            continue;
        }
        if ((owned[n_msgs] = malloc(len + 1)) == NULL) {
            fprintf(stderr, "llmem chat: out of memory\n");
            rc = CLI_FAIL;
            break;
        }
        memcpy(owned[n_msgs], line, len + 1);
        msgs[n_msgs] = (struct llmem_chat_message){"user", owned[n_msgs], len};
        n_msgs++;
        char *text = NULL;
        size_t text_len = 0;
        int32_t *ids = NULL;
        int64_t n = 0;
        if (llmem_chat_render(tok, tmpl, msgs, n_msgs, 1, &text, &text_len) != LLMEM_OK ||
            conversation_ids(tok, &conv, text, text_len, context, &ids, &n) != LLMEM_OK) {
            free(text);
            rc = CLI_FAIL;
            break;
        }
        struct llmem_generate_result r;
        int status = llmem_engine_generate(e, ids, n, &a->gen, stream_stdout, NULL, &r);
        if (status != LLMEM_OK) {
            free(text);
            free(ids);
            rc = CLI_FAIL;
            break;
        }
        conversation_keep(tok, &conv, text, text_len, ids, n, &r);
        printf("\n");
        fflush(stdout);
        if (a->stats)
            print_stats(e, &r);
        owned[n_msgs] = r.text;
        r.text = NULL;
        msgs[n_msgs] = (struct llmem_chat_message){"assistant", owned[n_msgs], r.text_len};
        n_msgs++;
        llmem_generate_result_free(&r);
    }
    free(line);
    conversation_free(&conv);
    for (int i = 0; i < n_msgs; i++)
        free(owned[i]);
    free(owned);
    free(msgs);
    llmem_engine_close(e);
    return rc;
}

/* ---- llmem tokenize / llmem logits ------------------------------------------------------------
 */

static int tokenize_main(int argc, char **argv, struct run_args *a) {
    if (a->help) {
        printf("usage: llmem tokenize MODEL (--text TEXT | --text-file FILE) [--json]\n\n"
               "Prints the token ids of TEXT, or of the whole of FILE, every byte (- for stdin;\n"
               "no BOS added); --json prints {\"ids\": [...]}.\n");
        return CLI_OK;
    }
    if (optind != argc - 1 || (a->text == NULL) == (a->text_file == NULL))
        return cli_usage_error(
            a->cmd, "usage: llmem tokenize MODEL (--text TEXT | --text-file FILE) [--json]");
    char *file_text = NULL;
    size_t text_len = a->text != NULL ? strlen(a->text) : 0;
    if (a->text_file != NULL && read_input(a->cmd, a->text_file, &file_text, &text_len) != CLI_OK)
        return CLI_FAIL;
    const char *text = a->text_file != NULL ? file_text : a->text;
    struct llmem_tokenizer *tok = NULL;
    if (llmem_tokenizer_load(argv[optind], &tok) != LLMEM_OK) {
        free(file_text);
        return CLI_FAIL;
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    int rc = CLI_FAIL;
    if (llmem_tokenizer_encode(tok, text, text_len, &ids, &n) == LLMEM_OK) {
        if (a->json) {
            cJSON *root = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(root, "ids");
            for (int64_t i = 0; arr != NULL && i < n; i++)
                cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
            rc = cli_print_json(root);
        } else {
            for (int64_t i = 0; i < n; i++)
                printf("%s%d", i ? "," : "", ids[i]);
            printf("\n");
            rc = CLI_OK;
        }
    }
    free(ids);
    free(file_text);
    llmem_tokenizer_free(tok);
    return rc;
}

static int logits_main(int argc, char **argv, struct run_args *a) {
    if (a->help) {
        printf("usage: llmem logits MODEL --ids 1,2,3 --out FILE.npy [options]\n\n"
               "Writes the teacher-forced logits of every position, float32 [n, vocab].\n\n%s",
               cli_engine_help);
        return CLI_OK;
    }
    if (optind != argc - 1 || a->ids == NULL || a->out == NULL)
        return cli_usage_error(a->cmd, "usage: llmem logits MODEL --ids 1,2,3 --out FILE.npy");
    int32_t *ids = NULL;
    int64_t n = 0;
    if (parse_ids(a->cmd, a->ids, &ids, &n) != CLI_OK)
        return CLI_USAGE;
    a->engine.no_spill = 1; /* teacher forcing never uses the bank: leave the store to others */
    struct llmem_engine *e = NULL;
    int rc = open_engine(argv[optind], a, &e);
    float *logits = NULL;
    int seq = -1;
    if (rc != CLI_OK)
        goto out;
    const int64_t window = llmem_engine_plan(e)->context_window_resolved;
    if (n > window) {
        fprintf(stderr, "%s %s: %" PRId64 " ids exceed the context window of %" PRId64 " tokens\n",
                cli_program, a->cmd, n, window);
        rc = CLI_FAIL;
        goto out;
    }
    int64_t vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size;
    int64_t chunk = llmem_forward_max_tokens(llmem_engine_forward(e));
    logits = malloc((size_t)(n * vocab) * sizeof(float));
    rc = CLI_FAIL;
    if (logits == NULL || llmem_kv_seq_new(llmem_engine_kv(e), &seq) != LLMEM_OK)
        goto out;
    for (int64_t pos = 0; pos < n; pos += chunk) {
        int64_t m = n - pos < chunk ? n - pos : chunk;
        struct llmem_batch_seq b = {.seq = seq, .pos = pos, .n_tokens = m, .all_logits = 1};
        if (llmem_forward_run(llmem_engine_forward(e), ids + pos, &b, 1, logits + pos * vocab) !=
            LLMEM_OK)
            goto out;
    }
    if (llmem_npy_write_f32(a->out, logits, n, vocab) == LLMEM_OK)
        rc = CLI_OK;
out:
    free(logits);
    free(ids);
    llmem_engine_close(e);
    return rc;
}

/* ---- dispatch ----------------------------------------------------------------------------------
 */

int cli_run(int argc, char **argv) {
    struct run_args a;
    memset(&a, 0, sizeof(a));
    a.cmd = argv[0];
    llmem_engine_config_default(&a.engine);
    llmem_generate_params_default(&a.gen);
    int rc = parse(argc, argv, &a);
    if (rc != CLI_OK)
        return rc;
    if (strcmp(a.cmd, "chat") == 0)
        return chat_main(argc, argv, &a);
    if (strcmp(a.cmd, "tokenize") == 0)
        return tokenize_main(argc, argv, &a);
    if (strcmp(a.cmd, "logits") == 0)
        return logits_main(argc, argv, &a);
    return run_main(argc, argv, &a);
}

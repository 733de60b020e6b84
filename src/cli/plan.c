/*
 * cli/plan.c — `llmem plan`: the memory plan for a model directory, a GGUF file (its header
 * alone), a catalog name, or explicit numbers, on this machine or a simulated one. Asks model/ for
 * the geometry and sys/ (or the backend registry) for the machine, hands numbers to plan/, and
 * prints the result as text, JSON (--json) and an SVG picture (--svg).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "cli/bandwidth.h"
#include "cli/cli.h"
#include "core/json.h"
#include "core/log.h"
#include "llmem/backend.h"
#include "llmem/engine.h"
#include "llmem/model.h"
#include "llmem/plan.h"
#include "llmem/size.h"
#include "llmem/sys.h"
#include "llmem/tokenizer.h"
#include "model/gguf.h"
#include "plan/plan_json.h"

static const char plan_usage[] =
    "usage: llmem plan MODEL [options]      MODEL: a model directory, a .gguf file or a catalog"
    " name\n"
    "       llmem plan --weights SIZE --kv-bytes-per-token N [--max-context N] [options]\n"
    "       llmem plan --list\n"
    "\n"
    "Computes, without loading anything, what the model commits (weights, one full window of KV,\n"
    "runtime transients), what is reclaimable cache (the session bank), how much context fits,\n"
    "and the allocation limit, trip and ceiling the engine will apply.\n"
    "\n"
    "machine (default: this machine, probed):\n"
    "  --total SIZE               memory the engine's process can have (RAM or device memory)\n"
    "  --ceiling SIZE             hard ceiling (default: the total)\n"
    "  --backend cpu|cuda         plan for host memory (default) or a CUDA device\n"
    "  --device N                 which CUDA device (default 0)\n"
    "  --tensor-parallel N        with --backend cuda, the model split over N devices (1, 2,\n"
    "                             4, 8: heads, MLP columns, vocabulary): one device's plan\n"
    "  --experts-on-host N        with --backend cuda, a mixture of experts: the first N MoE\n"
    "                             layers' experts in host memory, run on the CPU (default: the\n"
    "                             fewest with which the model fits the device)\n"
    "  --bandwidth GBPS           the host memory's read bandwidth in GB/s, for the decode\n"
    "                             estimate (default: measured when planning this machine)\n"
    "  --device-bandwidth GBPS    the device memory's (default: the device's peak)\n"
    "model by numbers (instead of MODEL):\n"
    "  --weights SIZE             bytes of all weights\n"
    "  --kv-bytes-per-token N     KV bytes per token at 2 bytes per element\n"
    "  --max-context N            the model's maximum context (default: none)\n"
    "plan:\n"
    "  --context N                the context window to reserve (default: what fits)\n"
    "  --budget SIZE              plan as if the machine had SIZE\n"
    "  --memory-limit SIZE        the engine budget, exactly (bounded by the machine)\n"
    "  --util F                   the engine budget as a fraction of the ceiling, in (0, 1]\n"
    "  --kv-format FMT            f16 (default), bf16, f32, q8, q4, tq\n"
    "  --max-sequences N          running batch size (default 1)\n"
    "  --max-batch-tokens N       most tokens in one forward step (default: as llmem run,\n"
    "                             512; with --backend cuda up to 8192 within the plan)\n"
    "  --working-set SIZE         also report the bank's dynamic ceiling at this live KV\n"
    "  --weight-type TYPE         plan MODEL (a catalog name or a directory) as the GGUF file\n"
    "                             `llmem quantize --type TYPE` makes of it: q8_0, q6_k,\n"
    "                             q5_k_m, q4_k_m, q4_0, f16, bf16\n"
    "  --load-format F            auto (default), or dummy: a directory's config.json alone,\n"
    "                             as llmem run --load-format dummy makes it (bf16)\n"
    "  --baseline SIZE            what the process holds outside the allocator (default: on\n"
    "                             this host measured as llmem run would, with the model's\n"
    "                             tokenizer loaded; 0 with --total or --backend cuda)\n"
    "output:\n"
    "  --json                     one JSON object on stdout\n"
    "  --svg FILE                 a picture of the envelope\n"
    "  --list                     the built-in catalog\n"
    "\n"
    "Sizes take K/M/G/T suffixes (binary): 48G, 512M, 1.5T. Exit status: 0 when the plan fits,\n"
    "3 when the model does not fit, the requested context is overcommitted or the limits break\n"
    "footprint < allocation limit < trip < ceiling, 1 on errors, 2 on usage errors.\n";

enum {
    OPT_TOTAL = 256,
    OPT_CEILING,
    OPT_WEIGHTS,
    OPT_KV_BYTES,
    OPT_MAX_CONTEXT,
    OPT_CONTEXT,
    OPT_BUDGET,
    OPT_MEMORY_LIMIT,
    OPT_UTIL,
    OPT_KV_FORMAT,
    OPT_MAX_SEQUENCES,
    OPT_MAX_BATCH_TOKENS,
    OPT_WORKING_SET,
    OPT_BASELINE,
    OPT_WEIGHT_TYPE,
    OPT_LOAD_FORMAT,
    OPT_BACKEND,
    OPT_DEVICE,
    OPT_EXPERTS_ON_HOST,
    OPT_TENSOR_PARALLEL,
    OPT_BANDWIDTH,
    OPT_DEVICE_BANDWIDTH,
    OPT_JSON,
    OPT_SVG,
    OPT_LIST,
    OPT_HELP,
};

static const struct option plan_options[] = {
    {"total", required_argument, NULL, OPT_TOTAL},
    {"ceiling", required_argument, NULL, OPT_CEILING},
    {"weights", required_argument, NULL, OPT_WEIGHTS},
    {"kv-bytes-per-token", required_argument, NULL, OPT_KV_BYTES},
    {"max-context", required_argument, NULL, OPT_MAX_CONTEXT},
    {"context", required_argument, NULL, OPT_CONTEXT},
    {"budget", required_argument, NULL, OPT_BUDGET},
    {"memory-limit", required_argument, NULL, OPT_MEMORY_LIMIT},
    {"util", required_argument, NULL, OPT_UTIL},
    {"kv-format", required_argument, NULL, OPT_KV_FORMAT},
    {"max-sequences", required_argument, NULL, OPT_MAX_SEQUENCES},
    {"max-batch-tokens", required_argument, NULL, OPT_MAX_BATCH_TOKENS},
    {"working-set", required_argument, NULL, OPT_WORKING_SET},
    {"baseline", required_argument, NULL, OPT_BASELINE},
    {"weight-type", required_argument, NULL, OPT_WEIGHT_TYPE},
    {"load-format", required_argument, NULL, OPT_LOAD_FORMAT},
    {"backend", required_argument, NULL, OPT_BACKEND},
    {"device", required_argument, NULL, OPT_DEVICE},
    {"experts-on-host", required_argument, NULL, OPT_EXPERTS_ON_HOST},
    {"tensor-parallel", required_argument, NULL, OPT_TENSOR_PARALLEL},
    {"bandwidth", required_argument, NULL, OPT_BANDWIDTH},
    {"device-bandwidth", required_argument, NULL, OPT_DEVICE_BANDWIDTH},
    {"json", no_argument, NULL, OPT_JSON},
    {"svg", required_argument, NULL, OPT_SVG},
    {"list", no_argument, NULL, OPT_LIST},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

struct plan_args {
    struct llmem_plan_params params;
    const char *model;
    int64_t total, ceiling, weights, kv_bytes, max_context, working_set;
    int have_working_set, have_baseline;
    int weight_type; /* an llmem_gguf_ftype; 0: the model's own */
    int dummy;       /* --load-format dummy: the directory's config.json alone */
    int64_t device;
    int64_t experts_on_host; /* -1: the plan's choice */
    int64_t tp;              /* devices the model is split over (--tensor-parallel) */
    double bandwidth, device_bandwidth; /* GB/s; 0: not given */
    int json, list;
    const char *svg;
};

#define MAX_CONTEXT_TOKENS ((int64_t)1 << 40)
#define MAX_COUNT          ((int64_t)1 << 30)

static int parse_args(int argc, char **argv, struct plan_args *a) {
    memset(a, 0, sizeof(*a));
    a->params.kv_format = LLMEM_KV_FORMAT_F16;
    a->experts_on_host = -1;
    a->tp = 1;
    optind = 1;
    opterr = 0;
    int c, rc = CLI_OK;
    while (rc == CLI_OK && (c = getopt_long(argc, argv, ":h", plan_options, NULL)) != -1) {
        switch (c) {
        case OPT_TOTAL: rc = cli_parse_positive_size("--total", optarg, &a->total); break;
        case OPT_CEILING: rc = cli_parse_positive_size("--ceiling", optarg, &a->ceiling); break;
        case OPT_WEIGHTS: rc = cli_parse_size("--weights", optarg, &a->weights); break;
        case OPT_KV_BYTES:
            rc = cli_parse_int("--kv-bytes-per-token", optarg, 1, INT64_MAX / 4, &a->kv_bytes);
            break;
        case OPT_MAX_CONTEXT:
            rc = cli_parse_int("--max-context", optarg, 1, MAX_CONTEXT_TOKENS, &a->max_context);
            break;
        case OPT_CONTEXT:
            rc = cli_parse_int("--context", optarg, 2, MAX_CONTEXT_TOKENS,
                               &a->params.requested_context);
            break;
        case OPT_BUDGET:
            rc = cli_parse_positive_size("--budget", optarg, &a->params.memory_budget_bytes);
            break;
        case OPT_MEMORY_LIMIT:
            rc = cli_parse_positive_size("--memory-limit", optarg, &a->params.memory_limit_bytes);
            break;
        case OPT_UTIL: rc = cli_parse_double("--util", optarg, 0.0, 1.0, &a->params.util); break;
        case OPT_KV_FORMAT:
            if (llmem_kv_format_parse(optarg, &a->params.kv_format) != LLMEM_OK)
                rc = CLI_USAGE; /* the parser said which names exist */
            break;
        case OPT_MAX_SEQUENCES:
            rc = cli_parse_int("--max-sequences", optarg, 1, MAX_COUNT, &a->params.max_sequences);
            break;
        case OPT_MAX_BATCH_TOKENS:
            rc = cli_parse_int("--max-batch-tokens", optarg, 1, MAX_COUNT,
                               &a->params.max_batch_tokens);
            break;
        case OPT_WORKING_SET:
            rc = cli_parse_size("--working-set", optarg, &a->working_set);
            a->have_working_set = 1;
            break;
        case OPT_WEIGHT_TYPE:
            if ((a->weight_type = llmem_gguf_ftype_parse(optarg)) < 0)
                return cli_usage_error("plan",
                                       "--weight-type: '%s' is not q8_0, q6_k, q5_k_m, "
                                       "q4_k_m, q4_0, f16 or bf16",
                                       optarg);
            break;
        case OPT_LOAD_FORMAT:
            if (strcmp(optarg, "auto") != 0 && strcmp(optarg, "dummy") != 0)
                return cli_usage_error("plan", "--load-format: '%s' is not auto or dummy", optarg);
            a->dummy = strcmp(optarg, "dummy") == 0;
            break;
        case OPT_BASELINE:
            rc = cli_parse_size("--baseline", optarg, &a->params.runtime_baseline_bytes);
            a->have_baseline = 1;
            break;
        case OPT_BACKEND:
            if (strcmp(optarg, "cpu") == 0)
                a->params.target = LLMEM_PLAN_HOST;
            else if (strcmp(optarg, "cuda") == 0)
                a->params.target = LLMEM_PLAN_CUDA;
            else
                rc = cli_usage_error("plan", "--backend: '%s' is not cpu or cuda", optarg);
            break;
        case OPT_DEVICE: rc = cli_parse_int("--device", optarg, 0, 1024, &a->device); break;
        case OPT_EXPERTS_ON_HOST:
            rc = cli_parse_int("--experts-on-host", optarg, 0, 1 << 20, &a->experts_on_host);
            break;
        case OPT_TENSOR_PARALLEL:
            rc = cli_parse_int("--tensor-parallel", optarg, 1, 8, &a->tp);
            break;
        case OPT_BANDWIDTH:
            rc = cli_parse_double("--bandwidth", optarg, 0.0, 1e6, &a->bandwidth);
            break;
        case OPT_DEVICE_BANDWIDTH:
            rc = cli_parse_double("--device-bandwidth", optarg, 0.0, 1e6, &a->device_bandwidth);
            break;
        case OPT_JSON: a->json = 1; break;
        case OPT_SVG: a->svg = optarg; break;
        case OPT_LIST: a->list = 1; break;
        case 'h':
        case OPT_HELP: fputs(plan_usage, stdout); return -1;
        case ':': return cli_usage_error("plan", "%s needs a value", argv[optind - 1]);
        default:
            return cli_usage_error("plan", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (rc != CLI_OK)
        return rc;
    if (optind < argc)
        a->model = argv[optind++];
    if (optind < argc)
        return cli_usage_error("plan", "unexpected argument '%s'", argv[optind]);
    if (a->params.memory_limit_bytes > 0 && a->params.util > 0)
        return cli_usage_error("plan", "--memory-limit and --util both set the engine budget;"
                                       " give one");
    int by_numbers = a->weights > 0 || a->kv_bytes > 0 || a->max_context > 0;
    if (a->model != NULL && by_numbers)
        return cli_usage_error("plan", "--weights, --kv-bytes-per-token and --max-context"
                                       " describe a model; give them instead of MODEL");
    if (a->weight_type > 0 && a->model == NULL)
        return cli_usage_error("plan", "--weight-type plans a MODEL (a catalog name or a "
                                       "directory) at that type; give one");
    if (a->tp > 1 && (a->params.target != LLMEM_PLAN_CUDA || a->model == NULL))
        return cli_usage_error("plan", "--tensor-parallel splits a MODEL over CUDA devices; give "
                                       "one and --backend cuda");
    if (a->model == NULL && !a->list && (a->weights <= 0 || a->kv_bytes <= 0))
        return cli_usage_error("plan", "give a MODEL (directory or catalog name) or"
                                       " --weights and --kv-bytes-per-token (see --help)");
    return CLI_OK;
}

/* ---- the catalog --------------------------------------------------------------------------- */

/* A geometry's numbers as JSON fields (the catalog list and the plan's "model" object). */
static int geometry_json(cJSON *o, const struct llmem_model_geometry *g) {
    int st = llmem_json_add_string(o, "name", g->name);
    st |= llmem_json_add_string(o, "arch", g->arch);
    st |= llmem_json_add_string(o, "source", g->source);
    st |= llmem_json_add_int(o, "n_params", g->n_params);
    st |= llmem_json_add_int(o, "weights_bytes", g->weights_bytes);
    st |= llmem_json_add_int(o, "n_layers", g->n_layers);
    st |= llmem_json_add_int(o, "hidden_size", g->hidden_size);
    st |= llmem_json_add_int(o, "n_heads", g->n_heads);
    st |= llmem_json_add_int(o, "n_kv_heads", g->n_kv_heads);
    st |= llmem_json_add_int(o, "head_dim", g->head_dim);
    st |= llmem_json_add_int(o, "intermediate_size", g->intermediate_size);
    st |= llmem_json_add_int(o, "vocab_size", g->vocab_size);
    st |= llmem_json_add_int(o, "max_context", g->max_context);
    st |= llmem_json_add_int(o, "sliding_window", g->sliding_window);
    st |= llmem_json_add_int(o, "kv_bytes_per_token", llmem_geometry_kv_bytes_per_token(g));
    if (g->n_experts > 0) {
        st |= llmem_json_add_int(o, "n_experts", g->n_experts);
        st |= llmem_json_add_int(o, "n_experts_used", g->n_experts_used);
        st |= llmem_json_add_int(o, "expert_intermediate", g->expert_intermediate);
        st |= llmem_json_add_int(o, "n_moe_layers", g->n_moe_layers);
    }
    st |= llmem_json_add_int(o, "active_params", llmem_geometry_active_param_count(g));
    st |= llmem_json_add_int(o, "active_bytes", llmem_geometry_active_bytes(g));
    return st != 0 ? LLMEM_ENOMEM : LLMEM_OK;
}

static int print_catalog(int json) {
    size_t n = llmem_catalog_count();
    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON *models = root != NULL ? cJSON_AddArrayToObject(root, "models") : NULL;
        for (size_t i = 0; models != NULL && i < n; i++) {
            cJSON *m = cJSON_CreateObject();
            if (m == NULL || !cJSON_AddItemToArray(models, m) ||
                geometry_json(m, llmem_catalog_get(i)) != LLMEM_OK) {
                cJSON_Delete(m);
                models = NULL;
            }
        }
        if (models == NULL) {
            cJSON_Delete(root);
            fprintf(stderr, "llmem plan: out of memory building the JSON output\n");
            return CLI_FAIL;
        }
        return cli_print_json(root);
    }
    printf("%-20s %-8s %8s %9s %12s %10s  %s\n", "name", "arch", "params", "weights", "KV/token",
           "max ctx", "source");
    for (size_t i = 0; i < n; i++) {
        const struct llmem_model_geometry *g = llmem_catalog_get(i);
        char w[LLMEM_SIZE_STR_MAX];
        printf("%-20s %-8s %7.2fB %9s %10lld B %10lld  %s\n", g->name, g->arch,
               (double)g->n_params / 1e9, llmem_size_format_short(g->weights_bytes, w, sizeof(w)),
               (long long)llmem_geometry_kv_bytes_per_token(g), (long long)g->max_context,
               g->source);
    }
    return CLI_OK;
}

/* ---- the machine ---------------------------------------------------------------------------- */

struct machine {
    char label[224];
    int64_t total, ceiling;
    int64_t memory_bandwidth; /* a probed device's peak (bytes/s), else unknown */
};

static int probe_machine(const struct plan_args *a, struct machine *m) {
    struct llmem_device_info info;
    if (a->params.target == LLMEM_PLAN_CUDA) {
        int n = 0;
        if (llmem_backend_device_count(&n) != LLMEM_OK || n == 0) {
            if (a->total > 0) { /* planning a device we do not have, by numbers */
                snprintf(m->label, sizeof(m->label), "CUDA device (simulated)");
                return CLI_OK;
            }
            fprintf(stderr, "llmem plan: no CUDA device %s; give --total to plan for one\n",
                    llmem_backend_cuda_available() ? "found" : "(built without CUDA)");
            return CLI_FAIL;
        }
        if (a->device + a->tp > n) {
            fprintf(stderr, "llmem plan: --device %lld%s: only %d CUDA device(s)\n",
                    (long long)a->device, a->tp > 1 ? " and the devices after it" : "", n);
            return CLI_FAIL;
        }
        if (llmem_backend_device_info((int)a->device, &info) != LLMEM_OK)
            return CLI_FAIL;
        snprintf(m->label, sizeof(m->label), "cuda:%lld %s%s", (long long)a->device, info.name,
                 a->tp > 1 ? " (each of the devices alike)" : "");
    } else {
        if (llmem_sys_probe_host(&info) != LLMEM_OK)
            return CLI_FAIL;
        snprintf(m->label, sizeof(m->label), "this host (%s)", info.name);
    }
    /* On a host the engine's memory is min(RAM, cgroup limit): the ceiling of SPEC §1. */
    m->total = info.max_recommended_working_set_size;
    m->ceiling = info.max_recommended_working_set_size;
    m->memory_bandwidth = info.memory_bandwidth;
    return CLI_OK;
}

/* ---- the model ------------------------------------------------------------------------------ */

static int resolve_model(const char *name, int dummy, struct llmem_model_geometry *g) {
    struct stat st;
    if (stat(name, &st) == 0 || strchr(name, '/') != NULL || strcmp(name, ".") == 0)
        return (dummy ? llmem_model_geometry_load_dummy(name, g)
                      : llmem_model_geometry_load(name, g)) == LLMEM_OK
                   ? CLI_OK
                   : CLI_FAIL;
    const struct llmem_model_geometry *entry = llmem_catalog_find(name);
    if (entry == NULL) {
        fprintf(stderr,
                "llmem plan: unknown model '%s': not a directory and not in the catalog"
                " (llmem plan --list)\n",
                name);
        return CLI_FAIL;
    }
    *g = *entry;
    return CLI_OK;
}

/* What llmem run would hold outside its allocator (SPEC §2.2): this process's resident memory
 * with the model's tokenizer and its grammar vocabulary loaded, as the engine measures it at
 * open. */
static int64_t measured_baseline(const struct plan_args *a, const struct llmem_engine_config *cfg,
                                 int64_t vocab, int threads) {
    struct llmem_tokenizer *tok = NULL;
    struct llmem_grammar_vocab *gv = NULL;
    struct stat st;
    if (a->model != NULL && stat(a->model, &st) == 0 && S_ISDIR(st.st_mode) &&
        llmem_tokenizer_load(a->model, &tok) == LLMEM_OK) /* (run refuses a model without one) */
        llmem_grammar_vocab_create(tok, &gv);
    int64_t bytes = llmem_engine_runtime_baseline(cfg, vocab, threads);
    llmem_grammar_vocab_free(gv);
    llmem_tokenizer_free(tok);
    return bytes;
}

/* ---- the decode estimate ----------------------------------------------------------------------
 *
 * A decode step's roofline: a token reads the weights it multiplies by (of a mixture, the
 * experts its router picks) and its sequence's KV once each, at the memory's bandwidth; the
 * experts on the host at the host's. Tokens/s a sequence at a short context and at the end of
 * the plan's full window. The bandwidths: given, or the device's peak, or this host's measured
 * read (a pass over 256 MiB on every CPU); unknown on a machine planned by numbers. */

#define PROBE_BYTES ((int64_t)256 << 20)

struct decode_estimate {
    double device_gbps, host_gbps;          /* 0: unknown or not needed */
    const char *device_from, *host_from;    /* where each comes from */
    int64_t device_bytes, host_bytes;       /* a token's weight reads, on each side */
    int64_t kv_bytes;                       /* a token's KV read at the end of the full window */
    double tokens_per_s, tokens_per_s_full; /* 0: unknown */
};

static void estimate_decode(const struct plan_args *a, const struct machine *m,
                            const struct llmem_plan *plan, const struct llmem_model_geometry *g,
                            const struct llmem_expert_placement *placed, int threads,
                            struct decode_estimate *d) {
    const int cuda = a->params.target == LLMEM_PLAN_CUDA, here = a->total == 0;
    *d = (struct decode_estimate){0};
    d->device_bytes = g != NULL ? placed->device_read_bytes : plan->weights_bytes;
    d->host_bytes = cuda ? placed->host_read_bytes : 0;
    if (!cuda) /* the host's memory is the one the weights are read from */
        d->host_bytes = d->device_bytes, d->device_bytes = 0;
    d->kv_bytes = plan->context_window_resolved *
                  (plan->kv_bytes_per_token_effective + plan->aux_bytes_per_token);
    if (d->device_bytes > 0) {
        if (a->device_bandwidth > 0)
            d->device_gbps = a->device_bandwidth, d->device_from = "--device-bandwidth";
        else if (here && m->memory_bandwidth > 0)
            d->device_gbps = (double)m->memory_bandwidth / 1e9,
            d->device_from = "the device's peak";
    }
    if (d->host_bytes > 0) {
        if (a->bandwidth > 0)
            d->host_gbps = a->bandwidth, d->host_from = "--bandwidth";
        else if (here && cli_read_bandwidth(threads, PROBE_BYTES, &d->host_gbps) == CLI_OK)
            d->host_from = "this host's, measured";
        else
            d->host_gbps = 0;
    }
    if ((d->device_bytes > 0 && d->device_gbps <= 0) || (d->host_bytes > 0 && d->host_gbps <= 0))
        return;
    const double weights_s =
        (d->device_bytes > 0 ? (double)d->device_bytes / (d->device_gbps * 1e9) : 0) +
        (d->host_bytes > 0 ? (double)d->host_bytes / (d->host_gbps * 1e9) : 0);
    const double kv_gbps = cuda ? d->device_gbps : d->host_gbps; /* where the KV lives */
    if (weights_s <= 0 || kv_gbps <= 0)
        return;
    d->tokens_per_s = 1.0 / weights_s;
    d->tokens_per_s_full = 1.0 / (weights_s + (double)d->kv_bytes / (kv_gbps * 1e9));
}

static void print_decode(const struct decode_estimate *d, const struct llmem_plan *plan, int here) {
    char s1[LLMEM_SIZE_STR_MAX], s2[LLMEM_SIZE_STR_MAX], s3[LLMEM_SIZE_STR_MAX];
    if (d->tokens_per_s <= 0) {
        const char *need = d->device_bytes > 0 && d->device_gbps <= 0 ? "--device-bandwidth GBPS"
                                                                      : "--bandwidth GBPS";
        printf("  decode   an estimate needs %s (%s)\n", need,
               here ? "not known for this machine" : "a machine planned by numbers");
        return;
    }
    printf("  decode   up to %.1f tokens/s a sequence (its reads at the bandwidth), %.1f at the "
           "end of the %lld-token window: a token reads ",
           d->tokens_per_s, d->tokens_per_s_full, (long long)plan->context_window_resolved);
    if (d->device_bytes > 0)
        printf("%s at %.0f GB/s (%s)%s", llmem_size_format_short(d->device_bytes, s1, sizeof(s1)),
               d->device_gbps, d->device_from, d->host_bytes > 0 ? " and " : "");
    if (d->host_bytes > 0)
        printf("%s at %.0f GB/s (%s)", llmem_size_format_short(d->host_bytes, s2, sizeof(s2)),
               d->host_gbps, d->host_from);
    printf(", its KV up to %s\n", llmem_size_format_short(d->kv_bytes, s3, sizeof(s3)));
}

/* The estimate as "decode": {…} (a rate or bandwidth not known: null). */
static int decode_json(cJSON *o, const struct decode_estimate *d) {
    cJSON *e = cJSON_AddObjectToObject(o, "decode");
    if (e == NULL)
        return LLMEM_ENOMEM;
    const struct {
        const char *key;
        double v;
    } f[] = {{"device_bandwidth_gbps", d->device_gbps},
             {"host_bandwidth_gbps", d->host_gbps},
             {"tokens_per_s", d->tokens_per_s},
             {"tokens_per_s_full_window", d->tokens_per_s_full}};
    int st = llmem_json_add_int(e, "device_read_bytes", d->device_bytes) |
             llmem_json_add_int(e, "host_read_bytes", d->host_bytes) |
             llmem_json_add_int(e, "kv_read_bytes_full_window", d->kv_bytes);
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++)
        st |= f[i].v > 0 ? llmem_json_add_double(e, f[i].key, f[i].v)
                         : llmem_json_add_null(e, f[i].key);
    return st != 0 ? LLMEM_ENOMEM : LLMEM_OK;
}

/* ---- output --------------------------------------------------------------------------------- */

static void row(const char *name, int64_t bytes, const char *why) {
    char s[LLMEM_SIZE_STR_MAX];
    fprintf(stdout, "  %-22s %16lld  %9s  %s\n", name, (long long)bytes,
            llmem_size_format_short(bytes, s, sizeof(s)), why);
}

static void print_human(const struct llmem_plan *p, const struct llmem_model_geometry *g,
                        const struct llmem_model_geometry *part, const char *machine,
                        const struct plan_args *a, int64_t dynamic_ceiling,
                        const struct llmem_expert_placement *placed,
                        const struct decode_estimate *decode) {
    char line[512], s1[LLMEM_SIZE_STR_MAX], s2[LLMEM_SIZE_STR_MAX], s3[LLMEM_SIZE_STR_MAX];
    printf("%s\n\n", llmem_plan_describe(p, line, sizeof(line)));
    if (g != NULL)
        printf("  model    %s (%s): %lld layers, %lld query / %lld KV heads × %lld, %.2fB params\n",
               g->name, g->arch, (long long)g->n_layers, (long long)g->n_heads,
               (long long)g->n_kv_heads, (long long)g->head_dim, (double)g->n_params / 1e9);
    if (part != NULL)
        printf(
            "  parallel %lld devices, each %lld of the %lld query heads, %lld of the %lld KV heads"
            "%s, 1/%lld of the MLP and of the vocabulary: %s of weights; the plan is one "
            "device's\n",
            (long long)a->tp, (long long)part->n_heads, (long long)g->n_heads,
            (long long)part->n_kv_heads, (long long)g->n_kv_heads,
            part->n_kv_heads * a->tp > g->n_kv_heads ? " (repeated)" : "", (long long)a->tp,
            llmem_size_format_short(part->weights_bytes, s1, sizeof(s1)));
    if (g != NULL && g->n_experts > 0) { /* and on a host, the pages of the mapping it touches */
        const long page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
        const int64_t active = llmem_geometry_active_bytes(g);
        char pages[64] = "";
        if (p->target == LLMEM_PLAN_HOST)
            snprintf(pages, sizeof(pages), " (%lld pages of %ld KiB)",
                     (long long)((active + page - 1) / page), page / 1024);
        printf("  experts  %lld of %lld a token in %lld of the layers: %.2fB active params, %s of "
               "weights read a token%s\n",
               (long long)g->n_experts_used, (long long)g->n_experts, (long long)g->n_moe_layers,
               (double)llmem_geometry_active_param_count(g) / 1e9,
               llmem_size_format_short(active, s1, sizeof(s1)), pages);
    }
    if (placed->moe_layers > 0)
        printf("  placed   %s\n", llmem_plan_describe_experts(placed, line, sizeof(line)));
    if (p->model_fits)
        print_decode(decode, p, a->total == 0);
    printf("  machine  %s\n\n", machine);

    printf("  %-22s %16s  %9s\n", "", "bytes", "size");
    row("total", p->total_bytes, "memory the process can have");
    row("ceiling", p->ceiling_bytes, p->ceiling_bytes < p->total_bytes ? "below the total" : "");
    if (p->budget_bytes > 0)
        row("budget", p->budget_bytes, "--budget");
    snprintf(line, sizeof(line), "engine budget (%s)", llmem_usable_source_name(p->usable_source));
    row("usable", p->usable_bytes, line);
    row("weights", p->weights_bytes, "committed");
    snprintf(line, sizeof(line), "committed: %lld tokens × %lld B (%s)",
             (long long)p->context_window_resolved,
             (long long)(p->kv_bytes_per_token_effective + p->aux_bytes_per_token),
             llmem_kv_format_name(p->kv_format));
    row("KV reserve", p->kv_reserve_bytes, line);
    snprintf(line, sizeof(line), "committed: max(workspace %s, min(3G, usable/8))",
             llmem_size_format(p->computed_workspace_bytes, s1, sizeof(s1)));
    row("runtime transients", p->runtime_transients_bytes, line);
    row("runtime baseline", p->runtime_baseline_bytes,
        p->runtime_baseline_bytes > 0
            ? "committed: outside the allocator (code, tokenizer, threads, buffers, grammars)"
            : "committed: none given (--baseline SIZE)");
    row("session bank, steady", p->bank_steady_bytes, "cache: beside one full window");
    row("session bank, idle", p->bank_idle_max_bytes, "cache: when no long context is live");
    row("bank floor", p->bank_floor_bytes, "the bank never yields below this");
    row("headroom", p->headroom_bytes, "unplanned");

    printf("\n  context  %lld tokens (machine fit %lld, model max %lld); KV %lld B/token as %s"
           " (%lld at 2 B/element)\n",
           (long long)p->context_window_resolved, (long long)p->context_window_fit,
           (long long)p->model_max_context, (long long)p->kv_bytes_per_token_effective,
           llmem_kv_format_name(p->kv_format), (long long)p->kv_bytes_per_token);
    printf("  pool     %lld tokens: %lld full window(s); %lld sequence(s), %lld tokens per step\n",
           (long long)p->pool_tokens, (long long)p->max_full_window_sequences,
           (long long)p->max_sequences, (long long)p->max_batch_tokens);
    if (a->have_working_set)
        printf("  bank     %s at a live working set of %s\n",
               llmem_size_format_short(dynamic_ceiling, s1, sizeof(s1)),
               llmem_size_format_short(a->working_set, s2, sizeof(s2)));

    /* With --budget the limits are derived against the simulated machine. */
    int64_t ceiling = llmem_plan_limits_ceiling(p);
    int ok = llmem_plan_limits_check(p, NULL, 0) == 0;
    printf("\n  limits   footprint %s < allocation limit %s < trip %s < ceiling %s",
           llmem_size_format_short(p->footprint_bytes, s1, sizeof(s1)),
           llmem_size_format_short(p->allocation_limit_bytes, s2, sizeof(s2)),
           llmem_size_format_short(p->trip_bytes, s3, sizeof(s3)),
           llmem_size_format_short(ceiling, line, sizeof(line)));
    printf(": %s\n", ok ? "holds" : "BROKEN");
    printf("  util     %.3f, band (%.3f, %.3f)%s\n", p->util, p->band_low, p->band_high,
           p->band_empty     ? ": EMPTY"
           : p->util_in_band ? ": inside"
                             : ": OUTSIDE");
    const char *verdict = p->overcommitted ? "OVERCOMMITTED"
                          : !p->model_fits ? LLMEM_PLAN_NO_FIT
                          : !ok            ? "fits, but the limits are unsafe"
                                           : "fits";
    printf("  verdict  %s\n", verdict);
    if (p->n_notes > 0)
        printf("\nnotes:\n");
    for (int i = 0; i < p->n_notes; i++)
        printf("  - %s\n", p->notes[i]);
}

int cli_plan(int argc, char **argv) {
    struct plan_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    if (a.list)
        return print_catalog(a.json);

    struct llmem_model_geometry geom, *g = NULL;
    if (a.model != NULL && (rc = resolve_model(a.model, a.dummy, &geom)) != CLI_OK)
        return rc;
    g = a.model != NULL ? &geom : NULL;
    const int gguf = g != NULL && llmem_gguf_is_gguf(a.model);
    if (a.weight_type > 0 && gguf)
        return cli_usage_error("plan", "--weight-type: %s is a GGUF file, whose types are its own",
                               a.model);
    if (a.weight_type > 0) { /* the experts' share priced by parameters from here on */
        geom.weights_bytes = llmem_gguf_weights_bytes(&geom, a.weight_type);
        geom.expert_bytes = 0;
    }

    struct llmem_model_geometry whole;
    if (g != NULL)
        whole = geom;
    if (a.tp > 1) { /* from here on one device's part */
        char why[200];
        if (llmem_geometry_tensor_rank(&whole, (int)a.tp, &geom, why, sizeof(why)) != LLMEM_OK)
            return cli_usage_error("plan", "--tensor-parallel %lld: %s: %s", (long long)a.tp,
                                   whole.name, why);
    }

    struct machine m = {.total = a.total, .ceiling = a.ceiling};
    if (a.total > 0) {
        snprintf(m.label, sizeof(m.label), "simulated (--total)");
    } else {
        if ((rc = probe_machine(&a, &m)) != CLI_OK)
            return rc;
        if (a.ceiling > 0)
            m.ceiling = a.ceiling;
    }
    if (a.ceiling > m.total) {
        char c1[32], c2[32];
        return cli_usage_error("plan",
                               "--ceiling %s is above the %s memory total %s: the ceiling "
                               "is what the process may have of it",
                               llmem_size_format_short(a.ceiling, c1, sizeof(c1)),
                               a.total > 0 ? "given" : "machine's",
                               llmem_size_format_short(m.total, c2, sizeof(c2)));
    }

    struct llmem_engine_config cfg;
    struct llmem_expert_placement placed = {0};
    llmem_engine_config_default(&cfg);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cpus > 0 ? (int)cpus : 1;
    const int64_t baseline = a.params.runtime_baseline_bytes;
    if (g != NULL) {
        /* what llmem run allocates with these settings: the forward pass's buffers, the
         * backend's scratch (on a host for the online CPUs, llmem run's default thread count)
         * and its prefill chunk */
        cfg.kv_format = a.params.kv_format;
        cfg.context = a.params.requested_context;
        cfg.budget_bytes = a.params.memory_budget_bytes;
        cfg.memory_limit_bytes = a.params.memory_limit_bytes;
        cfg.util = a.params.util;
        if (a.params.max_sequences > 0)
            cfg.max_sequences = a.params.max_sequences;
        cfg.max_batch_tokens = a.params.max_batch_tokens;
        cfg.backend = a.params.target == LLMEM_PLAN_CUDA ? LLMEM_BACKEND_CUDA : LLMEM_BACKEND_CPU;
        cfg.experts_on_host = a.experts_on_host;
        cfg.tensor_parallel = (int)a.tp; /* the plan of one device's share (geom from here on) */
        llmem_engine_plan_params(&cfg, &whole, m.total, m.ceiling, threads, &a.params, &placed);
    } else {
        a.params.weights_bytes = a.weights;
        a.params.kv_bytes_per_token = a.kv_bytes;
        a.params.model_max_context = a.max_context;
        a.params.total_bytes = m.total;
        a.params.ceiling_bytes = m.ceiling;
    }
    if (a.have_baseline)
        a.params.runtime_baseline_bytes = baseline;
    else
        a.params.runtime_baseline_bytes =
            a.total > 0 || a.params.target == LLMEM_PLAN_CUDA
                ? 0
                : measured_baseline(&a, &cfg, g != NULL ? g->vocab_size : 0, threads);

    struct llmem_plan plan;
    if (llmem_plan_compute(&a.params, &plan) != LLMEM_OK)
        return CLI_FAIL;
    /* a model of floats that does not fit: the largest weight type that does, named */
    int fits_at = 0;
    int64_t fits_weights = 0;
    static const int smaller[] = {LLMEM_GGUF_FTYPE_Q8_0, LLMEM_GGUF_FTYPE_Q6_K,
                                  LLMEM_GGUF_FTYPE_Q5_K_M, LLMEM_GGUF_FTYPE_Q4_K_M};
    for (size_t i = 0; g != NULL && !gguf && a.weight_type == 0 && plan.available &&
                       !plan.model_fits && !fits_at && i < sizeof(smaller) / sizeof(smaller[0]);
         i++) {
        struct llmem_plan_params p = a.params;
        struct llmem_plan q;
        p.weights_bytes = llmem_gguf_weights_bytes(g, smaller[i]);
        if (llmem_plan_compute(&p, &q) == LLMEM_OK && q.model_fits && !q.overcommitted)
            fits_at = smaller[i], fits_weights = p.weights_bytes;
    }
    int64_t dynamic_ceiling = llmem_plan_bank_dynamic_ceiling(&plan, a.working_set, 0);
    struct decode_estimate decode = {0};
    if (plan.available && plan.model_fits)
        estimate_decode(&a, &m, &plan, g, &placed, threads, &decode);

    if (a.svg != NULL && cli_plan_svg(&plan, a.svg) != CLI_OK)
        return CLI_FAIL;

    if (a.json) {
        cJSON *o = llmem_plan_json(&plan);
        if (o == NULL)
            return CLI_FAIL;
        int st = llmem_json_add_string(o, "machine", m.label);
        if (a.weight_type > 0)
            st |= llmem_json_add_string(o, "weight_type", llmem_gguf_ftype_name(a.weight_type));
        if (fits_at > 0) {
            st |= llmem_json_add_string(o, "fits_at_weight_type", llmem_gguf_ftype_name(fits_at));
            st |= llmem_json_add_int(o, "fits_at_weights_bytes", fits_weights);
        }
        if (a.have_working_set) {
            st |= llmem_json_add_int(o, "working_set_bytes", a.working_set);
            st |= llmem_json_add_int(o, "bank_dynamic_ceiling_bytes", dynamic_ceiling);
        }
        if (g != NULL) {
            cJSON *mo = cJSON_AddObjectToObject(o, "model");
            st |= mo == NULL || geometry_json(mo, &whole) != LLMEM_OK;
        }
        if (a.tp > 1) { /* what each device holds, which the plan is of */
            cJSON *d = cJSON_AddObjectToObject(o, "device_part");
            st |= llmem_json_add_int(o, "tensor_parallel", a.tp);
            st |= d == NULL || geometry_json(d, g) != LLMEM_OK;
        }
        if (placed.moe_layers > 0) {
            cJSON *eo = cJSON_AddObjectToObject(o, "experts");
            const struct {
                const char *key;
                int64_t v;
            } f[] = {{"moe_layers", placed.moe_layers},
                     {"host_layers", placed.host_layers},
                     {"forced", placed.forced},
                     {"layer_bytes", placed.layer_bytes},
                     {"device_weights_bytes", placed.device_weights_bytes},
                     {"host_bytes", placed.host_bytes},
                     {"device_read_bytes", placed.device_read_bytes},
                     {"host_read_bytes", placed.host_read_bytes}};
            st |= eo == NULL;
            for (size_t i = 0; eo != NULL && i < sizeof(f) / sizeof(f[0]); i++)
                st |= llmem_json_add_int(eo, f[i].key, f[i].v);
        }
        if (plan.available && plan.model_fits)
            st |= decode_json(o, &decode);
        if (st != 0) {
            cJSON_Delete(o);
            fprintf(stderr, "llmem plan: out of memory building the JSON output\n");
            return CLI_FAIL;
        }
        if (cli_print_json(o) != CLI_OK)
            return CLI_FAIL;
    } else {
        print_human(&plan, g != NULL ? &whole : NULL, a.tp > 1 ? g : NULL, m.label, &a,
                    dynamic_ceiling, &placed, &decode);
        char w[LLMEM_SIZE_STR_MAX];
        if (a.weight_type > 0)
            printf("  - planned as the %s GGUF file `llmem quantize` makes: weights %s\n",
                   llmem_gguf_ftype_name(a.weight_type),
                   llmem_size_format_short(g->weights_bytes, w, sizeof(w)));
        if (fits_at > 0)
            printf(
                "  - at %s the weights are %s and the model fits: `llmem quantize %s "
                "OUT.gguf --type %s` (or plan it: --weight-type %s)\n",
                llmem_gguf_ftype_name(fits_at), llmem_size_format_short(fits_weights, w, sizeof(w)),
                strchr(a.model, '/') != NULL || access(a.model, F_OK) == 0 ? a.model : "MODEL_DIR",
                llmem_gguf_ftype_name(fits_at), llmem_gguf_ftype_name(fits_at));
    }
    if (!plan.available) {
        fprintf(stderr, "llmem plan: memory plan unavailable (%s)\n", plan.unavailable_reason);
        return CLI_FAIL;
    }
    if (!plan.model_fits)
        return CLI_NOFIT;
    /* limits the plan itself calls unsafe are refused as `llmem run` refuses them */
    char why[256];
    if (llmem_plan_limits_check(&plan, why, sizeof(why)) != 0) {
        fprintf(stderr, "llmem plan: the limits are unsafe: %s\n", why);
        return CLI_NOFIT;
    }
    return CLI_OK;
}

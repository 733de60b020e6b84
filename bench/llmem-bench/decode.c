/*
 * bench/llmem-bench/decode.c — `llmem-bench decode MODEL`: end-to-end prefill and decode speed of a
 * real model through the engine, for each thread count asked, against the machine's read bandwidth
 * probed right before and right after every run (this machine's bandwidth drifts by 1.5× within
 * minutes, so each run is compared with its own neighbourhood).
 *
 * One run: a prompt of --prompt random tokens (ids 5 … vocab−1, seeded) prefilled in chunks of
 * 512, then --gen tokens decoded greedily with EOS ignored. --warmup untimed runs of at most 8
 * generated tokens go first (by default two on a device, whose decode steps become CUDA graphs on
 * their second and third use: a step with the host's tokens starts each run, fed ones follow).
 * Reported, as medians over --reps runs:
 *   prefill tokens/s and GFLOP/s: 2 × (the layers' matmul parameters) per token, plus attention
 *                                  (4 × head_dim × heads × layers per query-key pair, causal), plus
 *                                  one lm_head row set for the last token;
 *   decode tokens/s, and bytes/s: every token reads all matmul weights (layers and lm_head) and
 *                                  the KV of the tokens before it (at the run's mean length);
 *   fraction of read bandwidth:   decode bytes/s ÷ the median of the probes around the run;
 *   overhead per token:           measured time per token − bytes per token ÷ probed bandwidth,
 *                                  what dispatch and everything that is not streaming costs;
 *   device time per token:         (a backend that replays decode steps as graphs) the device's
 *                                  time per replayed step: the rest of a token's time is the
 *                                  host's (the step's bookkeeping, sampling, the logits' copy).
 * With --backend cuda the whole pass runs on the GPU, and the bandwidth is the device-to-device
 * copy's (bytes read + written) probed around each run: the fraction is then of that roofline.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "backend/ops.h"
#include "bench.h"
#include "cli/bandwidth.h"
#include "cli/common.h"
#include "core/json.h"
#include "llmem/pool.h"
#include "llmem/engine.h"
#include "llmem/size.h"

#define MAX_THREADS_LIST 8
#define MAX_REPS         32

struct decode_point {
    int threads;
    double prefill_tps, prefill_gflops, decode_tps, decode_gbps, bw_gbps, fraction, overhead_ms;
    double device_ms; /* the device's time per decode step replayed as a graph (0: none) */
    /* the allocator's peak on each device, and the plan's footprint of one (devices 0: one
     * allocator, mem_peak) */
    int devices;
    int64_t peak[LLMEM_SPLIT_MAX], footprint;
};

static void progress_tick(void *arg) {
    int64_t *p = arg;
    cli_progress("bench decode", ++p[0], p[1]);
}

/* Bytes of the matmul weights one decode step reads, and its FLOPs per prompt token. */
static void model_costs(const struct llmem_model_config *c, int64_t *weight_bytes,
                        double *flops_per_token) {
    const struct llmem_model_geometry *g = &c->geom;
    int64_t q = g->n_heads * g->head_dim, kv = g->n_kv_heads * g->head_dim;
    /* the matrices a token multiplies: attention, and a dense MLP or its k experts and router */
    const int64_t moe_layers = g->n_experts > 0 ? g->n_moe_layers : 0;
    int64_t params = g->n_layers * g->hidden_size * (2 * q + 2 * kv) +
                     (g->n_layers - moe_layers) * 3 * g->hidden_size * g->intermediate_size +
                     moe_layers * g->hidden_size *
                         (g->n_experts + 3 * g->n_experts_used * g->expert_intermediate);
    /* bytes a parameter as stored: 2 for bf16, a fraction for quantized files */
    const double per_param = (double)g->weights_bytes / (double)(g->n_params > 0 ? g->n_params : 1);
    *weight_bytes = (int64_t)((double)(params + g->vocab_size * g->hidden_size) * per_param);
    *flops_per_token = 2.0 * (double)params;
}

/* The bandwidth around a run: the host's read bandwidth, or a device's copy bandwidth (in *bw). */
static int probe(struct llmem_engine *e, struct llmem_pool *pool, struct bench_device_probe *dev,
                 int64_t bytes, double *bw, double *copy, int64_t *prog) {
    if (dev != NULL) {
        progress_tick(prog);
        if (bench_device_probe_run(dev, bw) != CLI_OK)
            return CLI_FAIL;
        *copy = *bw;
        return CLI_OK;
    }
    return cli_bandwidth(llmem_engine_mem(e), pool, bytes, 1, bw, copy, progress_tick, prog);
}

static const char usage[] =
    "usage: llmem-bench decode MODEL [options]\n"
    "\n"
    "Prefill and decode speed of MODEL, against the memory read bandwidth probed before and after\n"
    "each run.\n"
    "  --prompt N       prompt tokens (default 512)\n"
    "  --gen N          generated tokens (default 128)\n"
    "  --threads LIST   thread counts, e.g. 1,2 (default: the online CPUs)\n"
    "  --reps N         runs per thread count (default 3)\n"
    "  --warmup N       untimed runs of up to 8 generated tokens first (default 2 with --backend\n"
    "                   cuda: its decode steps recorded as graphs; 0 on the CPU)\n"
    "  --kv-format F    the KV format (default f16)\n"
    "  --bw-size SIZE   the bandwidth probe's buffer (default 512M; --backend cuda: two on the\n"
    "                   device, beside what the plan counts: small with --budget)\n"
    "  --no-mmap        read the weights into (huge-page) memory, as llmem run --no-mmap\n"
    "  --load-format F  auto (default), or dummy: seeded random bf16 weights from MODEL's\n"
    "                   config.json alone, as llmem run --load-format dummy\n"
    "  --backend B      cpu (default) or cuda: then against the device's copy bandwidth\n"
    "  --device N       the CUDA device (default 0)\n"
    "  --precision P    fast (default) or f32 (cuda: tensor cores; cpu: quantized and bf16\n"
    "                   weights)\n"
    "  --budget SIZE    plan as if the machine (the device with cuda) had SIZE, as llmem run\n"
    "  --experts-on-host N  cuda, a mixture of experts: the first N MoE layers' experts on the\n"
    "                   host, as llmem run (default: the plan's placement)\n"
    "  --tensor-parallel N  the model split over N ranks, as llmem run (cuda: N devices from\n"
    "                   --device)\n"
    "  --json           one JSON object: model, weights_bytes, points[] {threads, "
    "prefill_tokens_per_s,\n"
    "                   prefill_gflops, decode_tokens_per_s, decode_gbps, bandwidth_read_gbps,\n"
    "                   fraction_of_bandwidth, overhead_ms_per_token, device_ms_per_token}\n";

int bench_decode(int argc, char **argv) {
    enum {
        OPT_PROMPT = 256,
        OPT_GEN,
        OPT_THREADS,
        OPT_REPS,
        OPT_WARMUP,
        OPT_KV_FORMAT,
        OPT_BW,
        OPT_JSON,
        OPT_NO_MMAP,
        OPT_LOAD_FORMAT,
        OPT_BACKEND,
        OPT_DEVICE,
        OPT_PRECISION,
        OPT_BUDGET,
        OPT_EXPERTS_ON_HOST,
        OPT_TENSOR_PARALLEL,
        OPT_HELP
    };
    static const struct option opts[] = {
        {"prompt", required_argument, NULL, OPT_PROMPT},
        {"gen", required_argument, NULL, OPT_GEN},
        {"threads", required_argument, NULL, OPT_THREADS},
        {"reps", required_argument, NULL, OPT_REPS},
        {"warmup", required_argument, NULL, OPT_WARMUP},
        {"kv-format", required_argument, NULL, OPT_KV_FORMAT},
        {"bw-size", required_argument, NULL, OPT_BW},
        {"json", no_argument, NULL, OPT_JSON},
        {"no-mmap", no_argument, NULL, OPT_NO_MMAP},
        {"load-format", required_argument, NULL, OPT_LOAD_FORMAT},
        {"backend", required_argument, NULL, OPT_BACKEND},
        {"device", required_argument, NULL, OPT_DEVICE},
        {"precision", required_argument, NULL, OPT_PRECISION},
        {"budget", required_argument, NULL, OPT_BUDGET},
        {"experts-on-host", required_argument, NULL, OPT_EXPERTS_ON_HOST},
        {"tensor-parallel", required_argument, NULL, OPT_TENSOR_PARALLEL},
        {"help", no_argument, NULL, OPT_HELP},
        {NULL, 0, NULL, 0},
    };
    int64_t n_prompt = 512, n_gen = 128, reps = 3, bw_bytes = (int64_t)512 << 20;
    int threads[MAX_THREADS_LIST], n_threads = 0, json = 0, no_mmap = 0, dummy = 0;
    enum llmem_kv_format format = LLMEM_KV_FORMAT_F16;
    enum llmem_backend_kind backend = LLMEM_BACKEND_CPU;
    enum llmem_backend_precision precision = LLMEM_PRECISION_FAST;
    int64_t device = 0, warmup = -1; /* -1: by the backend */
    int64_t budget = 0, experts_on_host = -1;
    struct llmem_engine_config split; /* --tensor-parallel, parsed as llmem run parses it */
    llmem_engine_config_default(&split);
    optind = 1;
    opterr = 0;
    int c, rc = CLI_OK;
    while (rc == CLI_OK && (c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case OPT_PROMPT: rc = cli_parse_int("--prompt", optarg, 1, 1 << 20, &n_prompt); break;
        case OPT_GEN: rc = cli_parse_int("--gen", optarg, 1, 1 << 20, &n_gen); break;
        case OPT_REPS: rc = cli_parse_int("--reps", optarg, 1, MAX_REPS, &reps); break;
        case OPT_WARMUP: rc = cli_parse_int("--warmup", optarg, 0, MAX_REPS, &warmup); break;
        case OPT_BW: rc = cli_parse_size("--bw-size", optarg, &bw_bytes); break;
        case OPT_JSON: json = 1; break;
        case OPT_NO_MMAP: no_mmap = 1; break;
        case OPT_LOAD_FORMAT:
            if (strcmp(optarg, "auto") != 0 && strcmp(optarg, "dummy") != 0)
                rc = cli_usage_error("decode", "--load-format: '%s' is not auto or dummy", optarg);
            dummy = strcmp(optarg, "dummy") == 0;
            break;
        case OPT_BACKEND:
            if (llmem_backend_kind_parse(optarg, &backend) != LLMEM_OK)
                rc = CLI_USAGE;
            break;
        case OPT_DEVICE: rc = cli_parse_int("--device", optarg, 0, 1024, &device); break;
        case OPT_BUDGET: rc = cli_parse_positive_size("--budget", optarg, &budget); break;
        case OPT_EXPERTS_ON_HOST:
            rc = cli_parse_int("--experts-on-host", optarg, 0, 1 << 20, &experts_on_host);
            break;
        case OPT_TENSOR_PARALLEL:
            rc = cli_engine_option(CLI_OPT_TENSOR_PARALLEL, optarg, &split);
            break;
        case OPT_PRECISION:
            if (llmem_backend_precision_parse(optarg, &precision) != LLMEM_OK)
                rc = CLI_USAGE;
            break;
        case OPT_KV_FORMAT:
            if (llmem_kv_format_parse(optarg, &format) != LLMEM_OK)
                rc = CLI_USAGE;
            break;
        case OPT_THREADS:
            for (char *p = optarg; rc == CLI_OK && *p;) {
                char *end = NULL;
                long v = strtol(p, &end, 10);
                if (end == p || v < 1 || v > 1024 || n_threads == MAX_THREADS_LIST ||
                    (*end != ',' && *end != '\0'))
                    rc =
                        cli_usage_error("decode", "--threads: '%s' is not a list like 1,2", optarg);
                else
                    threads[n_threads++] = (int)v;
                p = *end == ',' ? end + 1 : end;
            }
            break;
        case 'h':
        case OPT_HELP: fputs(usage, stdout); return CLI_OK;
        case ':': rc = cli_usage_error("decode", "%s needs a value", argv[optind - 1]); break;
        default:
            rc = cli_usage_error("decode", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (rc != CLI_OK)
        return rc;
    if (optind != argc - 1)
        return cli_usage_error("decode", "needs one MODEL directory (see --help)");
    if (n_threads == 0)
        threads[n_threads++] = 0;
    const char *model = argv[optind];
    if (warmup < 0) /* a device's decode steps are recorded as graphs the first times they run */
        warmup = backend == LLMEM_BACKEND_CUDA ? 2 : 0;

    struct decode_point points[MAX_THREADS_LIST];
    int64_t prog[2] = {0, (int64_t)n_threads * (reps * 3 + warmup)};
    struct llmem_engine *e = NULL;
    struct llmem_pool *pool = NULL;
    struct bench_device_probe *dprobe = NULL; /* the device's probe (--backend cuda) */
    int32_t *prompt = malloc((size_t)n_prompt * sizeof(int32_t));
    int64_t weight_bytes = 0;
    double flops_per_token = 0;
    rc = CLI_FAIL;
    if (prompt == NULL)
        goto out;
    for (int t = 0; t < n_threads; t++) {
        struct llmem_engine_config cfg;
        llmem_engine_config_default(&cfg);
        cfg.model_dir = model;
        cfg.n_threads = threads[t];
        cfg.kv_format = format;
        cfg.no_mmap = no_mmap;
        cfg.load_dummy = dummy;
        cfg.backend = backend;
        cfg.device = (int)device;
        cfg.precision = precision;
        cfg.budget_bytes = budget;
        cfg.experts_on_host = experts_on_host;
        cfg.tensor_parallel = split.tensor_parallel;
        cfg.no_bank = 1; /* every run prefills its whole prompt */
        cfg.context = n_prompt + n_gen + 1;
        if (llmem_engine_open(&cfg, NULL, NULL, &e) != LLMEM_OK)
            goto out;
        pool = llmem_engine_pool(e); /* the probe runs on the engine's own threads */
        /* the device's probe: its buffers held from here to the end (see cli.h) */
        if (backend == LLMEM_BACKEND_CUDA && dprobe == NULL &&
            bench_device_probe_open((int)device, bw_bytes, &dprobe) != CLI_OK)
            goto out;
        const struct llmem_model_config *mc = llmem_model_get_config(llmem_engine_model(e));
        model_costs(mc, &weight_bytes, &flops_per_token);
        const struct llmem_model_geometry *g = &mc->geom;
        uint64_t x = 99;
        for (int64_t i = 0; i < n_prompt; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            prompt[i] = (int32_t)(5 + (int64_t)(x >> 33) % (g->vocab_size - 5));
        }
        double kv_token =
            (double)llmem_kv_token_bytes(&(struct llmem_kv_config){.format = format,
                                                                   .n_layers = (int)g->n_layers,
                                                                   .n_kv_heads = (int)g->n_kv_heads,
                                                                   .head_dim = (int)g->head_dim});
        double attn_flops = 4.0 * (double)(g->n_heads * g->head_dim * g->n_layers) *
                            (double)n_prompt * (double)(n_prompt + 1) / 2.0;
        /* a split's costs are a rank's share: one device's; on the host every rank's */
        const double shares =
            backend == LLMEM_BACKEND_CPU && split.tensor_parallel > 1 ? split.tensor_parallel : 1;
        weight_bytes = (int64_t)(shares * (double)weight_bytes);
        flops_per_token *= shares, kv_token *= shares, attn_flops *= shares;
        double bytes_per_token = (double)weight_bytes + kv_token * ((double)n_prompt + n_gen / 2.0);
        double pre[MAX_REPS], gfl[MAX_REPS], dec[MAX_REPS], bw[MAX_REPS], frac[MAX_REPS],
            over[MAX_REPS], dev[MAX_REPS];
        struct llmem_backend *be = llmem_engine_backend(e);
        struct llmem_backend_counters c0 = {0}, c1 = {0};
        for (int64_t w = 0; w < warmup; w++) { /* untimed */
            struct llmem_generate_params p;
            llmem_generate_params_default(&p);
            p.max_tokens = n_gen < 8 ? n_gen : 8;
            p.ignore_eos = 1;
            struct llmem_generate_result res;
            if (llmem_engine_generate(e, prompt, n_prompt, &p, NULL, NULL, &res) != LLMEM_OK)
                goto out;
            llmem_generate_result_free(&res);
            progress_tick(prog);
        }
        for (int64_t r = 0; r < reps; r++) {
            double rd[2], cp[2];
            if (probe(e, pool, dprobe, bw_bytes, &rd[0], &cp[0], prog) != CLI_OK)
                goto out;
            struct llmem_generate_params p;
            llmem_generate_params_default(&p);
            p.max_tokens = n_gen;
            p.ignore_eos = 1;
            struct llmem_generate_result res;
            if (be->ops->counters != NULL)
                be->ops->counters(be->ctx, &c0);
            if (llmem_engine_generate(e, prompt, n_prompt, &p, NULL, NULL, &res) != LLMEM_OK)
                goto out;
            if (be->ops->counters != NULL)
                be->ops->counters(be->ctx, &c1);
            const int64_t replays = c1.graphs_replayed - c0.graphs_replayed;
            dev[r] = replays > 0 ? (c1.graphs_device_s - c0.graphs_device_s) / replays * 1e3 : 0;
            progress_tick(prog);
            if (probe(e, pool, dprobe, bw_bytes, &rd[1], &cp[1], prog) != CLI_OK) {
                llmem_generate_result_free(&res);
                goto out;
            }
            pre[r] = (double)n_prompt / res.prefill_s;
            gfl[r] = ((double)n_prompt * flops_per_token + attn_flops +
                      2.0 * (double)(g->vocab_size * g->hidden_size)) /
                     res.prefill_s * 1e-9;
            dec[r] = (double)res.decode_tokens / res.decode_s;
            bw[r] = (rd[0] + rd[1]) / 2;
            frac[r] = bytes_per_token * dec[r] * 1e-9 / bw[r];
            over[r] = (1.0 / dec[r] - bytes_per_token / (bw[r] * 1e9)) * 1e3;
            llmem_generate_result_free(&res);
        }
        struct decode_point *pt = &points[t];
        pt->threads = threads[t] > 0 ? threads[t] : llmem_pool_threads(pool);
        pt->prefill_tps = bench_median(pre, (int)reps);
        pt->prefill_gflops = bench_median(gfl, (int)reps);
        pt->decode_tps = bench_median(dec, (int)reps);
        pt->decode_gbps = pt->decode_tps * bytes_per_token * 1e-9;
        pt->bw_gbps = bench_median(bw, (int)reps);
        pt->fraction = bench_median(frac, (int)reps);
        pt->overhead_ms = bench_median(over, (int)reps);
        pt->device_ms = bench_median(dev, (int)reps);
        struct llmem_engine_metrics m;
        llmem_engine_metrics(e, &m);
        pt->devices = m.n_devices;
        pt->peak[0] = m.mem_peak;
        for (int d = 0; d < m.n_devices && d < LLMEM_SPLIT_MAX; d++)
            pt->peak[d] = m.devices[d].peak;
        pt->footprint = llmem_engine_plan(e)->footprint_bytes;
        llmem_engine_close(e);
        e = NULL;
    }
    cli_progress_done();
    if (json) {
        cJSON *root = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(root, "points");
        int bad = root == NULL || arr == NULL || llmem_json_add_string(root, "model", model) ||
                  llmem_json_add_int(root, "prompt_tokens", n_prompt) ||
                  llmem_json_add_int(root, "generated_tokens", n_gen) ||
                  llmem_json_add_int(root, "decode_weight_bytes_per_token", weight_bytes) ||
                  llmem_json_add_string(root, "backend",
                                        backend == LLMEM_BACKEND_CUDA ? "cuda" : "cpu") ||
                  llmem_json_add_string(root, "bandwidth",
                                        backend == LLMEM_BACKEND_CUDA ? "copy" : "read");
        for (int t = 0; !bad && t < n_threads; t++) {
            const struct decode_point *pt = &points[t];
            cJSON *o = cJSON_CreateObject();
            bad = o == NULL || !cJSON_AddItemToArray(arr, o) ||
                  llmem_json_add_int(o, "threads", pt->threads) ||
                  llmem_json_add_double(o, "prefill_tokens_per_s", pt->prefill_tps) ||
                  llmem_json_add_double(o, "prefill_gflops", pt->prefill_gflops) ||
                  llmem_json_add_double(o, "decode_tokens_per_s", pt->decode_tps) ||
                  llmem_json_add_double(o, "decode_gbps", pt->decode_gbps) ||
                  llmem_json_add_double(o, "bandwidth_read_gbps", pt->bw_gbps) ||
                  llmem_json_add_double(o, "fraction_of_bandwidth", pt->fraction) ||
                  llmem_json_add_double(o, "overhead_ms_per_token", pt->overhead_ms) ||
                  (pt->device_ms > 0 &&
                   llmem_json_add_double(o, "device_ms_per_token", pt->device_ms)) ||
                  llmem_json_add_int(o, "planned_footprint_bytes", pt->footprint);
            cJSON *peaks = bad ? NULL : cJSON_AddArrayToObject(o, "allocator_peak_bytes");
            bad = bad || peaks == NULL;
            for (int d = 0; !bad && d < (pt->devices > 0 ? pt->devices : 1); d++)
                bad = !cJSON_AddItemToArray(peaks, cJSON_CreateNumber((double)pt->peak[d]));
        }
        if (bad) {
            cJSON_Delete(root);
            goto out;
        }
        rc = cli_print_json(root);
    } else {
        char wb[32];
        printf("llmem-bench decode: %s%s, prompt %" PRId64 ", %" PRId64
               " generated, KV %s; decode reads %s of weights per token; median of %" PRId64
               " runs\n",
               model, no_mmap ? " (--no-mmap)" : "", n_prompt, n_gen, llmem_kv_format_name(format),
               llmem_size_format_short(weight_bytes, wb, sizeof(wb)), reps);
        printf("threads  prefill tok/s  GFLOP/s  decode tok/s   GB/s  %s bw GB/s  of bw  "
               "overhead ms/tok%s\n",
               backend == LLMEM_BACKEND_CUDA ? "copy" : "read",
               backend == LLMEM_BACKEND_CUDA ? "  device ms/tok" : "");
        for (int t = 0; t < n_threads; t++) {
            const struct decode_point *pt = &points[t];
            printf("%7d  %13.1f  %7.1f  %12.1f  %5.1f  %12.1f  %4.0f%%  %15.3f", pt->threads,
                   pt->prefill_tps, pt->prefill_gflops, pt->decode_tps, pt->decode_gbps,
                   pt->bw_gbps, 100 * pt->fraction, pt->overhead_ms);
            if (backend == LLMEM_BACKEND_CUDA)
                printf("  %14.3f", pt->device_ms);
            printf("\n");
        }
        /* the last point's allocators against the plan (each device's, of a split) */
        const struct decode_point *pt = &points[n_threads - 1];
        char fb[32], pb[32];
        printf("allocator peak%s:", pt->devices > 0 ? " per device" : "");
        for (int d = 0; d < (pt->devices > 0 ? pt->devices : 1); d++)
            printf(" %s", llmem_size_format_short(pt->peak[d], pb, sizeof(pb)));
        printf(" (planned footprint %s)\n", llmem_size_format_short(pt->footprint, fb, sizeof(fb)));
        rc = CLI_OK;
    }
out:
    cli_progress_done();
    free(prompt);
    bench_device_probe_close(dprobe);
    llmem_engine_close(e);
    return rc;
}

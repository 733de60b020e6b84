/*
 * bench/llmem-bench/serve.c — `llmem-bench serve MODEL`: throughput and time to first token of the
 * HTTP server under concurrent clients, and what prefix reuse (the session bank) gains.
 *
 * The server runs in this process on a free loopback port (llmem/server.h); client threads talk
 * to it over real sockets. Each client sends streaming completions one after another (a closed
 * loop) until the run's requests are done. A prompt is token ids (random, seeded; so every prompt
 * has exactly the length asked) and every request generates exactly --max-tokens tokens (EOS
 * ignored); one unmeasured request goes first. Per request: TTFT = first SSE event − request sent;
 * inter-token latency = (last event − first event) / (tokens − 1). Per run: tokens/s = generated
 * tokens / wall time (the prompts' prefill included); decode/s = the clients streaming at once ÷
 * the mean inter-token latency (the generation alone, as llama-batched-bench's S_TG counts it);
 * TTFT p50 and p99 over its requests (p99 is the largest below 100 requests);
 * the scheduler's steps ("pf": those that prefill a prompt's chunk): wall time per step, the
 * scheduler's own time in a step ("sched") and of that the forward pass's ("forward"; "fwd pf" in
 * a step that prefills), and on a device with graphs the device's time per decode step replayed
 * ("dev ms").
 *
 * The prefix workload sends prompts of S shared tokens + P distinct ones, against a run with the
 * same lengths where nothing is shared (each prompt starts with its own S tokens); one unmeasured
 * request first in both, the caches cleared between runs.
 */
#include <arpa/inet.h>
#include <getopt.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "backend/ops.h"
#include "bench.h"
#include "core/clock.h"
#include "core/file.h"
#include "cli/common.h"
#include "core/json.h"
#include "llmem/pool.h"
#include "llmem/engine.h"
#include "llmem/server.h"
#include "llmem/sys.h"

#define MAX_CLIENT_LIST 8

/* ---- one request over HTTP ------------------------------------------------------------------- */

struct outcome {
    int ok;
    double ttft_s, itl_s;
    int64_t tokens;
};

/* Sends body to POST /v1/completions as HTTP/1.0 (the answer ends at EOF) and times the stream. */
static struct outcome request(int port, const char *body) {
    struct outcome o = {0};
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    double t0 = llmem_clock_s(), first = 0, last = 0;
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        if (fd >= 0)
            close(fd);
        return o;
    }
    char head[256];
    size_t len = strlen(body);
    int hn = snprintf(head, sizeof(head),
                      "POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: "
                      "application/json\r\nContent-Length: %zu\r\n\r\n",
                      len);
    if (write(fd, head, (size_t)hn) != hn || write(fd, body, len) != (ssize_t)len) {
        close(fd);
        return o;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    int events = 0;
    while (buf != NULL) {
        if (n + 4096 + 1 > cap) {
            char *b = realloc(buf, cap *= 2);
            if (b == NULL)
                break;
            buf = b;
        }
        ssize_t got = read(fd, buf + n, cap - n - 1);
        if (got <= 0)
            break;
        double now = llmem_clock_s();
        size_t from = n >= 7 ? n - 7 : 0; /* an event marker split across reads */
        n += (size_t)got;
        buf[n] = '\0';
        for (char *p = buf + from; (p = strstr(p, "data: {")) != NULL; p += 7) {
            if (first == 0)
                first = now;
            last = now;
            events++;
        }
    }
    close(fd);
    if (buf != NULL && strncmp(buf, "HTTP/1.", 7) == 0 && atoi(buf + 9) == 200) {
        const char *u = strstr(buf, "\"completion_tokens\":");
        o.tokens = u != NULL ? strtoll(u + 20, NULL, 10) : 0;
        o.ok = first > 0 && o.tokens > 0;
        o.ttft_s = first - t0;
        o.itl_s = o.tokens > 1 ? (last - first) / (double)(o.tokens - 1) : 0;
    }
    free(buf);
    return o;
}

/* ---- a run: clients in a closed loop --------------------------------------------------------- */

struct run {
    int port;
    char **bodies; /* one per request */
    int n_requests;
    pthread_mutex_t mu;
    int next;
    struct outcome *out;
};

static void *client(void *arg) {
    struct run *r = arg;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        int i = r->next < r->n_requests ? r->next++ : -1;
        pthread_mutex_unlock(&r->mu);
        if (i < 0)
            return NULL;
        r->out[i] = request(r->port, r->bodies[i]);
    }
}

struct stats {
    int clients, requests, failed;
    int64_t tokens, prefilled, reused, steps, prefill_steps;
    double wall_s, tokens_per_s, requests_per_s, ttft_p50_ms, ttft_p99_ms, itl_ms;
    double decode_per_s;       /* the concurrent streams ÷ the inter-token latency */
    double step_ms;            /* wall time per scheduler step */
    double sched_ms;           /* the scheduler's time in a step */
    double forward_ms;         /* of which in the forward pass */
    double forward_prefill_ms; /* the forward pass of a step that prefills (a prompt's chunk) */
    double device_ms;          /* a device's time per decode step replayed as a graph; 0: none */
    int64_t replayed, recorded, missed; /* decode steps replayed, recorded, not matched */
    int64_t masked, masks_late; /* device steps with grammars' masks; of which they came last */
};

/* The backend's graph counters so far (zeros without graphs). */
static struct llmem_backend_counters graphs(struct llmem_engine *e) {
    const struct llmem_backend *be = llmem_engine_backend(e);
    struct llmem_backend_counters c = {0};
    if (be->ops->counters != NULL)
        be->ops->counters(be->ctx, &c);
    return c;
}

static double percentile(double *v, int n, double q) {
    for (int i = 1; i < n; i++) /* insertion sort: n is small */
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    int k = (int)(q * (double)(n - 1) + 0.5);
    return n > 0 ? v[k < n ? k : n - 1] : 0;
}

static int run_clients(struct llmem_engine *e, int port, char **bodies, int n, int clients,
                       struct stats *st) {
    struct run r = {.port = port, .bodies = bodies, .n_requests = n};
    r.out = calloc((size_t)n, sizeof(*r.out));
    pthread_t *th = calloc((size_t)clients, sizeof(*th));
    double *ttft = calloc((size_t)n, sizeof(double));
    if (r.out == NULL || th == NULL || ttft == NULL) {
        free(r.out), free(th), free(ttft);
        return CLI_FAIL;
    }
    pthread_mutex_init(&r.mu, NULL);
    struct llmem_engine_metrics m0, m1;
    struct llmem_backend_counters g0, g1;
    llmem_engine_metrics(e, &m0);
    g0 = graphs(e);
    double t0 = llmem_clock_s();
    int started = 0;
    for (; started < clients; started++)
        if (pthread_create(&th[started], NULL, client, &r) != 0)
            break;
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    double wall = llmem_clock_s() - t0;
    llmem_engine_metrics(e, &m1);
    g1 = graphs(e);
    *st = (struct stats){.clients = clients,
                         .requests = n,
                         .wall_s = wall,
                         .steps = m1.steps - m0.steps,
                         .prefill_steps = m1.prefill_steps - m0.prefill_steps,
                         .replayed = g1.graphs_replayed - g0.graphs_replayed,
                         .recorded = g1.graphs_recorded - g0.graphs_recorded,
                         .missed = g1.graphs_missed - g0.graphs_missed,
                         .masked = m1.masked_steps - m0.masked_steps,
                         .masks_late = m1.masks_late - m0.masks_late};
    if (st->replayed > 0)
        st->device_ms = (g1.graphs_device_s - g0.graphs_device_s) / (double)st->replayed * 1e3;
    if (st->steps > 0) {
        st->step_ms = wall / (double)st->steps * 1e3;
        st->sched_ms = (m1.step_seconds - m0.step_seconds) / (double)st->steps * 1e3;
        st->forward_ms = (m1.forward_seconds - m0.forward_seconds) / (double)st->steps * 1e3;
    }
    if (st->prefill_steps > 0)
        st->forward_prefill_ms = (m1.prefill_forward_seconds - m0.prefill_forward_seconds) /
                                 (double)st->prefill_steps * 1e3;
    double itl = 0;
    int ok = 0;
    for (int i = 0; i < n; i++) {
        if (!r.out[i].ok) {
            st->failed++;
            continue;
        }
        st->tokens += r.out[i].tokens;
        ttft[ok++] = r.out[i].ttft_s;
        itl += r.out[i].itl_s;
    }
    st->tokens_per_s = (double)st->tokens / wall;
    st->requests_per_s = (double)ok / wall;
    st->ttft_p50_ms = percentile(ttft, ok, 0.50) * 1e3;
    st->ttft_p99_ms = percentile(ttft, ok, 0.99) * 1e3;
    st->itl_ms = ok > 0 ? itl / ok * 1e3 : 0;
    if (st->itl_ms > 0)
        st->decode_per_s = (double)(clients < ok ? clients : ok) / (st->itl_ms / 1e3);
    st->reused = m1.reused_tokens - m0.reused_tokens;
    st->prefilled = m1.prompt_tokens - m0.prompt_tokens - st->reused;
    pthread_mutex_destroy(&r.mu);
    free(r.out);
    free(th);
    free(ttft);
    return started == clients ? CLI_OK : CLI_FAIL;
}

/* ---- prompts --------------------------------------------------------------------------------- */

static uint64_t next_rand(uint64_t *s) {
    *s += 0x9E3779B97F4A7C15ull;
    uint64_t x = *s;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* What every request of the command asks beside its prompt: a temperature (its seed the
 * prompt's), and a response_format fragment (", \"response_format\": …", or ""). */
static double temperature;
static const char *format_field = "", *format_arg = "none";

/* A request body: a prompt of `shared` ids from seed_shared then `own` ids from seed_own. */
static char *body_of(int64_t vocab, int64_t shared, uint64_t seed_shared, int64_t own,
                     uint64_t seed_own, int64_t max_tokens) {
    const uint64_t seed = seed_own;
    size_t cap = (size_t)(shared + own) * 8 + 256 + strlen(format_field);
    char *b = malloc(cap);
    if (b == NULL)
        return NULL;
    size_t at = (size_t)snprintf(b, cap, "{\"prompt\": [");
    for (int64_t i = 0; i < shared + own; i++) {
        uint64_t *s = i < shared ? &seed_shared : &seed_own;
        at += (size_t)snprintf(b + at, cap - at, "%s%" PRIu64, i ? "," : "",
                               5 + next_rand(s) % (uint64_t)(vocab - 5));
    }
    snprintf(b + at, cap - at,
             "], \"max_tokens\": %" PRId64 ", \"temperature\": %g, \"seed\": %" PRIu64
             ", \"ignore_eos\": true, \"stream\": true, \"stream_options\": "
             "{\"include_usage\": true}%s}",
             max_tokens, temperature, seed % 1000000007u, format_field);
    return b;
}

static void free_bodies(char **b, int n) {
    for (int i = 0; b != NULL && i < n; i++)
        free(b[i]);
    free(b);
}

/* ---- the command ----------------------------------------------------------------------------- */

enum {
    OPT_CLIENTS = CLI_OPT_ENGINE_END,
    OPT_REQUESTS,
    OPT_PROMPT,
    OPT_GEN,
    OPT_SHARED,
    OPT_PREFIX_CLIENTS,
    OPT_MAX_SEQUENCES,
    OPT_TEMPERATURE,
    OPT_RESPONSE_FORMAT,
    OPT_JSON,
    OPT_HELP
};

static const struct option options[] = {
    CLI_ENGINE_OPTIONS,
    {"clients", required_argument, NULL, OPT_CLIENTS},
    {"requests", required_argument, NULL, OPT_REQUESTS},
    {"prompt-tokens", required_argument, NULL, OPT_PROMPT},
    {"max-tokens", required_argument, NULL, OPT_GEN},
    {"shared-prefix", required_argument, NULL, OPT_SHARED},
    {"prefix-clients", required_argument, NULL, OPT_PREFIX_CLIENTS},
    {"max-sequences", required_argument, NULL, OPT_MAX_SEQUENCES},
    {"temperature", required_argument, NULL, OPT_TEMPERATURE},
    {"response-format", required_argument, NULL, OPT_RESPONSE_FORMAT},
    {"json", no_argument, NULL, OPT_JSON},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

static const char usage[] =
    "usage: llmem-bench serve MODEL [options]\n"
    "\n"
    "Throughput and time to first token of the HTTP server (in this process, on a loopback port)\n"
    "under concurrent streaming clients, and the gain of prefix reuse: tokens/s over the whole\n"
    "run, prefill included, and decode/s, the clients streaming at once over the time between\n"
    "their tokens (the generation alone). Per run also the\n"
    "scheduler's steps (pf: those that prefill a prompt's chunk), wall ms per step, the\n"
    "scheduler's and the forward pass's ms in a step (fwd pf: in a step that prefills), and\n"
    "on a device the device's ms per decode step replayed as a graph, and how many were.\n"
    "  --clients LIST       concurrent clients, one run each (default 1,4,16)\n"
    "  --requests N         requests per run (default 4 per client, at least 8)\n"
    "  --prompt-tokens P    prompt length (default 128)\n"
    "  --max-tokens M       tokens generated per request, EOS ignored (default 128)\n"
    "  --shared-prefix S    the prefix workload: S shared + P distinct prompt tokens, against\n"
    "                       the same lengths with nothing shared (default 1024; 0: skip)\n"
    "  --prefix-clients N   clients of the prefix workload (default 4)\n"
    "  --max-sequences N    requests decoded together (default 16)\n"
    "  --temperature T      sampling temperature (default 0: greedy), a seed per request\n"
    "  --response-format F  constrained decoding: json_object, or FILE holding a JSON Schema\n"
    "                       (json_schema); every request's output under it\n"
    "  --json               one JSON object on stdout\n";

/* --response-format: format_field for json_object, or for the schema the file holds. */
static int response_format(const char *arg) {
    static char field[1 << 16];
    if (strcmp(arg, "json_object") == 0) {
        snprintf(field, sizeof(field), ", \"response_format\": {\"type\": \"json_object\"}");
        format_field = field;
        return CLI_OK;
    }
    char *text = NULL;
    size_t len = 0;
    cJSON *schema = NULL;
    if (llmem_file_read(arg, 1 << 20, &text, &len) != LLMEM_OK ||
        (schema = cJSON_ParseWithLength(text, len)) == NULL) {
        free(text);
        return cli_usage_error("serve", "--response-format: '%s' is not json_object or a file "
                                        "holding a JSON Schema", arg);
    }
    char *s = cJSON_PrintUnformatted(schema);
    int n = s != NULL ? snprintf(field, sizeof(field),
                                 ", \"response_format\": {\"type\": \"json_schema\", "
                                 "\"json_schema\": {\"name\": \"bench\", \"schema\": %s}}",
                                 s)
                      : -1;
    cJSON_free(s), cJSON_Delete(schema), free(text);
    if (n < 0 || (size_t)n >= sizeof(field))
        return cli_usage_error("serve", "--response-format: the schema in '%s' is too long", arg);
    format_field = field;
    return CLI_OK;
}

static int parse_list(const char *s, int *v, int *n) {
    *n = 0;
    for (const char *p = s; *p && *n < MAX_CLIENT_LIST;) {
        char *end = NULL;
        long x = strtol(p, &end, 10);
        if (end == p || x < 1 || x > 1024 || (*end != ',' && *end != '\0'))
            return cli_usage_error("serve", "--clients: '%s' is not a list like 1,4,16", s);
        v[(*n)++] = (int)x;
        p = *end == ',' ? end + 1 : end;
    }
    return *n > 0 ? CLI_OK : cli_usage_error("serve", "--clients: empty list");
}

static cJSON *stats_json(const struct stats *s, const char *workload) {
    cJSON *o = cJSON_CreateObject();
    if (o == NULL || (workload != NULL && llmem_json_add_string(o, "workload", workload)) ||
        llmem_json_add_int(o, "clients", s->clients) ||
        llmem_json_add_int(o, "requests", s->requests) ||
        llmem_json_add_int(o, "failed", s->failed) ||
        llmem_json_add_int(o, "generated_tokens", s->tokens) ||
        llmem_json_add_int(o, "prefilled_tokens", s->prefilled) ||
        llmem_json_add_int(o, "reused_tokens", s->reused) ||
        llmem_json_add_double(o, "wall_s", s->wall_s) ||
        llmem_json_add_double(o, "tokens_per_s", s->tokens_per_s) ||
        llmem_json_add_double(o, "decode_tokens_per_s", s->decode_per_s) ||
        llmem_json_add_double(o, "requests_per_s", s->requests_per_s) ||
        llmem_json_add_double(o, "ttft_p50_ms", s->ttft_p50_ms) ||
        llmem_json_add_double(o, "ttft_p99_ms", s->ttft_p99_ms) ||
        llmem_json_add_double(o, "inter_token_ms", s->itl_ms) ||
        llmem_json_add_int(o, "steps", s->steps) ||
        llmem_json_add_double(o, "step_ms", s->step_ms) ||
        llmem_json_add_double(o, "scheduler_ms_per_step", s->sched_ms) ||
        llmem_json_add_double(o, "forward_ms_per_step", s->forward_ms) ||
        llmem_json_add_int(o, "prefill_steps", s->prefill_steps) ||
        llmem_json_add_double(o, "forward_ms_per_prefill_step", s->forward_prefill_ms) ||
        llmem_json_add_double(o, "device_ms_per_decode_step", s->device_ms) ||
        llmem_json_add_int(o, "graphs_replayed", s->replayed) ||
        llmem_json_add_int(o, "graphs_recorded", s->recorded) ||
        llmem_json_add_int(o, "graphs_missed", s->missed) ||
        llmem_json_add_int(o, "masked_steps", s->masked) ||
        llmem_json_add_int(o, "masks_late", s->masks_late)) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

static void print_row(const char *label, const struct stats *s) {
    char dev[16] = "-";
    if (s->device_ms > 0)
        snprintf(dev, sizeof(dev), "%.3f", s->device_ms);
    printf("%-9s %7d %8d %9" PRId64 " %8" PRId64 " %9.1f %9.1f %7.2f %10.1f %10.1f %7.2f %7" PRId64
           " %7" PRId64 " %7.3f %7.3f %7.3f %7.3f %7s %7" PRId64 "%s\n",
           label, s->clients, s->requests, s->prefilled, s->reused, s->tokens_per_s,
           s->decode_per_s, s->requests_per_s, s->ttft_p50_ms, s->ttft_p99_ms, s->itl_ms, s->steps,
           s->prefill_steps, s->step_ms, s->sched_ms, s->forward_ms, s->forward_prefill_ms, dev,
           s->replayed, s->failed ? "  (some failed)" : "");
    if (s->masked > 0)
        printf("%-9s grammars' masks on the device: %" PRId64 " steps, %" PRId64
               " of them ready only after it had finished the step\n",
               "", s->masked, s->masks_late);
}

int bench_serve(int argc, char **argv) {
    struct llmem_engine_config ec;
    llmem_engine_config_default(&ec);
    ec.max_sequences = 16;
    int clients[MAX_CLIENT_LIST] = {1, 4, 16}, n_clients = 3, json = 0, c, rc = CLI_OK;
    int64_t requests = 0, prompt = 128, gen = 128, shared = 1024, prefix_clients = 4;
    optind = 1;
    opterr = 0;
    while (rc == CLI_OK && (c = getopt_long(argc, argv, ":h", options, NULL)) != -1) {
        switch (c) {
        case OPT_CLIENTS: rc = parse_list(optarg, clients, &n_clients); break;
        case OPT_REQUESTS: rc = cli_parse_int("--requests", optarg, 1, 1 << 20, &requests); break;
        case OPT_PROMPT: rc = cli_parse_int("--prompt-tokens", optarg, 1, 1 << 20, &prompt); break;
        case OPT_GEN: rc = cli_parse_int("--max-tokens", optarg, 1, 1 << 20, &gen); break;
        case OPT_SHARED: rc = cli_parse_int("--shared-prefix", optarg, 0, 1 << 20, &shared); break;
        case OPT_PREFIX_CLIENTS:
            rc = cli_parse_int("--prefix-clients", optarg, 1, 1024, &prefix_clients);
            break;
        case OPT_MAX_SEQUENCES:
            rc = cli_parse_int("--max-sequences", optarg, 1, 4096, &ec.max_sequences);
            break;
        case OPT_TEMPERATURE:
            if (sscanf(optarg, "%lf", &temperature) != 1 || !(temperature >= 0 && temperature <= 2))
                rc = cli_usage_error("serve", "--temperature: '%s' is not in [0, 2]", optarg);
            break;
        case OPT_RESPONSE_FORMAT:
            rc = response_format(optarg);
            format_arg = optarg;
            break;
        case OPT_JSON: json = 1; break;
        case 'h':
        case OPT_HELP: printf("%s\n%s", usage, cli_engine_help); return CLI_OK;
        case ':': rc = cli_usage_error("serve", "%s needs a value", argv[optind - 1]); break;
        default:
            if ((rc = cli_engine_option(c, optarg, &ec)) < 0)
                rc = cli_usage_error("serve", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (rc != CLI_OK)
        return rc;
    if (optind != argc - 1)
        return cli_usage_error("serve", "needs one MODEL directory (see --help)");

    struct llmem_engine *e = NULL;
    struct llmem_server *s = NULL;
    char **bodies = NULL;
    int n_bodies = 0;
    cJSON *root = json ? cJSON_CreateObject() : NULL, *runs = NULL, *prefix = NULL;
    if ((rc = cli_engine_open("serve", argv[optind], &ec, !json, &e)) != CLI_OK)
        goto out;
    struct llmem_server_config sc;
    llmem_server_config_default(&sc);
    sc.port = 0;
    sc.model_name = "bench";
    if (llmem_server_start(e, &sc, &s) != LLMEM_OK) {
        rc = CLI_FAIL;
        goto out;
    }
    const int port = llmem_server_port(s);
    const int64_t vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size;
    const int64_t context = llmem_engine_plan(e)->context_window_resolved;
    if (prompt + gen >= context || (shared > 0 && shared + prompt + gen >= context)) {
        fprintf(stderr,
                "llmem-bench serve: prompt + generated tokens must stay below the context "
                "window (%" PRId64 ")\n",
                context);
        rc = CLI_USAGE;
        goto out;
    }
    struct llmem_device_info host;
    llmem_sys_probe_host(&host);
    int threads = llmem_pool_threads(llmem_engine_pool(e));
    if (json) {
        cJSON *m = cJSON_AddObjectToObject(root, "machine");
        if (m != NULL) {
            llmem_json_add_string(m, "cpu", host.name);
            llmem_json_add_int(m, "n_cpus", host.n_cpus);
        }
        llmem_json_add_string(root, "model", argv[optind]);
        llmem_json_add_int(root, "threads", threads);
        llmem_json_add_int(root, "max_sequences", ec.max_sequences);
        llmem_json_add_int(root, "prompt_tokens", prompt);
        llmem_json_add_int(root, "max_tokens", gen);
        llmem_json_add_double(root, "temperature", temperature);
        llmem_json_add_string(root, "response_format", format_arg);
        runs = cJSON_AddArrayToObject(root, "runs");
    } else {
        printf("llmem-bench serve: %s on %s (%d CPUs), %d threads, %" PRId64
               " sequences; streaming completions over loopback HTTP, %s, EOS ignored%s\n",
               argv[optind], host.name, host.n_cpus, threads, ec.max_sequences,
               temperature > 0 ? "sampled" : "greedy",
               *format_field ? ", under the response format" : "");
        printf("prompt %" PRId64 " tokens, %" PRId64 " generated per request\n", prompt, gen);
        printf("\n%-9s %7s %8s %9s %8s %9s %9s %7s %10s %10s %7s %7s %7s %7s %7s %7s %7s %7s "
               "%7s\n",
               "workload", "clients", "requests", "prefilled", "reused", "tokens/s", "decode/s",
               "req/s", "TTFT p50", "TTFT p99", "ITL ms", "steps", "pf", "step ms", "sched",
               "forward", "fwd pf", "dev ms", "replays");
    }

    /* one unmeasured request: the first one pays for page faults and cold caches */
    char *warm = body_of(vocab, 0, 0, prompt, 99, gen);
    if (warm != NULL)
        request(port, warm);
    free(warm);

    /* throughput and TTFT by concurrency: distinct prompts */
    for (int k = 0; k < n_clients && rc == CLI_OK; k++) {
        int n = (int)(requests > 0 ? requests : 4 * clients[k] < 8 ? 8 : 4 * clients[k]);
        bodies = calloc((size_t)n, sizeof(char *));
        n_bodies = n;
        for (int i = 0; bodies != NULL && i < n; i++)
            if ((bodies[i] = body_of(vocab, 0, 0, prompt, 1000003u * (uint64_t)(k * 4096 + i + 1),
                                     gen)) == NULL)
                rc = CLI_FAIL;
        if (bodies == NULL)
            rc = CLI_FAIL;
        llmem_engine_clear_cache(e);
        struct stats st;
        if (rc == CLI_OK && (rc = run_clients(e, port, bodies, n, clients[k], &st)) == CLI_OK) {
            if (json)
                cJSON_AddItemToArray(runs, stats_json(&st, NULL));
            else
                print_row("distinct", &st);
        }
        free_bodies(bodies, n_bodies);
        bodies = NULL;
    }

    /* prefix reuse: S shared + P own tokens, against S own + P own */
    if (shared > 0 && rc == CLI_OK) {
        int n = (int)(requests > 0 ? requests : 4 * prefix_clients < 8 ? 8 : 4 * prefix_clients);
        struct stats st[2];
        if (!json)
            printf("\nprefix reuse: %" PRId64 " shared + %" PRId64 " distinct prompt tokens\n",
                   shared, prompt);
        prefix = json ? cJSON_AddArrayToObject(root, "prefix_reuse") : NULL;
        for (int w = 0; w < 2 && rc == CLI_OK; w++) {
            int shared_w = w == 1;
            bodies = calloc((size_t)n + 1, sizeof(char *));
            n_bodies = n + 1;
            for (int i = 0; bodies != NULL && i <= n; i++) {
                uint64_t seed = 7777777u * (uint64_t)(i + 1);
                bodies[i] = shared_w ? body_of(vocab, shared, 42, prompt, seed, gen)
                                     : body_of(vocab, shared, seed ^ 0xABCDEFu, prompt, seed, gen);
                if (bodies[i] == NULL)
                    rc = CLI_FAIL;
            }
            if (bodies == NULL)
                rc = CLI_FAIL;
            llmem_engine_clear_cache(e);
            if (rc == CLI_OK)
                request(port, bodies[n]); /* the unmeasured first request */
            if (rc == CLI_OK &&
                (rc = run_clients(e, port, bodies, n, (int)prefix_clients, &st[w])) == CLI_OK) {
                if (json)
                    cJSON_AddItemToArray(prefix,
                                         stats_json(&st[w], shared_w ? "shared" : "distinct"));
                else
                    print_row(shared_w ? "shared" : "distinct", &st[w]);
            }
            free_bodies(bodies, n_bodies);
            bodies = NULL;
        }
        if (rc == CLI_OK && !json)
            printf("gain from reuse: throughput ×%.2f, TTFT p50 ×%.2f faster\n",
                   st[1].tokens_per_s / st[0].tokens_per_s,
                   st[0].ttft_p50_ms / (st[1].ttft_p50_ms > 0 ? st[1].ttft_p50_ms : 1));
    }
    if (rc == CLI_OK && json) {
        rc = cli_print_json(root);
        root = NULL;
    }
out:
    cJSON_Delete(root);
    free_bodies(bodies, n_bodies);
    llmem_server_stop(s);
    llmem_engine_close(e);
    return rc;
}

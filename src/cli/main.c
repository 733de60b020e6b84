/*
 * cli/main.c — `llmem <command> [options]`: dispatch, help, and the stderr log sink.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/json.h"
#include "core/log.h"
#include "core/options.h"
#include "llmem/plan.h"
#include "llmem/size.h"

static const char usage[] =
    "llmem — an LLM inference runtime whose memory is planned, not discovered\n"
    "\n"
    "usage: llmem <command> [options]\n"
    "\n"
    "commands:\n"
    "  info              this machine: RAM, cgroup limit, available memory, ceiling,\n"
    "                    RLIMIT_MEMLOCK, CPU and ISA features (and CUDA devices)\n"
    "  plan MODEL        the memory plan for a model directory or a catalog name\n"
    "                    (`llmem plan --list` shows the catalog)\n"
    "  run MODEL -p TEXT generate text (streams to stdout; --json, --stats)\n"
    "  chat MODEL        an interactive conversation with the model's chat template\n"
    "  serve MODEL       an OpenAI-compatible HTTP server (completions, chat, SSE,\n"
    "                    /health, /metrics)\n"
    "  tokenize MODEL    the token ids of --text TEXT\n"
    "  logits MODEL      teacher-forced logits of --ids, to a .npy file\n"
    "  gc                reconcile the session bank's spill store on disk (--bank-dir,\n"
    "                    --json): drop bad rows, remove orphans, hold it to its cap\n"
    "  bench mem         the caching allocator against malloc and mmap\n"
    "  bench kv          attention over the KV caches against the memory bandwidth,\n"
    "                    the accuracy of each KV format, and the cost of appending\n"
    "  bench matmul      the CPU matmul against the memory bandwidth and the FMA peak\n"
    "  bench decode MODEL  prefill and decode speed against the memory bandwidth\n"
    "  bench bank MODEL    time to first token cold, from RAM, as a chat turn, from disk\n"
    "  bench serve MODEL   HTTP throughput and time to first token under concurrent clients\n"
    "\n"
    "Run `llmem <command> --help` for the options of a command.\n";

/* While set, error lines are left to the caller, which reports them with more context. */
static int quiet_errors;

static void log_to_stderr(enum llmem_log_level level, const char *line, void *user) {
    (void)user;
    if (quiet_errors && level == LLMEM_LOG_ERROR)
        return;
    static const char *const prefix[] = {"error", "warning", "info", "debug"};
    fprintf(stderr, "llmem %s: %s\n", prefix[level], line);
}

void cli_log_init(int verbose) {
    llmem_log_set_callback(log_to_stderr, NULL, verbose ? LLMEM_LOG_DEBUG : LLMEM_LOG_WARN);
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    fprintf(stderr, "llmem%s%s: ", *cmd ? " " : "", cmd);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    return CLI_USAGE;
}

int cli_parse_size(const char *flag, const char *value, int64_t *out) {
    /* The parser's own message names the problem; say which flag it was about. */
    quiet_errors = 1;
    int status = llmem_size_parse(value, out);
    quiet_errors = 0;
    if (status != LLMEM_OK) {
        const char *msg = strchr(llmem_last_error(), ':');
        return cli_usage_error("", "%s: %s", flag, msg != NULL ? msg + 2 : llmem_last_error());
    }
    return CLI_OK;
}

int cli_parse_int(const char *flag, const char *value, int64_t min, int64_t max, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(value, &end, 10);
    if (value[0] == '\0' || *end != '\0' || errno != 0)
        return cli_usage_error("", "%s: '%s' is not an integer", flag, value);
    if (v < min || v > max)
        return cli_usage_error("", "%s: %lld is out of range [%lld, %lld]", flag, v, (long long)min,
                               (long long)max);
    *out = v;
    return CLI_OK;
}

int cli_parse_double(const char *flag, const char *value, double min_excl, double max_incl,
                     double *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(value, &end);
    if (value[0] == '\0' || *end != '\0' || errno != 0 || v != v)
        return cli_usage_error("", "%s: '%s' is not a number", flag, value);
    if (!(v > min_excl && v <= max_incl))
        return cli_usage_error("", "%s: %s is out of range (%g, %g]", flag, value, min_excl,
                               max_incl);
    *out = v;
    return CLI_OK;
}

int cli_parse_names(const char *cmd, const char *flag, const char *value, int max, int *out,
                    int (*parse)(const char *, int *)) {
    char buf[256];
    if (strlen(value) >= sizeof(buf))
        return cli_usage_error(cmd, "%s: list too long", flag), -1;
    strcpy(buf, value);
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        int v;
        if (parse(tok, &v) != LLMEM_OK)
            return -1;
        int dup = 0;
        for (int i = 0; i < n; i++)
            dup |= out[i] == v;
        if (!dup && n < max)
            out[n++] = v;
    }
    if (n == 0)
        return cli_usage_error(cmd, "%s: empty list", flag), -1;
    return n;
}

int cli_kv_format_name_parse(const char *name, int *out) {
    enum llmem_kv_format f;
    int st = llmem_kv_format_parse(name, &f);
    *out = (int)f;
    return st;
}

static int progress_drawn;

void cli_progress(const char *label, int64_t done, int64_t total) {
    if (total <= 0 || !isatty(STDERR_FILENO))
        return;
    const int width = 40;
    int filled = (int)(done * width / total);
    fprintf(stderr, "\r%s [%.*s%*s] %3d%%", label, filled,
            "########################################", width - filled, "",
            (int)(done * 100 / total));
    fflush(stderr);
    progress_drawn = 1;
}

void cli_progress_done(void) {
    if (progress_drawn)
        fputc('\n', stderr);
    progress_drawn = 0;
}

int cli_print_json(cJSON *root) {
    char *text = llmem_json_print(root, 1);
    cJSON_Delete(root);
    if (text == NULL)
        return CLI_FAIL;
    printf("%s\n", text);
    free(text);
    return CLI_OK;
}

int main(int argc, char **argv) {
    int verbose = 0;
    cli_log_init(0);
    if (llmem_option_bool(LLMEM_OPT_VERBOSE, &verbose) != LLMEM_OK)
        return CLI_FAIL; /* the line saying why is on stderr */
    cli_log_init(verbose);
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? CLI_USAGE : CLI_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("llmem 0.1.0\n");
        return CLI_OK;
    }
    if (strcmp(argv[1], "info") == 0)
        return cli_info(argc - 1, argv + 1);
    if (strcmp(argv[1], "plan") == 0)
        return cli_plan(argc - 1, argv + 1);
    if (strcmp(argv[1], "bench") == 0)
        return cli_bench(argc - 1, argv + 1);
    if (strcmp(argv[1], "gc") == 0)
        return cli_gc(argc - 1, argv + 1);
    if (strcmp(argv[1], "serve") == 0)
        return cli_serve(argc - 1, argv + 1);
    static const char *const run_commands[] = {"run", "chat", "tokenize", "logits"};
    for (size_t i = 0; i < sizeof(run_commands) / sizeof(run_commands[0]); i++)
        if (strcmp(argv[1], run_commands[i]) == 0)
            return cli_run(argc - 1, argv + 1);
    fprintf(stderr, "llmem: unknown command '%s'\n\n%s", argv[1], usage);
    return CLI_USAGE;
}

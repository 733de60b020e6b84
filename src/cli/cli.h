/*
 * cli/cli.h — the llmem command line: one file per subcommand, shared option parsing.
 *
 * Output discipline (SPEC §7): with --json, stdout is exactly one JSON object; logs, progress and
 * human notes go to stderr. Exit codes: 0 success, 1 failure, 2 usage error, 3 a plan that does not
 * fit (the plan itself is still printed).
 */
#ifndef LLMEM_CLI_H
#define LLMEM_CLI_H

#include <getopt.h>
#include <stdint.h>

enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2, CLI_NOFIT = 3 };

int cli_info(int argc, char **argv);
int cli_plan(int argc, char **argv);
int cli_bench(int argc, char **argv);
/* `llmem run`, `chat`, `tokenize` and `logits` (run.c), by argv[0]. */
int cli_run(int argc, char **argv);
/* `llmem gc` (gc.c): the session bank's spill store reconciled offline. */
int cli_gc(int argc, char **argv);
/* `llmem bench kv` (bench_kv.c), dispatched by cli_bench. */
int cli_bench_kv(int argc, char **argv);
/* `llmem bench attn` (bench_attn.c). */
int cli_bench_attn(int argc, char **argv);
/* `llmem bench decode MODEL` (bench_decode.c). */
int cli_bench_decode(int argc, char **argv);
/* `llmem bench bank MODEL` (bench_bank.c): time to first token with the session bank. */
int cli_bench_bank(int argc, char **argv);
/* `llmem bench serve MODEL` (bench_serve.c). */
int cli_bench_serve(int argc, char **argv);
/* `llmem bench matmul` (bench_matmul.c), dispatched by cli_bench. */
int cli_bench_matmul(int argc, char **argv);

struct llmem_plan;
/* Writes the plan's envelope as an SVG picture to path; CLI_FAIL (message on stderr) on error. */
int cli_plan_svg(const struct llmem_plan *plan, const char *path);

/* Option values, each with an error naming the flag on stderr (returns CLI_USAGE on failure). */
int cli_parse_size(const char *flag, const char *value, int64_t *out);
int cli_parse_int(const char *flag, const char *value, int64_t min, int64_t max, int64_t *out);
int cli_parse_double(const char *flag, const char *value, double min_excl, double max_incl,
                     double *out);
/* A comma-separated list of names, each through `parse` (which logs a bad one), duplicates dropped,
 * at most max kept: the count, or −1 (the message printed). */
int cli_parse_names(const char *cmd, const char *flag, const char *value, int max, int *out,
                    int (*parse)(const char *, int *));
/* A KV format name as an int, for cli_parse_names. */
int cli_kv_format_name_parse(const char *name, int *out);

/* The model, plan and KV options of every command that opens an engine (engine_opts.c): the
 * getopt_long entries, their values (a command's own options start at CLI_OPT_ENGINE_END), the
 * help text, and the parser: CLI_OK, CLI_USAGE (the message printed), or -1 when `opt` is not
 * one of them. */
enum {
    CLI_OPT_KV_LAYOUT = 256,
    CLI_OPT_KV_FORMAT,
    CLI_OPT_CONTEXT,
    CLI_OPT_BUDGET,
    CLI_OPT_MEMORY_LIMIT,
    CLI_OPT_UTIL,
    CLI_OPT_THREADS,
    CLI_OPT_MAX_BATCH_TOKENS,
    CLI_OPT_BANK_MAX,
    CLI_OPT_BANK_DIR,
    CLI_OPT_SPILL_MAX,
    CLI_OPT_NO_SPILL,
    CLI_OPT_NO_MMAP,
    CLI_OPT_BACKEND,
    CLI_OPT_DEVICE,
    CLI_OPT_PRECISION,
    CLI_OPT_ENGINE_END
};
// clang-format off
#define CLI_ENGINE_OPTIONS                                                                         \
    {"kv-layout", required_argument, NULL, CLI_OPT_KV_LAYOUT},                                     \
        {"kv-format", required_argument, NULL, CLI_OPT_KV_FORMAT},                                 \
        {"context", required_argument, NULL, CLI_OPT_CONTEXT},                                     \
        {"budget", required_argument, NULL, CLI_OPT_BUDGET},                                       \
        {"memory-limit", required_argument, NULL, CLI_OPT_MEMORY_LIMIT},                           \
        {"util", required_argument, NULL, CLI_OPT_UTIL},                                           \
        {"threads", required_argument, NULL, CLI_OPT_THREADS},                                     \
        {"max-batch-tokens", required_argument, NULL, CLI_OPT_MAX_BATCH_TOKENS},                   \
        {"bank-max", required_argument, NULL, CLI_OPT_BANK_MAX},                                   \
        {"bank-dir", required_argument, NULL, CLI_OPT_BANK_DIR},                                   \
        {"spill-max", required_argument, NULL, CLI_OPT_SPILL_MAX},                                 \
        {"no-spill", no_argument, NULL, CLI_OPT_NO_SPILL},                                         \
        {"no-mmap", no_argument, NULL, CLI_OPT_NO_MMAP},                                           \
        {"backend", required_argument, NULL, CLI_OPT_BACKEND},                                     \
        {"device", required_argument, NULL, CLI_OPT_DEVICE},                                       \
        {"precision", required_argument, NULL, CLI_OPT_PRECISION}
// clang-format on
extern const char cli_engine_help[];
struct llmem_engine_config;
struct llmem_engine;
int cli_engine_option(int opt, const char *arg, struct llmem_engine_config *c);
/* Opens the engine for MODEL: the plan line on stderr, then (print_limits) the limits applied.
 * CLI_NOFIT when the plan refuses the model, CLI_FAIL on other errors (a message on stderr). */
int cli_engine_open(const char *cmd, const char *model, struct llmem_engine_config *c,
                    int print_limits, struct llmem_engine **e);

/* `llmem serve MODEL` (serve.c). */
int cli_serve(int argc, char **argv);

/* Prints "llmem <cmd>: message" to stderr for usage errors; returns CLI_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prints root as pretty JSON and a newline on stdout, then deletes it. */
struct cJSON;
int cli_print_json(struct cJSON *root);

/* Benchmarks: monotonic seconds, and the median of n values (sorted in place). */
double cli_now_s(void);
double cli_median(double *v, int n);

/* Appends `passes` read and copy bandwidth measurements (GB/s) to read_gbps / copy_gbps, with a
 * multithreaded pass over a `bytes` buffer from mem (tag scratch); tick (optional) is called after
 * every pass. CLI_FAIL when the buffer cannot be allocated. */
struct llmem_mem;
struct llmem_pool;
int cli_bandwidth(struct llmem_mem *mem, struct llmem_pool *pool, int64_t bytes, int passes,
                  double *read_gbps, double *copy_gbps, void (*tick)(void *), void *tick_arg);

/* The device-to-device copy bandwidth of CUDA device `device` (bytes read + written per second,
 * the best of 10 copies of `bytes` after a warm-up): the roofline's bandwidth (SPEC §8). */
int cli_device_copy_bandwidth(int device, int64_t bytes, double *copy_gbps);
/* The same probe kept open between runs: its buffers stay allocated, so that runs timed between
 * two probes do not pay for freeing and mapping them again (the device's page tables). */
struct cli_device_probe;
int cli_device_probe_open(int device, int64_t bytes, struct cli_device_probe **out);
int cli_device_probe_run(struct cli_device_probe *p, double *copy_gbps);
void cli_device_probe_close(struct cli_device_probe *p);

/* A progress bar on stderr, drawn only when stderr is a terminal; done ≤ total. */
void cli_progress(const char *label, int64_t done, int64_t total);
/* Ends the bar's line (if one was drawn). */
void cli_progress_done(void);

/* Makes library log lines at or above WARN (INFO with verbose) go to stderr. */
void cli_log_init(int verbose);

#endif

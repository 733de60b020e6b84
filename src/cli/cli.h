/*
 * cli/cli.h — the llmem command line: one file per subcommand, shared option parsing.
 *
 * Output discipline (SPEC §7): with --json, stdout is exactly one JSON object; logs, progress and
 * human notes go to stderr. Exit codes: 0 success, 1 failure, 2 usage error, 3 a plan that does not
 * fit (the plan itself is still printed).
 */
#ifndef LLMEM_CLI_H
#define LLMEM_CLI_H

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
/* `llmem bench decode MODEL` (bench_decode.c). */
int cli_bench_decode(int argc, char **argv);
/* `llmem bench bank MODEL` (bench_bank.c): time to first token with the session bank. */
int cli_bench_bank(int argc, char **argv);
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

/* A progress bar on stderr, drawn only when stderr is a terminal; done ≤ total. */
void cli_progress(const char *label, int64_t done, int64_t total);
/* Ends the bar's line (if one was drawn). */
void cli_progress_done(void);

/* Makes library log lines at or above WARN (INFO with verbose) go to stderr. */
void cli_log_init(int verbose);

#endif

/*
 * cli/common.h — what the command-line programs share (`llmem` and `llmem-bench`, built once as
 * a static library): exit codes, option values, the model, plan and KV options of every command
 * that opens an engine, usage errors, JSON on stdout, the progress bar and the stderr log sink.
 *
 * Output discipline (SPEC §7): with --json, stdout is exactly one JSON object; logs, progress and
 * human notes go to stderr. Exit codes: 0 success, 1 failure, 2 usage error, 3 a plan that does not
 * fit (the plan itself is still printed).
 */
#ifndef LLMEM_CLI_COMMON_H
#define LLMEM_CLI_COMMON_H

#include <getopt.h>
#include <stdint.h>

enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2, CLI_NOFIT = 3 };

/* The program's name in its messages ("llmem" unless the program sets it before anything else). */
extern const char *cli_program;

/* Option values, each with an error naming the flag on stderr (returns CLI_USAGE on failure). */
int cli_parse_size(const char *flag, const char *value, int64_t *out);
/* cli_parse_size for a size that must be more than 0 (leaving the flag out picks the default). */
int cli_parse_positive_size(const char *flag, const char *arg, int64_t *out);
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
    CLI_OPT_LOAD_FORMAT,
    CLI_OPT_BACKEND,
    CLI_OPT_DEVICE,
    CLI_OPT_PRECISION,
    CLI_OPT_EXPERTS_ON_HOST,
    CLI_OPT_TENSOR_PARALLEL,
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
        {"load-format", required_argument, NULL, CLI_OPT_LOAD_FORMAT},                             \
        {"backend", required_argument, NULL, CLI_OPT_BACKEND},                                     \
        {"device", required_argument, NULL, CLI_OPT_DEVICE},                                       \
        {"precision", required_argument, NULL, CLI_OPT_PRECISION},                                 \
        {"experts-on-host", required_argument, NULL, CLI_OPT_EXPERTS_ON_HOST},                     \
        {"tensor-parallel", required_argument, NULL, CLI_OPT_TENSOR_PARALLEL}
// clang-format on
extern const char cli_engine_help[];
struct llmem_engine_config;
struct llmem_engine;
int cli_engine_option(int opt, const char *arg, struct llmem_engine_config *c);
/* Opens the engine for MODEL: the plan line on stderr, then (print_limits) the limits applied.
 * CLI_NOFIT when the plan refuses the model, CLI_FAIL on other errors (a message on stderr). */
int cli_engine_open(const char *cmd, const char *model, struct llmem_engine_config *c,
                    int print_limits, struct llmem_engine **e);

/* Prints "<program> <cmd>: message" to stderr for usage errors; returns CLI_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prints root as pretty JSON and a newline on stdout, then deletes it. */
struct cJSON;
int cli_print_json(struct cJSON *root);

/* A progress bar on stderr, drawn only when stderr is a terminal; done ≤ total. */
void cli_progress(const char *label, int64_t done, int64_t total);
/* Ends the bar's line (if one was drawn). */
void cli_progress_done(void);

/* Makes library log lines at or above WARN (INFO with verbose) go to stderr. */
void cli_log_init(int verbose);
/* cli_log_init as LLMEM_VERBOSE says; CLI_FAIL (the line saying why on stderr) for a value it does
 * not take. */
int cli_log_from_options(void);

#endif

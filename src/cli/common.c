/*
 * cli/common.c — the helpers the command-line programs share (common.h): the stderr log sink,
 * usage errors, option values, JSON on stdout and the progress bar.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/common.h"
#include "core/json.h"
#include "core/log.h"
#include "core/options.h"
#include "llmem/plan.h"
#include "llmem/size.h"

const char *cli_program = "llmem";

/* While set, error lines are left to the caller, which reports them with more context. */
static int quiet_errors;

static void log_to_stderr(enum llmem_log_level level, const char *line, void *user) {
    (void)user;
    if (quiet_errors && level == LLMEM_LOG_ERROR)
        return;
    static const char *const prefix[] = {"error", "warning", "info", "debug"};
    fprintf(stderr, "%s %s: %s\n", cli_program, prefix[level], line);
}

void cli_log_init(int verbose) {
    llmem_log_set_callback(log_to_stderr, NULL, verbose ? LLMEM_LOG_DEBUG : LLMEM_LOG_WARN);
}

int cli_log_from_options(void) {
    int verbose = 0;
    cli_log_init(0);
    if (llmem_option_bool(LLMEM_OPT_VERBOSE, &verbose) != LLMEM_OK)
        return CLI_FAIL;
    cli_log_init(verbose);
    return CLI_OK;
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    fprintf(stderr, "%s%s%s: ", cli_program, *cmd ? " " : "", cmd);
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

int cli_parse_positive_size(const char *flag, const char *arg, int64_t *out) {
    int rc = cli_parse_size(flag, arg, out);
    if (rc == CLI_OK && *out <= 0)
        return cli_usage_error("", "%s: the size must be positive (leave it out for the plan's "
                                   "default)",
                               flag);
    return rc;
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

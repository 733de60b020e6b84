/*
 * tests/testutil.h — shared helpers for the cmocka suites: the library's error lines counted,
 * temporary directories and files, and running the built `llmem` binary with its stdout, stderr
 * and exit status captured.
 */
#ifndef LLMEM_TESTUTIL_H
#define LLMEM_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "llmem/status.h"

/* The library's ERROR lines, counted in tu_error_lines from tu_count_errors (its log callback,
 * at `level`) until tu_count_errors_stop. */
extern int tu_error_lines;
void tu_count_errors(enum llmem_log_level level);
void tu_count_errors_stop(void);
/* The call failed with `want` and logged one error line, which contains `phrase` (so does
 * llmem_last_error); the count starts again from 0. */
#define tu_expect_failure(call, want, phrase)                                                      \
    tu_expect_failure_at(__LINE__, #call, (call), want, phrase)
void tu_expect_failure_at(int line, const char *call, int status, int want, const char *phrase);
/* cmocka setup and teardown: a fresh directory (tu_mkdtemp) as the state, the errors counted. */
int tu_setup_dir(void **state);
int tu_teardown_dir(void **state);

/* A fresh directory under $TMPDIR (or /tmp); removed with everything in it by tu_rmtree. */
char *tu_mkdtemp(void);
void tu_rmtree(const char *path);
/* Writes len bytes to dir/name (len < 0: strlen(data)); returns the malloc'ed full path. */
char *tu_write_file(const char *dir, const char *name, const void *data, long len);

struct tu_run {
    int exit_code; /* the exit status, or 128 + signal */
    char *out;     /* stdout, NUL-terminated */
    char *err;     /* stderr, NUL-terminated */
};
/* Runs LLMEM_BIN with the arguments (NULL-terminated list) and captures everything. */
struct tu_run tu_llmem(const char *arg, ...);
/* Same with an argv array of n entries (not counting the program). */
struct tu_run tu_llmem_argv(int n, const char *const *args);
/* Same with `input` on stdin (NULL: empty). */
struct tu_run tu_llmem_input(const char *input, int n, const char *const *args);
void tu_run_free(struct tu_run *run);
/* Runs any program (found on PATH) the same way. */
struct tu_run tu_exec(const char *bin, const char *input, int n, const char *const *args);

/* `llmem serve ARGS --port 0`, stderr to a temp file; returns once it has printed its URL (the
 * test fails if it exits first). */
struct tu_server {
    int pid;
    char url[128]; /* "http://127.0.0.1:PORT" */
    char *err_path;
};
void tu_serve_start(struct tu_server *s, int n, const char *const *args);
/* What it has written on stderr so far (malloc'ed). */
char *tu_serve_stderr(const struct tu_server *s);
/* SIGTERM, then waits: the exit status (its stderr is printed when not 0). */
int tu_serve_stop(struct tu_server *s);

/* One HTTP request through curl: the final status, the header block and the body (malloc'ed).
 * body NULL: none; len < 0: strlen(body). extra: more curl arguments. */
struct tu_http {
    int status;
    char *headers;
    char *body;
};
struct tu_http tu_http(const char *method, const char *url, const char *body);
struct tu_http tu_http_argv(const char *method, const char *url, const char *body, long len, int n,
                            const char *const *extra);
void tu_http_free(struct tu_http *h);
struct cJSON *tu_http_json(const struct tu_http *h);

/* 1 (after printing why: no CUDA build, or no device) when the CUDA suites must skip, else 0. */
int tu_no_gpu(void);

/* Parses run->out as exactly one JSON object (only whitespace around it); fails the test
 * otherwise, printing stdout and stderr. Free with cJSON_Delete. */
struct cJSON;
struct cJSON *tu_json_stdout(const struct tu_run *run);

#endif

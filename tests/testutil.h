/*
 * tests/testutil.h — shared helpers for the cmocka suites: the library's error lines counted,
 * temporary directories and files, running the built `llmem` binary with its stdout, stderr and
 * exit status captured, and groups of tests that skip visibly where the machine lacks what they
 * need.
 */
#ifndef LLMEM_TESTUTIL_H
#define LLMEM_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cmocka.h>

#include "llmem/status.h"

/* 1 in a build with AddressSanitizer: its shadow memory and quarantine are resident memory the
 * plan does not count, and it runs several times slower. */
#if defined(__SANITIZE_ADDRESS__)
#define TU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TU_ASAN 1
#endif
#endif
#ifndef TU_ASAN
#define TU_ASAN 0
#endif

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
/* The file's bytes, NUL-terminated (malloc'ed). */
char *tu_read_file(const char *path);

struct tu_run {
    int exit_code; /* the exit status, or 128 + signal */
    char *out;     /* stdout, NUL-terminated */
    char *err;     /* stderr, NUL-terminated */
};
/* Runs LLMEM_BIN with the arguments (NULL-terminated list) and captures everything. */
struct tu_run tu_llmem(const char *arg, ...);
/* The same for the built llmem-bench. */
struct tu_run tu_llmem_bench(const char *arg, ...);
/* Same with an argv array of n entries (not counting the program). */
struct tu_run tu_llmem_argv(int n, const char *const *args);
/* Same with `input` on stdin (NULL: empty). */
struct tu_run tu_llmem_input(const char *input, int n, const char *const *args);
/* Same with input_len bytes of input (NULs included). */
struct tu_run tu_llmem_input_len(const char *input, size_t input_len, int n,
                                 const char *const *args);
void tu_run_free(struct tu_run *run);
/* Runs any program (found on PATH) the same way. */
struct tu_run tu_exec(const char *bin, const char *input, int n, const char *const *args);
struct tu_run tu_exec_len(const char *bin, const char *input, size_t input_len, int n,
                          const char *const *args);

/* `llmem serve ARGS --port 0`, stderr to a temp file; returns once it has printed its URL (the
 * test fails if it exits first). */
struct tu_server {
    int pid;
    char url[128]; /* "http://127.0.0.1:PORT" */
    char *err_path;
};
void tu_serve_start(struct tu_server *s, int n, const char *const *args);
/* An engine on `model` in this process (4 sequences, 2 threads; its guard's readings through
 * `guard` when not NULL) and a server over it on a free port, configured as sc (NULL: the
 * defaults; the model name "pycoder" when sc has none); view gets the server's URL. */
struct llmem_engine;
struct llmem_server;
struct llmem_server_config;
struct llmem_guard_reading;
void tu_library_serve(const char *model, void (*guard)(void *, struct llmem_guard_reading *),
                      const struct llmem_server_config *sc, struct llmem_engine **e,
                      struct llmem_server **s, struct tu_server *view);
/* A --budget (into buf, e.g. "64M") a little above the smallest machine, in steps of 8 MiB, on
 * which `llmem plan model --max-sequences N` holds with the runtime baseline this binary measures
 * (larger in a CUDA build, whose CUDA libraries are resident too, and under ASan), plus
 * extra_mib. */
const char *tu_budget_for(const char *model, int max_sequences, int extra_mib, char *buf,
                          size_t size);
/* An f32 safetensors file, for reference models the tests make: every tensor's name and shape
 * (d1 0: a vector of d0) added first, then the file opened at path with its header, then each
 * tensor's values written in the same order, then closed (the sizes checked). */
struct tu_st_writer {
    char *header;
    size_t len;
    int64_t offset, written;
    FILE *f;
};
void tu_st_add(struct tu_st_writer *w, const char *name, int64_t d0, int64_t d1);
void tu_st_add_shape(struct tu_st_writer *w, const char *name, int n_dims, const int64_t *dims);
void tu_st_open(struct tu_st_writer *w, const char *path);
void tu_st_write(struct tu_st_writer *w, const float *values, int64_t n);
void tu_st_close(struct tu_st_writer *w);
/* cp from into the directory dir. */
void tu_copy_into(const char *from, const char *dir);
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

/* The value of one sample line of the server's /metrics ("name" or "name{labels}"). */
double tu_metric(const struct tu_server *s, const char *name);
/* Until nothing runs or waits (/metrics): the metrics are published after the scheduler step
 * that answered the last client, which may come a moment after the answer. */
void tu_wait_idle(const struct tu_server *s);

/* The JSON payloads of an SSE body, in order, checking that it ends with data: [DONE]. */
int tu_sse_events(const char *body, struct cJSON **events, int max);

/* The helpers below make no cmocka assertion, so that client threads (which must not) can use
 * them: they return -1, or 0 for "no". */
/* tu_sse_events's parse: the number of events, or -1 when the body is not SSE events ending in
 * data: [DONE] (or has more than max). The events parsed before a failure are freed. */
int tu_sse_parse(const char *body, struct cJSON **events, int max);
/* 1 when root is an OpenAI error object: {"error": {"message": non-empty, "type": a string}}. */
int tu_is_error_object(const struct cJSON *root);
/* A TCP connection to the host and port of url ("http://127.0.0.1:PORT"), reads and writes
 * timing out after timeout_s seconds; -1 (errno set) on failure. */
int tu_http_connect(const char *url, int timeout_s);
/* Writes all of data (len < 0: strlen); 0, or -1 on a failed write. */
int tu_http_send(int fd, const void *data, long len);
/* Reads a whole response from fd until the server closes it (the request said Connection:
 * close), into h: the status, the header block and the body (a chunked body decoded). 0, or -1
 * with the reason in why (a timeout, a reset, a malformed response). */
int tu_http_read(int fd, struct tu_http *h, char *why, size_t why_size);

/* Why the CUDA tests cannot run here ("built without CUDA", "no CUDA device"), or NULL. */
const char *tu_gpu_unavailable(void);
/* 1 (after printing why) when the CUDA suites must skip, else 0. */
int tu_no_gpu(void);

/* Parses run->out as exactly one JSON object (only whitespace around it); fails the test
 * otherwise, printing stdout and stderr. Free with cJSON_Delete. */
struct cJSON;
struct cJSON *tu_json_stdout(const struct tu_run *run);

/* ---- tests that cannot run here -------------------------------------------------------------
 *
 * A test that cannot run on this machine (no vector kernels, no GPU, no right to mount a file
 * system) says so; it never returns early as if it had passed. ctest sees one exit status per
 * test and counts 77 as skipped (SKIP_RETURN_CODE in tests/CMakeLists.txt), while cmocka counts a
 * skipped test as not failed, so a skip inside an executable whose other tests pass would not
 * show. Hence: an executable puts the tests that depend on the machine in groups of their own and
 * runs its groups through tu_main, and each group is a ctest test of its own, which ctest lists
 * under "The following tests did not run" where it skips:
 *
 *     const struct tu_group groups[] = {
 *         TU_GROUP("kvcodec", tests, NULL),               ctest "test-kvcodec"
 *         TU_GROUP("simd", simd_tests, no_vector_kernels), ctest "test-kvcodec:simd"
 *     };
 *     return tu_main(argc, argv, groups, 2);
 *
 * tests/CMakeLists.txt reads the TU_GROUP names from the source: the first group is registered
 * under the executable's name, every other as <executable>:<group>, each running
 * `<executable> <group>`. A group whose `unavailable` callback returns a reason is not run: the
 * reason is printed and the group exits 77. Where the condition is known only inside a test (after
 * trying a mount, say), the test calls tu_skip(why), and a group whose every test skipped exits 77
 * too. So a group either runs all it can or shows as skipped, with the reason in its output.
 * Without an argument (by hand) the executable runs every group. CMake passes the names it
 * registered in LLMEM_TEST_GROUPS, and tu_main fails when a group is missing there, so no group is
 * left out of ctest unnoticed (a name is a string literal of [a-z0-9_-] in the TU_GROUP call).
 * An executable that cannot run at all exits 77 before its tests (e2e-serve-node without node,
 * test-cuda-attn without a GPU).
 *
 * Groups rather than the alternatives: a small executable per machine-dependent test would copy
 * the helpers of its module, and an executable that exited 77 whenever one test skipped would hide
 * the tests that passed. A group keeps its tests beside their helpers and has a ctest status of
 * its own.
 */
struct tu_group {
    const char *name;
    const struct CMUnitTest *tests;
    size_t n_tests;
    const char *(*unavailable)(void);  /* (optional) why the group cannot run here, or NULL */
    CMFixtureFunction setup, teardown; /* (optional) cmocka's group fixtures */
};
#define TU_GROUP(name, tests, unavailable) TU_GROUP_FIXTURES(name, tests, unavailable, NULL, NULL)
#define TU_GROUP_FIXTURES(name, tests, unavailable, setup, teardown)                               \
    { (name), (tests), sizeof(tests) / sizeof((tests)[0]), (unavailable), (setup), (teardown) }
/* Runs the group named by argv[1], or every group without one: 1 when a test failed, 77 when
 * every test was skipped, else 0. */
int tu_main(int argc, char **argv, const struct tu_group *groups, size_t n_groups);
/* Skips the running test, printing why; counted for tu_main (use it rather than skip()). */
#define tu_skip(why)                                                                               \
    do {                                                                                           \
        tu_skip_note(why);                                                                         \
        skip();                                                                                    \
    } while (0)
void tu_skip_note(const char *why);

#endif

/*
 * tests/testutil.c — see testutil.h.
 */
#include "testutil.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <signal.h>
#include <time.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/hooks.h"
#include "llmem/backend.h"
#include "llmem/server.h"

int tu_error_lines;

static void count_error(enum llmem_log_level level, const char *line, void *user) {
    (void)line, (void)user;
    if (level == LLMEM_LOG_ERROR)
        tu_error_lines++;
}

void tu_count_errors(enum llmem_log_level level) {
    tu_error_lines = 0;
    llmem_log_set_callback(count_error, NULL, level);
}

void tu_count_errors_stop(void) {
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_ERROR);
}

void tu_expect_failure_at(int line, const char *call, int status, int want, const char *phrase) {
    const char *err = llmem_last_error();
    if (status != want || strstr(err, phrase) == NULL || tu_error_lines != 1) {
        print_error("line %d: %s\n  status %s (want %s), %d error lines (want 1)\n"
                    "  last error: %s\n  wanted phrase: %s\n",
                    line, call, llmem_status_name(status), llmem_status_name(want), tu_error_lines,
                    err, phrase);
        fail();
    }
    tu_error_lines = 0;
}

int tu_setup_dir(void **state) {
    *state = tu_mkdtemp();
    tu_count_errors(LLMEM_LOG_ERROR);
    return 0;
}

int tu_teardown_dir(void **state) {
    tu_rmtree(*state);
    free(*state);
    tu_count_errors_stop();
    return 0;
}

char *tu_mkdtemp(void) {
    const char *tmp = getenv("TMPDIR");
    char buf[4096];
    snprintf(buf, sizeof(buf), "%s/llmem-test-XXXXXX", tmp != NULL && *tmp ? tmp : "/tmp");
    char *dir = mkdtemp(buf);
    assert_non_null(dir);
    return strdup(dir);
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

void tu_rmtree(const char *path) {
    nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

char *tu_write_file(const char *dir, const char *name, const void *data, long len) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *path = malloc(n);
    assert_non_null(path);
    snprintf(path, n, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    size_t size = len < 0 ? strlen((const char *)data) : (size_t)len;
    assert_int_equal(fwrite(data, 1, size, f), size);
    assert_int_equal(fclose(f), 0);
    return path;
}

static char *slurp_fd(int fd) {
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        if (len + 1 >= cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t n = read(fd, buf + len, cap - len - 1);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    return buf;
}

char *tu_read_file(const char *path) {
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    char *text = slurp_fd(fd);
    close(fd);
    return text;
}

struct tu_run tu_exec(const char *bin, const char *input, int n, const char *const *args) {
    return tu_exec_len(bin, input, input != NULL ? strlen(input) : 0, n, args);
}

struct tu_run tu_exec_len(const char *bin, const char *input, size_t input_len, int n,
                          const char *const *args) {
    /* stdin, stdout and stderr are unlinked temp files, so large outputs never block on a pipe. */
    char out_path[] = "/tmp/llmem-out-XXXXXX", err_path[] = "/tmp/llmem-err-XXXXXX";
    char in_path[] = "/tmp/llmem-in-XXXXXX";
    int out_fd = mkstemp(out_path), err_fd = mkstemp(err_path), in_fd = mkstemp(in_path);
    assert_true(out_fd >= 0 && err_fd >= 0 && in_fd >= 0);
    unlink(out_path);
    unlink(err_path);
    unlink(in_path);
    if (input != NULL) {
        assert_int_equal(write(in_fd, input, input_len), (ssize_t)input_len);
        lseek(in_fd, 0, SEEK_SET);
    }

    const char **argv = calloc((size_t)n + 2, sizeof(*argv));
    assert_non_null(argv);
    argv[0] = bin;
    for (int i = 0; i < n; i++)
        argv[i + 1] = args[i];

    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(out_fd, 1);
        dup2(err_fd, 2);
        dup2(in_fd, 0);
        execvp(bin, (char *const *)argv);
        _exit(127);
    }
    free(argv);
    int wstatus = 0;
    assert_int_equal(waitpid(pid, &wstatus, 0), pid);

    struct tu_run run;
    run.exit_code = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
    lseek(out_fd, 0, SEEK_SET);
    lseek(err_fd, 0, SEEK_SET);
    run.out = slurp_fd(out_fd);
    run.err = slurp_fd(err_fd);
    close(out_fd);
    close(err_fd);
    close(in_fd);
    return run;
}

struct tu_run tu_llmem_input(const char *input, int n, const char *const *args) {
    return tu_exec(LLMEM_BIN, input, n, args);
}

struct tu_run tu_llmem_input_len(const char *input, size_t input_len, int n,
                                 const char *const *args) {
    return tu_exec_len(LLMEM_BIN, input, input_len, n, args);
}

struct tu_run tu_llmem_argv(int n, const char *const *args) {
    return tu_llmem_input(NULL, n, args);
}

/* Up to 64 arguments of a NULL-terminated list into args; returns how many. */
static int collect_args(const char *arg, va_list ap, const char **args) {
    int n = 0;
    for (const char *a = arg; a != NULL && n < 64; a = va_arg(ap, const char *))
        args[n++] = a;
    return n;
}

struct tu_run tu_llmem(const char *arg, ...) {
    const char *args[64];
    va_list ap;
    va_start(ap, arg);
    int n = collect_args(arg, ap, args);
    va_end(ap);
    return tu_llmem_argv(n, args);
}

struct tu_run tu_llmem_bench(const char *arg, ...) {
    const char *args[64];
    va_list ap;
    va_start(ap, arg);
    int n = collect_args(arg, ap, args);
    va_end(ap);
    return tu_exec(LLMEM_BENCH_BIN, NULL, n, args);
}

void tu_run_free(struct tu_run *run) {
    free(run->out);
    free(run->err);
    run->out = run->err = NULL;
}

cJSON *tu_json_stdout(const struct tu_run *run) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(run->out, &end, 0);
    while (root != NULL && (*end == ' ' || *end == '\n' || *end == '\t' || *end == '\r'))
        end++;
    if (root == NULL || !cJSON_IsObject(root) || *end != '\0') {
        cJSON_Delete(root);
        fail_msg("stdout is not exactly one JSON object:\n%s\nstderr:\n%s", run->out, run->err);
    }
    return root;
}

/* ---- llmem serve ----------------------------------------------------------------------------- */

void tu_serve_start(struct tu_server *s, int n, const char *const *args) {
    memset(s, 0, sizeof(*s));
    char err_path[] = "/tmp/llmem-serve-XXXXXX";
    int fd = mkstemp(err_path);
    assert_true(fd >= 0);
    s->err_path = strdup(err_path);
    const char **argv = calloc((size_t)n + 6, sizeof(*argv));
    assert_non_null(argv);
    int k = 0;
    argv[k++] = LLMEM_BIN;
    argv[k++] = "serve";
    for (int i = 0; i < n; i++)
        argv[k++] = args[i];
    argv[k++] = "--port";
    argv[k++] = "0";
    s->pid = fork();
    assert_true(s->pid >= 0);
    if (s->pid == 0) {
        int null = open("/dev/null", O_RDWR);
        dup2(null, 0);
        dup2(null, 1);
        dup2(fd, 2);
        execv(LLMEM_BIN, (char *const *)argv);
        _exit(127);
    }
    free(argv);
    close(fd);
    /* the URL is on the line that says it serves; 60 s for a slow (sanitized) start */
    for (int tries = 0; tries < 6000; tries++) {
        char *err = tu_serve_stderr(s);
        const char *at = strstr(err, " at http://");
        if (at != NULL) {
            at += 4;
            size_t len = strcspn(at, "; \n");
            assert_true(len < sizeof(s->url));
            memcpy(s->url, at, len);
            s->url[len] = '\0';
            free(err);
            return;
        }
        int status = 0;
        if (waitpid(s->pid, &status, WNOHANG) == s->pid) {
            s->pid = 0;
            fail_msg("llmem serve exited before serving:\n%s", err);
        }
        free(err);
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    fail_msg("llmem serve did not print its URL");
}

char *tu_serve_stderr(const struct tu_server *s) {
    int fd = open(s->err_path, O_RDONLY);
    assert_true(fd >= 0);
    char *text = slurp_fd(fd);
    close(fd);
    return text;
}

int tu_serve_stop(struct tu_server *s) {
    int code = -1;
    if (s->pid > 0) {
        kill(s->pid, SIGTERM);
        int status = 0;
        assert_int_equal(waitpid(s->pid, &status, 0), s->pid);
        code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code != 0) {
            char *err = tu_serve_stderr(s);
            print_message("llmem serve exited with %d:\n%s\n", code, err);
            free(err);
        }
    }
    unlink(s->err_path);
    free(s->err_path);
    memset(s, 0, sizeof(*s));
    return code;
}

/* ---- HTTP through curl ----------------------------------------------------------------------- */

struct tu_http tu_http_argv(const char *method, const char *url, const char *body, long len, int n,
                            const char *const *extra) {
    char path[] = "/tmp/llmem-body-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    if (body != NULL) {
        size_t size = len < 0 ? strlen(body) : (size_t)len;
        assert_int_equal(write(fd, body, size), (ssize_t)size);
    }
    close(fd);
    char data[64];
    snprintf(data, sizeof(data), "@%s", path);
    const char *args[64];
    int k = 0;
    args[k++] = "-sS";
    args[k++] = "-i";
    args[k++] = "--max-time";
    args[k++] = "120";
    args[k++] = "-X";
    args[k++] = method;
    if (body != NULL) {
        args[k++] = "-H";
        args[k++] = "Content-Type: application/json";
        args[k++] = "--data-binary";
        args[k++] = data;
    }
    for (int i = 0; i < n && k < 62; i++)
        args[k++] = extra[i];
    args[k++] = url;
    struct tu_run r = tu_exec("curl", NULL, k, args);
    unlink(path);
    struct tu_http h = {0};
    if (r.exit_code != 0)
        fail_msg("curl %s %s failed (%d): %s", method, url, r.exit_code, r.err);
    /* skip interim responses (100 Continue), then the status line, headers, body */
    char *p = r.out;
    for (;;) {
        assert_true(strncmp(p, "HTTP/", 5) == 0);
        h.status = atoi(strchr(p, ' ') + 1);
        char *end = strstr(p, "\r\n\r\n");
        assert_non_null(end);
        if (h.status >= 200) {
            *end = '\0';
            h.headers = strdup(p);
            h.body = strdup(end + 4);
            break;
        }
        p = end + 4;
    }
    tu_run_free(&r);
    return h;
}

struct tu_http tu_http(const char *method, const char *url, const char *body) {
    return tu_http_argv(method, url, body, -1, 0, NULL);
}

void tu_http_free(struct tu_http *h) {
    free(h->headers);
    free(h->body);
    memset(h, 0, sizeof(*h));
}

cJSON *tu_http_json(const struct tu_http *h) {
    cJSON *root = cJSON_Parse(h->body);
    if (root == NULL)
        fail_msg("not JSON (HTTP %d):\n%s", h->status, h->body);
    return root;
}

double tu_metric(const struct tu_server *s, const char *name) {
    char url[256];
    snprintf(url, sizeof(url), "%s/metrics", s->url);
    struct tu_http h = tu_http("GET", url, NULL);
    assert_int_equal(h.status, 200);
    size_t n = strlen(name);
    for (const char *p = h.body; p != NULL && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, name, n) == 0 && p[n] == ' ') {
            double v = strtod(p + n + 1, NULL);
            tu_http_free(&h);
            return v;
        }
    }
    fail_msg("no metric %s in:\n%s", name, h.body);
    return 0;
}

void tu_wait_idle(const struct tu_server *s) {
    for (int i = 0; i < 600; i++) {
        if (tu_metric(s, "llmem_requests_running") == 0 &&
            tu_metric(s, "llmem_requests_waiting") == 0)
            return;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    fail_msg("the server does not become idle");
}

/* ---- server-sent events and error objects ---------------------------------------------------- */

int tu_sse_parse(const char *body, cJSON **events, int max) {
    int n = 0, done = 0;
    for (const char *p = body; *p;) {
        const char *end = strstr(p, "\n\n");
        if (end == NULL || strncmp(p, "data: ", 6) != 0 || done) /* nothing after [DONE] */
            goto out_bad;
        if (strncmp(p + 6, "[DONE]", 6) == 0) {
            done = 1;
        } else {
            if (n >= max)
                goto out_bad;
            events[n] = cJSON_ParseWithLength(p + 6, (size_t)(end - p - 6));
            if (events[n] == NULL)
                goto out_bad;
            n++;
        }
        p = end + 2;
    }
    if (done)
        return n;
out_bad:
    for (int i = 0; i < n; i++)
        cJSON_Delete(events[i]);
    return -1;
}

int tu_sse_events(const char *body, cJSON **events, int max) {
    int n = tu_sse_parse(body, events, max);
    if (n < 0)
        fail_msg("not SSE events ending in data: [DONE] (or more than %d):\n%s", max, body);
    return n;
}

int tu_is_error_object(const cJSON *root) {
    const cJSON *err = cJSON_GetObjectItem(root, "error");
    const cJSON *message = cJSON_GetObjectItem(err, "message");
    return cJSON_IsObject(err) && cJSON_IsString(cJSON_GetObjectItem(err, "type")) &&
           cJSON_IsString(message) && message->valuestring[0] != '\0';
}

/* ---- HTTP on a raw socket -------------------------------------------------------------------- */

int tu_http_connect(const char *url, int timeout_s) {
    const char *colon = strrchr(url, ':');
    if (colon == NULL) {
        errno = EINVAL;
        return -1;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {.tv_sec = timeout_s};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

int tu_http_send(int fd, const void *data, long len) {
    size_t left = len < 0 ? strlen(data) : (size_t)len;
    const char *p = data;
    while (left > 0) {
        ssize_t n = send(fd, p, left, MSG_NOSIGNAL);
        if (n <= 0)
            return -1;
        p += n;
        left -= (size_t)n;
    }
    return 0;
}

/* Decodes a chunked body in place; its length, or -1 when it is malformed or cut short. */
static long dechunk(char *body) {
    char *in = body, *out = body;
    for (;;) {
        char *end = NULL;
        long size = strtol(in, &end, 16);
        if (end == in || size < 0 || (end = strstr(end, "\r\n")) == NULL)
            return -1;
        in = end + 2;
        if (size == 0)
            break;
        if ((long)strnlen(in, (size_t)size) < size || strncmp(in + size, "\r\n", 2) != 0)
            return -1;
        memmove(out, in, (size_t)size);
        out += size;
        in += size + 2;
    }
    *out = '\0';
    return out - body;
}

int tu_http_read(int fd, struct tu_http *h, char *why, size_t why_size) {
    memset(h, 0, sizeof(*h));
    size_t cap = 1 << 14, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (buf == NULL) {
            snprintf(why, why_size, "out of memory");
            return -1;
        }
        if (len + 1 >= cap) {
            char *more = realloc(buf, cap *= 2);
            if (more == NULL)
                free(buf);
            buf = more;
            continue;
        }
        ssize_t n = recv(fd, buf + len, cap - len - 1, 0);
        if (n == 0)
            break;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            snprintf(why, why_size, "%s after %zu bytes",
                     errno == EAGAIN || errno == EWOULDBLOCK ? "timed out" : strerror(errno), len);
            goto out_bad;
        }
        len += (size_t)n;
    }
    buf[len] = '\0';
    char *end = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.", 7) != 0 || strlen(buf) != len || end == NULL) {
        snprintf(why, why_size, "not an HTTP response (%zu bytes): %.200s", len, buf);
        goto out_bad;
    }
    h->status = atoi(buf + 9);
    *end = '\0';
    h->headers = strdup(buf);
    h->body = strdup(end + 4);
    free(buf);
    if (h->headers == NULL || h->body == NULL) {
        snprintf(why, why_size, "out of memory");
        tu_http_free(h);
        return -1;
    }
    for (const char *p = h->headers; (p = strchr(p, '\n')) != NULL;) {
        p++;
        if (strncasecmp(p, "Transfer-Encoding: chunked", 26) == 0 && dechunk(h->body) < 0) {
            snprintf(why, why_size, "HTTP %d: a malformed chunked body: %.200s", h->status,
                     h->body);
            tu_http_free(h);
            return -1;
        }
    }
    return 0;
out_bad:
    free(buf);
    return -1;
}

const char *tu_gpu_unavailable(void) {
    int n = 0;
    llmem_backend_device_count(&n);
    if (llmem_backend_cuda_available() && n > 0)
        return NULL;
    return llmem_backend_cuda_available() ? "no CUDA device" : "built without CUDA";
}

int tu_no_gpu(void) {
    const char *why = tu_gpu_unavailable();
    if (why != NULL)
        printf("skipped: %s\n", why);
    return why != NULL;
}

/* ---- groups ---------------------------------------------------------------------------------- */

static int n_skipped; /* tu_skip calls in the group running */

void tu_skip_note(const char *why) {
    print_message("[  SKIPPED ] %s\n", why);
    n_skipped++;
}

/* Whether `name` is in LLMEM_TEST_GROUPS (a comma-separated list; unset: run by hand, any). */
static int registered(const char *name) {
    const char *list = getenv("LLMEM_TEST_GROUPS");
    if (list == NULL)
        return 1;
    size_t n = strlen(name);
    for (const char *p = list;;) {
        const char *end = strchr(p, ',');
        size_t len = end != NULL ? (size_t)(end - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0)
            return 1;
        if (end == NULL)
            return 0;
        p = end + 1;
    }
}

int tu_main(int argc, char **argv, const struct tu_group *groups, size_t n_groups) {
    const char *only = argc > 1 ? argv[1] : NULL;
    size_t n_tests = 0, n_skips = 0;
    int failed = 0, found = 0;
    for (size_t i = 0; i < n_groups; i++) {
        const struct tu_group *g = &groups[i];
        if (!registered(g->name)) {
            fprintf(stderr,
                    "group '%s' is not registered with ctest (tests/CMakeLists.txt finds "
                    "groups as TU_GROUP(\"name\", ...) in the source)\n",
                    g->name);
            return 1;
        }
        if (only != NULL && strcmp(only, g->name) != 0)
            continue;
        found = 1;
        n_tests += g->n_tests;
        const char *why = g->unavailable != NULL ? g->unavailable() : NULL;
        if (why != NULL) {
            printf("[==========] %s: %zu test(s) skipped: %s\n", g->name, g->n_tests, why);
            n_skips += g->n_tests;
            continue;
        }
        n_skipped = 0;
        failed += _cmocka_run_group_tests(g->name, g->tests, g->n_tests, g->setup, g->teardown);
        n_skips += (size_t)n_skipped;
    }
    if (!found) {
        fprintf(stderr, "no group '%s'\n", only);
        return 1;
    }
    if (failed > 0)
        return 1;
    return n_tests > 0 && n_skips == n_tests ? 77 : 0;
}

void tu_library_serve(const char *model, void (*guard)(void *, struct llmem_guard_reading *),
                      const struct llmem_server_config *sc, struct llmem_engine **e,
                      struct llmem_server **s, struct tu_server *view) {
    struct llmem_engine_config ec;
    llmem_engine_config_default(&ec);
    ec.model_dir = model;
    ec.max_sequences = 4;
    ec.n_threads = 2;
    struct llmem_engine_hooks hooks = {.guard_source = guard};
    assert_int_equal(llmem_engine_open_hooked(&ec, &hooks, NULL, NULL, e), LLMEM_OK);
    struct llmem_server_config c;
    if (sc != NULL)
        c = *sc;
    else
        llmem_server_config_default(&c);
    c.port = 0;
    if (c.model_name == NULL)
        c.model_name = "pycoder";
    assert_int_equal(llmem_server_start(*e, &c, s), LLMEM_OK);
    memset(view, 0, sizeof(*view));
    snprintf(view->url, sizeof(view->url), "%s", llmem_server_url(*s));
}

const char *tu_budget_for(const char *model, int max_sequences, int extra_mib, char *buf,
                          size_t size) {
    char seqs[16];
    snprintf(seqs, sizeof(seqs), "%d", max_sequences);
    struct tu_run r = tu_llmem("plan", model, "--json", "--max-sequences", seqs, NULL);
    assert_int_equal(r.exit_code, 0);
    cJSON *o = tu_json_stdout(&r);
    int mib = (int)(cJSON_GetObjectItem(o, "runtime_baseline_bytes")->valuedouble / 1048576) + 40;
    cJSON_Delete(o);
    tu_run_free(&r);
    /* the smallest machine, in steps of 8 MiB, on which the plan holds (llmem plan exits 0) */
    for (int fits = 0; !fits; mib += 8) {
        assert_true(mib < 1 << 16);
        snprintf(buf, size, "%dM", mib);
        r = tu_llmem("plan", model, "--budget", buf, "--max-sequences", seqs, NULL);
        fits = r.exit_code == 0;
        tu_run_free(&r);
    }
    snprintf(buf, size, "%dM", mib + 8 + extra_mib);
    return buf;
}

#define TU_ST_HEADER_MAX (1 << 20)

void tu_st_add(struct tu_st_writer *w, const char *name, int64_t d0, int64_t d1) {
    const int64_t dims[2] = {d0, d1};
    tu_st_add_shape(w, name, d1 > 0 ? 2 : 1, dims);
}

void tu_st_add_shape(struct tu_st_writer *w, const char *name, int n_dims, const int64_t *dims) {
    if (w->header == NULL) {
        assert_non_null(w->header = malloc(TU_ST_HEADER_MAX));
        w->len = (size_t)snprintf(w->header, TU_ST_HEADER_MAX, "{");
    }
    int64_t n = 1;
    char shape[96];
    int at = snprintf(shape, sizeof(shape), "[");
    for (int d = 0; d < n_dims; d++) {
        n *= dims[d];
        at += snprintf(shape + at, sizeof(shape) - (size_t)at, "%s%lld", d ? ", " : "",
                       (long long)dims[d]);
    }
    snprintf(shape + at, sizeof(shape) - (size_t)at, "]");
    w->len += (size_t)snprintf(w->header + w->len, TU_ST_HEADER_MAX - w->len,
                               "%s\"%s\": {\"dtype\": \"F32\", \"shape\": %s, "
                               "\"data_offsets\": [%lld, %lld]}",
                               w->offset > 0 ? ", " : "", name, shape, (long long)w->offset,
                               (long long)(w->offset + 4 * n));
    assert_true(w->len + 2 < TU_ST_HEADER_MAX);
    w->offset += 4 * n;
}

void tu_st_open(struct tu_st_writer *w, const char *path) {
    w->len += (size_t)snprintf(w->header + w->len, TU_ST_HEADER_MAX - w->len, "}");
    assert_non_null(w->f = fopen(path, "wb"));
    uint64_t n = w->len;
    assert_int_equal(fwrite(&n, 8, 1, w->f), 1);
    assert_int_equal(fwrite(w->header, 1, w->len, w->f), w->len);
}

void tu_st_write(struct tu_st_writer *w, const float *values, int64_t n) {
    assert_int_equal(fwrite(values, sizeof(float), (size_t)n, w->f), (size_t)n);
    w->written += 4 * n;
}

void tu_st_close(struct tu_st_writer *w) {
    assert_int_equal(w->written, w->offset);
    assert_int_equal(fclose(w->f), 0);
    free(w->header);
    memset(w, 0, sizeof(*w));
}

void tu_copy_into(const char *from, const char *dir) {
    struct tu_run r = tu_exec("cp", NULL, 2, (const char *[]){from, dir});
    assert_int_equal(r.exit_code, 0);
    tu_run_free(&r);
}

/*
 * tests/testutil.c — see testutil.h.
 */
#include "testutil.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

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

struct tu_run tu_llmem_input(const char *input, int n, const char *const *args) {
    /* stdin, stdout and stderr are unlinked temp files, so large outputs never block on a pipe. */
    char out_path[] = "/tmp/llmem-out-XXXXXX", err_path[] = "/tmp/llmem-err-XXXXXX";
    char in_path[] = "/tmp/llmem-in-XXXXXX";
    int out_fd = mkstemp(out_path), err_fd = mkstemp(err_path), in_fd = mkstemp(in_path);
    assert_true(out_fd >= 0 && err_fd >= 0 && in_fd >= 0);
    unlink(out_path);
    unlink(err_path);
    unlink(in_path);
    if (input != NULL) {
        size_t len = strlen(input);
        assert_int_equal(write(in_fd, input, len), (ssize_t)len);
        lseek(in_fd, 0, SEEK_SET);
    }

    const char **argv = calloc((size_t)n + 2, sizeof(*argv));
    assert_non_null(argv);
    argv[0] = LLMEM_BIN;
    for (int i = 0; i < n; i++)
        argv[i + 1] = args[i];

    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(out_fd, 1);
        dup2(err_fd, 2);
        dup2(in_fd, 0);
        execv(LLMEM_BIN, (char *const *)argv);
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

struct tu_run tu_llmem_argv(int n, const char *const *args) {
    return tu_llmem_input(NULL, n, args);
}

struct tu_run tu_llmem(const char *arg, ...) {
    const char *args[64];
    int n = 0;
    va_list ap;
    va_start(ap, arg);
    for (const char *a = arg; a != NULL && n < 64; a = va_arg(ap, const char *))
        args[n++] = a;
    va_end(ap);
    return tu_llmem_argv(n, args);
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

/*
 * tests/e2e/e2e-crash.c — crash consistency of the session bank's spill store: `llmem run`
 * processes on one store are killed (SIGKILL) at seeded random points, before, while and after
 * they write chunks; then a run on the store generates what a run without the bank generates, and
 * `llmem gc` finds the store consistent, both as the kills left it and after those runs: a second
 * gc has nothing left to fix. The assertions hold wherever the kills land; LLMEM_CRASH_SEED sets
 * another seed by hand.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "testutil.h"

#define PYCODER LLMEM_SOURCE_DIR "/models/pycoder"

#define N_PROMPT 700 /* at least 512 tokens: spilled, in chunks of 256, 256 and the rest */
#define N_KILLS  20
#define N_SALTS  3 /* the killed runs take turns over this many prompts */
#define SEED     0x6c6c6d656d2d6bULL

/* N_PROMPT prompt ids as "a,b,c". */
static char *long_ids(int salt) {
    char *s = malloc(N_PROMPT * 6);
    size_t len = 0;
    for (int i = 0; i < N_PROMPT; i++)
        len += (size_t)sprintf(s + len, "%s%d", i ? "," : "", 20 + (i * 37 + salt * 101) % 3900);
    return s;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Starts `llmem run` of ids on the store dir, its output to /dev/null. */
static pid_t start_run(const char *ids, const char *dir) {
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int null = open("/dev/null", O_RDWR);
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
        execl(LLMEM_BIN, LLMEM_BIN, "run", PYCODER, "--ids", ids, "-n", "16", "--ignore-eos",
              "--threads", "1", "--bank-dir", dir, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* `llmem run --json` of ids on the store bank_dir, or without the bank (NULL). */
static struct tu_run run_json(const char *ids, const char *bank_dir) {
    const char *opt = bank_dir ? "--bank-dir" : "--bank-max", *val = bank_dir ? bank_dir : "0";
    const char *args[] = {"run",          PYCODER,  "--ids",     ids, "-n", "16",
                          "--ignore-eos", "--json", "--threads", "1", opt,  val};
    return tu_llmem_argv(12, args);
}

static char *ids_of(const struct tu_run *run) {
    cJSON *out = tu_json_stdout(run);
    char *s = cJSON_PrintUnformatted(cJSON_GetObjectItem(out, "ids"));
    assert_non_null(s);
    cJSON_Delete(out);
    return s;
}

static int64_t field(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    assert_true(cJSON_IsNumber(v));
    return (int64_t)v->valuedouble;
}

/* gc of dir succeeds; a second gc finds nothing to fix and the same chunk files. */
static void gc_twice(const char *dir, const char *what) {
    struct tu_run g = tu_llmem("gc", "--bank-dir", dir, "--json", NULL);
    if (g.exit_code != 0)
        fail_msg("%s: exit %d\n%s", what, g.exit_code, g.err);
    cJSON *first = tu_json_stdout(&g);
    printf("  %s: %lld files, %lld rows dropped, %lld orphans and %lld temps removed\n", what,
           (long long)field(first, "files"), (long long)field(first, "rows_dropped"),
           (long long)field(first, "orphans_removed"), (long long)field(first, "temps_removed"));
    tu_run_free(&g);
    g = tu_llmem("gc", "--bank-dir", dir, "--json", NULL);
    if (g.exit_code != 0)
        fail_msg("%s, again: exit %d\n%s", what, g.exit_code, g.err);
    cJSON *second = tu_json_stdout(&g);
    assert_int_equal(field(second, "rows_dropped"), 0);
    assert_int_equal(field(second, "orphans_removed"), 0);
    assert_int_equal(field(second, "temps_removed"), 0);
    assert_int_equal(field(second, "rows_rebuilt"), 0);
    assert_int_equal(field(second, "evicted_files"), 0);
    /* (not "bytes": it counts the manifest's own files, whose write-ahead log changes size) */
    assert_int_equal(field(second, "files"), field(first, "files"));
    cJSON_Delete(first), cJSON_Delete(second);
    tu_run_free(&g);
}

static void test_killed_runs(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *scratch = tu_mkdtemp(), *crashed = tu_mkdtemp();
    char *ids[N_SALTS];
    for (int i = 0; i < N_SALTS; i++)
        ids[i] = long_ids(10 + i);

    /* the ids without the bank, for each prompt (which brings the model into the page cache) */
    char *want[N_SALTS];
    for (int i = 0; i < N_SALTS; i++) {
        struct tu_run r = run_json(ids[i], NULL);
        assert_int_equal(r.exit_code, 0);
        want[i] = ids_of(&r);
        tu_run_free(&r);
    }

    /* one whole run that writes its chunks, measured: the kills spread over 0 to 1.1 times it */
    double t0 = now_ms();
    pid_t pid = start_run(ids[0], scratch);
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    double whole_ms = now_ms() - t0;
    uint64_t span_us = (uint64_t)(whole_ms * 1.1 * 1000.0) + 1;
    uint64_t seed = SEED;
    const char *env = getenv("LLMEM_CRASH_SEED"); /* another seed, by hand */
    if (env != NULL && *env != '\0')
        seed = strtoull(env, NULL, 0);
    printf("  a whole run: %.0f ms; kills within 0-%.0f ms (seed %#llx)\n", whole_ms,
           (double)span_us / 1000.0, (unsigned long long)seed);

    uint64_t rng = seed;
    int killed = 0, finished = 0;
    for (int k = 0; k < N_KILLS; k++) {
        uint64_t us = splitmix64(&rng) % span_us;
        pid = start_run(ids[k % N_SALTS], dir);
        struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
        nanosleep(&ts, NULL);
        assert_int_equal(kill(pid, SIGKILL), 0);
        assert_int_equal(waitpid(pid, &ws, 0), pid);
        if (WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL)
            killed++;
        else {
            assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0); /* ended before the kill */
            finished++;
        }
    }
    printf("  %d runs killed, %d ended before their kill\n", killed, finished);

    /* the store as the kills left it, for gc alone */
    char cmd[8400];
    snprintf(cmd, sizeof(cmd), "cp -a '%s/.' '%s'", dir, crashed);
    assert_int_equal(system(cmd), 0);

    /* the same ids from the store as without the bank, for every prompt */
    for (int i = 0; i < N_SALTS; i++) {
        struct tu_run a = run_json(ids[i], dir);
        if (a.exit_code != 0)
            fail_msg("run on the store: exit %d\n%s", a.exit_code, a.err);
        char *got = ids_of(&a);
        assert_string_equal(got, want[i]);
        free(got);
        tu_run_free(&a);
    }

    gc_twice(crashed, "gc of the store as the kills left it");
    gc_twice(dir, "gc after the runs on it");

    for (int i = 0; i < N_SALTS; i++)
        free(ids[i]), free(want[i]);
    tu_rmtree(dir), tu_rmtree(scratch), tu_rmtree(crashed);
    free(dir), free(scratch), free(crashed);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_killed_runs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * tests/e2e/e2e-bank.c — the session bank's spill tier through the built binary: a second process
 * restores a long prompt from disk with the same output, a second `llmem chat` process starts its
 * conversation from disk, two processes on one store (the second neither reads nor writes and
 * says so; gc refuses it), `llmem gc` on a damaged store, and bad options named clearly.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <sqlite3.h>

#include "testutil.h"

#define PYCODER LLMEM_SOURCE_DIR "/models/pycoder"

/* A prompt long enough to be spilled (at least 512 tokens), short enough for the sanitizer
 * build: 700 tokens, 715 with 16 generated, KV of 714: 44 blocks in chunks of 16, 16 and 12. */
#define N_PROMPT 700
#define REUSED   688 /* (N_PROMPT − 1) / 16 × 16 */

/* N_PROMPT prompt ids as "a,b,c". */
static char *long_ids(int salt) {
    char *s = malloc(N_PROMPT * 6);
    size_t len = 0;
    for (int i = 0; i < N_PROMPT; i++)
        len += (size_t)sprintf(s + len, "%s%d", i ? "," : "", 20 + (i * 37 + salt * 101) % 3900);
    return s;
}

static const cJSON *stat_of(const cJSON *out, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(cJSON_GetObjectItem(out, "stats"), key);
    assert_non_null(v);
    return v;
}

static int64_t spill_stat(const cJSON *out, const char *key) {
    const cJSON *spill = cJSON_GetObjectItem(stat_of(out, "bank"), "spill");
    assert_true(cJSON_IsObject(spill));
    const cJSON *v = cJSON_GetObjectItem(spill, key);
    assert_non_null(v);
    return (int64_t)v->valuedouble;
}

/* extra: up to 2 more arguments (NULL-terminated), or NULL */
static struct tu_run run_ids(const char *ids, const char *dir, const char *const *extra) {
    const char *args[16] = {"run", PYCODER,        "--ids",  ids,       "-n",
                            "16",  "--ignore-eos", "--json", "--stats", "--threads",
                            "2",   "--bank-dir",   dir};
    int n = 13;
    for (int i = 0; extra != NULL && extra[i] != NULL && i < 2; i++)
        args[n++] = extra[i];
    return tu_llmem_argv(n, args);
}

/* Names and sizes of the chunk files in dir, one per line, sorted (the manifest's own files
 * change with whoever has it open). */
static char *listing(const char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && ls -l --time-style=+ | awk '{print $5, $6}' | grep '[.]kv' | sort", dir);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char *buf = calloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, p);
    buf[n] = '\0';
    pclose(p);
    return buf;
}

/* A second process runs the same long prompt: everything but the last block's worth comes from
 * disk, and the output is the same; without the spill tier it is all prefilled again. */
static void test_second_process_restores(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *ids = long_ids(0);
    struct tu_run a = run_ids(ids, dir, NULL);
    assert_int_equal(a.exit_code, 0);
    cJSON *first = tu_json_stdout(&a);
    assert_int_equal(stat_of(first, "reused_disk_tokens")->valueint, 0);
    assert_true(spill_stat(first, "write_bytes") > 0);
    assert_int_equal(spill_stat(first, "written_chunks"), 3);

    struct tu_run b = run_ids(ids, dir, NULL);
    assert_int_equal(b.exit_code, 0);
    cJSON *second = tu_json_stdout(&b);
    assert_int_equal(stat_of(second, "reused_disk_tokens")->valueint, REUSED);
    assert_int_equal(stat_of(second, "reused_ram_tokens")->valueint, 0);
    assert_true(spill_stat(second, "read_bytes") > 0);
    assert_int_equal(spill_stat(second, "written_chunks"), 0);
    char *x = cJSON_PrintUnformatted(cJSON_GetObjectItem(first, "ids"));
    char *y = cJSON_PrintUnformatted(cJSON_GetObjectItem(second, "ids"));
    assert_string_equal(x, y);
    assert_string_equal(cJSON_GetObjectItem(first, "text")->valuestring,
                        cJSON_GetObjectItem(second, "text")->valuestring);
    printf("  ttft: cold %.1f ms, from disk in a new process %.1f ms\n",
           stat_of(first, "ttft_ms")->valuedouble, stat_of(second, "ttft_ms")->valuedouble);

    const char *no_spill[] = {"--no-spill", NULL};
    struct tu_run c = run_ids(ids, dir, no_spill);
    assert_int_equal(c.exit_code, 0);
    cJSON *third = tu_json_stdout(&c);
    assert_int_equal(stat_of(third, "reused_disk_tokens")->valueint, 0);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(stat_of(third, "bank"), "spill")));
    char *z = cJSON_PrintUnformatted(cJSON_GetObjectItem(third, "ids"));
    assert_string_equal(x, z);
    /* human --stats name both tiers */
    const char *args[] = {"run",     PYCODER,      "--ids", ids,         "-n", "4",
                          "--stats", "--bank-dir", dir,     "--threads", "2"};
    struct tu_run d = tu_llmem_argv(11, args);
    assert_int_equal(d.exit_code, 0);
    assert_non_null(strstr(d.err, "(688 from the session bank: 0 from RAM, 688 from disk)"));
    assert_non_null(strstr(d.err, "llmem bank: RAM"));
    assert_non_null(strstr(d.err, dir));
    free(x), free(y), free(z);
    cJSON_Delete(first), cJSON_Delete(second), cJSON_Delete(third);
    tu_run_free(&a), tu_run_free(&b), tu_run_free(&c), tu_run_free(&d);
    free(ids);
    tu_rmtree(dir);
    free(dir);
}

/* A model split over 2 ranks banks and spills as a whole one does (a block holds both ranks'
 * heads): a second process restores the prompt from disk with the same output; a run of the whole
 * model on the same store finds nothing of the split's (its identity is salted with the ranks). */
static void test_split_restores(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *ids = long_ids(3);
    const char *split[] = {"--tensor-parallel", "2", NULL};
    struct tu_run a = run_ids(ids, dir, split), b = run_ids(ids, dir, split);
    struct tu_run c = run_ids(ids, dir, NULL);
    assert_int_equal(a.exit_code, 0);
    assert_int_equal(b.exit_code, 0);
    assert_int_equal(c.exit_code, 0);
    cJSON *first = tu_json_stdout(&a), *second = tu_json_stdout(&b), *whole = tu_json_stdout(&c);
    assert_int_equal(stat_of(first, "reused_disk_tokens")->valueint, 0);
    assert_int_equal(spill_stat(first, "written_chunks"), 3);
    assert_int_equal(stat_of(second, "reused_disk_tokens")->valueint, REUSED);
    assert_int_equal(stat_of(whole, "reused_disk_tokens")->valueint, 0);
    char *x = cJSON_PrintUnformatted(cJSON_GetObjectItem(first, "ids"));
    char *y = cJSON_PrintUnformatted(cJSON_GetObjectItem(second, "ids"));
    assert_string_equal(x, y);
    printf("  over 2 ranks: %d tokens from disk in a second process, the same ids\n", REUSED);
    free(x), free(y);
    cJSON_Delete(first), cJSON_Delete(second), cJSON_Delete(whole);
    tu_run_free(&a), tu_run_free(&b), tu_run_free(&c);
    free(ids);
    tu_rmtree(dir);
    free(dir);
}

/* A chat whose first message is long, in two processes: the first answers its second turn from
 * RAM, the second process starts its first turn from disk. */
static void test_chat_from_disk(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char input[8192];
    size_t len = 0;
    for (int i = 0; i < 50; i++)
        len += (size_t)snprintf(input + len, sizeof(input) - len, "v%d = compute(%d, %d); ", i, i,
                                i * 7 % 13);
    snprintf(input + len, sizeof(input) - len, "\nreturn v1\n");
    const char *args[] = {"chat",         PYCODER,   "--chat-template", "chatml", "-n",        "8",
                          "--ignore-eos", "--stats", "--bank-dir",      dir,      "--threads", "2"};
    struct tu_run a = tu_llmem_input(input, 12, args);
    assert_int_equal(a.exit_code, 0);
    const char *t1 = strstr(a.err, "llmem stats:"), *t2 = t1 ? strstr(t1 + 1, "llmem stats:") : 0;
    assert_non_null(t2);
    assert_non_null(strstr(t1, "(0 from the session bank"));
    long prompt = 0, reused = 0, ram = 0;
    assert_int_equal(sscanf(t2, "llmem stats: prompt %ld tokens (%ld from the session bank: %ld",
                            &prompt, &reused, &ram),
                     3);
    long first = 0;
    sscanf(t1, "llmem stats: prompt %ld", &first);
    assert_true(first > 512);
    /* the whole first turn, prompt and answer, in full blocks */
    assert_int_equal(reused, (first + 8 - 1) / 16 * 16);
    assert_int_equal(ram, reused);

    struct tu_run b = tu_llmem_input(input, 12, args);
    assert_int_equal(b.exit_code, 0);
    long disk = 0;
    assert_int_equal(sscanf(strstr(b.err, "llmem stats:"),
                            "llmem stats: prompt %ld tokens (%ld from the session bank: %ld from "
                            "RAM, %ld from disk",
                            &prompt, &reused, &ram, &disk),
                     4);
    assert_int_equal(prompt, first);
    assert_int_equal(disk, (first - 1) / 16 * 16);
    /* the same answers */
    assert_string_equal(a.out, b.out);
    tu_run_free(&a), tu_run_free(&b);
    tu_rmtree(dir);
    free(dir);
}

/* Starts `llmem chat` on the store with stdin a pipe held open; returns its pid, the pipe's
 * write end in *in, and its stderr file path in err_path. */
static pid_t start_holder(const char *dir, int *in, char *err_path) {
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    strcpy(err_path, "/tmp/llmem-holder-XXXXXX");
    int err = mkstemp(err_path);
    assert_true(err >= 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(fds[0], 0);
        dup2(err, 2);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        close(fds[1]);
        execl(LLMEM_BIN, LLMEM_BIN, "chat", PYCODER, "--chat-template", "chatml", "--bank-dir", dir,
              "--threads", "1", (char *)NULL);
        _exit(127);
    }
    close(fds[0]);
    close(err);
    *in = fds[1];
    /* wait until it has opened the engine (and so the store) */
    for (int i = 0; i < 600; i++) {
        FILE *f = fopen(err_path, "r");
        char buf[8192] = "";
        size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
        if (f)
            fclose(f);
        buf[n] = '\0';
        if (strstr(buf, "limits applied") != NULL)
            return pid;
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL);
    }
    fail_msg("llmem chat did not start");
    return pid;
}

/* Two processes on one store: the second runs, neither reads nor writes the store, and says so
 * once; gc refuses the store while it is in use; once the first ends, all is as before. */
static void test_two_processes(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *ids = long_ids(1);
    struct tu_run a = run_ids(ids, dir, NULL); /* something on disk to (not) read */
    assert_int_equal(a.exit_code, 0);
    tu_run_free(&a);
    char *before = listing(dir);
    int in = -1;
    char err_path[64];
    pid_t holder = start_holder(dir, &in, err_path);

    char *other = long_ids(2);
    struct tu_run b = run_ids(ids, dir, NULL);
    struct tu_run c = run_ids(other, dir, NULL);
    assert_int_equal(b.exit_code, 0);
    assert_int_equal(c.exit_code, 0);
    const char *said = strstr(b.err, "is in use by another process; this one neither reads nor "
                                     "writes it");
    assert_non_null(said);
    assert_null(strstr(said + 10, "in use by another process")); /* once */
    cJSON *out = tu_json_stdout(&b);
    assert_int_equal(stat_of(out, "reused_disk_tokens")->valueint, 0);
    assert_int_equal(spill_stat(out, "owned"), 0);
    assert_int_equal(spill_stat(out, "read_bytes"), 0);
    assert_int_equal(spill_stat(out, "skip_not_owner"), 3);
    cJSON_Delete(out);
    out = tu_json_stdout(&c);
    assert_int_equal(spill_stat(out, "written_chunks"), 0);
    cJSON_Delete(out);
    char *during = listing(dir);
    assert_string_equal(before, during);
    struct tu_run g = tu_llmem("gc", "--bank-dir", dir, NULL);
    assert_int_equal(g.exit_code, 1);
    assert_non_null(strstr(g.err, "in use by another process"));
    tu_run_free(&g);

    close(in); /* end of input: the chat ends */
    int ws = 0;
    assert_int_equal(waitpid(holder, &ws, 0), holder);
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    unlink(err_path);
    char *after = listing(dir);
    assert_string_equal(before, after);
    struct tu_run d = run_ids(ids, dir, NULL);
    assert_int_equal(d.exit_code, 0);
    out = tu_json_stdout(&d);
    assert_int_equal(stat_of(out, "reused_disk_tokens")->valueint, REUSED);
    cJSON_Delete(out);
    tu_run_free(&b), tu_run_free(&c), tu_run_free(&d);
    free(before), free(during), free(after), free(ids), free(other);
    tu_rmtree(dir);
    free(dir);
}

/* llmem gc on a store with a corrupt chunk, a truncated one, an orphan and a temp file: each is
 * found and named; the next run restores what is left and writes the rest again. */
static void test_gc(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *ids = long_ids(3);
    struct tu_run a = run_ids(ids, dir, NULL);
    assert_int_equal(a.exit_code, 0);
    cJSON *first = tu_json_stdout(&a);
    /* the chunks at tokens 256 and 512, from the manifest: damage one, cut the other short;
     * add an orphan and a temp file */
    char db_path[4200], second_chunk[4200] = "", third_chunk[4200] = "", cmd[16384];
    snprintf(db_path, sizeof(db_path), "%s/manifest.sqlite", dir);
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(db_path, &db), SQLITE_OK);
    sqlite3_stmt *q = NULL;
    assert_int_equal(sqlite3_prepare_v2(db, "SELECT position, file FROM chunks", -1, &q, NULL),
                     SQLITE_OK);
    while (sqlite3_step(q) == SQLITE_ROW) {
        int pos = sqlite3_column_int(q, 0);
        char *to = pos == 256 ? second_chunk : pos == 512 ? third_chunk : NULL;
        if (to != NULL)
            snprintf(to, 4200, "%s/%s", dir, (const char *)sqlite3_column_text(q, 1));
    }
    sqlite3_finalize(q);
    sqlite3_close(db);
    assert_true(second_chunk[0] != '\0' && third_chunk[0] != '\0');
    snprintf(cmd, sizeof(cmd),
             "printf '\\377\\377' | dd of='%s' bs=1 seek=70000 conv=notrunc 2>/dev/null && "
             "truncate -s 5000 '%s' && cp '%s' '%s/%064d.kv' && echo partial > '%s/%064d.kv.tmp'",
             second_chunk, third_chunk, third_chunk, dir, 42, dir, 43);
    assert_int_equal(system(cmd), 0);
    struct tu_run g = tu_llmem("gc", "--bank-dir", dir, "--json", NULL);
    assert_int_equal(g.exit_code, 0);
    cJSON *r = tu_json_stdout(&g);
    assert_int_equal(cJSON_GetObjectItem(r, "rows_dropped")->valueint, 2);
    assert_int_equal(cJSON_GetObjectItem(r, "orphans_removed")->valueint, 1);
    assert_int_equal(cJSON_GetObjectItem(r, "temps_removed")->valueint, 1);
    assert_int_equal(cJSON_GetObjectItem(r, "files")->valueint, 1);
    assert_non_null(strstr(g.err, "checksum mismatch"));
    assert_non_null(strstr(g.err, "the manifest says"));
    cJSON_Delete(r);
    tu_run_free(&g);
    g = tu_llmem("gc", "--bank-dir", dir, NULL); /* clean now; the human form */
    assert_int_equal(g.exit_code, 0);
    assert_non_null(strstr(g.out, ": 1 chunk file, "));
    assert_non_null(strstr(g.out, "rows dropped (file missing, truncated or corrupt): 0"));
    tu_run_free(&g);
    struct tu_run b = run_ids(ids, dir, NULL);
    assert_int_equal(b.exit_code, 0);
    cJSON *second = tu_json_stdout(&b);
    assert_int_equal(stat_of(second, "reused_disk_tokens")->valueint, 256);
    assert_int_equal(spill_stat(second, "written_chunks"), 2);
    char *x = cJSON_PrintUnformatted(cJSON_GetObjectItem(first, "ids"));
    char *y = cJSON_PrintUnformatted(cJSON_GetObjectItem(second, "ids"));
    assert_string_equal(x, y);
    free(x), free(y);
    cJSON_Delete(first), cJSON_Delete(second);
    tu_run_free(&a), tu_run_free(&b);
    free(ids);
    tu_rmtree(dir);
    free(dir);
}

/* Bad values are named; a store that cannot be used, given or default, is a warning and the run
 * goes on without the disk tier; gc makes no store, and says in one line why it skipped one. */
static void test_bad_options(void **state) {
    (void)state;
    struct tu_run r = tu_llmem("run", PYCODER, "-p", "x", "--spill-max", "12Q", NULL);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "--spill-max"));
    tu_run_free(&r);
    r = tu_llmem("run", PYCODER, "-p", "x", "--spill-max", "-1G", NULL);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "--spill-max"));
    tu_run_free(&r);
    r = tu_llmem("run", PYCODER, "-p", "x", "--bank-dir", NULL);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "--bank-dir needs a value"));
    tu_run_free(&r);
    char *dir = tu_mkdtemp();
    char *file = tu_write_file(dir, "not-a-dir", "x", -1);
    r = tu_llmem("run", PYCODER, "-p", "x", "-n", "2", "--bank-dir", file, NULL);
    assert_int_equal(r.exit_code, 0);
    assert_non_null(strstr(r.err, "cannot create or open the spill directory"));
    assert_non_null(strstr(r.err, "runs without its spill tier"));
    assert_non_null(strstr(r.err, file));
    assert_null(strstr(r.err, "error"));
    tu_run_free(&r);
    /* --spill-max 0 turns the tier off */
    r = tu_llmem("run", PYCODER, "-p", "x", "-n", "2", "--spill-max", "0", "--json", "--stats",
                 NULL);
    assert_int_equal(r.exit_code, 0);
    cJSON *out = tu_json_stdout(&r);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(stat_of(out, "bank"), "spill")));
    cJSON_Delete(out);
    tu_run_free(&r);
    r = tu_llmem("gc", "--bank-dir", file, NULL);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, "not collected"));
    assert_non_null(strstr(r.err, file));
    tu_run_free(&r);
    /* gc on a directory that does not exist creates nothing */
    char missing[4200], parent[4200];
    snprintf(parent, sizeof(parent), "%s/nonexistent", dir);
    snprintf(missing, sizeof(missing), "%s/nonexistent/x", dir);
    r = tu_llmem("gc", "--bank-dir", missing, NULL);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, "not collected: no spill store there"));
    assert_non_null(strstr(r.err, missing));
    assert_null(strchr(strchr(r.err, '\n') + 1, '\n')); /* one line */
    struct stat st;
    assert_int_equal(stat(parent, &st), -1);
    tu_run_free(&r);
    r = tu_llmem("gc", "--frobnicate", NULL);
    assert_int_equal(r.exit_code, 2);
    tu_run_free(&r);
    r = tu_llmem("gc", "--spill-max", "0", NULL);
    assert_int_equal(r.exit_code, 2);
    tu_run_free(&r);
    free(file);
    tu_rmtree(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_second_process_restores),
        cmocka_unit_test(test_split_restores),
        cmocka_unit_test(test_chat_from_disk),
        cmocka_unit_test(test_two_processes),
        cmocka_unit_test(test_gc),
        cmocka_unit_test(test_bad_options),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * tests/test-core.c — status codes, the log callback, the size parser and formatter, the JSON
 * helper, bounded file reads, the options table and the cache directory, the monotonic clock,
 * splitmix64 and the thread pool.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/file.h"
#include "core/hash.h"
#include "core/json.h"
#include "core/log.h"
#include "core/options.h"
#include "core/rng.h"
#include "llmem/pool.h"
#include "llmem/size.h"
#include "llmem/status.h"
#include "testutil.h"

static void test_status_strings(void **state) {
    (void)state;
    int codes[] = {LLMEM_OK,     LLMEM_EINVAL,  LLMEM_ENOMEM, LLMEM_EIO,
                   LLMEM_ENOENT, LLMEM_EFORMAT, LLMEM_ERANGE, LLMEM_EUNSUPPORTED};
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++) {
        assert_string_not_equal(llmem_status_str(codes[i]), "unknown status");
        assert_true(strncmp(llmem_status_name(codes[i]), "LLMEM_", 6) == 0);
    }
    assert_string_equal(llmem_status_name(LLMEM_ENOMEM), "LLMEM_ENOMEM");
    assert_string_equal(llmem_status_str(12345), "unknown status");
}

struct captured {
    int n;
    enum llmem_log_level level;
    char line[1024];
};

static void capture(enum llmem_log_level level, const char *line, void *user) {
    struct captured *c = user;
    c->n++;
    c->level = level;
    snprintf(c->line, sizeof(c->line), "%s", line);
}

static void test_log_callback(void **state) {
    (void)state;
    struct captured c = {0};
    llmem_log_set_callback(capture, &c, LLMEM_LOG_WARN);
    LLMEM_INFO("dropped %d", 1);
    assert_int_equal(c.n, 0);
    LLMEM_WARN("kept %d", 2);
    assert_int_equal(c.n, 1);
    assert_string_equal(c.line, "test_log_callback: kept 2");
    LLMEM_ERROR("bad %s", "thing");
    assert_int_equal(c.n, 2);
    assert_int_equal(c.level, LLMEM_LOG_ERROR);
    assert_string_equal(llmem_last_error(), "test_log_callback: bad thing");
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_ERROR);
    LLMEM_ERROR("silent but kept");
    assert_int_equal(c.n, 2);
    assert_string_equal(llmem_last_error(), "test_log_callback: silent but kept");
}

static void test_size_parse_valid(void **state) {
    (void)state;
    const struct {
        const char *text;
        int64_t bytes;
    } cases[] = {
        {"0", 0},
        {"4096", 4096},
        {"48G", 48LL << 30},
        {"48g", 48LL << 30},
        {"48GiB", 48LL << 30},
        {"48GB", 48LL << 30},
        {"512M", 512LL << 20},
        {"1.5T", 3LL << 39},
        {"1K", 1024},
        {"0.5K", 512},
        {"1.0009765625K", 1025},
        {"0.3K", 307}, /* 307.2 rounded down */
        {"100B", 100},
        {" 2G ", 2LL << 30},
        {"+1M", 1 << 20},
        {"8388607T", 8388607LL << 40},
        {"9223372036854775807", INT64_MAX},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int64_t v = -1;
        assert_int_equal(llmem_size_parse(cases[i].text, &v), LLMEM_OK);
        assert_int_equal(v, cases[i].bytes);
    }
}

static void test_size_parse_invalid(void **state) {
    (void)state;
    const struct {
        const char *text;
        int status;
        const char *phrase;
    } cases[] = {
        {"", LLMEM_EINVAL, "empty"},
        {"-5G", LLMEM_EINVAL, "negative"},
        {"G", LLMEM_EINVAL, "not a size"},
        {"abc", LLMEM_EINVAL, "not a size"},
        {"12X", LLMEM_EINVAL, "unexpected 'X'"},
        {"12GG", LLMEM_EINVAL, "unexpected"},
        {"1.5", LLMEM_EINVAL, "fraction needs a unit"},
        {"1.G", LLMEM_EINVAL, "digits after the decimal point"},
        {"8388608T", LLMEM_ERANGE, "too large"},
        {"9223372036854775808", LLMEM_ERANGE, "too large"},
        {"99999999999999999999999", LLMEM_ERANGE, "too large"},
        {"1 2", LLMEM_EINVAL, "unexpected"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int64_t v = 42;
        assert_int_equal(llmem_size_parse(cases[i].text, &v), cases[i].status);
        assert_int_equal(v, 42);
        assert_non_null(strstr(llmem_last_error(), cases[i].phrase));
    }
    int64_t v = 0;
    assert_int_equal(llmem_size_parse(NULL, &v), LLMEM_EINVAL);
}

static void test_size_format(void **state) {
    (void)state;
    char b[LLMEM_SIZE_STR_MAX];
    assert_string_equal(llmem_size_format(48LL << 30, b, sizeof(b)), "48G");
    assert_string_equal(llmem_size_format(512LL << 20, b, sizeof(b)), "512M");
    assert_string_equal(llmem_size_format(900, b, sizeof(b)), "900B");
    assert_string_equal(llmem_size_format((36LL << 30) + (1LL << 29), b, sizeof(b)), "36.5G");
    assert_string_equal(llmem_size_format(-(2LL << 30), b, sizeof(b)), "-2G");
    assert_string_equal(llmem_size_format(INT64_MIN, b, sizeof(b)), "-8E");
    assert_string_equal(llmem_size_format_short(21313949792LL, b, sizeof(b)), "19.9G");
    /* Formatting then parsing a whole size gives it back. */
    int64_t v = 0;
    assert_int_equal(llmem_size_parse(llmem_size_format(3LL << 40, b, sizeof(b)), &v), LLMEM_OK);
    assert_int_equal(v, 3LL << 40);
}

static void test_json_reads(void **state) {
    (void)state;
    const char *doc = "{\"a\": 9007199254740991, \"b\": 1.5, \"c\": \"x\", \"d\": true,"
                      " \"e\": null, \"f\": [1], \"g\": 9007199254740993}";
    cJSON *root = NULL;
    assert_int_equal(llmem_json_parse(doc, strlen(doc), "doc", &root), LLMEM_OK);
    int64_t i = 0;
    double d = 0;
    const char *s = NULL;
    int b = 0;
    assert_int_equal(llmem_json_get_int(root, "a", &i), LLMEM_OK);
    assert_int_equal(i, 9007199254740991LL);
    assert_int_equal(llmem_json_get_int(root, "b", &i), LLMEM_ERANGE);
    assert_int_equal(llmem_json_get_int(root, "g", &i), LLMEM_ERANGE);
    assert_int_equal(llmem_json_get_int(root, "c", &i), LLMEM_EFORMAT);
    assert_int_equal(llmem_json_get_int(root, "e", &i), LLMEM_ENOENT);
    assert_int_equal(llmem_json_get_int(root, "zz", &i), LLMEM_ENOENT);
    assert_int_equal(llmem_json_get_double(root, "b", &d), LLMEM_OK);
    assert_true(d == 1.5);
    assert_int_equal(llmem_json_get_string(root, "c", &s), LLMEM_OK);
    assert_string_equal(s, "x");
    assert_int_equal(llmem_json_get_string(root, "f", &s), LLMEM_EFORMAT);
    assert_int_equal(llmem_json_get_bool(root, "d", &b), LLMEM_OK);
    assert_true(b);
    cJSON_Delete(root);

    const char *bad = "{\"a\": 1,, }";
    assert_int_equal(llmem_json_parse(bad, strlen(bad), "bad.json", &root), LLMEM_EFORMAT);
    assert_non_null(strstr(llmem_last_error(), "bad.json: invalid JSON at byte"));
    const char *trailing = "{\"a\": 1} x";
    assert_int_equal(llmem_json_parse(trailing, strlen(trailing), "t.json", &root), LLMEM_EFORMAT);
    assert_non_null(strstr(llmem_last_error(), "unexpected text after the JSON document"));
    const char *spaces = "{\"a\": 1}\n  ";
    assert_int_equal(llmem_json_parse(spaces, strlen(spaces), "s.json", &root), LLMEM_OK);
    cJSON_Delete(root);

    /* a key twice in one object, small or large, at any depth: refused (Python keeps the last,
     * cJSON the first); the same key in two objects is fine */
    const char *twice = "{\"x\": {\"a\": 1}, \"y\": [{\"a\": 2, \"b\": 3, \"a\": 4}]}";
    assert_int_equal(llmem_json_parse(twice, strlen(twice), "d.json", &root), LLMEM_EFORMAT);
    assert_non_null(strstr(llmem_last_error(), "d.json: the key \"a\" appears twice"));
    char big[64 * 16 + 64] = "{";
    for (int k = 0; k < 64; k++)
        snprintf(big + strlen(big), sizeof(big) - strlen(big), "\"k%d\": %d,", k, k);
    snprintf(big + strlen(big), sizeof(big) - strlen(big), "\"k%d\": 0}", 37);
    assert_int_equal(llmem_json_parse(big, strlen(big), "big.json", &root), LLMEM_EFORMAT);
    assert_non_null(strstr(llmem_last_error(), "the key \"k37\" appears twice"));
    big[strlen(big) - 7] = '9'; /* the last key "k97": all distinct */
    assert_int_equal(llmem_json_parse(big, strlen(big), "big.json", &root), LLMEM_OK);
    cJSON_Delete(root);
}

static void test_json_writes_exact_integers(void **state) {
    (void)state;
    cJSON *o = cJSON_CreateObject();
    assert_int_equal(llmem_json_add_int(o, "max", INT64_MAX), LLMEM_OK);
    assert_int_equal(llmem_json_add_int(o, "n", -7), LLMEM_OK);
    assert_int_equal(llmem_json_add_double(o, "u", 0.75), LLMEM_OK);
    assert_int_equal(llmem_json_add_double(o, "third", 1.0 / 3.0), LLMEM_OK);
    char *text = llmem_json_print(o, 0);
    assert_string_equal(text, "{\"max\":9223372036854775807,\"n\":-7,\"u\":0.75,"
                              "\"third\":0.3333333333333333}");
    free(text);
    cJSON_Delete(o);
}

static void test_file_read_bounds(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *path = tu_write_file(dir, "f.txt", "hello", -1);
    char *data = NULL;
    size_t len = 0;
    assert_int_equal(llmem_file_read(path, 5, &data, &len), LLMEM_OK);
    assert_int_equal(len, 5);
    assert_string_equal(data, "hello");
    free(data);
    assert_int_equal(llmem_file_read(path, 4, &data, &len), LLMEM_ERANGE);
    assert_non_null(strstr(llmem_last_error(), "more than the 4 bytes allowed"));
    assert_int_equal(llmem_file_read(dir, 100, &data, &len), LLMEM_EFORMAT);
    assert_non_null(strstr(llmem_last_error(), "a directory, not a regular file"));
    /* a FIFO is refused at once, not waited on for a writer */
    char fifo[4200];
    assert_int_equal(llmem_path_join(fifo, sizeof(fifo), dir, "fifo.json"), LLMEM_OK);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    alarm(20);
    assert_int_equal(llmem_file_read(fifo, 100, &data, &len), LLMEM_EFORMAT);
    assert_non_null(strstr(llmem_last_error(), "fifo.json: a FIFO, not a regular file"));
    int fd = -1;
    assert_int_equal(llmem_file_open_regular(fifo, "test", &fd), LLMEM_EFORMAT);
    assert_int_equal(fd, -1);
    alarm(0);
    assert_int_equal(llmem_file_open_regular(path, "test", &fd), LLMEM_OK);
    assert_true(fd >= 0);
    assert_int_equal(fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
    close(fd);
    char missing[4200];
    assert_int_equal(llmem_path_join(missing, sizeof(missing), dir, "nope.json"), LLMEM_OK);
    assert_int_equal(llmem_file_read(missing, 100, &data, &len), LLMEM_ENOENT);
    assert_non_null(strstr(llmem_last_error(), "nope.json"));
    char small[8];
    assert_int_equal(llmem_path_join(small, sizeof(small), "/a/long/dir", "x"), LLMEM_ERANGE);
    tu_rmtree(dir);
    free(path);
    free(dir);
}

static void test_file_read_quiet_proc(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *data = NULL;
    size_t len = 0;
    char path[4096];
    snprintf(path, sizeof(path), "%s/missing", dir);
    llmem_path_join(path, sizeof(path), dir, "missing"); /* reset the last error */
    assert_int_equal(llmem_file_read_quiet(path, 100, &data, &len), LLMEM_ENOENT);
    assert_null(strstr(llmem_last_error(), "missing")); /* quiet: nothing at ERROR */
    assert_int_equal(llmem_file_read_quiet(dir, 100, &data, &len), LLMEM_EFORMAT); /* a directory */
    /* A pseudo-file reports size 0 but has contents. */
    assert_int_equal(llmem_file_read_quiet("/proc/self/status", 1 << 20, &data, &len), LLMEM_OK);
    assert_true(len > 0 && strstr(data, "Name:") != NULL);
    free(data);
    /* Longer than the bound. */
    char big[10000];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    free(tu_write_file(dir, "big", big, -1));
    snprintf(path, sizeof(path), "%s/big", dir);
    assert_int_equal(llmem_file_read_quiet(path, 9998, &data, &len), LLMEM_ERANGE);
    assert_int_equal(llmem_file_read_quiet(path, 9999, &data, &len), LLMEM_OK);
    assert_int_equal(len, 9999);
    free(data);
    tu_rmtree(dir);
    free(dir);
}

/* ---- hashes ------------------------------------------------------------------------------------
 */

static void hex(const uint8_t *b, int n, char *out) {
    for (int i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", b[i]);
}

static void test_hashes(void **state) {
    (void)state;
    /* SHA-256: the FIPS 180-2 vector, and parts hash as their concatenation */
    uint8_t d[32];
    char h[65];
    const void *abc[] = {"abc"};
    size_t abc_n[] = {3};
    llmem_sha256(abc, abc_n, 1, d);
    hex(d, 32, h);
    assert_string_equal(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const void *parts[] = {"a", "", "bc"};
    size_t sizes[] = {1, 0, 2};
    uint8_t d2[32];
    llmem_sha256(parts, sizes, 3, d2);
    assert_memory_equal(d, d2, 32);

    /* XXH3-128 of a file: the empty input's published value, and a file read in several steps
     * equals the same bytes hashed at once (a different file differs) */
    char *dir = tu_mkdtemp();
    char *empty = tu_write_file(dir, "empty", "", 0);
    uint8_t x[16];
    assert_int_equal(llmem_digest_file(empty, x), LLMEM_OK);
    hex(x, 16, h);
    assert_string_equal(h, "99aa06d3014798d86001c324468d497f");
    size_t big = (9u << 20) + 123;
    char *data = malloc(big);
    for (size_t i = 0; i < big; i++)
        data[i] = (char)(i * 2654435761u >> 13);
    char *path = tu_write_file(dir, "big", data, (long)big);
    uint8_t y[16], z[16];
    assert_int_equal(llmem_digest_file(path, y), LLMEM_OK);
    data[big / 2] ^= 1;
    char *path2 = tu_write_file(dir, "big2", data, (long)big);
    assert_int_equal(llmem_digest_file(path2, z), LLMEM_OK);
    assert_memory_not_equal(y, z, 16);
    data[big / 2] ^= 1;
    free(tu_write_file(dir, "big3", data, (long)big));
    char p3[600];
    snprintf(p3, sizeof(p3), "%s/big3", dir);
    assert_int_equal(llmem_digest_file(p3, z), LLMEM_OK);
    assert_memory_equal(y, z, 16);
    snprintf(p3, sizeof(p3), "%s/missing", dir);
    assert_int_equal(llmem_digest_file(p3, z), LLMEM_ENOENT);
    free(data);
    free(empty);
    free(path);
    free(path2);
    tu_rmtree(dir);
    free(dir);
}

/* ---- options -----------------------------------------------------------------------------------
 */

/* Set in main before anything reads the options: the environment is read once, at the first
 * read (test_options_defaults_and_environment's first), and later changes to it are not seen. */
#define ENV_FUSE "32"

static void test_options_table(void **state) {
    (void)state;
    for (int i = 0; i < LLMEM_OPT_COUNT; i++) {
        const struct llmem_option_info *o = llmem_option_info((enum llmem_option)i);
        assert_non_null(o);
        assert_non_null(o->name);
        assert_true(strncmp(o->name, "LLMEM_", 6) == 0);
        assert_true(o->doc != NULL && o->doc[0] != '\0');
        for (int j = 0; j < i; j++)
            assert_string_not_equal(o->name, llmem_option_info((enum llmem_option)j)->name);
        if (o->type == LLMEM_OPTION_ENUM)
            assert_true(o->choices != NULL && o->choices[0] != NULL);
        if (o->type == LLMEM_OPTION_INT || o->type == LLMEM_OPTION_SIZE)
            assert_true(o->min <= o->max);
        int64_t v;
        if (o->def != NULL) /* the defaults are spelled as the variables would be */
            assert_int_equal(llmem_option_parse(o, o->def, &v), LLMEM_OK);
        char accepted[160];
        llmem_option_accepted(o, accepted, sizeof(accepted));
        assert_true(accepted[0] != '\0');
    }
    assert_null(llmem_option_info(LLMEM_OPT_COUNT));
    assert_string_equal(llmem_option_type_name(LLMEM_OPTION_SIZE), "size");
}

static void test_options_parse(void **state) {
    (void)state;
    int64_t v = -7;
    /* bool */
    const struct llmem_option_info *b = llmem_option_info(LLMEM_OPT_DECODE_AHEAD);
    const char *yes[] = {"1", "true", "TRUE", "yes", "on", "On"};
    const char *no[] = {"0", "false", "no", "off", "OFF"};
    for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
        assert_int_equal(llmem_option_parse(b, yes[i], &v), LLMEM_OK);
        assert_int_equal(v, 1);
    }
    for (size_t i = 0; i < sizeof(no) / sizeof(no[0]); i++) {
        assert_int_equal(llmem_option_parse(b, no[i], &v), LLMEM_OK);
        assert_int_equal(v, 0);
    }
    const char *bad_bools[] = {"2", "abc", "", "01", "yes please", " 1"};
    for (size_t i = 0; i < sizeof(bad_bools) / sizeof(bad_bools[0]); i++)
        assert_int_equal(llmem_option_parse(b, bad_bools[i], &v), LLMEM_EINVAL);

    /* int with a range: both ends in, one past each out; junk and overflow out */
    const struct llmem_option_info *n = llmem_option_info(LLMEM_OPT_CUDA_ATTN_FUSE);
    assert_int_equal(n->min, 0);
    assert_int_equal(n->max, 256);
    assert_int_equal(llmem_option_parse(n, "0", &v), LLMEM_OK);
    assert_int_equal(v, 0);
    assert_int_equal(llmem_option_parse(n, "256", &v), LLMEM_OK);
    assert_int_equal(v, 256);
    assert_int_equal(llmem_option_parse(n, "+17", &v), LLMEM_OK);
    assert_int_equal(v, 17);
    const char *bad_ints[] = {"-1", "257", "12x", "abc", "", "1.5", "99999999999999999999"};
    for (size_t i = 0; i < sizeof(bad_ints) / sizeof(bad_ints[0]); i++)
        assert_int_equal(llmem_option_parse(n, bad_ints[i], &v), LLMEM_EINVAL);
    const struct llmem_option_info *big = llmem_option_info(LLMEM_OPT_KV_NUM_BLOCKS);
    assert_int_equal(llmem_option_parse(big, "1099511627776", &v), LLMEM_OK);
    assert_int_equal(v, (int64_t)1 << 40);

    /* size: the size parser's forms, in the range, quietly */
    const struct llmem_option_info size = {
        "LLMEM_TEST_SIZE", LLMEM_OPTION_SIZE, "1M", 4096, (int64_t)1 << 40, NULL, "a size"};
    assert_int_equal(llmem_option_parse(&size, "4G", &v), LLMEM_OK);
    assert_int_equal(v, (int64_t)4 << 30);
    assert_int_equal(llmem_option_parse(&size, "1.5M", &v), LLMEM_OK);
    assert_int_equal(v, 3 << 19);
    assert_int_equal(llmem_option_parse(&size, "4096", &v), LLMEM_OK);
    assert_int_equal(v, 4096);
    struct captured c = {0};
    llmem_log_set_callback(capture, &c, LLMEM_LOG_DEBUG);
    const char *bad_sizes[] = {"4095", "2T", "4Q", "-1G", "", "1.5"};
    for (size_t i = 0; i < sizeof(bad_sizes) / sizeof(bad_sizes[0]); i++)
        assert_int_equal(llmem_option_parse(&size, bad_sizes[i], &v), LLMEM_EINVAL);
    assert_int_equal(c.n, 0); /* parsing logs nothing: the getters say which variable */
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_ERROR);
    char accepted[160];
    llmem_option_accepted(&size, accepted, sizeof(accepted));
    assert_non_null(strstr(accepted, "a size"));

    /* enum: any case, the index of the choice */
    const struct llmem_option_info *e = llmem_option_info(LLMEM_OPT_KV_LAYOUT);
    assert_int_equal(llmem_option_parse(e, "Blocks", &v), LLMEM_OK);
    assert_string_equal(e->choices[v], "blocks");
    assert_int_equal(llmem_option_parse(e, "tree", &v), LLMEM_EINVAL);
    assert_int_equal(llmem_option_parse(e, "", &v), LLMEM_EINVAL);
    llmem_option_accepted(e, accepted, sizeof(accepted));
    assert_string_equal(accepted, "one of paged, contiguous, blocks, ragged");
    llmem_option_accepted(e, accepted, 12); /* cut short, still a string */
    assert_string_equal(accepted, "one of page");
}

static void test_options_defaults_and_environment(void **state) {
    (void)state;
    /* read once: at the first read, the value main set; not what the environment says later */
    int64_t v = -1;
    assert_int_equal(llmem_option_int(LLMEM_OPT_CUDA_ATTN_FUSE, &v), LLMEM_OK);
    assert_int_equal(v, atoi(ENV_FUSE));
    setenv("LLMEM_CUDA_ATTN_FUSE", "64", 1);
    v = -1;
    assert_int_equal(llmem_option_int(LLMEM_OPT_CUDA_ATTN_FUSE, &v), LLMEM_OK);
    assert_int_equal(v, atoi(ENV_FUSE));
    assert_string_equal(llmem_option_text(LLMEM_OPT_CUDA_ATTN_FUSE), ENV_FUSE);
    unsetenv("LLMEM_CUDA_ATTN_FUSE");

    /* defaults: unset and empty take the table's; no default leaves the caller's value */
    int on = -1;
    llmem_option_set(LLMEM_OPT_DECODE_AHEAD, NULL);
    assert_int_equal(llmem_option_bool(LLMEM_OPT_DECODE_AHEAD, &on), LLMEM_OK);
    assert_int_equal(on, 1);
    assert_null(llmem_option_text(LLMEM_OPT_DECODE_AHEAD));
    llmem_option_set(LLMEM_OPT_DECODE_AHEAD, "");
    on = -1;
    assert_int_equal(llmem_option_bool(LLMEM_OPT_DECODE_AHEAD, &on), LLMEM_OK);
    assert_int_equal(on, 1);
    assert_null(llmem_option_text(LLMEM_OPT_DECODE_AHEAD));
    llmem_option_set(LLMEM_OPT_CUDA_PROFILE, NULL);
    assert_int_equal(llmem_option_bool(LLMEM_OPT_CUDA_PROFILE, &on), LLMEM_OK);
    assert_int_equal(on, 0);
    llmem_option_set(LLMEM_OPT_CUDA_ATTN_SERIAL_FROM, NULL);
    assert_int_equal(llmem_option_int(LLMEM_OPT_CUDA_ATTN_SERIAL_FROM, &v), LLMEM_OK);
    assert_int_equal(v, 4096);
    llmem_option_set(LLMEM_OPT_KV_NUM_BLOCKS, NULL);
    v = 77;
    assert_int_equal(llmem_option_int(LLMEM_OPT_KV_NUM_BLOCKS, &v), LLMEM_OK);
    assert_int_equal(v, 77);
    int dynamic = 5;
    llmem_option_set(LLMEM_OPT_KV_DYNAMIC, NULL);
    assert_int_equal(llmem_option_bool(LLMEM_OPT_KV_DYNAMIC, &dynamic), LLMEM_OK);
    assert_int_equal(dynamic, 5);
    const char *name = "mine";
    llmem_option_set(LLMEM_OPT_KV_FORMAT, NULL);
    assert_int_equal(llmem_option_enum(LLMEM_OPT_KV_FORMAT, &name), LLMEM_OK);
    assert_string_equal(name, "mine");

    /* set values: typed, enum names canonical */
    llmem_option_set(LLMEM_OPT_DECODE_AHEAD, "off");
    assert_int_equal(llmem_option_bool(LLMEM_OPT_DECODE_AHEAD, &on), LLMEM_OK);
    assert_int_equal(on, 0);
    assert_string_equal(llmem_option_text(LLMEM_OPT_DECODE_AHEAD), "off");
    llmem_option_set(LLMEM_OPT_KV_FORMAT, "Q8");
    assert_int_equal(llmem_option_enum(LLMEM_OPT_KV_FORMAT, &name), LLMEM_OK);
    assert_string_equal(name, "q8");
    assert_int_equal(llmem_option_check(LLMEM_OPT_KV_FORMAT), LLMEM_OK);
    llmem_option_set(LLMEM_OPT_DECODE_AHEAD, NULL);
    llmem_option_set(LLMEM_OPT_KV_FORMAT, NULL);
}

static void test_options_malformed(void **state) {
    (void)state;
    tu_count_errors(LLMEM_LOG_ERROR);
    /* one line naming the variable, its value and what is accepted; the value is left as it was */
    int on = 7;
    llmem_option_set(LLMEM_OPT_DECODE_AHEAD, "abc");
    tu_expect_failure(llmem_option_bool(LLMEM_OPT_DECODE_AHEAD, &on), LLMEM_EINVAL,
                      "LLMEM_DECODE_AHEAD='abc' is not accepted: expected 0 or 1");
    assert_int_equal(on, 7);
    assert_string_equal(llmem_option_text(LLMEM_OPT_DECODE_AHEAD), "abc");
    /* every call that asks fails the same way, with its own line */
    tu_expect_failure(llmem_option_check(LLMEM_OPT_DECODE_AHEAD), LLMEM_EINVAL,
                      "LLMEM_DECODE_AHEAD='abc'");
    llmem_option_set(LLMEM_OPT_DECODE_AHEAD, NULL);

    int64_t v = 5;
    llmem_option_set(LLMEM_OPT_CUDA_ATTN_FUSE, "300");
    tu_expect_failure(
        llmem_option_int(LLMEM_OPT_CUDA_ATTN_FUSE, &v), LLMEM_EINVAL,
        "LLMEM_CUDA_ATTN_FUSE='300' is not accepted: expected an integer in [0, 256]");
    assert_int_equal(v, 5);
    llmem_option_set(LLMEM_OPT_CUDA_ATTN_FUSE, ENV_FUSE);

    const char *name = NULL;
    llmem_option_set(LLMEM_OPT_KV_LAYOUT, "tree");
    tu_expect_failure(llmem_option_enum(LLMEM_OPT_KV_LAYOUT, &name), LLMEM_EINVAL,
                      "LLMEM_KV_LAYOUT='tree' is not accepted: expected one of paged, contiguous");
    assert_null(name);

    /* a value longer than any accepted one is malformed, shown cut short */
    char longer[200];
    memset(longer, '1', sizeof(longer) - 1);
    longer[sizeof(longer) - 1] = '\0';
    llmem_option_set(LLMEM_OPT_KV_LAYOUT, longer);
    tu_expect_failure(llmem_option_check(LLMEM_OPT_KV_LAYOUT), LLMEM_EINVAL, "1…' is not accepted");
    llmem_option_set(LLMEM_OPT_KV_LAYOUT, NULL);
    assert_int_equal(llmem_option_check(LLMEM_OPT_KV_LAYOUT), LLMEM_OK);
    assert_int_equal(tu_error_lines, 0);
    tu_count_errors_stop();
}

static void test_cache_dir(void **state) {
    (void)state;
    char *xdg = getenv("XDG_CACHE_HOME") ? strdup(getenv("XDG_CACHE_HOME")) : NULL;
    char *home = getenv("HOME") ? strdup(getenv("HOME")) : NULL;
    char buf[64];
    setenv("XDG_CACHE_HOME", "/x/cache", 1);
    setenv("HOME", "/home/u", 1);
    assert_int_equal(llmem_cache_dir(NULL, buf, sizeof(buf)), LLMEM_OK);
    assert_string_equal(buf, "/x/cache/llmem");
    assert_int_equal(llmem_cache_dir("bank", buf, sizeof(buf)), LLMEM_OK);
    assert_string_equal(buf, "/x/cache/llmem/bank");
    setenv("XDG_CACHE_HOME", "relative", 1); /* not absolute: HOME's */
    assert_int_equal(llmem_cache_dir("digests", buf, sizeof(buf)), LLMEM_OK);
    assert_string_equal(buf, "/home/u/.cache/llmem/digests");
    assert_int_equal(llmem_cache_dir("digests", buf, 10), LLMEM_ERANGE);
    unsetenv("XDG_CACHE_HOME");
    setenv("HOME", "", 1);
    tu_count_errors(LLMEM_LOG_ERROR);
    assert_int_equal(llmem_cache_dir(NULL, buf, sizeof(buf)), LLMEM_ENOENT);
    assert_int_equal(tu_error_lines, 0); /* the caller says whether that is an error */
    tu_count_errors_stop();
    if (xdg != NULL)
        setenv("XDG_CACHE_HOME", xdg, 1);
    else
        unsetenv("XDG_CACHE_HOME");
    if (home != NULL)
        setenv("HOME", home, 1);
    else
        unsetenv("HOME");
    free(xdg);
    free(home);
}

/* ---- clock and splitmix64 ----------------------------------------------------------------------
 */

static void test_clock(void **state) {
    (void)state;
    double s0 = llmem_clock_s();
    uint64_t n0 = llmem_clock_ns();
    double s1 = llmem_clock_s();
    uint64_t n1 = llmem_clock_ns();
    assert_true(s0 > 0 && s1 >= s0);
    assert_true(n1 >= n0);
    assert_true(fabs((double)n0 * 1e-9 - s0) < 1.0); /* one clock */
    struct timespec now, d;
    clock_gettime(CLOCK_MONOTONIC, &now);
    d = llmem_clock_deadline(1.75);
    double ahead = (double)(d.tv_sec - now.tv_sec) + (double)(d.tv_nsec - now.tv_nsec) * 1e-9;
    assert_true(ahead >= 1.75 - 0.5 && ahead <= 1.75 + 0.5);
    assert_true(d.tv_nsec >= 0 && d.tv_nsec < 1000000000L);
    for (int i = 0; i < 100; i++) { /* normalized whatever the sum of the nanoseconds */
        d = llmem_clock_deadline(0.999999999);
        assert_true(d.tv_nsec >= 0 && d.tv_nsec < 1000000000L);
    }
    d = llmem_clock_deadline(0);
    assert_true(d.tv_sec > now.tv_sec || (d.tv_sec == now.tv_sec && d.tv_nsec >= now.tv_nsec));
}

static void test_splitmix64(void **state) {
    (void)state;
    /* the reference sequence from state 0 (Vigna's splitmix64.c): seeds depend on it */
    uint64_t x = 0;
    assert_true(llmem_splitmix64_next(&x) == 0xe220a8397b1dcdafull);
    assert_true(llmem_splitmix64_next(&x) == 0x6e789e6aa1b965f4ull);
    assert_true(llmem_splitmix64_next(&x) == 0x06c45d188009454full);
    assert_true(x == 3 * 0x9e3779b97f4a7c15ull);
    /* the one-value mix is the first output from that state */
    assert_true(llmem_splitmix64(0) == 0xe220a8397b1dcdafull);
    x = 12345;
    uint64_t first = llmem_splitmix64(12345);
    assert_true(llmem_splitmix64_next(&x) == first);
}

struct pool_count {
    _Atomic int hits[64];
    _Atomic int bad_thread;
    int threads;
};

static void count_task(void *arg, int task, int thread) {
    struct pool_count *c = arg;
    atomic_fetch_add(&c->hits[task], 1);
    if (thread < 0 || thread >= c->threads)
        atomic_store(&c->bad_thread, 1);
}

/* Every task runs exactly once per run, with a valid thread index, whether the workers are
 * spinning (back-to-back runs), asleep (a pause longer than the spin between runs) or not yet
 * run by the OS when the caller has taken every task (more threads than CPUs). */
static void test_pool_runs(void **state) {
    (void)state;
    for (int threads = 1; threads <= 16; threads += threads < 4 ? 1 : 4) {
        struct llmem_pool *pool = NULL;
        assert_int_equal(llmem_pool_create(threads, &pool), LLMEM_OK);
        assert_int_equal(llmem_pool_threads(pool), threads);
        for (int run = 0; run < 400; run++) {
            struct pool_count c = {.threads = threads};
            int n_tasks = 1 + run % 64;
            llmem_pool_run(pool, n_tasks, count_task, &c);
            for (int t = 0; t < 64; t++)
                assert_int_equal(atomic_load(&c.hits[t]), t < n_tasks ? 1 : 0);
            assert_int_equal(atomic_load(&c.bad_thread), 0);
            if (run % 100 == 99) {
                struct timespec pause = {0, 2 * 1000 * 1000}; /* 2 ms: the workers sleep */
                nanosleep(&pause, NULL);
            }
        }
        llmem_pool_destroy(pool);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_strings),
        cmocka_unit_test(test_log_callback),
        cmocka_unit_test(test_size_parse_valid),
        cmocka_unit_test(test_size_parse_invalid),
        cmocka_unit_test(test_size_format),
        cmocka_unit_test(test_json_reads),
        cmocka_unit_test(test_json_writes_exact_integers),
        cmocka_unit_test(test_file_read_bounds),
        cmocka_unit_test(test_file_read_quiet_proc),
        cmocka_unit_test(test_hashes),
        cmocka_unit_test(test_options_table),
        cmocka_unit_test(test_options_parse),
        cmocka_unit_test(test_options_defaults_and_environment),
        cmocka_unit_test(test_options_malformed),
        cmocka_unit_test(test_cache_dir),
        cmocka_unit_test(test_clock),
        cmocka_unit_test(test_splitmix64),
        cmocka_unit_test(test_pool_runs),
    };
    setenv("LLMEM_CUDA_ATTN_FUSE", ENV_FUSE, 1); /* before the first read of any option */
    return cmocka_run_group_tests(tests, NULL, NULL);
}

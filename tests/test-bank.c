/*
 * tests/test-bank.c — the session bank: the identity its hash chains are rooted in (weights by
 * content, tokenizer, KV format and layout, salt; the digest cache keyed by size and mtime) and
 * the block hashes themselves.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "llmem/bank.h"
#include "testutil.h"

#define PYCODER LLMEM_SOURCE_DIR "/models/pycoder"

static char *slurp(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)*n);
    assert_int_equal(fread(buf, 1, (size_t)*n, f), (size_t)*n);
    fclose(f);
    return buf;
}

/* A copy of pycoder's config, tokenizer and weights in a fresh directory. */
static char *copy_model(void) {
    char *dir = tu_mkdtemp();
    const char *files[] = {"config.json", "model.safetensors", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        char src[512];
        snprintf(src, sizeof(src), "%s/%s", PYCODER, files[i]);
        long n = 0;
        char *buf = slurp(src, &n);
        free(tu_write_file(dir, files[i], buf, n));
        free(buf);
    }
    return dir;
}

/* Flips one byte of a file in place, keeping its size and (when keep_mtime) its mtime. */
static void flip_byte(const char *path, long at, int keep_mtime) {
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char b;
    assert_int_equal(pread(fd, &b, 1, at), 1);
    b ^= 0x40;
    assert_int_equal(pwrite(fd, &b, 1, at), 1);
    if (keep_mtime) {
        struct timespec t[2] = {st.st_atim, st.st_mtim};
        assert_int_equal(futimens(fd, t), 0);
    } else {
        struct timespec t[2] = {st.st_atim, {st.st_mtim.tv_sec + 1, st.st_mtim.tv_nsec}};
        assert_int_equal(futimens(fd, t), 0);
    }
    close(fd);
}

static void test_identity(void **state) {
    (void)state;
    struct llmem_bank_identity a, b;
    assert_int_equal(
        llmem_bank_identity(PYCODER, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, NULL, &a),
        LLMEM_OK);
    assert_int_equal(
        llmem_bank_identity(PYCODER, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, NULL, &b),
        LLMEM_OK);
    assert_memory_equal(&a, &b, sizeof(a));
    /* format, layout and salt each change the root, not the content digests */
    assert_int_equal(
        llmem_bank_identity(PYCODER, LLMEM_KV_FORMAT_Q8, LLMEM_KV_LAYOUT_PAGED, NULL, NULL, &b),
        LLMEM_OK);
    assert_memory_equal(a.weights, b.weights, 16);
    assert_memory_not_equal(a.root, b.root, 32);
    assert_int_equal(llmem_bank_identity(PYCODER, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_CONTIGUOUS,
                                         NULL, NULL, &b),
                     LLMEM_OK);
    assert_memory_not_equal(a.root, b.root, 32);
    assert_int_equal(llmem_bank_identity(PYCODER, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED,
                                         "tenant-7", NULL, &b),
                     LLMEM_OK);
    assert_memory_not_equal(a.root, b.root, 32);

    /* a copy in another directory is the same model */
    char *dir = copy_model();
    char cache[600], weights[600], tok[600];
    snprintf(cache, sizeof(cache), "%s/digests", dir);
    snprintf(weights, sizeof(weights), "%s/model.safetensors", dir);
    snprintf(tok, sizeof(tok), "%s/tokenizer.json", dir);
    struct llmem_bank_identity c;
    assert_int_equal(
        llmem_bank_identity(dir, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, cache, &c),
        LLMEM_OK);
    assert_memory_equal(&a, &c, sizeof(a));
    long n = 0;
    char *text = slurp(cache, &n);
    assert_true(n > 0 && strstr(text, weights) != NULL && strstr(text, tok) != NULL);
    free(text);

    /* a fine-tune saved over it with the same size and mtime: the cache still answers (this is
     * what the cache is for, and why it keys on mtime) ... */
    flip_byte(weights, 100000, 1);
    struct llmem_bank_identity d;
    assert_int_equal(
        llmem_bank_identity(dir, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, cache, &d),
        LLMEM_OK);
    assert_memory_equal(c.weights, d.weights, 16);
    /* ... and as soon as its mtime moves, its bytes are read again: a different model */
    flip_byte(weights, 100001, 0);
    assert_int_equal(
        llmem_bank_identity(dir, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, cache, &d),
        LLMEM_OK);
    assert_memory_not_equal(c.weights, d.weights, 16);
    assert_memory_not_equal(c.root, d.root, 32);
    /* without the cache, the content decides */
    struct llmem_bank_identity e;
    assert_int_equal(
        llmem_bank_identity(dir, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, NULL, &e),
        LLMEM_OK);
    assert_memory_equal(d.weights, e.weights, 16);
    /* another tokenizer is another identity */
    flip_byte(tok, 5000, 0);
    assert_int_equal(
        llmem_bank_identity(dir, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, cache, &e),
        LLMEM_OK);
    assert_memory_equal(d.weights, e.weights, 16);
    assert_memory_not_equal(d.tokenizer, e.tokenizer, 16);
    assert_memory_not_equal(d.root, e.root, 32);
    /* a garbage cache is ignored and rewritten */
    free(tu_write_file(dir, "digests", "garbage\n1 2 zz\n", -1));
    assert_int_equal(
        llmem_bank_identity(dir, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, cache, &d),
        LLMEM_OK);
    assert_memory_equal(&d, &e, sizeof(d));
    /* a directory without weights */
    assert_int_equal(llmem_bank_identity("/nonexistent", LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED,
                                         NULL, NULL, &d),
                     LLMEM_ENOENT);
    tu_rmtree(dir);
    free(dir);
}

static void test_block_hash(void **state) {
    (void)state;
    static const char *const want[] = {
        "e7ca17d6581d126af7e0c8574cdd8987ed93319969b54a5e2a272d585a38f3ea", /* [1, 2] */
        "890ed82cf09f22243bdc4252e4d79c8a9810c1391f455dce37a7b732eb0a0e4f", /* [-1] */
    };
    uint8_t zero[32] = {0}, h[32];
    char hex[65];
    int32_t t12[] = {1, 2}, tm1[] = {-1};
    llmem_bank_block_hash(zero, t12, 2, h);
    for (int i = 0; i < 32; i++)
        sprintf(hex + 2 * i, "%02x", h[i]);
    assert_string_equal(hex, want[0]);
    llmem_bank_block_hash(zero, tm1, 1, h);
    for (int i = 0; i < 32; i++)
        sprintf(hex + 2 * i, "%02x", h[i]);
    assert_string_equal(hex, want[1]);
    /* a chain depends on every earlier block: change a token of the first, the second differs */
    int32_t blk[16];
    for (int i = 0; i < 16; i++)
        blk[i] = i;
    uint8_t first[32], a[32], b[32];
    llmem_bank_block_hash(zero, blk, 16, first);
    llmem_bank_block_hash(first, t12, 2, a);
    blk[3] = 99;
    llmem_bank_block_hash(zero, blk, 16, first);
    llmem_bank_block_hash(first, t12, 2, b);
    assert_memory_not_equal(a, b, 32);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_identity),
        cmocka_unit_test(test_block_hash),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

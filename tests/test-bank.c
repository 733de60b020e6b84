/*
 * tests/test-bank.c — the session bank: the identity its hash chains are rooted in (weights by
 * content, tokenizer, KV format and layout, salt; the digest cache keyed by size and mtime) and
 * the block hashes themselves.
 */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/ops.h"
#include "llmem/bank.h"
#include "llmem/model.h"
#include "llmem/forward.h"
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
    /* other numbers in config.json (here rms_norm_eps) are another model */
    char config[600];
    snprintf(config, sizeof(config), "%s/config.json", dir);
    long config_len = 0;
    char *text_config = slurp(config, &config_len);
    char *eps = strstr(text_config, "rms_norm_eps");
    assert_non_null(eps);
    char *digit = strpbrk(eps, "123456789");
    assert_non_null(digit);
    *digit = *digit == '9' ? '8' : (char)(*digit + 1);
    free(tu_write_file(dir, "config.json", text_config, config_len));
    free(text_config);
    assert_int_equal(
        llmem_bank_identity(dir, LLMEM_KV_FORMAT_F16, LLMEM_KV_LAYOUT_PAGED, NULL, cache, &d),
        LLMEM_OK);
    assert_memory_not_equal(d.weights, e.weights, 16);
    assert_memory_equal(d.tokenizer, e.tokenizer, 16);
    assert_memory_not_equal(d.root, e.root, 32);
    e = d;
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

/* ---- the RAM tier on a real model ------------------------------------------------------------ */

struct rig {
    struct llmem_mem *mem;
    struct llmem_model *model;
    struct llmem_backend *be;
    struct llmem_kv *kv;
    struct llmem_forward *fwd;
    struct llmem_bank *bank;
    int64_t vocab;
};

static void rig_open(struct rig *r) {
    memset(r, 0, sizeof(*r));
    struct llmem_mem_config mc = {.cache_limit_bytes = -1};
    assert_int_equal(llmem_mem_create(&mc, &r->mem), LLMEM_OK);
    assert_int_equal(llmem_model_load(PYCODER, r->mem, 0, NULL, NULL, &r->model), LLMEM_OK);
    const struct llmem_model_geometry *g = &llmem_model_get_config(r->model)->geom;
    r->vocab = g->vocab_size;
    assert_int_equal(llmem_backend_cpu_create(2, &r->be), LLMEM_OK);
    struct llmem_kv_config kc;
    llmem_kv_config_default(&kc);
    kc.format = LLMEM_KV_FORMAT_F32;
    kc.n_layers = (int)g->n_layers;
    kc.n_kv_heads = (int)g->n_kv_heads;
    kc.head_dim = (int)g->head_dim;
    kc.max_sequences = 4;
    kc.num_blocks = 320;
    kc.n_threads = 2;
    assert_int_equal(llmem_kv_create(&kc, r->mem, &r->kv), LLMEM_OK);
    assert_int_equal(llmem_forward_create(r->model, r->be, r->kv, 512, &r->fwd), LLMEM_OK);
    struct llmem_bank_identity id;
    assert_int_equal(llmem_bank_identity(PYCODER, kc.format, kc.layout, NULL, NULL, &id), LLMEM_OK);
    assert_int_equal(llmem_bank_create(r->kv, id.root, &r->bank), LLMEM_OK);
}

static void rig_close(struct rig *r) {
    llmem_bank_destroy(r->bank);
    struct llmem_kv_stats ks;
    llmem_kv_stats(r->kv, &ks);
    assert_int_equal(ks.n_blocks_used, 0); /* the bank let go of every block */
    assert_int_equal(llmem_kv_check(r->kv), LLMEM_OK);
    llmem_forward_free(r->fwd);
    llmem_kv_destroy(r->kv);
    llmem_backend_destroy(r->be);
    llmem_model_free(r->model);
    llmem_mem_destroy(r->mem);
}

/* Runs tokens[from..n) on seq (which holds tokens[0..from)) with every row's logits. */
static float *run_rows(struct rig *r, int seq, const int32_t *tokens, int64_t from, int64_t n) {
    float *logits = malloc((size_t)((n - from) * r->vocab) * sizeof(float));
    for (int64_t pos = from; pos < n; pos += 512) {
        int64_t m = n - pos < 512 ? n - pos : 512;
        struct llmem_batch_seq b = {seq, pos, m, 1};
        assert_int_equal(
            llmem_forward_run(r->fwd, tokens + pos, &b, 1, logits + (pos - from) * r->vocab),
            LLMEM_OK);
    }
    return logits;
}

static void make_prompt(int32_t *t, int64_t n, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = (int32_t)(5 + (seed >> 33) % 4000);
    }
}

/* A prompt that shares k tokens with one the bank holds gives the same logits as a cold prefill,
 * for k = 0, 1, 15, 16, 17 and 1000 (blocks of 16: none, none, none, one, one, 62). */
static void test_prefix_reuse_equals_cold(void **state) {
    (void)state;
    static const int64_t shared[] = {0, 1, 15, 16, 17, 1000};
    struct rig r;
    rig_open(&r);
    for (size_t c = 0; c < sizeof(shared) / sizeof(shared[0]); c++) {
        int64_t k = shared[c], na = k + 9, nb = k + 13;
        int32_t *a = malloc((size_t)na * 4), *b = malloc((size_t)nb * 4);
        make_prompt(a, na, 1000 + c);
        memcpy(b, a, (size_t)k * 4);
        make_prompt(b + k, nb - k, 2000 + c);
        /* cold */
        int seq;
        assert_int_equal(llmem_kv_seq_new(r.kv, &seq), LLMEM_OK);
        float *cold = run_rows(&r, seq, b, 0, nb);
        llmem_kv_seq_free(r.kv, seq);
        /* a finished request for A leaves its full blocks in the bank */
        assert_int_equal(llmem_kv_seq_new(r.kv, &seq), LLMEM_OK);
        free(run_rows(&r, seq, a, 0, na));
        assert_int_equal(llmem_bank_insert(r.bank, seq, a, na), LLMEM_OK);
        llmem_kv_seq_free(r.kv, seq);
        /* B reuses what matches and prefills the rest */
        int64_t ids[128];
        int64_t m = llmem_bank_lookup(r.bank, b, nb, (nb - 1) / 16, ids);
        assert_int_equal(m, k / 16);
        assert_int_equal(llmem_kv_seq_new_from_blocks(r.kv, ids, m, &seq), LLMEM_OK);
        float *warm = run_rows(&r, seq, b, m * 16, nb);
        llmem_kv_seq_free(r.kv, seq);
        double worst = 0;
        for (int64_t i = 0; i < (nb - m * 16) * r.vocab; i++) {
            double d = fabs((double)warm[i] - (double)cold[m * 16 * r.vocab + i]);
            worst = d > worst ? d : worst;
        }
        printf("  shared %4lld tokens: %lld blocks reused, max |Δ logits| vs cold %.2e\n",
               (long long)k, (long long)m, worst);
        assert_true(worst <= 1e-5);
        assert_int_equal(llmem_kv_check(r.kv), LLMEM_OK);
        free(cold), free(warm), free(a), free(b);
        llmem_bank_trim(r.bank, 0);
    }
    rig_close(&r);
}

/* Two sequences started from the same banked blocks diverge; each equals its cold run. */
static void test_shared_blocks_diverge(void **state) {
    (void)state;
    struct rig r;
    rig_open(&r);
    int32_t base[40], x[60], y[60];
    make_prompt(base, 40, 7);
    memcpy(x, base, sizeof(base));
    memcpy(y, base, sizeof(base));
    make_prompt(x + 40, 20, 8);
    make_prompt(y + 40, 20, 9);
    int seq;
    assert_int_equal(llmem_kv_seq_new(r.kv, &seq), LLMEM_OK);
    free(run_rows(&r, seq, base, 0, 40));
    assert_int_equal(llmem_bank_insert(r.bank, seq, base, 40), LLMEM_OK);
    llmem_kv_seq_free(r.kv, seq);
    float *want[2], *got[2];
    const int32_t *p[2] = {x, y};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(llmem_kv_seq_new(r.kv, &seq), LLMEM_OK);
        want[i] = run_rows(&r, seq, p[i], 0, 60);
        llmem_kv_seq_free(r.kv, seq);
    }
    int s[2];
    int64_t ids[4];
    for (int i = 0; i < 2; i++) {
        assert_int_equal(llmem_bank_lookup(r.bank, p[i], 60, 3, ids), 2);
        assert_int_equal(llmem_kv_seq_new_from_blocks(r.kv, ids, 2, &s[i]), LLMEM_OK);
    }
    /* interleaved, token by token */
    for (int i = 0; i < 2; i++)
        got[i] = malloc((size_t)(28 * r.vocab) * sizeof(float));
    for (int64_t pos = 32; pos < 60; pos++)
        for (int i = 0; i < 2; i++) {
            struct llmem_batch_seq b = {s[i], pos, 1, 1};
            assert_int_equal(
                llmem_forward_run(r.fwd, p[i] + pos, &b, 1, got[i] + (pos - 32) * r.vocab),
                LLMEM_OK);
        }
    for (int i = 0; i < 2; i++) {
        assert_memory_equal(got[i], want[i] + 32 * r.vocab, (size_t)(28 * r.vocab) * 4);
        llmem_kv_seq_free(r.kv, s[i]);
        free(got[i]), free(want[i]);
    }
    assert_int_equal(llmem_kv_check(r.kv), LLMEM_OK);
    rig_close(&r);
}

/* Eviction takes the least recently used block, and a chain's last block before its first. */
static void test_eviction_order(void **state) {
    (void)state;
    struct rig r;
    rig_open(&r);
    int32_t x[48], y[48];
    make_prompt(x, 48, 11);
    make_prompt(y, 48, 12);
    const int32_t *p[2] = {x, y};
    for (int i = 0; i < 2; i++) {
        int seq;
        assert_int_equal(llmem_kv_seq_new(r.kv, &seq), LLMEM_OK);
        free(run_rows(&r, seq, p[i], 0, 48));
        assert_int_equal(llmem_bank_insert(r.bank, seq, p[i], 48), LLMEM_OK);
        llmem_kv_seq_free(r.kv, seq);
    }
    struct llmem_bank_stats st;
    llmem_bank_stats(r.bank, &st);
    assert_int_equal(st.blocks, 6);
    int64_t bb = st.bytes / 6, ids[3];
    /* x was banked first, then y; using x again makes y the least recent */
    assert_int_equal(llmem_bank_lookup(r.bank, x, 48, 3, ids), 3);
    llmem_bank_trim(r.bank, 5 * bb); /* y's last block goes */
    assert_int_equal(llmem_bank_lookup(r.bank, y, 48, 3, ids), 2);
    assert_int_equal(llmem_bank_lookup(r.bank, x, 48, 3, ids), 3);
    llmem_bank_trim(r.bank, 3 * bb); /* y's two remaining blocks, last first */
    assert_int_equal(llmem_bank_lookup(r.bank, y, 48, 3, ids), 0);
    assert_int_equal(llmem_bank_lookup(r.bank, x, 48, 3, ids), 3);
    llmem_bank_trim(r.bank, 2 * bb); /* then x's last block */
    assert_int_equal(llmem_bank_lookup(r.bank, x, 48, 3, ids), 2);
    llmem_bank_stats(r.bank, &st);
    assert_int_equal(st.evicted_blocks, 4);
    assert_int_equal(st.blocks, 2);
    rig_close(&r);
}

/* A block's raw bytes copied out (as the spill store writes them) and into fresh blocks of the
 * pool (as it loads them) continue a prompt exactly as the original blocks do: the logits of the
 * tail are bit for bit those of a cold prefill. */
static void test_block_bytes_roundtrip(void **state) {
    (void)state;
    struct rig r;
    rig_open(&r);
    int32_t a[1013];
    make_prompt(a, 1013, 77);
    int seq;
    assert_int_equal(llmem_kv_seq_new(r.kv, &seq), LLMEM_OK);
    float *cold = run_rows(&r, seq, a, 0, 1013);
    const int64_t *ids = NULL;
    llmem_kv_seq_blocks(r.kv, seq, &ids);
    int64_t bb = llmem_kv_block_bytes(r.kv), n = 1000 / 16;
    uint8_t *bytes = malloc((size_t)(n * bb));
    for (int64_t b = 0; b < n; b++)
        llmem_kv_block_copy_out(r.kv, ids[b], bytes + b * bb);
    llmem_kv_seq_free(r.kv, seq);
    struct llmem_kv_stats ks;
    llmem_kv_stats(r.kv, &ks);
    assert_int_equal(ks.n_blocks_used, 0);
    int64_t fresh[64];
    for (int64_t b = 0; b < n; b++)
        assert_int_equal(llmem_kv_block_new_from(r.kv, bytes + b * bb, &fresh[b]), LLMEM_OK);
    assert_int_equal(llmem_kv_check(r.kv), LLMEM_OK);
    assert_int_equal(llmem_kv_seq_new_from_blocks(r.kv, fresh, n, &seq), LLMEM_OK);
    for (int64_t b = 0; b < n; b++)
        llmem_kv_block_release(r.kv, fresh[b]); /* the sequence holds them now */
    float *warm = run_rows(&r, seq, a, n * 16, 1013);
    assert_memory_equal(warm, cold + n * 16 * r.vocab, (size_t)((1013 - n * 16) * r.vocab) * 4);
    llmem_kv_seq_free(r.kv, seq);
    /* a pool with no free block refuses, without growing */
    int64_t total = llmem_kv_blocks_free(r.kv), got = 0, id;
    int64_t *all = malloc((size_t)total * sizeof(int64_t));
    while (llmem_kv_block_new_from(r.kv, bytes, &id) == LLMEM_OK)
        all[got++] = id;
    assert_int_equal(got, total);
    assert_int_equal(llmem_kv_blocks_free(r.kv), 0);
    for (int64_t i = 0; i < got; i++)
        llmem_kv_block_release(r.kv, all[i]);
    assert_int_equal(llmem_kv_check(r.kv), LLMEM_OK);
    free(all), free(bytes), free(cold), free(warm);
    rig_close(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_identity),
        cmocka_unit_test(test_block_hash),
        cmocka_unit_test(test_prefix_reuse_equals_cold),
        cmocka_unit_test(test_shared_blocks_diverge),
        cmocka_unit_test(test_eviction_order),
        cmocka_unit_test(test_block_bytes_roundtrip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

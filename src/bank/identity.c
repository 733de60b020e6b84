/*
 * bank/identity.c — the root of the session bank's hash chains (see llmem/bank.h): what makes KV
 * computed by one model (its weights and config.json), tokenizer and KV format unusable by any
 * other.
 *
 * The digest cache is a text file of lines "<size> <mtime_ns> <32 hex digits> <path>": a line is
 * used only when the file's size and modification time still match, so a file rewritten in place
 * (a fine-tune saved over the old one) is read again.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "core/file.h"
#include "core/hash.h"
#include "core/log.h"
#include "llmem/bank.h"
#include "llmem/model.h"
#include "llmem/safetensors.h"
#include "model/gguf.h"

#define IDENTITY_FUNC "llmem_bank_identity"
#define CACHE_MAX     ((int64_t)4 << 20)

static const char domain[] = "llmem session bank v1";

/* ---- the digest cache ------------------------------------------------------------------------ */

struct cache {
    char *text;  /* the file as read, or NULL */
    char *added; /* lines to append */
    size_t added_len;
};

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* The cached digest of (path, size, mtime), if a line holds it. */
static int cache_find(const struct cache *c, const char *path, int64_t size, int64_t mtime,
                      uint8_t out[16]) {
    for (const char *line = c->text; line != NULL && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end != NULL ? (size_t)(end - line) : strlen(line);
        long long s = -1, m = -1;
        char hexd[33];
        int off = 0;
        if (sscanf(line, "%lld %lld %32s %n", &s, &m, hexd, &off) == 3 && off > 0 &&
            (size_t)off <= len && s == size && m == mtime && strlen(hexd) == 32 &&
            len - (size_t)off == strlen(path) && memcmp(line + off, path, strlen(path)) == 0) {
            int ok = 1;
            for (int i = 0; i < 16 && ok; i++) {
                int hi = hexval(hexd[2 * i]), lo = hexval(hexd[2 * i + 1]);
                ok = hi >= 0 && lo >= 0;
                out[i] = (uint8_t)(hi << 4 | lo);
            }
            if (ok)
                return 1;
        }
        line = end != NULL ? end + 1 : NULL;
    }
    return 0;
}

static int cache_add(struct cache *c, const char *path, int64_t size, int64_t mtime,
                     const uint8_t d[16]) {
    char line[4200];
    int n = snprintf(line, sizeof(line), "%" PRId64 " %" PRId64 " ", size, mtime);
    for (int i = 0; i < 16; i++)
        n += snprintf(line + n, sizeof(line) - (size_t)n, "%02x", d[i]);
    n += snprintf(line + n, sizeof(line) - (size_t)n, " %s\n", path);
    if (n >= (int)sizeof(line) || strchr(path, '\n') != NULL)
        return LLMEM_OK; /* not cacheable; computed again next time */
    char *p = realloc(c->added, c->added_len + (size_t)n + 1);
    if (p == NULL)
        return LLMEM_ENOMEM;
    memcpy(p + c->added_len, line, (size_t)n + 1);
    c->added = p;
    c->added_len += (size_t)n;
    return LLMEM_OK;
}

/* Writes the old lines and the new ones to a temp file and renames it over the cache; a failure
 * only costs the next run a re-read (logged at WARN). */
static void cache_save(const struct cache *c, const char *cache_path) {
    if (c->added_len == 0)
        return;
    char tmp[4200];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", cache_path, (long)getpid()) >= (int)sizeof(tmp))
        return;
    FILE *f = fopen(tmp, "w");
    int ok = f != NULL;
    if (ok && c->text != NULL)
        ok = fputs(c->text, f) >= 0;
    ok = ok && fwrite(c->added, 1, c->added_len, f) == c->added_len;
    if (f != NULL) { /* (closed whatever the flush did) */
        const int flushed = fflush(f) == 0 && fsync(fileno(f)) == 0;
        ok = (fclose(f) == 0) && flushed && ok;
    }
    if (!ok || rename(tmp, cache_path) != 0) {
        LLMEM_WARN("%s: cannot update the digest cache: %s", cache_path, strerror(errno));
        unlink(tmp);
    }
}

/* ---- the identity -----------------------------------------------------------------------------
 */

static int file_digest(struct cache *c, const char *path, uint8_t out[16]) {
    struct stat st;
    if (stat(path, &st) != 0) {
        LLMEM_ERROR_AS(IDENTITY_FUNC, "%s: %s", path, strerror(errno));
        return errno == ENOENT ? LLMEM_ENOENT : LLMEM_EIO;
    }
    int64_t mtime = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    if (cache_find(c, path, (int64_t)st.st_size, mtime, out))
        return LLMEM_OK;
    int status = llmem_digest_file(path, out);
    if (status == LLMEM_OK)
        status = cache_add(c, path, (int64_t)st.st_size, mtime, out);
    return status;
}

int llmem_bank_identity(const char *model_dir, enum llmem_kv_format format,
                        enum llmem_kv_layout layout, const char *salt, const char *cache_path,
                        struct llmem_bank_identity *out) {
    /* a GGUF file holds the weights, their block types and the tokenizer: one digest for all */
    const int gguf = llmem_gguf_is_gguf(model_dir);
    struct llmem_safetensors *st = NULL;
    int status = gguf ? LLMEM_OK : llmem_safetensors_load_dir(model_dir, &st);
    if (status != LLMEM_OK)
        return status;
    struct cache c = {0};
    if (cache_path != NULL) {
        size_t len = 0;
        if (llmem_file_read_quiet(cache_path, CACHE_MAX, &c.text, &len) != LLMEM_OK)
            c.text = NULL;
    }
    struct llmem_bank_identity id;
    XXH3_state_t *xs = XXH3_createState();
    if (xs == NULL || XXH3_128bits_reset(xs) != XXH_OK) {
        LLMEM_ERROR_AS(IDENTITY_FUNC, "out of memory");
        status = LLMEM_ENOMEM;
        goto out;
    }
    for (int f = 0; f < (gguf ? 1 : st->n_files); f++) {
        uint8_t d[16];
        if ((status = file_digest(&c, gguf ? model_dir : st->files[f].path, d)) != LLMEM_OK)
            goto out;
        XXH3_128bits_update(xs, d, sizeof(d));
    }
    char path[4200];
    if (!gguf) { /* config.json: the same weights under other numbers (rope, norms) are not the
                  * same model */
        uint8_t d[16];
        if ((status = llmem_path_join(path, sizeof(path), model_dir, "config.json")) != LLMEM_OK ||
            (status = file_digest(&c, path, d)) != LLMEM_OK)
            goto out;
        XXH3_128bits_update(xs, d, sizeof(d));
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(xs));
    memcpy(id.weights, canon.digest, 16);
    if (gguf)
        memcpy(id.tokenizer, id.weights, 16);
    else if ((status = llmem_path_join(path, sizeof(path), model_dir, "tokenizer.json")) !=
                 LLMEM_OK ||
             (status = file_digest(&c, path, id.tokenizer)) != LLMEM_OK)
        goto out;

    uint32_t numbers[3] = {(uint32_t)format, (uint32_t)layout, LLMEM_BANK_NUMERICS_VERSION};
    const void *parts[] = {domain, id.weights, id.tokenizer, numbers, salt != NULL ? salt : ""};
    size_t sizes[] = {sizeof(domain), 16, 16, sizeof(numbers), salt != NULL ? strlen(salt) : 0};
    llmem_sha256(parts, sizes, 5, id.root);
    if (cache_path != NULL)
        cache_save(&c, cache_path);
    *out = id;
out:
    XXH3_freeState(xs);
    free(c.text);
    free(c.added);
    llmem_safetensors_free(st);
    return status;
}

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the block hash reads token ids as little-endian int32 in place"
#endif

void llmem_bank_block_hash(const uint8_t prev[32], const int32_t *tokens, int n, uint8_t out[32]) {
    const void *parts[] = {prev, tokens};
    size_t sizes[] = {32, (size_t)n * sizeof(int32_t)};
    llmem_sha256(parts, sizes, 2, out);
}

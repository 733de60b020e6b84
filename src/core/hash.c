/*
 * core/hash.c — the project's hashes (see core/hash.h): XXH3 from libxxhash, SHA-256 from
 * OpenSSL's libcrypto.
 */
#include "core/hash.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <xxhash.h>

#include "core/file.h"
#include "core/log.h"
#include "llmem/status.h"

uint64_t llmem_hash64(const void *p, size_t n, uint64_t seed) {
    return (uint64_t)XXH3_64bits_withSeed(p, n, (XXH64_hash_t)seed);
}

int llmem_digest_file(const char *path, uint8_t out[16]) {
    int fd;
    int opened = llmem_file_open_regular(path, __func__, &fd);
    if (opened != LLMEM_OK)
        return opened;
    FILE *f = fdopen(fd, "rb");
    if (f == NULL) {
        LLMEM_ERROR("%s: %s", path, strerror(errno));
        close(fd);
        return LLMEM_ENOMEM;
    }
    enum { STEP = 4 << 20 };
    char *buf = malloc(STEP);
    XXH3_state_t *st = XXH3_createState();
    int status = LLMEM_OK;
    if (buf == NULL || st == NULL || XXH3_128bits_reset(st) != XXH_OK) {
        LLMEM_ERROR("%s: out of memory", path);
        status = LLMEM_ENOMEM;
        goto out;
    }
    size_t n;
    while ((n = fread(buf, 1, STEP, f)) > 0)
        XXH3_128bits_update(st, buf, n);
    if (ferror(f)) {
        LLMEM_ERROR("%s: read failed: %s", path, strerror(errno));
        status = LLMEM_EIO;
        goto out;
    }
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
    memcpy(out, c.digest, 16);
out:
    XXH3_freeState(st);
    free(buf);
    fclose(f);
    return status;
}

void llmem_digest(const void *p, size_t n, uint8_t out[16]) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(p, n));
    memcpy(out, c.digest, 16);
}

void llmem_sha256(const void *const *parts, const size_t *sizes, int n_parts, uint8_t out[32]) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned int len = 0;
    int ok = ctx != NULL && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1;
    for (int i = 0; ok && i < n_parts; i++)
        ok = EVP_DigestUpdate(ctx, parts[i], sizes[i]) == 1;
    ok = ok && EVP_DigestFinal_ex(ctx, out, &len) == 1 && len == 32;
    EVP_MD_CTX_free(ctx);
    LLMEM_ASSERT(ok); /* SHA-256 over memory cannot fail short of a broken libcrypto */
}

/*
 * bank/spill_file.c — the spill store's chunk files (see llmem/spill.h): their names, the header
 * encoded and decoded, a file opened, read whole and verified against its checksum, the keys of a
 * chain's chunks.
 *
 * File layout (little-endian), HEADER_BYTES of header, then n_tokens int32 token ids, then n_blocks
 * blocks of block_bytes each:
 *   0 magic "LLMEMKV\0" | 8 version u32 | 12 header+tokens bytes u32 | 16 root[32] | 48 key[32]
 *   80 parent[32] | 112 position i64 | 120 n_tokens i32 | 124 n_blocks i32 | 128 block_size i32
 *   132 format i32 | 136 n_layers i32 | 140 n_kv_heads i32 | 144 head_dim i32 | 148 (zero)
 *   152 block_bytes i64 | 160 payload_bytes i64 | 168 checksum[16] | 184 (zero)
 * The checksum is XXH3-128 (llmem_digest) of the whole file with the checksum field zeroed.
 *
 * Guarantee: nothing is handed on without its header agreeing with itself and with the file's
 * size, and (llmem_spill_read_verified) without its checksum agreeing.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bank/spill_int.h"
#include "core/file.h"
#include "core/hash.h"
#include "llmem/bank.h"

/* ---- names and reads ------------------------------------------------------------------------- */

void llmem_spill_chunk_name(const uint8_t key[32], char name[NAME_LEN + 1]) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        name[2 * i] = digits[key[i] >> 4];
        name[2 * i + 1] = digits[key[i] & 15];
    }
    memcpy(name + 64, ".kv", 4);
}

/* "<64 hex>.kv" → key; 0 for any other name. */
int llmem_spill_parse_chunk_name(const char *name, uint8_t key[32]) {
    if (strlen(name) != NAME_LEN || strcmp(name + 64, ".kv") != 0)
        return 0;
    for (int i = 0; i < 64; i++) {
        char c = name[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0)
            return 0;
        if (i % 2 == 0)
            key[i / 2] = (uint8_t)(v << 4);
        else
            key[i / 2] |= (uint8_t)v;
    }
    return 1;
}

static int read_at(int fd, void *buf, size_t n, int64_t off) {
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
        off += r;
    }
    return 0;
}

/* ---- the header ----------------------------------------------------------------------------- */

static void put32(uint8_t *b, int off, uint32_t v) {
    memcpy(b + off, &v, 4);
}
static void put64(uint8_t *b, int off, int64_t v) {
    memcpy(b + off, &v, 8);
}
static uint32_t get32(const uint8_t *b, int off) {
    uint32_t v;
    memcpy(&v, b + off, 4);
    return v;
}
static int64_t get64(const uint8_t *b, int off) {
    int64_t v;
    memcpy(&v, b + off, 8);
    return v;
}

void llmem_spill_header_encode(const struct header *h, uint8_t b[HEADER_BYTES]) {
    memset(b, 0, HEADER_BYTES);
    memcpy(b, MAGIC, 8);
    put32(b, 8, h->version);
    put32(b, 12, h->header_tokens_bytes);
    memcpy(b + 16, h->root, 32);
    memcpy(b + 48, h->key, 32);
    memcpy(b + 80, h->parent, 32);
    put64(b, 112, h->position);
    put32(b, 120, (uint32_t)h->n_tokens);
    put32(b, 124, (uint32_t)h->n_blocks);
    put32(b, 128, (uint32_t)h->block_size);
    put32(b, 132, (uint32_t)h->format);
    put32(b, 136, (uint32_t)h->n_layers);
    put32(b, 140, (uint32_t)h->n_kv_heads);
    put32(b, 144, (uint32_t)h->head_dim);
    put64(b, 152, h->block_bytes);
    put64(b, 160, h->payload_bytes);
    memcpy(b + OFF_CHECKSUM, h->checksum, 16);
}

/* Decodes and checks the header's own consistency against a file of file_size bytes. */
static enum reason header_decode(const uint8_t b[HEADER_BYTES], int64_t file_size, struct header *h,
                                 char *why, size_t why_size) {
    if (memcmp(b, MAGIC, 8) != 0) {
        snprintf(why, why_size, "not a spill chunk (bad magic)");
        return CHUNK_CORRUPT;
    }
    h->version = get32(b, 8);
    if (h->version != VERSION) {
        snprintf(why, why_size, "chunk format version %u, this build reads %d", h->version,
                 VERSION);
        return CHUNK_CORRUPT;
    }
    h->header_tokens_bytes = get32(b, 12);
    memcpy(h->root, b + 16, 32);
    memcpy(h->key, b + 48, 32);
    memcpy(h->parent, b + 80, 32);
    h->position = get64(b, 112);
    h->n_tokens = (int32_t)get32(b, 120);
    h->n_blocks = (int32_t)get32(b, 124);
    h->block_size = (int32_t)get32(b, 128);
    h->format = (int32_t)get32(b, 132);
    h->n_layers = (int32_t)get32(b, 136);
    h->n_kv_heads = (int32_t)get32(b, 140);
    h->head_dim = (int32_t)get32(b, 144);
    h->block_bytes = get64(b, 152);
    h->payload_bytes = get64(b, 160);
    memcpy(h->checksum, b + OFF_CHECKSUM, 16);
    if (h->n_blocks < 1 || h->n_blocks > LLMEM_SPILL_CHUNK_BLOCKS || h->block_size < 1 ||
        h->block_size > (1 << 20) || h->n_tokens != h->n_blocks * h->block_size ||
        h->position < 0 || h->block_bytes < 1 || h->block_bytes > ((int64_t)1 << 36) ||
        h->payload_bytes != h->n_blocks * h->block_bytes ||
        h->header_tokens_bytes != (uint32_t)(HEADER_BYTES + 4 * (int64_t)h->n_tokens)) {
        snprintf(why, why_size, "inconsistent header (%d blocks of %d tokens, %lld payload bytes)",
                 h->n_blocks, h->block_size, (long long)h->payload_bytes);
        return CHUNK_CORRUPT;
    }
    int64_t want = (int64_t)h->header_tokens_bytes + h->payload_bytes;
    if (file_size != want) {
        snprintf(why, why_size, "%lld bytes but its header describes %lld (truncated or extended)",
                 (long long)file_size, (long long)want);
        return CHUNK_TRUNCATED;
    }
    return CHUNK_OK;
}

/* Opens dir/name and reads its header: CHUNK_OK with *fd open, else *fd = −1. */
enum reason llmem_spill_open_chunk(const struct llmem_spill *s, const char *name, struct header *h,
                                   int *fd, int64_t *size, char *why, size_t why_size) {
    char err[160];
    if (llmem_file_open_regular_at(s->dir_fd, name, fd, err, sizeof(err)) != LLMEM_OK) {
        snprintf(why, why_size, "cannot open: %s", err);
        return CHUNK_IO;
    }
    struct stat st;
    uint8_t b[HEADER_BYTES];
    enum reason r = CHUNK_OK;
    if (fstat(*fd, &st) != 0) {
        snprintf(why, why_size, "cannot stat: %s", strerror(errno));
        r = CHUNK_IO;
    } else if (st.st_size < HEADER_BYTES) {
        snprintf(why, why_size, "%lld bytes, shorter than a header", (long long)st.st_size);
        r = CHUNK_TRUNCATED;
    } else if (read_at(*fd, b, HEADER_BYTES, 0) != 0) {
        snprintf(why, why_size, "cannot read the header: %s", strerror(errno));
        r = CHUNK_IO;
    } else {
        *size = (int64_t)st.st_size;
        r = header_decode(b, *size, h, why, why_size);
    }
    if (r != CHUNK_OK) {
        close(*fd);
        *fd = -1;
    }
    return r;
}

/* Reads the whole file into buf (size bytes) and checks its checksum. */
enum reason llmem_spill_read_verified(int fd, uint8_t *buf, int64_t size, char *why,
                                      size_t why_size) {
    if (read_at(fd, buf, (size_t)size, 0) != 0) {
        snprintf(why, why_size, "read failed: %s", errno ? strerror(errno) : "short read");
        return CHUNK_IO;
    }
    uint8_t want[16], got[16];
    memcpy(want, buf + OFF_CHECKSUM, 16);
    memset(buf + OFF_CHECKSUM, 0, 16);
    llmem_digest(buf, (size_t)size, got);
    memcpy(buf + OFF_CHECKSUM, want, 16);
    if (memcmp(want, got, 16) != 0) {
        snprintf(why, why_size, "checksum mismatch (the file was altered or damaged)");
        return CHUNK_CORRUPT;
    }
    return CHUNK_OK;
}

/* Opens, reads and verifies a whole chunk file into a buffer from the store's allocator. */
enum reason llmem_spill_load_file(struct llmem_spill *s, const char *name, struct header *h,
                                  uint8_t **buf, int64_t *size, char *why, size_t why_size) {
    int fd = -1;
    *buf = NULL;
    enum reason r = llmem_spill_open_chunk(s, name, h, &fd, size, why, why_size);
    if (r != CHUNK_OK)
        return r;
    *buf = buf_alloc(s, (size_t)*size);
    if (*buf == NULL) {
        snprintf(why, why_size, "no memory for %lld bytes", (long long)*size);
        r = CHUNK_NO_MEMORY;
    } else {
        r = llmem_spill_read_verified(fd, *buf, *size, why, why_size);
    }
    close(fd);
    if (r != CHUNK_OK) {
        buf_free(s, *buf);
        *buf = NULL;
    }
    return r;
}

/* ---- token ids, chain keys, geometry --------------------------------------------------------- */

/* The token ids of a sibling chunk file (n of them at most) into out; its count, or −1. */
int64_t llmem_spill_read_tokens(struct llmem_spill *s, const uint8_t key[32], int32_t *out,
                                int64_t max) {
    char name[NAME_LEN + 1], why[256];
    llmem_spill_chunk_name(key, name);
    struct header h;
    int fd = -1;
    int64_t size = 0;
    if (llmem_spill_open_chunk(s, name, &h, &fd, &size, why, sizeof(why)) != CHUNK_OK)
        return -1;
    int64_t n = h.n_tokens < max ? h.n_tokens : max;
    int ok = read_at(fd, out, (size_t)n * 4, HEADER_BYTES) == 0;
    close(fd);
    return ok ? n : -1;
}

/* The chain hashes h[0..n] of tokens' first n blocks: h[0] = root, h[i] after block i. */
uint8_t (*llmem_spill_chain_hashes(const uint8_t root[32], const int32_t *tokens, int64_t n,
                                   int bs))[32] {
    uint8_t(*h)[32] = malloc((size_t)(n + 1) * 32);
    if (h == NULL)
        return NULL;
    memcpy(h[0], root, 32);
    for (int64_t i = 0; i < n; i++)
        llmem_bank_block_hash(h[i], tokens + i * bs, bs, h[i + 1]);
    return h;
}

void llmem_spill_fill_geometry(struct header *h, const struct llmem_kv *kv) {
    const struct llmem_kv_config *c = llmem_kv_get_config(kv);
    h->block_size = llmem_kv_block_size(kv);
    h->format = (int32_t)c->format;
    h->n_layers = c->n_layers;
    h->n_kv_heads = c->n_kv_heads;
    h->head_dim = c->head_dim;
    h->block_bytes = llmem_kv_block_bytes(kv);
}

/*
 * bank/spill_int.h — what the files of the spill store share (spill.c: open, reconcile, close,
 * load; spill_file.c: the chunk files; spill_manifest.c: the SQLite manifest; spill_writer.c: the
 * writer thread): the store, a chunk file's header, a queued chunk, why a file cannot be served,
 * and the functions each file offers the others.
 */
#ifndef LLMEM_BANK_SPILL_INT_H
#define LLMEM_BANK_SPILL_INT_H

#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include <sqlite3.h>

#include "core/clock.h"
#include "llmem/kv.h"
#include "llmem/mem.h"
#include "llmem/spill.h"

#define MAGIC           "LLMEMKV"
#define VERSION         1
#define HEADER_BYTES    192
#define OFF_CHECKSUM    168
#define MANIFEST        "manifest.sqlite"
#define SCHEMA_VERSION  1
#define NAME_LEN        (64 + 3) /* "<64 hex>.kv" */
#define MAX_CANDIDATES  64       /* children of one parent considered per lookup step */
#define MAX_PEEKS       8        /* of them, headers read to compare tokens */
#define MAX_PEEK_TOKENS 1024     /* token ids of one chunk compared at most (blocks up to 64) */

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "spill files are written and read as little-endian in place"
#endif

struct header {
    uint32_t version, header_tokens_bytes;
    uint8_t root[32], key[32], parent[32];
    int64_t position;
    int32_t n_tokens, n_blocks, block_size, format, n_layers, n_kv_heads, head_dim;
    int64_t block_bytes, payload_bytes;
    uint8_t checksum[16];
};

/* A chunk waiting for the writer: the whole file, built in staging memory. */
struct job {
    struct job *next;
    uint8_t key[32], parent[32];
    int64_t position, n_tokens;
    int64_t when; /* submitted (ms since the epoch): created and last access of its row */
    uint8_t *buf;
    int64_t bytes;
    const struct llmem_kv *copies; /* the cache whose copies to the host fill buf (NULL: done) */
};

struct llmem_spill {
    struct llmem_spill_config cfg;
    char dir[PATH_MAX];
    int dir_fd;
    int owned;
    char *open_why; /* while opening as a cache: where a failure's reason goes, not the log */
    size_t open_why_size;
    sqlite3 *db;
    sqlite3_stmt *q_exists, *q_children, *q_insert, *q_delete, *q_touch, *q_lru;
    pthread_mutex_t lock;
    pthread_cond_t wake, idle;
    pthread_t writer;
    int has_writer, closing, aborting;
    struct job *head, *tail, *current;
    int64_t chunk_bytes, temp_bytes, other_bytes;
    int64_t window_start_ms, window_bytes;
    int warned_disk, warned_budget, warned_write;
    struct llmem_spill_stats st;
};

/* Why a chunk file cannot be served. */
enum reason {
    CHUNK_OK = 0,
    CHUNK_IO,
    CHUNK_TRUNCATED,
    CHUNK_CORRUPT,
    CHUNK_IDENTITY,
    CHUNK_FORMAT,
    CHUNK_NO_MEMORY
};

/* A row of the manifest: a chunk and its size. */
struct sibling {
    uint8_t key[32];
    int64_t tokens, bytes;
};

/* ---- small helpers -------------------------------------------------------------------------- */

static inline int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Staging and read buffers: from the store's allocator (tag bank), else malloc. */
static inline void *buf_alloc(struct llmem_spill *s, size_t n) {
    return s->cfg.mem != NULL ? llmem_mem_alloc(s->cfg.mem, n, LLMEM_TAG_BANK) : malloc(n);
}

static inline void buf_free(struct llmem_spill *s, void *p) {
    if (p == NULL)
        return;
    if (s->cfg.mem != NULL)
        llmem_mem_free(s->cfg.mem, p);
    else
        free(p);
}

/* ---- the chunk files (spill_file.c) ---------------------------------------------------------- */

/* "<64 hex>.kv" of a key. */
void llmem_spill_chunk_name(const uint8_t key[32], char name[NAME_LEN + 1]);
/* "<64 hex>.kv" → key; 0 for any other name. */
int llmem_spill_parse_chunk_name(const char *name, uint8_t key[32]);
void llmem_spill_header_encode(const struct header *h, uint8_t b[HEADER_BYTES]);
/* Opens dir/name and reads its header: CHUNK_OK with *fd open, else *fd = −1 (why says why). */
enum reason llmem_spill_open_chunk(const struct llmem_spill *s, const char *name, struct header *h,
                                   int *fd, int64_t *size, char *why, size_t why_size);
/* Reads the whole file into buf (size bytes) and checks its checksum. */
enum reason llmem_spill_read_verified(int fd, uint8_t *buf, int64_t size, char *why,
                                      size_t why_size);
/* Opens, reads and verifies a whole chunk file into a buffer from the store's allocator. */
enum reason llmem_spill_load_file(struct llmem_spill *s, const char *name, struct header *h,
                                  uint8_t **buf, int64_t *size, char *why, size_t why_size);
/* The token ids of a chunk file (max of them at most) into out; its count, or −1. */
int64_t llmem_spill_read_tokens(struct llmem_spill *s, const uint8_t key[32], int32_t *out,
                                int64_t max);
/* The chain hashes h[0..n] of tokens' first n blocks of bs: h[0] = root, h[i] after block i
 * (malloc'd; NULL on out of memory). */
uint8_t (*llmem_spill_chain_hashes(const uint8_t root[32], const int32_t *tokens, int64_t n,
                                   int bs))[32];
/* The KV format and geometry of kv's blocks into a header. */
void llmem_spill_fill_geometry(struct header *h, const struct llmem_kv *kv);

/* ---- the manifest (spill_manifest.c; every call under the store's lock) ---------------------- */

/* Opens the manifest and prepares the statements: SQLITE_OK, or the failing SQLite code with a
 * message in why. */
int llmem_spill_db_open(struct llmem_spill *s, char *why, size_t why_size);
void llmem_spill_db_close(struct llmem_spill *s);
int llmem_spill_db_exists(struct llmem_spill *s, const uint8_t key[32]);
/* 0, or −1 when the row could not be deleted (inserted). */
int llmem_spill_db_delete(struct llmem_spill *s, const uint8_t key[32]);
int llmem_spill_db_insert(struct llmem_spill *s, const struct header *h, int64_t bytes,
                          int64_t when);
/* A hit: last access `when`, hits + 1. */
void llmem_spill_db_touch(struct llmem_spill *s, const uint8_t key[32], int64_t when);
/* The chunks with the same parent (up to MAX_CANDIDATES, most recently used first). */
int llmem_spill_children(struct llmem_spill *s, const uint8_t parent[32], struct sibling *out);
/* Drops a chunk: its row first, then its file. */
void llmem_spill_drop_chunk(struct llmem_spill *s, const uint8_t key[32], int64_t bytes);
/* Drops a chunk that failed a check, counting it and saying why. */
void llmem_spill_drop_bad(struct llmem_spill *s, const uint8_t key[32], int64_t bytes,
                          const char *why);
/* Evicts least recently used chunks until `incoming` more bytes fit the cap: 0, or −1 when even
 * an empty store cannot take them. */
int llmem_spill_make_room(struct llmem_spill *s, int64_t incoming);
/* Every file of the directory: what the cap bounds. */
int64_t llmem_spill_total_bytes(const struct llmem_spill *s);
/* The manifest's own files (manifest.sqlite and its -wal, -shm, -journal). */
int llmem_spill_is_manifest_name(const char *name);

/* ---- the writer (spill_writer.c) ------------------------------------------------------------- */

/* The writer thread's body (arg: the store). */
void *llmem_spill_writer_main(void *arg);
/* Frees a queued chunk once no copy may still write into its buffer. */
void llmem_spill_free_job(struct llmem_spill *s, struct job *j);
/* Free bytes of the store's disk (the probe of its configuration, if any); −1 when unknown. */
int64_t llmem_spill_free_disk(const struct llmem_spill *s);

#endif

/*
 * bank/spill.c — the session bank's spill store (see llmem/spill.h): chunk files, a SQLite
 * manifest, one owner by flock, a writer thread with a bounded queue, reconciliation at open.
 *
 * Guarantees:
 *  - a manifest row is added only after its file was written in full, fsynced and renamed into
 *    place (and the directory fsynced); a row is deleted before its file is unlinked. A process
 *    killed anywhere leaves the manifest pointing only at complete files; what it leaves behind
 *    (a temp file, a renamed file without its row) is removed by the next open;
 *  - nothing is served without its header (magic, version, key, parent, position, sizes), the
 *    identity root, the KV format and geometry, the token ids and the checksum agreeing; a file
 *    that disagrees is counted as a miss by reason, and dropped with its row;
 *  - the writer thread reads only staging buffers filled by llmem_spill_submit on the caller's
 *    thread, never the KV pool; every use of the manifest and of the counters is under one mutex;
 *  - the directory never holds more than the cap before a write (every file counted): least
 *    recently used chunks go first, and among chunks used at the same time the deepest of a chain.
 *
 * File layout (little-endian), HEADER_BYTES of header, then n_tokens int32 token ids, then n_blocks
 * blocks of block_bytes each:
 *   0 magic "LLMEMKV\0" | 8 version u32 | 12 header+tokens bytes u32 | 16 root[32] | 48 key[32]
 *   80 parent[32] | 112 position i64 | 120 n_tokens i32 | 124 n_blocks i32 | 128 block_size i32
 *   132 format i32 | 136 n_layers i32 | 140 n_kv_heads i32 | 144 head_dim i32 | 148 (zero)
 *   152 block_bytes i64 | 160 payload_bytes i64 | 168 checksum[16] | 184 (zero)
 * The checksum is XXH3-128 (llmem_digest) of the whole file with the checksum field zeroed.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "core/clock.h"
#include "core/file.h"
#include "core/hash.h"
#include "core/log.h"
#include "core/options.h"
#include "llmem/bank.h"
#include "llmem/size.h"
#include "llmem/spill.h"
#include "llmem/sys.h"

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

/* ---- small helpers ------------------------------------------------------------------------- */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void chunk_name(const uint8_t key[32], char name[NAME_LEN + 1]) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        name[2 * i] = digits[key[i] >> 4];
        name[2 * i + 1] = digits[key[i] & 15];
    }
    memcpy(name + 64, ".kv", 4);
}

/* "<64 hex>.kv" → key; 0 for any other name. */
static int parse_chunk_name(const char *name, uint8_t key[32]) {
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

static void path_of(const struct llmem_spill *s, const char *name, char *path, size_t size) {
    snprintf(path, size, "%s/%s", s->dir, name);
}

static int64_t file_size_at(const struct llmem_spill *s, const char *name) {
    struct stat st;
    return fstatat(s->dir_fd, name, &st, 0) == 0 ? (int64_t)st.st_size : 0;
}

/* The manifest's own files. */
static int64_t manifest_bytes(const struct llmem_spill *s) {
    return file_size_at(s, MANIFEST) + file_size_at(s, MANIFEST "-wal") +
           file_size_at(s, MANIFEST "-shm") + file_size_at(s, MANIFEST "-journal");
}

static int is_manifest_name(const char *name) {
    return strcmp(name, MANIFEST) == 0 || strcmp(name, MANIFEST "-wal") == 0 ||
           strcmp(name, MANIFEST "-shm") == 0 || strcmp(name, MANIFEST "-journal") == 0;
}

/* Every file of the directory: what the cap bounds. Under the lock. */
static int64_t total_bytes(const struct llmem_spill *s) {
    return s->chunk_bytes + s->temp_bytes + s->other_bytes + manifest_bytes(s);
}

static void *buf_alloc(struct llmem_spill *s, size_t n) {
    return s->cfg.mem != NULL ? llmem_mem_alloc(s->cfg.mem, n, LLMEM_TAG_BANK) : malloc(n);
}

static void buf_free(struct llmem_spill *s, void *p) {
    if (p == NULL)
        return;
    if (s->cfg.mem != NULL)
        llmem_mem_free(s->cfg.mem, p);
    else
        free(p);
}

static int write_all(int fd, const uint8_t *p, int64_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, (size_t)(n < (1 << 30) ? n : (1 << 30)));
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= w;
    }
    return 0;
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

static void header_encode(const struct header *h, uint8_t b[HEADER_BYTES]) {
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
static enum reason open_chunk(const struct llmem_spill *s, const char *name, struct header *h,
                              int *fd, int64_t *size, char *why, size_t why_size) {
    *fd = openat(s->dir_fd, name, O_RDONLY | O_CLOEXEC);
    if (*fd < 0) {
        snprintf(why, why_size, "cannot open: %s", strerror(errno));
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
static enum reason read_verified(int fd, uint8_t *buf, int64_t size, char *why, size_t why_size) {
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
static enum reason load_file(struct llmem_spill *s, const char *name, struct header *h,
                             uint8_t **buf, int64_t *size, char *why, size_t why_size) {
    int fd = -1;
    *buf = NULL;
    enum reason r = open_chunk(s, name, h, &fd, size, why, why_size);
    if (r != CHUNK_OK)
        return r;
    *buf = buf_alloc(s, (size_t)*size);
    if (*buf == NULL) {
        snprintf(why, why_size, "no memory for %lld bytes", (long long)*size);
        r = CHUNK_NO_MEMORY;
    } else {
        r = read_verified(fd, *buf, *size, why, why_size);
    }
    close(fd);
    if (r != CHUNK_OK) {
        buf_free(s, *buf);
        *buf = NULL;
    }
    return r;
}

/* ---- the manifest --------------------------------------------------------------------------- */

static const char schema[] =
    "CREATE TABLE IF NOT EXISTS chunks("
    " hash BLOB PRIMARY KEY NOT NULL, parent BLOB NOT NULL, file TEXT NOT NULL,"
    " position INTEGER NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL,"
    " created INTEGER NOT NULL, last_access INTEGER NOT NULL, hits INTEGER NOT NULL DEFAULT 0"
    ") WITHOUT ROWID;"
    "CREATE INDEX IF NOT EXISTS chunks_parent ON chunks(parent);"
    "CREATE INDEX IF NOT EXISTS chunks_lru ON chunks(last_access, position DESC);";

static void db_close(struct llmem_spill *s) {
    sqlite3_stmt **q[] = {&s->q_exists, &s->q_children, &s->q_insert,
                          &s->q_delete, &s->q_touch,    &s->q_lru};
    for (size_t i = 0; i < sizeof(q) / sizeof(q[0]); i++) {
        sqlite3_finalize(*q[i]);
        *q[i] = NULL;
    }
    sqlite3_close(s->db);
    s->db = NULL;
}

/* Opens the manifest and prepares the statements: SQLITE_OK, or the failing SQLite code with a
 * message in why. */
static int db_open(struct llmem_spill *s, char *why, size_t why_size) {
    char path[PATH_MAX + 32];
    path_of(s, MANIFEST, path, sizeof(path));
    int rc = sqlite3_open_v2(
        path, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, NULL);
    int version = -1;
    sqlite3_stmt *v = NULL;
    if (rc == SQLITE_OK)
        rc = sqlite3_busy_timeout(s->db, 5000);
    if (rc == SQLITE_OK)
        rc = sqlite3_prepare_v2(s->db, "PRAGMA user_version", -1, &v, NULL);
    if (rc == SQLITE_OK) {
        rc = sqlite3_step(v);
        if (rc == SQLITE_ROW) {
            version = sqlite3_column_int(v, 0);
            rc = SQLITE_OK;
        }
    }
    sqlite3_finalize(v);
    if (rc == SQLITE_OK && version != 0 && version != SCHEMA_VERSION) {
        snprintf(why, why_size, "manifest schema version %d, this build reads %d", version,
                 SCHEMA_VERSION);
        return SQLITE_NOTADB;
    }
    char *err = NULL;
    if (rc == SQLITE_OK)
        rc = sqlite3_exec(s->db,
                          "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
                          "PRAGMA wal_autocheckpoint=64; PRAGMA journal_size_limit=262144;"
                          "PRAGMA user_version=1;",
                          NULL, NULL, &err);
    if (rc == SQLITE_OK)
        rc = sqlite3_exec(s->db, schema, NULL, NULL, &err);
    /* a manifest whose tables are not ours */
    if (rc == SQLITE_OK)
        rc = sqlite3_exec(s->db,
                          "SELECT hash, parent, file, position, tokens, bytes, created, "
                          "last_access, hits FROM chunks LIMIT 0",
                          NULL, NULL, &err);
    struct {
        sqlite3_stmt **q;
        const char *sql;
    } stmts[] = {
        {&s->q_exists, "SELECT 1 FROM chunks WHERE hash = ?1"},
        {&s->q_children, "SELECT hash, tokens, bytes FROM chunks WHERE parent = ?1 "
                         "ORDER BY last_access DESC LIMIT 64"},
        {&s->q_insert,
         "INSERT OR REPLACE INTO chunks(hash, parent, file, position, tokens, "
         "bytes, created, last_access, hits) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, 0)"},
        {&s->q_delete, "DELETE FROM chunks WHERE hash = ?1"},
        {&s->q_touch, "UPDATE chunks SET last_access = ?2, hits = hits + 1 WHERE hash = ?1"},
        {&s->q_lru, "SELECT hash, bytes FROM chunks ORDER BY last_access, position DESC LIMIT 16"},
    };
    for (size_t i = 0; rc == SQLITE_OK && i < sizeof(stmts) / sizeof(stmts[0]); i++)
        rc = sqlite3_prepare_v2(s->db, stmts[i].sql, -1, stmts[i].q, NULL);
    if (rc != SQLITE_OK)
        snprintf(why, why_size, "%s", err != NULL ? err : sqlite3_errstr(rc));
    sqlite3_free(err);
    return rc;
}

static int db_exists(struct llmem_spill *s, const uint8_t key[32]) {
    sqlite3_reset(s->q_exists);
    sqlite3_bind_blob(s->q_exists, 1, key, 32, SQLITE_STATIC);
    int found = sqlite3_step(s->q_exists) == SQLITE_ROW;
    sqlite3_reset(s->q_exists);
    return found;
}

static int db_delete(struct llmem_spill *s, const uint8_t key[32]) {
    sqlite3_reset(s->q_delete);
    sqlite3_bind_blob(s->q_delete, 1, key, 32, SQLITE_STATIC);
    int rc = sqlite3_step(s->q_delete);
    sqlite3_reset(s->q_delete);
    return rc == SQLITE_DONE ? 0 : -1;
}

static int db_insert(struct llmem_spill *s, const struct header *h, int64_t bytes, int64_t when) {
    char name[NAME_LEN + 1];
    chunk_name(h->key, name);
    sqlite3_stmt *q = s->q_insert;
    sqlite3_reset(q);
    sqlite3_bind_blob(q, 1, h->key, 32, SQLITE_STATIC);
    sqlite3_bind_blob(q, 2, h->parent, 32, SQLITE_STATIC);
    sqlite3_bind_text(q, 3, name, -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(q, 4, h->position);
    sqlite3_bind_int64(q, 5, h->n_tokens);
    sqlite3_bind_int64(q, 6, bytes);
    sqlite3_bind_int64(q, 7, when);
    int rc = sqlite3_step(q);
    sqlite3_reset(q);
    return rc == SQLITE_DONE ? 0 : -1;
}

static void db_touch(struct llmem_spill *s, const uint8_t key[32], int64_t when) {
    sqlite3_reset(s->q_touch);
    sqlite3_bind_blob(s->q_touch, 1, key, 32, SQLITE_STATIC);
    sqlite3_bind_int64(s->q_touch, 2, when);
    sqlite3_step(s->q_touch);
    sqlite3_reset(s->q_touch);
}

/* Drops a chunk: its row first, then its file (a crash in between leaves an orphan file, never
 * a row without its file). Under the lock. */
static void drop_chunk(struct llmem_spill *s, const uint8_t key[32], int64_t bytes) {
    char name[NAME_LEN + 1];
    chunk_name(key, name);
    if (db_delete(s, key) != 0)
        return;
    if (unlinkat(s->dir_fd, name, 0) == 0 || errno == ENOENT) {
        s->chunk_bytes -= bytes;
        s->st.files--;
    }
}

/* Drops a chunk that failed a check, counting it and saying why. Under the lock. */
static void drop_bad(struct llmem_spill *s, const uint8_t key[32], int64_t bytes, const char *why) {
    char name[NAME_LEN + 1];
    chunk_name(key, name);
    LLMEM_WARN("%s/%s: %s; the chunk is dropped", s->dir, name, why);
    drop_chunk(s, key, bytes);
    s->st.rows_dropped++;
}

/* Evicts least recently used chunks until `incoming` more bytes fit the cap. Under the lock.
 * Returns 0, or −1 when even an empty store cannot take them. */
static int make_room(struct llmem_spill *s, int64_t incoming) {
    while (total_bytes(s) + incoming > s->st.cap_bytes) {
        uint8_t keys[16][32];
        int64_t sizes[16];
        int n = 0;
        sqlite3_reset(s->q_lru);
        while (n < 16 && sqlite3_step(s->q_lru) == SQLITE_ROW) {
            if (sqlite3_column_bytes(s->q_lru, 0) == 32) {
                memcpy(keys[n], sqlite3_column_blob(s->q_lru, 0), 32);
                sizes[n++] = sqlite3_column_int64(s->q_lru, 1);
            }
        }
        sqlite3_reset(s->q_lru);
        if (n == 0)
            return -1;
        for (int i = 0; i < n && total_bytes(s) + incoming > s->st.cap_bytes; i++) {
            drop_chunk(s, keys[i], sizes[i]);
            s->st.evicted_files++;
            s->st.evicted_bytes += sizes[i];
        }
    }
    return 0;
}

/* ---- reconciliation --------------------------------------------------------------------------
 */

struct dir_entry {
    char name[NAME_LEN + 1];
    uint8_t key[32];
    int64_t size;
    int seen;
};

static int entry_cmp(const void *a, const void *b) {
    return memcmp(((const struct dir_entry *)a)->key, ((const struct dir_entry *)b)->key, 32);
}

/* Adds a row for a chunk file that verifies (the manifest is being rebuilt); 1 when added. */
static int adopt(struct llmem_spill *s, struct dir_entry *e) {
    struct header h;
    uint8_t *buf = NULL;
    int64_t size = 0;
    char why[256];
    if (load_file(s, e->name, &h, &buf, &size, why, sizeof(why)) != CHUNK_OK ||
        memcmp(h.key, e->key, 32) != 0) {
        buf_free(s, buf);
        return 0;
    }
    buf_free(s, buf);
    struct stat st;
    int64_t when = fstatat(s->dir_fd, e->name, &st, 0) == 0
                       ? (int64_t)st.st_mtim.tv_sec * 1000 + st.st_mtim.tv_nsec / 1000000
                       : now_ms();
    return db_insert(s, &h, size, when) == 0;
}

/* Lists the directory: stale temp files removed, chunk files into *out (sorted by key), the
 * bytes of anything else in other_bytes. */
static int list_dir(struct llmem_spill *s, struct dir_entry **out, int64_t *n_out) {
    int fd = dup(s->dir_fd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (d == NULL) {
        if (fd >= 0)
            close(fd);
        LLMEM_ERROR_AS("llmem_spill_open", "%s: cannot list: %s", s->dir, strerror(errno));
        return LLMEM_EIO;
    }
    rewinddir(d);
    struct dir_entry *v = NULL;
    int64_t n = 0, cap = 0;
    int status = LLMEM_OK;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        struct stat st;
        if (de->d_name[0] == '.' && (de->d_name[1] == '\0' || strcmp(de->d_name, "..") == 0))
            continue;
        if (fstatat(s->dir_fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode))
            continue;
        size_t len = strlen(de->d_name);
        uint8_t key[32];
        if (len > 4 && strcmp(de->d_name + len - 4, ".tmp") == 0) {
            if (unlinkat(s->dir_fd, de->d_name, 0) == 0)
                s->st.temps_removed++;
            else
                s->other_bytes += st.st_size;
        } else if (parse_chunk_name(de->d_name, key)) {
            if (n == cap) {
                cap = cap ? cap * 2 : 256;
                struct dir_entry *nv = realloc(v, (size_t)cap * sizeof(*v));
                if (nv == NULL) {
                    status = LLMEM_ENOMEM;
                    break;
                }
                v = nv;
            }
            memcpy(v[n].name, de->d_name, NAME_LEN + 1);
            memcpy(v[n].key, key, 32);
            v[n].size = (int64_t)st.st_size;
            v[n].seen = 0;
            n++;
        } else if (!is_manifest_name(de->d_name)) {
            s->other_bytes += st.st_size;
        }
    }
    closedir(d);
    if (status != LLMEM_OK) {
        free(v);
        LLMEM_ERROR_AS("llmem_spill_open", "out of memory listing %s", s->dir);
        return status;
    }
    if (n > 1)
        qsort(v, (size_t)n, sizeof(*v), entry_cmp);
    *out = v;
    *n_out = n;
    return LLMEM_OK;
}

/* Checks one row against its file; returns NULL when it holds, else why not (in why). */
static const char *check_row(struct llmem_spill *s, struct dir_entry *e, const uint8_t parent[32],
                             int64_t position, int64_t tokens, int64_t bytes, char *why,
                             size_t why_size) {
    if (e == NULL)
        return "its file is missing";
    if (e->size != bytes) {
        snprintf(why, why_size, "the file has %lld bytes, the manifest says %lld",
                 (long long)e->size, (long long)bytes);
        return why;
    }
    struct header h;
    int fd = -1;
    int64_t size = 0;
    if (open_chunk(s, e->name, &h, &fd, &size, why, why_size) != CHUNK_OK)
        return why;
    const char *bad = NULL;
    if (memcmp(h.key, e->key, 32) != 0 || memcmp(h.parent, parent, 32) != 0 ||
        h.position != position || h.n_tokens != tokens) {
        snprintf(why, why_size, "its header disagrees with the manifest");
        bad = why;
    } else if (s->cfg.verify) {
        uint8_t *buf = buf_alloc(s, (size_t)size);
        if (buf == NULL) {
            snprintf(why, why_size, "no memory to verify it");
            bad = NULL; /* not the file's fault: keep it */
        } else if (read_verified(fd, buf, size, why, why_size) != CHUNK_OK) {
            bad = why;
        }
        buf_free(s, buf);
    }
    close(fd);
    return bad;
}

/* Reconciles manifest and directory (see the top of the file). */
static int reconcile(struct llmem_spill *s, int rebuild) {
    struct dir_entry *ents = NULL;
    int64_t n_ents = 0;
    int status = list_dir(s, &ents, &n_ents);
    if (status != LLMEM_OK)
        return status;
    sqlite3_exec(s->db, "BEGIN", NULL, NULL, NULL);
    sqlite3_stmt *q = NULL;
    uint8_t(*bad)[32] = NULL;
    int64_t n_bad = 0, cap_bad = 0;
    if (sqlite3_prepare_v2(s->db, "SELECT hash, parent, file, position, tokens, bytes FROM chunks",
                           -1, &q, NULL) != SQLITE_OK) {
        status = LLMEM_EIO;
        LLMEM_ERROR_AS("llmem_spill_open", "%s/%s: %s", s->dir, MANIFEST, sqlite3_errmsg(s->db));
        goto out;
    }
    while (sqlite3_step(q) == SQLITE_ROW) {
        struct dir_entry probe, *e = NULL;
        uint8_t parent[32] = {0};
        const char *file = (const char *)sqlite3_column_text(q, 2);
        char why[256], name[NAME_LEN + 1];
        const char *problem = NULL;
        int key_ok = sqlite3_column_bytes(q, 0) == 32 && sqlite3_column_bytes(q, 1) == 32;
        if (key_ok) {
            memcpy(probe.key, sqlite3_column_blob(q, 0), 32);
            memcpy(parent, sqlite3_column_blob(q, 1), 32);
            chunk_name(probe.key, name);
            e = bsearch(&probe, ents, (size_t)n_ents, sizeof(*ents), entry_cmp);
        }
        if (!key_ok || file == NULL || strcmp(file, name) != 0)
            problem = "a malformed manifest row";
        else
            problem =
                check_row(s, e, parent, sqlite3_column_int64(q, 3), sqlite3_column_int64(q, 4),
                          sqlite3_column_int64(q, 5), why, sizeof(why));
        if (problem == NULL) {
            e->seen = 1;
            s->chunk_bytes += e->size;
            s->st.files++;
            continue;
        }
        LLMEM_WARN("%s/%s: %s; the row is dropped", s->dir, key_ok ? name : "?", problem);
        if (e != NULL) {
            unlinkat(s->dir_fd, e->name, 0);
            e->seen = 1; /* gone */
        }
        if (n_bad == cap_bad) {
            cap_bad = cap_bad ? cap_bad * 2 : 64;
            void *nb = realloc(bad, (size_t)cap_bad * 32);
            if (nb == NULL) {
                status = LLMEM_ENOMEM;
                LLMEM_ERROR_AS("llmem_spill_open", "out of memory");
                goto out;
            }
            bad = nb;
        }
        if (key_ok)
            memcpy(bad[n_bad++], probe.key, 32);
        else /* a malformed key: delete by its exact blob */
            s->st.rows_dropped++;
    }
    sqlite3_finalize(q);
    q = NULL;
    sqlite3_exec(s->db, "DELETE FROM chunks WHERE length(hash) != 32 OR length(parent) != 32", NULL,
                 NULL, NULL);
    for (int64_t i = 0; i < n_bad; i++)
        if (db_delete(s, bad[i]) == 0)
            s->st.rows_dropped++;
    for (int64_t i = 0; i < n_ents; i++) {
        if (ents[i].seen)
            continue;
        if (rebuild && adopt(s, &ents[i])) {
            s->st.rows_rebuilt++;
            s->chunk_bytes += ents[i].size;
            s->st.files++;
        } else if (unlinkat(s->dir_fd, ents[i].name, 0) == 0) {
            s->st.orphans_removed++;
        }
    }
out:
    sqlite3_finalize(q);
    sqlite3_exec(s->db, status == LLMEM_OK ? "COMMIT" : "ROLLBACK", NULL, NULL, NULL);
    free(bad);
    free(ents);
    return status;
}

/* ---- open and close ------------------------------------------------------------------------- */

void llmem_spill_config_default(struct llmem_spill_config *c) {
    memset(c, 0, sizeof(*c));
}

int llmem_spill_default_dir(char *buf, size_t size) {
    int status = llmem_cache_dir("bank", buf, size);
    if (status == LLMEM_ENOENT)
        LLMEM_ERROR("neither XDG_CACHE_HOME nor HOME is an absolute path; pass a directory");
    else if (status != LLMEM_OK)
        LLMEM_ERROR("the spill directory's path is too long");
    return status;
}

int64_t llmem_spill_default_max(int64_t ram) {
    const int64_t g = (int64_t)1 << 30;
    return ram <= 16 * g ? 16 * g : ram <= 32 * g ? 24 * g : ram <= 64 * g ? 32 * g : 100 * g;
}

/* mkdir -p, 0700 for what it creates. */
static int make_dirs(const char *dir) {
    char p[PATH_MAX];
    if (snprintf(p, sizeof(p), "%s", dir) >= (int)sizeof(p))
        return -1;
    for (char *c = p + 1; *c; c++) {
        if (*c == '/') {
            *c = '\0';
            if (mkdir(p, 0700) != 0 && errno != EEXIST)
                return -1;
            *c = '/';
        }
    }
    return mkdir(p, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

static int64_t free_disk(const struct llmem_spill *s) {
    return s->cfg.free_probe != NULL ? s->cfg.free_probe(s->cfg.free_probe_arg, s->dir)
                                     : llmem_sys_disk_free(s->dir);
}

static void *writer_main(void *arg);

static int spill_open(const struct llmem_spill_config *c, int for_gc, struct llmem_spill **out) {
    *out = NULL;
    struct llmem_spill *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        LLMEM_ERROR_AS("llmem_spill_open", "out of memory");
        return LLMEM_ENOMEM;
    }
    s->cfg = *c;
    s->dir_fd = -1;
    int status = LLMEM_OK;
    if (c->dir != NULL && c->dir[0] != '\0') {
        if (snprintf(s->dir, sizeof(s->dir), "%s", c->dir) >= (int)sizeof(s->dir)) {
            LLMEM_ERROR_AS("llmem_spill_open", "the spill directory's path is too long");
            free(s);
            return LLMEM_ERANGE;
        }
    } else if ((status = llmem_spill_default_dir(s->dir, sizeof(s->dir))) != LLMEM_OK) {
        free(s);
        return status;
    }
    s->cfg.dir = s->dir;
    if (s->cfg.min_free_bytes == 0)
        s->cfg.min_free_bytes = LLMEM_SPILL_MIN_FREE_BYTES;
    if (s->cfg.hourly_write_bytes <= 0)
        s->cfg.hourly_write_bytes = LLMEM_SPILL_HOURLY_BYTES;
    if (s->cfg.queue_bytes <= 0)
        s->cfg.queue_bytes = LLMEM_SPILL_QUEUE_BYTES;
    if (s->cfg.min_tokens <= 0)
        s->cfg.min_tokens = LLMEM_SPILL_MIN_TOKENS;
    pthread_mutex_init(&s->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->wake, &ca);
    pthread_cond_init(&s->idle, &ca);
    pthread_condattr_destroy(&ca);

    if (make_dirs(s->dir) != 0 ||
        (s->dir_fd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
        LLMEM_ERROR_AS("llmem_spill_open", "%s: cannot create or open the spill directory: %s",
                       s->dir, strerror(errno));
        status = LLMEM_EIO;
        goto fail;
    }
    if (flock(s->dir_fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK) {
            LLMEM_ERROR_AS("llmem_spill_open", "%s: cannot lock: %s", s->dir, strerror(errno));
            status = LLMEM_EIO;
            goto fail;
        }
        if (for_gc) {
            LLMEM_ERROR_AS("llmem_spill_gc",
                           "%s: the spill store is in use by another process; stop it first",
                           s->dir);
            status = LLMEM_EIO;
            goto fail;
        }
        LLMEM_WARN("%s: the spill store is in use by another process; this one neither reads "
                   "nor writes it",
                   s->dir);
        *out = s; /* owned = 0 */
        return LLMEM_OK;
    }
    s->owned = 1;
    s->st.owned = 1;

    char why[512] = "";
    int rebuild = 0;
    int rc = db_open(s, why, sizeof(why));
    if (rc == SQLITE_NOTADB || rc == SQLITE_CORRUPT || rc == SQLITE_ERROR) {
        LLMEM_WARN("%s/%s: %s; rebuilding the manifest from the chunk files", s->dir, MANIFEST,
                   why);
        db_close(s);
        static const char *const names[] = {MANIFEST, MANIFEST "-wal", MANIFEST "-shm",
                                            MANIFEST "-journal"};
        for (int i = 0; i < 4; i++)
            unlinkat(s->dir_fd, names[i], 0);
        rebuild = 1;
        rc = db_open(s, why, sizeof(why));
    }
    if (rc != SQLITE_OK) {
        LLMEM_ERROR_AS("llmem_spill_open", "%s/%s: %s", s->dir, MANIFEST, why);
        status = LLMEM_EIO;
        goto fail;
    }
    if ((status = reconcile(s, rebuild)) != LLMEM_OK)
        goto fail;

    /* the cap: given, or by RAM and at most a quarter of the disk the store can have */
    int64_t cap = s->cfg.max_bytes;
    if (cap <= 0) {
        int64_t ram = s->cfg.ram_bytes > 0
                          ? s->cfg.ram_bytes
                          : (int64_t)sysconf(_SC_PHYS_PAGES) * (int64_t)sysconf(_SC_PAGESIZE);
        cap = llmem_spill_default_max(ram);
        int64_t disk = free_disk(s);
        if (disk >= 0 && (disk + total_bytes(s)) / 4 < cap)
            cap = (disk + total_bytes(s)) / 4;
    }
    s->st.cap_bytes = cap;
    pthread_mutex_lock(&s->lock);
    make_room(s, 0);
    pthread_mutex_unlock(&s->lock);
    char b1[32], b2[32];
    LLMEM_INFO("%s: %lld chunks, %s of %s; %lld rows dropped, %lld orphan and %lld temp files "
               "removed",
               s->dir, (long long)s->st.files, llmem_size_format_short(total_bytes(s), b1, 32),
               llmem_size_format_short(cap, b2, 32), (long long)s->st.rows_dropped,
               (long long)s->st.orphans_removed, (long long)s->st.temps_removed);

    if (!s->cfg.no_writer) {
        if (pthread_create(&s->writer, NULL, writer_main, s) != 0) {
            LLMEM_ERROR_AS("llmem_spill_open", "cannot start the spill writer thread");
            status = LLMEM_ENOMEM;
            goto fail;
        }
        s->has_writer = 1;
    }
    *out = s;
    return LLMEM_OK;
fail:
    llmem_spill_close(s);
    return status;
}

int llmem_spill_open(const struct llmem_spill_config *c, struct llmem_spill **out) {
    return spill_open(c, 0, out);
}

/* Waits for the copies that fill a job's buffer (on the writer's thread: the thread that
 * generates does not wait for them); LLMEM_EIO (logged) when one failed. */
static int job_filled(struct job *j) {
    const struct llmem_kv *kv = j->copies;
    j->copies = NULL;
    return kv != NULL ? llmem_kv_copies_wait(kv) : LLMEM_OK;
}

static void free_job(struct llmem_spill *s, struct job *j) {
    (void)job_filled(j); /* no copy may still write into the buffer */
    buf_free(s, j->buf);
    free(j);
}

void llmem_spill_close(struct llmem_spill *s) {
    if (s == NULL)
        return;
    if (s->has_writer) {
        pthread_mutex_lock(&s->lock);
        s->closing = 1;
        pthread_cond_signal(&s->wake);
        double deadline = llmem_clock_s() + LLMEM_SPILL_FLUSH_S;
        while ((s->head != NULL || s->current != NULL) && llmem_clock_s() < deadline) {
            struct timespec ts = llmem_clock_deadline(0.050);
            pthread_cond_timedwait(&s->idle, &s->lock, &ts);
        }
        if (s->head != NULL) {
            s->aborting = 1;
            LLMEM_WARN("%s: pending spill writes did not finish in %.0f s; the rest are dropped",
                       s->dir, LLMEM_SPILL_FLUSH_S);
        }
        pthread_cond_signal(&s->wake);
        pthread_mutex_unlock(&s->lock);
        pthread_join(s->writer, NULL);
    }
    while (s->head != NULL) { /* no writer: nothing was ever queued, but be sure */
        struct job *j = s->head;
        s->head = j->next;
        free_job(s, j);
    }
    db_close(s);
    if (s->dir_fd >= 0)
        close(s->dir_fd); /* releases the lock */
    pthread_cond_destroy(&s->wake);
    pthread_cond_destroy(&s->idle);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

int llmem_spill_owned(const struct llmem_spill *s) {
    return s != NULL && s->owned;
}

const char *llmem_spill_dir(const struct llmem_spill *s) {
    return s->dir;
}

/* ---- writing -------------------------------------------------------------------------------- */

/* The token ids of a sibling chunk file (n of them at most) into out; its count, or −1. */
static int64_t read_tokens(struct llmem_spill *s, const uint8_t key[32], int32_t *out,
                           int64_t max) {
    char name[NAME_LEN + 1], why[256];
    chunk_name(key, name);
    struct header h;
    int fd = -1;
    int64_t size = 0;
    if (open_chunk(s, name, &h, &fd, &size, why, sizeof(why)) != CHUNK_OK)
        return -1;
    int64_t n = h.n_tokens < max ? h.n_tokens : max;
    int ok = read_at(fd, out, (size_t)n * 4, HEADER_BYTES) == 0;
    close(fd);
    return ok ? n : -1;
}

struct sibling {
    uint8_t key[32];
    int64_t tokens, bytes;
};

/* The chunks with the same parent (up to MAX_CANDIDATES, most recently used first). Under the
 * lock. */
static int children(struct llmem_spill *s, const uint8_t parent[32], struct sibling *out) {
    int n = 0;
    sqlite3_reset(s->q_children);
    sqlite3_bind_blob(s->q_children, 1, parent, 32, SQLITE_STATIC);
    while (n < MAX_CANDIDATES && sqlite3_step(s->q_children) == SQLITE_ROW) {
        if (sqlite3_column_bytes(s->q_children, 0) != 32)
            continue;
        memcpy(out[n].key, sqlite3_column_blob(s->q_children, 0), 32);
        out[n].tokens = sqlite3_column_int64(s->q_children, 1);
        out[n].bytes = sqlite3_column_int64(s->q_children, 2);
        n++;
    }
    sqlite3_reset(s->q_children);
    return n;
}

/* A partial chunk whose tokens begin a longer sibling's is already on disk; a shorter sibling
 * whose tokens begin this chunk's is redundant once it is written (drop_shorter). Returns 1 when
 * covered. */
static int sibling_pass(struct llmem_spill *s, const struct job *j, int drop_shorter) {
    struct sibling sib[MAX_CANDIDATES];
    pthread_mutex_lock(&s->lock);
    int n = children(s, j->parent, sib);
    pthread_mutex_unlock(&s->lock);
    const int32_t *mine = (const int32_t *)(j->buf + HEADER_BYTES);
    int32_t theirs[MAX_PEEK_TOKENS];
    int64_t max = (int64_t)(sizeof(theirs) / sizeof(theirs[0]));
    for (int i = 0; i < n; i++) {
        if (memcmp(sib[i].key, j->key, 32) == 0)
            continue;
        int longer = sib[i].tokens > j->n_tokens;
        if (longer == drop_shorter || sib[i].tokens > max || j->n_tokens > max)
            continue;
        int64_t common = longer ? j->n_tokens : sib[i].tokens;
        if (read_tokens(s, sib[i].key, theirs, common) != common ||
            memcmp(theirs, mine, (size_t)common * 4) != 0)
            continue;
        if (!drop_shorter)
            return 1;
        pthread_mutex_lock(&s->lock);
        drop_chunk(s, sib[i].key, sib[i].bytes);
        s->st.evicted_files++;
        s->st.evicted_bytes += sib[i].bytes;
        pthread_mutex_unlock(&s->lock);
    }
    return 0;
}

/* Counts a skipped chunk, logging the first of each kind. Under the lock. */
static void skip(struct llmem_spill *s, int64_t *counter, int *warned, const char *message) {
    (*counter)++;
    if (!*warned) {
        *warned = 1;
        LLMEM_WARN("%s: %s", s->dir, message);
    }
}

static void write_job(struct llmem_spill *s, struct job *j) {
    char name[NAME_LEN + 1], tmp[NAME_LEN + 8], msg[700], b1[32], b2[32];
    chunk_name(j->key, name);
    snprintf(tmp, sizeof(tmp), "%s.tmp", name);

    pthread_mutex_lock(&s->lock);
    int present = db_exists(s, j->key);
    if (present)
        s->st.skip_present++;
    pthread_mutex_unlock(&s->lock);
    if (present)
        return;
    if (sibling_pass(s, j, 0)) {
        pthread_mutex_lock(&s->lock);
        s->st.skip_present++;
        pthread_mutex_unlock(&s->lock);
        return;
    }
    int64_t disk = free_disk(s);
    pthread_mutex_lock(&s->lock);
    int64_t now = now_ms();
    if (now - s->window_start_ms >= 3600 * 1000) {
        s->window_start_ms = now;
        s->window_bytes = 0;
    }
    if (s->cfg.min_free_bytes > 0 && disk >= 0 && disk < s->cfg.min_free_bytes) {
        snprintf(msg, sizeof(msg), "the disk has %s free; spill writes wait until it has %s",
                 llmem_size_format_short(disk, b1, sizeof(b1)),
                 llmem_size_format_short(s->cfg.min_free_bytes, b2, sizeof(b2)));
        skip(s, &s->st.skip_disk_low, &s->warned_disk, msg);
        pthread_mutex_unlock(&s->lock);
        return;
    }
    if (s->window_bytes + j->bytes > s->cfg.hourly_write_bytes) {
        snprintf(msg, sizeof(msg),
                 "%s written within the hour, the write budget; spill writes "
                 "wait for the next hour",
                 llmem_size_format_short(s->cfg.hourly_write_bytes, b1, sizeof(b1)));
        skip(s, &s->st.skip_budget, &s->warned_budget, msg);
        pthread_mutex_unlock(&s->lock);
        return;
    }
    if (make_room(s, j->bytes) != 0) {
        s->st.skip_cap++;
        pthread_mutex_unlock(&s->lock);
        return;
    }
    s->temp_bytes += j->bytes;
    pthread_mutex_unlock(&s->lock);

    /* checksum, then temp file + fsync + rename + fsync of the directory */
    uint8_t sum[16];
    memset(j->buf + OFF_CHECKSUM, 0, 16);
    llmem_digest(j->buf, (size_t)j->bytes, sum);
    memcpy(j->buf + OFF_CHECKSUM, sum, 16);
    const char *step = "create";
    int fd = openat(s->dir_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int ok = fd >= 0;
    if (ok && (step = "write", write_all(fd, j->buf, j->bytes) != 0))
        ok = 0;
    if (ok && (step = "fsync", fsync(fd) != 0))
        ok = 0;
    int err = errno;
    if (fd >= 0 && close(fd) != 0 && ok) {
        ok = 0;
        err = errno;
        step = "close";
    }
    if (ok && (step = "rename", renameat(s->dir_fd, tmp, s->dir_fd, name) != 0)) {
        ok = 0;
        err = errno;
    }
    if (ok)
        fsync(s->dir_fd);
    struct header h;
    memcpy(h.key, j->key, 32);
    memcpy(h.parent, j->parent, 32);
    h.position = j->position;
    h.n_tokens = (int32_t)j->n_tokens;

    pthread_mutex_lock(&s->lock);
    s->temp_bytes -= j->bytes;
    if (ok && db_insert(s, &h, j->bytes, j->when) != 0) {
        ok = 0;
        err = 0;
        step = "record";
        unlinkat(s->dir_fd, name, 0);
    } else if (!ok) {
        unlinkat(s->dir_fd, tmp, 0);
    }
    if (ok) {
        s->chunk_bytes += j->bytes;
        s->st.files++;
        s->st.written_chunks++;
        s->st.write_bytes += j->bytes;
        s->window_bytes += j->bytes;
    } else {
        snprintf(msg, sizeof(msg), "spill write: %s %s failed: %s", step, tmp,
                 err != 0 ? strerror(err) : sqlite3_errmsg(s->db));
        skip(s, &s->st.skip_write_error, &s->warned_write, msg);
    }
    pthread_mutex_unlock(&s->lock);
    if (ok)
        sibling_pass(s, j, 1);
}

static void *writer_main(void *arg) {
    struct llmem_spill *s = arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (s->head == NULL && !s->closing)
            pthread_cond_wait(&s->wake, &s->lock);
        if (s->head == NULL)
            break;
        struct job *j = s->head;
        s->head = j->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->current = j;
        if (s->aborting) {
            s->st.skip_shutdown++;
        } else {
            pthread_mutex_unlock(&s->lock);
            if (job_filled(j) == LLMEM_OK)
                write_job(s, j);
            else
                LLMEM_WARN("spill: a chunk's blocks did not reach the host; not written");
            pthread_mutex_lock(&s->lock);
        }
        s->st.queued_bytes -= j->bytes;
        s->current = NULL;
        pthread_mutex_unlock(&s->lock);
        free_job(s, j);
        pthread_mutex_lock(&s->lock);
        if (s->head == NULL)
            pthread_cond_broadcast(&s->idle);
    }
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* The chain hashes h[0..n] of tokens' first n blocks: h[0] = root, h[i] after block i. */
static uint8_t (*chain_hashes(const uint8_t root[32], const int32_t *tokens, int64_t n,
                              int bs))[32] {
    uint8_t(*h)[32] = malloc((size_t)(n + 1) * 32);
    if (h == NULL)
        return NULL;
    memcpy(h[0], root, 32);
    for (int64_t i = 0; i < n; i++)
        llmem_bank_block_hash(h[i], tokens + i * bs, bs, h[i + 1]);
    return h;
}

static int pending(const struct llmem_spill *s, const uint8_t key[32]) {
    if (s->current != NULL && memcmp(s->current->key, key, 32) == 0)
        return 1;
    for (const struct job *j = s->head; j != NULL; j = j->next)
        if (memcmp(j->key, key, 32) == 0)
            return 1;
    return 0;
}

static void fill_geometry(struct header *h, const struct llmem_kv *kv) {
    const struct llmem_kv_config *c = llmem_kv_get_config(kv);
    h->block_size = llmem_kv_block_size(kv);
    h->format = (int32_t)c->format;
    h->n_layers = c->n_layers;
    h->n_kv_heads = c->n_kv_heads;
    h->head_dim = c->head_dim;
    h->block_bytes = llmem_kv_block_bytes(kv);
}

int64_t llmem_spill_submit(struct llmem_spill *s, struct llmem_kv *kv, const uint8_t root[32],
                           const int32_t *tokens, const int64_t *ids, int64_t n_blocks) {
    if (s == NULL || n_blocks <= 0)
        return 0;
    const int bs = llmem_kv_block_size(kv);
    const int64_t per = LLMEM_SPILL_CHUNK_BLOCKS;
    const int64_t n_chunks = (n_blocks + per - 1) / per;
    if (!s->owned || !s->has_writer) {
        pthread_mutex_lock(&s->lock);
        s->st.skip_not_owner += n_chunks;
        pthread_mutex_unlock(&s->lock);
        return 0;
    }
    if (n_blocks * bs < s->cfg.min_tokens) {
        pthread_mutex_lock(&s->lock);
        s->st.skip_short++;
        pthread_mutex_unlock(&s->lock);
        return 0;
    }
    uint8_t(*h)[32] = chain_hashes(root, tokens, n_blocks, bs);
    if (h == NULL) {
        pthread_mutex_lock(&s->lock);
        s->st.skip_no_memory += n_chunks;
        pthread_mutex_unlock(&s->lock);
        return 0;
    }
    struct header hd;
    memset(&hd, 0, sizeof(hd));
    hd.version = VERSION;
    memcpy(hd.root, root, 32);
    fill_geometry(&hd, kv);
    int64_t queued = 0, when = now_ms();
    for (int64_t k = 0; k < n_chunks; k++) {
        int64_t b0 = k * per, b1 = b0 + per < n_blocks ? b0 + per : n_blocks;
        memcpy(hd.key, h[b1], 32);
        memcpy(hd.parent, h[b0], 32);
        hd.position = b0 * bs;
        hd.n_blocks = (int32_t)(b1 - b0);
        hd.n_tokens = hd.n_blocks * bs;
        hd.payload_bytes = hd.n_blocks * hd.block_bytes;
        hd.header_tokens_bytes = (uint32_t)(HEADER_BYTES + 4 * (int64_t)hd.n_tokens);
        int64_t bytes = (int64_t)hd.header_tokens_bytes + hd.payload_bytes;
        pthread_mutex_lock(&s->lock);
        int present = db_exists(s, hd.key) || pending(s, hd.key);
        int full = !present && s->st.queued_bytes + bytes > s->cfg.queue_bytes;
        if (present)
            s->st.skip_present++;
        else if (full)
            s->st.skip_queue_full++;
        pthread_mutex_unlock(&s->lock);
        if (present || full)
            continue;
        struct job *j = calloc(1, sizeof(*j));
        uint8_t *buf = j != NULL ? buf_alloc(s, (size_t)bytes) : NULL;
        if (buf == NULL) {
            free(j);
            pthread_mutex_lock(&s->lock);
            s->st.skip_no_memory++;
            pthread_mutex_unlock(&s->lock);
            continue;
        }
        header_encode(&hd, buf);
        memcpy(buf + HEADER_BYTES, tokens + b0 * bs, (size_t)hd.n_tokens * 4);
        llmem_kv_blocks_copy_out_async(kv, ids + b0, b1 - b0, buf + hd.header_tokens_bytes);
        j->copies = kv; /* the writer waits for these */
        memcpy(j->key, hd.key, 32);
        memcpy(j->parent, hd.parent, 32);
        j->position = hd.position;
        j->n_tokens = hd.n_tokens;
        j->when = when;
        j->buf = buf;
        j->bytes = bytes;
        pthread_mutex_lock(&s->lock);
        if (s->tail != NULL)
            s->tail->next = j;
        else
            s->head = j;
        s->tail = j;
        s->st.queued_bytes += bytes;
        if (s->st.queued_bytes > s->st.queue_peak_bytes)
            s->st.queue_peak_bytes = s->st.queued_bytes;
        pthread_cond_signal(&s->wake);
        pthread_mutex_unlock(&s->lock);
        queued++;
    }
    free(h);
    return queued;
}

int64_t llmem_spill_flush(struct llmem_spill *s, double timeout_s) {
    if (s == NULL || !s->has_writer)
        return 0;
    double deadline = llmem_clock_s() + timeout_s;
    pthread_mutex_lock(&s->lock);
    while ((s->head != NULL || s->current != NULL) && llmem_clock_s() < deadline) {
        struct timespec ts = llmem_clock_deadline(0.020);
        pthread_cond_timedwait(&s->idle, &s->lock, &ts);
    }
    int64_t left = s->current != NULL;
    for (const struct job *j = s->head; j != NULL; j = j->next)
        left++;
    pthread_mutex_unlock(&s->lock);
    return left;
}

/* ---- loading -------------------------------------------------------------------------------- */

struct candidate {
    struct sibling row;
    int64_t usable; /* blocks of it that continue the prompt (within the lookup's bound) */
    int exact;      /* its key is the prompt's chain hash: every block matches */
};

/* Counts a failed check by reason. Under the lock. */
static void count_miss(struct llmem_spill *s, enum reason r) {
    switch (r) {
    case CHUNK_IO: s->st.miss_io++; break;
    case CHUNK_TRUNCATED: s->st.miss_truncated++; break;
    case CHUNK_CORRUPT: s->st.miss_corrupt++; break;
    case CHUNK_IDENTITY: s->st.miss_identity++; break;
    case CHUNK_FORMAT: s->st.miss_format++; break;
    case CHUNK_NO_MEMORY: s->st.miss_no_memory++; break;
    default: break;
    }
}

/* Loads and checks candidate c (whose chunk starts at block c0) against the prompt: CHUNK_OK with
 * the verified file in *buf. */
static enum reason verify_candidate(struct llmem_spill *s, const struct llmem_kv *kv,
                                    const uint8_t root[32], const uint8_t parent[32],
                                    const int32_t *tokens, int64_t c0, const struct candidate *c,
                                    uint8_t **buf, char *why, size_t why_size) {
    char name[NAME_LEN + 1];
    chunk_name(c->row.key, name);
    struct header h, want;
    int64_t size = 0;
    enum reason r = load_file(s, name, &h, buf, &size, why, why_size);
    if (r != CHUNK_OK)
        return r;
    memset(&want, 0, sizeof(want));
    fill_geometry(&want, kv);
    const int bs = want.block_size;
    if (size != c->row.bytes) {
        snprintf(why, why_size, "%lld bytes, the manifest says %lld", (long long)size,
                 (long long)c->row.bytes);
        r = CHUNK_TRUNCATED;
    } else if (memcmp(h.root, root, 32) != 0) {
        snprintf(why, why_size, "written for another model identity");
        r = CHUNK_IDENTITY;
    } else if (h.format != want.format || h.block_size != bs || h.n_layers != want.n_layers ||
               h.n_kv_heads != want.n_kv_heads || h.head_dim != want.head_dim ||
               h.block_bytes != want.block_bytes) {
        snprintf(why, why_size,
                 "KV format %d, %d layers × %d heads × %d, blocks of %d: this cache is %d, %d × "
                 "%d × %d, blocks of %d",
                 h.format, h.n_layers, h.n_kv_heads, h.head_dim, h.block_size, want.format,
                 want.n_layers, want.n_kv_heads, want.head_dim, bs);
        r = CHUNK_FORMAT;
    } else if (memcmp(h.key, c->row.key, 32) != 0 || memcmp(h.parent, parent, 32) != 0 ||
               h.position != c0 * bs || h.n_tokens != c->row.tokens) {
        snprintf(why, why_size, "its header disagrees with the manifest");
        r = CHUNK_CORRUPT;
    } else if (memcmp(*buf + HEADER_BYTES, tokens + c0 * bs, (size_t)c->usable * bs * 4) != 0) {
        snprintf(why, why_size, "its token ids disagree with its chain hash");
        r = CHUNK_CORRUPT;
    }
    if (r != CHUNK_OK) {
        buf_free(s, *buf);
        *buf = NULL;
    }
    return r;
}

int64_t llmem_spill_load(struct llmem_spill *s, struct llmem_kv *kv, const uint8_t root[32],
                         const int32_t *tokens, int64_t n_tokens, int64_t from, int64_t max_blocks,
                         int64_t *ids, llmem_spill_room_fn room, void *room_arg) {
    const int bs = llmem_kv_block_size(kv);
    const int64_t per = LLMEM_SPILL_CHUNK_BLOCKS, full = n_tokens / bs;
    if (max_blocks > full)
        max_blocks = full;
    if (s == NULL || !s->owned || from >= max_blocks)
        return 0;
    uint8_t(*h)[32] = chain_hashes(root, tokens, full, bs);
    if (h == NULL)
        return 0;
    pthread_mutex_lock(&s->lock);
    s->st.lookups++;
    pthread_mutex_unlock(&s->lock);
    /* one time for the whole lookup: the chain's chunks are equally recent, and the eviction
     * order (position descending among equals) takes its deepest first */
    const int64_t when = now_ms();
    const int64_t block_bytes = llmem_kv_block_bytes(kv);
    int64_t pos = from, n = 0;
    int32_t peek[MAX_PEEK_TOKENS];
    while (pos < max_blocks) {
        int64_t c0 = pos / per * per, skip_blocks = pos - c0;
        int64_t allowed = max_blocks - c0 < per ? max_blocks - c0 : per;
        struct sibling rows[MAX_CANDIDATES];
        struct candidate cand[MAX_CANDIDATES];
        pthread_mutex_lock(&s->lock);
        int n_rows = children(s, h[c0], rows), n_cand = 0, peeks = 0;
        pthread_mutex_unlock(&s->lock);
        for (int i = 0; i < n_rows; i++) {
            int64_t len = rows[i].tokens / bs;
            if (rows[i].tokens % bs != 0 || len < 1 || len > per)
                continue;
            struct candidate c = {rows[i], 0, 0};
            if (c0 + len <= full && memcmp(rows[i].key, h[c0 + len], 32) == 0) {
                c.exact = 1;
                c.usable = len < allowed ? len : allowed;
            } else if (peeks < MAX_PEEKS && bs * per <= MAX_PEEK_TOKENS) {
                /* a chunk that goes past the prompt, or leaves it within: the blocks that agree */
                peeks++;
                int64_t got = read_tokens(s, rows[i].key, peek, len * bs);
                int64_t m = 0;
                while (got == len * bs && m < len && c0 + m < full &&
                       memcmp(peek + m * bs, tokens + (c0 + m) * bs, (size_t)bs * 4) == 0)
                    m++;
                c.usable = m < allowed ? m : allowed;
            }
            if (c.usable > skip_blocks)
                cand[n_cand++] = c;
        }
        uint8_t *buf = NULL;
        int chosen = -1;
        while (chosen < 0) {
            int best = -1;
            for (int i = 0; i < n_cand; i++)
                if (cand[i].usable > 0 &&
                    (best < 0 || cand[i].usable > cand[best].usable ||
                     (cand[i].usable == cand[best].usable && cand[i].exact > cand[best].exact)))
                    best = i;
            if (best < 0)
                break;
            char why[512];
            enum reason r = verify_candidate(s, kv, root, h[c0], tokens, c0, &cand[best], &buf, why,
                                             sizeof(why));
            if (r == CHUNK_OK) {
                chosen = best;
                break;
            }
            pthread_mutex_lock(&s->lock);
            count_miss(s, r);
            if (r == CHUNK_NO_MEMORY) {
                pthread_mutex_unlock(&s->lock);
                break;
            }
            if (r == CHUNK_IO) {
                char name[NAME_LEN + 1];
                chunk_name(cand[best].row.key, name);
                LLMEM_WARN("%s/%s: %s; not used", s->dir, name, why);
            } else {
                drop_bad(s, cand[best].row.key, cand[best].row.bytes, why);
            }
            pthread_mutex_unlock(&s->lock);
            cand[best].usable = 0;
        }
        if (chosen < 0) {
            pthread_mutex_lock(&s->lock);
            if (n_cand == 0)
                s->st.miss_absent++;
            pthread_mutex_unlock(&s->lock);
            break;
        }
        const struct candidate *c = &cand[chosen];
        int64_t need = c->usable - skip_blocks;
        int64_t free_now = room != NULL ? room(room_arg, need) : llmem_kv_blocks_free(kv);
        if (free_now < need) {
            pthread_mutex_lock(&s->lock);
            s->st.miss_no_room++;
            pthread_mutex_unlock(&s->lock);
            buf_free(s, buf);
            break;
        }
        const uint8_t *payload = buf + HEADER_BYTES + (size_t)c->row.tokens * 4;
        int64_t got = 0;
        for (int64_t b = skip_blocks; b < c->usable; b++, got++)
            if (llmem_kv_block_new_from(kv, payload + b * block_bytes, &ids[n + got]) != LLMEM_OK)
                break;
        buf_free(s, buf);
        n += got;
        pthread_mutex_lock(&s->lock);
        db_touch(s, c->row.key, when);
        s->st.hit_chunks++;
        s->st.read_blocks += got;
        s->st.read_bytes += c->row.bytes;
        pthread_mutex_unlock(&s->lock);
        pos = c0 + skip_blocks + got;
        if (got < need || c->usable < per)
            break;
    }
    free(h);
    return n;
}

/* ---- stats and gc --------------------------------------------------------------------------- */

void llmem_spill_stats(struct llmem_spill *s, struct llmem_spill_stats *st) {
    pthread_mutex_lock(&s->lock);
    *st = s->st;
    st->bytes = s->owned ? total_bytes(s) : 0;
    pthread_mutex_unlock(&s->lock);
}

int llmem_spill_gc(const struct llmem_spill_config *c, struct llmem_spill_stats *stats) {
    struct llmem_spill_config g = *c;
    g.verify = 1;
    g.no_writer = 1;
    struct llmem_spill *s = NULL;
    int status = spill_open(&g, 1, &s);
    if (status != LLMEM_OK)
        return status;
    llmem_spill_stats(s, stats);
    llmem_spill_close(s);
    return LLMEM_OK;
}

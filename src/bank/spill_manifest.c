/*
 * bank/spill_manifest.c — the spill store's SQLite manifest (see llmem/spill.h): one row per chunk
 * file, its statements prepared once; rows looked up, added, touched and dropped, the cap kept by
 * evicting the least recently used chunks (among chunks used at the same time, the deepest of a
 * chain first), and the bytes the cap counts.
 *
 * Guarantee: a chunk is dropped row first, then file, so a crash in between leaves an orphan file
 * (removed at the next open), never a row without its file. Every function is called under the
 * store's lock.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sqlite3.h>

#include "bank/spill_int.h"
#include "core/log.h"

/* ---- the bytes the cap counts ---------------------------------------------------------------- */

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

int llmem_spill_is_manifest_name(const char *name) {
    return strcmp(name, MANIFEST) == 0 || strcmp(name, MANIFEST "-wal") == 0 ||
           strcmp(name, MANIFEST "-shm") == 0 || strcmp(name, MANIFEST "-journal") == 0;
}

/* Every file of the directory: what the cap bounds. Under the lock. */
int64_t llmem_spill_total_bytes(const struct llmem_spill *s) {
    return s->chunk_bytes + s->temp_bytes + s->other_bytes + manifest_bytes(s);
}

/* ---- the rows -------------------------------------------------------------------------------- */

static const char schema[] =
    "CREATE TABLE IF NOT EXISTS chunks("
    " hash BLOB PRIMARY KEY NOT NULL, parent BLOB NOT NULL, file TEXT NOT NULL,"
    " position INTEGER NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL,"
    " created INTEGER NOT NULL, last_access INTEGER NOT NULL, hits INTEGER NOT NULL DEFAULT 0"
    ") WITHOUT ROWID;"
    "CREATE INDEX IF NOT EXISTS chunks_parent ON chunks(parent);"
    "CREATE INDEX IF NOT EXISTS chunks_lru ON chunks(last_access, position DESC);";

void llmem_spill_db_close(struct llmem_spill *s) {
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
int llmem_spill_db_open(struct llmem_spill *s, char *why, size_t why_size) {
    char path[PATH_MAX + 32];
    path_of(s, MANIFEST, path, sizeof(path));
    /* SQLite would open a FIFO there and wait in its first read */
    struct stat st;
    if (fstatat(s->dir_fd, MANIFEST, &st, 0) == 0 && !S_ISREG(st.st_mode)) {
        snprintf(why, why_size, "not a regular file (a %s)",
                 S_ISDIR(st.st_mode)    ? "directory"
                 : S_ISFIFO(st.st_mode) ? "FIFO"
                                        : "special file");
        return SQLITE_CANTOPEN;
    }
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

int llmem_spill_db_exists(struct llmem_spill *s, const uint8_t key[32]) {
    sqlite3_reset(s->q_exists);
    sqlite3_bind_blob(s->q_exists, 1, key, 32, SQLITE_STATIC);
    int found = sqlite3_step(s->q_exists) == SQLITE_ROW;
    sqlite3_reset(s->q_exists);
    return found;
}

int llmem_spill_db_delete(struct llmem_spill *s, const uint8_t key[32]) {
    sqlite3_reset(s->q_delete);
    sqlite3_bind_blob(s->q_delete, 1, key, 32, SQLITE_STATIC);
    int rc = sqlite3_step(s->q_delete);
    sqlite3_reset(s->q_delete);
    return rc == SQLITE_DONE ? 0 : -1;
}

int llmem_spill_db_insert(struct llmem_spill *s, const struct header *h, int64_t bytes,
                          int64_t when) {
    char name[NAME_LEN + 1];
    llmem_spill_chunk_name(h->key, name);
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

void llmem_spill_db_touch(struct llmem_spill *s, const uint8_t key[32], int64_t when) {
    sqlite3_reset(s->q_touch);
    sqlite3_bind_blob(s->q_touch, 1, key, 32, SQLITE_STATIC);
    sqlite3_bind_int64(s->q_touch, 2, when);
    sqlite3_step(s->q_touch);
    sqlite3_reset(s->q_touch);
}

/* Drops a chunk: its row first, then its file (a crash in between leaves an orphan file, never
 * a row without its file). Under the lock. */
void llmem_spill_drop_chunk(struct llmem_spill *s, const uint8_t key[32], int64_t bytes) {
    char name[NAME_LEN + 1];
    llmem_spill_chunk_name(key, name);
    if (llmem_spill_db_delete(s, key) != 0)
        return;
    if (unlinkat(s->dir_fd, name, 0) == 0 || errno == ENOENT) {
        s->chunk_bytes -= bytes;
        s->st.files--;
    }
}

/* Drops a chunk that failed a check, counting it and saying why. Under the lock. */
void llmem_spill_drop_bad(struct llmem_spill *s, const uint8_t key[32], int64_t bytes,
                          const char *why) {
    char name[NAME_LEN + 1];
    llmem_spill_chunk_name(key, name);
    LLMEM_WARN("%s/%s: %s; the chunk is dropped", s->dir, name, why);
    llmem_spill_drop_chunk(s, key, bytes);
    s->st.rows_dropped++;
}

/* Evicts least recently used chunks until `incoming` more bytes fit the cap. Under the lock.
 * Returns 0, or −1 when even an empty store cannot take them. */
int llmem_spill_make_room(struct llmem_spill *s, int64_t incoming) {
    while (llmem_spill_total_bytes(s) + incoming > s->st.cap_bytes) {
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
        for (int i = 0; i < n && llmem_spill_total_bytes(s) + incoming > s->st.cap_bytes; i++) {
            llmem_spill_drop_chunk(s, keys[i], sizes[i]);
            s->st.evicted_files++;
            s->st.evicted_bytes += sizes[i];
        }
    }
    return 0;
}

/* The chunks with the same parent (up to MAX_CANDIDATES, most recently used first). Under the
 * lock. */
int llmem_spill_children(struct llmem_spill *s, const uint8_t parent[32], struct sibling *out) {
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

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
 * The pieces: the chunk files (spill_file.c), the SQLite manifest (spill_manifest.c), the writer
 * thread and its queue (spill_writer.c); here the store is opened (one owner by flock, the cap),
 * reconciled and closed, and chunks are looked up and loaded. spill_int.h is what they share.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "bank/spill_int.h"
#include "bank/spill_open.h"
#include "core/log.h"
#include "core/options.h"
#include "llmem/size.h"

/* A failure while opening: into s->open_why when the caller opens the store as a cache (and
 * says itself, once, what it does without it), else logged at ERROR. */
static void open_fail(struct llmem_spill *s, const char *func, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void open_fail(struct llmem_spill *s, const char *func, const char *fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (s->open_why != NULL && s->open_why[0] == '\0')
        snprintf(s->open_why, s->open_why_size, "%s", line);
    else if (s->open_why == NULL)
        LLMEM_ERROR_AS(func, "%s", line);
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
    if (llmem_spill_load_file(s, e->name, &h, &buf, &size, why, sizeof(why)) != CHUNK_OK ||
        memcmp(h.key, e->key, 32) != 0) {
        buf_free(s, buf);
        return 0;
    }
    buf_free(s, buf);
    struct stat st;
    int64_t when = fstatat(s->dir_fd, e->name, &st, 0) == 0
                       ? (int64_t)st.st_mtim.tv_sec * 1000 + st.st_mtim.tv_nsec / 1000000
                       : now_ms();
    return llmem_spill_db_insert(s, &h, size, when) == 0;
}

/* A chunk file's name while it is written ("<64 hex>.kv.tmp", spill_writer.c). */
static int is_temp_name(const char *name) {
    char chunk[NAME_LEN + 1];
    uint8_t key[32];
    if (strlen(name) != NAME_LEN + 4 || strcmp(name + NAME_LEN, ".tmp") != 0)
        return 0;
    memcpy(chunk, name, NAME_LEN);
    chunk[NAME_LEN] = '\0';
    return llmem_spill_parse_chunk_name(chunk, key);
}

/* A directory without a manifest is the store's only when it holds nothing but the store's own
 * files (a store whose manifest was lost): the first other entry's name into `other` ("" when
 * none), and whether it holds chunk files. */
static int find_foreign(struct llmem_spill *s, const char *func, char *other, size_t other_size,
                        int *chunks) {
    int fd = dup(s->dir_fd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (d == NULL) {
        if (fd >= 0)
            close(fd);
        open_fail(s, func, "%s: cannot list: %s", s->dir, strerror(errno));
        return LLMEM_EIO;
    }
    other[0] = '\0';
    *chunks = 0;
    uint8_t key[32];
    for (struct dirent *de; other[0] == '\0' && (de = readdir(d)) != NULL;) {
        const char *n = de->d_name;
        if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0 || is_temp_name(n) ||
            llmem_spill_is_manifest_name(n))
            continue;
        if (llmem_spill_parse_chunk_name(n, key))
            *chunks = 1;
        else
            snprintf(other, other_size, "%s", n);
    }
    closedir(d);
    return LLMEM_OK;
}

/* Lists the directory: stale temp files removed, chunk files into *out (sorted by key), the
 * bytes of anything else in other_bytes. */
static int list_dir(struct llmem_spill *s, struct dir_entry **out, int64_t *n_out) {
    int fd = dup(s->dir_fd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (d == NULL) {
        if (fd >= 0)
            close(fd);
        open_fail(s, "llmem_spill_open", "%s: cannot list: %s", s->dir, strerror(errno));
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
        uint8_t key[32];
        if (is_temp_name(de->d_name)) {
            if (unlinkat(s->dir_fd, de->d_name, 0) == 0)
                s->st.temps_removed++;
            else
                s->other_bytes += st.st_size;
        } else if (llmem_spill_parse_chunk_name(de->d_name, key)) {
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
        } else if (!llmem_spill_is_manifest_name(de->d_name)) {
            s->other_bytes += st.st_size;
        }
    }
    closedir(d);
    if (status != LLMEM_OK) {
        free(v);
        open_fail(s, "llmem_spill_open", "out of memory listing %s", s->dir);
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
    if (llmem_spill_open_chunk(s, e->name, &h, &fd, &size, why, why_size) != CHUNK_OK)
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
        } else if (llmem_spill_read_verified(fd, buf, size, why, why_size) != CHUNK_OK) {
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
        open_fail(s, "llmem_spill_open", "%s/%s: %s", s->dir, MANIFEST, sqlite3_errmsg(s->db));
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
            llmem_spill_chunk_name(probe.key, name);
            /* with no chunk file left, ents is NULL: bsearch must not see it */
            if (n_ents > 0)
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
                open_fail(s, "llmem_spill_open", "out of memory");
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
        if (llmem_spill_db_delete(s, bad[i]) == 0)
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

/* for_gc: the store must exist already (gc creates nothing); reason (optional): a failure is put
 * there rather than logged. */
static int spill_open(const struct llmem_spill_config *c, int for_gc, struct llmem_spill **out,
                      char *reason, size_t reason_size) {
    if (reason != NULL && reason_size > 0)
        reason[0] = '\0';
    *out = NULL;
    struct llmem_spill *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        LLMEM_ERROR_AS("llmem_spill_open", "out of memory");
        return LLMEM_ENOMEM;
    }
    s->cfg = *c;
    s->dir_fd = -1;
    s->open_why = reason_size > 0 ? reason : NULL;
    s->open_why_size = reason_size;
    int status = LLMEM_OK;
    if (c->dir != NULL && c->dir[0] != '\0') {
        if (snprintf(s->dir, sizeof(s->dir), "%s", c->dir) >= (int)sizeof(s->dir)) {
            open_fail(s, "llmem_spill_open", "the spill directory's path is too long");
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

    if (for_gc) { /* gc collects a store that is there; it makes none */
        if ((s->dir_fd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
            int err = errno;
            open_fail(s, "llmem_spill_gc", "%s: not collected: no spill store there (%s)", s->dir,
                      strerror(err));
            status = err == ENOENT ? LLMEM_ENOENT : LLMEM_EIO;
            goto fail;
        }
    } else if (make_dirs(s->dir) != 0 ||
               (s->dir_fd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
        open_fail(s, "llmem_spill_open", "%s: cannot create or open the spill directory: %s",
                  s->dir, strerror(errno));
        status = LLMEM_EIO;
        goto fail;
    }
    if (flock(s->dir_fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK) {
            open_fail(s, "llmem_spill_open", "%s: cannot lock: %s", s->dir, strerror(errno));
            status = LLMEM_EIO;
            goto fail;
        }
        if (for_gc) {
            open_fail(s, "llmem_spill_gc",
                      "%s: not collected: the spill store is in use by another process; stop it "
                      "first",
                      s->dir);
            status = LLMEM_EIO;
            goto fail;
        }
        LLMEM_WARN("%s: the spill store is in use by another process; this one neither reads "
                   "nor writes it",
                   s->dir);
        s->open_why = NULL;
        *out = s; /* owned = 0 */
        return LLMEM_OK;
    }
    s->owned = 1;
    s->st.owned = 1;

    const char *func = for_gc ? "llmem_spill_gc" : "llmem_spill_open";
    if (faccessat(s->dir_fd, MANIFEST, F_OK, 0) != 0) { /* never a store, or one that lost it */
        char other[NAME_MAX + 1];
        int chunks;
        if ((status = find_foreign(s, func, other, sizeof(other), &chunks)) != LLMEM_OK)
            goto fail;
        if (other[0] != '\0') {
            open_fail(s, func,
                      "%s: not a spill store (no %s) and it holds '%s', which is not the store's: "
                      "give an empty or new directory",
                      s->dir, MANIFEST, other);
            status = LLMEM_EINVAL;
            goto fail;
        }
        if (for_gc && !chunks) {
            open_fail(s, func, "%s: not collected: no spill store there (no %s)", s->dir, MANIFEST);
            status = LLMEM_ENOENT;
            goto fail;
        }
    }
    char why[512] = "";
    int rebuild = 0;
    int rc = llmem_spill_db_open(s, why, sizeof(why));
    if (rc == SQLITE_NOTADB || rc == SQLITE_CORRUPT || rc == SQLITE_ERROR) {
        LLMEM_WARN("%s/%s: %s; rebuilding the manifest from the chunk files", s->dir, MANIFEST,
                   why);
        llmem_spill_db_close(s);
        static const char *const names[] = {MANIFEST, MANIFEST "-wal", MANIFEST "-shm",
                                            MANIFEST "-journal"};
        for (int i = 0; i < 4; i++)
            unlinkat(s->dir_fd, names[i], 0);
        rebuild = 1;
        rc = llmem_spill_db_open(s, why, sizeof(why));
    }
    if (rc != SQLITE_OK) {
        open_fail(s, "llmem_spill_open", "%s/%s: %s", s->dir, MANIFEST, why);
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
        int64_t disk = llmem_spill_free_disk(s);
        if (disk >= 0 && (disk + llmem_spill_total_bytes(s)) / 4 < cap)
            cap = (disk + llmem_spill_total_bytes(s)) / 4;
    }
    s->st.cap_bytes = cap;
    pthread_mutex_lock(&s->lock);
    llmem_spill_make_room(s, 0);
    pthread_mutex_unlock(&s->lock);
    char b1[32], b2[32];
    LLMEM_INFO("%s: %lld chunks, %s of %s; %lld rows dropped, %lld orphan and %lld temp files "
               "removed",
               s->dir, (long long)s->st.files,
               llmem_size_format_short(llmem_spill_total_bytes(s), b1, 32),
               llmem_size_format_short(cap, b2, 32), (long long)s->st.rows_dropped,
               (long long)s->st.orphans_removed, (long long)s->st.temps_removed);

    if (!s->cfg.no_writer) {
        if (pthread_create(&s->writer, NULL, llmem_spill_writer_main, s) != 0) {
            open_fail(s, "llmem_spill_open", "cannot start the spill writer thread");
            status = LLMEM_ENOMEM;
            goto fail;
        }
        s->has_writer = 1;
    }
    s->open_why = NULL;
    *out = s;
    return LLMEM_OK;
fail:
    llmem_spill_close(s);
    return status;
}

int llmem_spill_open(const struct llmem_spill_config *c, struct llmem_spill **out) {
    return spill_open(c, 0, out, NULL, 0);
}

int llmem_spill_open_cache(const struct llmem_spill_config *c, struct llmem_spill **out, char *why,
                           size_t why_size) {
    return spill_open(c, 0, out, why, why_size);
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
        llmem_spill_free_job(s, j);
    }
    llmem_spill_db_close(s);
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
    llmem_spill_chunk_name(c->row.key, name);
    struct header h, want;
    int64_t size = 0;
    enum reason r = llmem_spill_load_file(s, name, &h, buf, &size, why, why_size);
    if (r != CHUNK_OK)
        return r;
    memset(&want, 0, sizeof(want));
    llmem_spill_fill_geometry(&want, kv);
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
    uint8_t(*h)[32] = llmem_spill_chain_hashes(root, tokens, full, bs);
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
        int n_rows = llmem_spill_children(s, h[c0], rows), n_cand = 0, peeks = 0;
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
                int64_t got = llmem_spill_read_tokens(s, rows[i].key, peek, len * bs);
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
                llmem_spill_chunk_name(cand[best].row.key, name);
                LLMEM_WARN("%s/%s: %s; not used", s->dir, name, why);
            } else {
                llmem_spill_drop_bad(s, cand[best].row.key, cand[best].row.bytes, why);
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
        llmem_spill_db_touch(s, c->row.key, when);
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
    st->bytes = s->owned ? llmem_spill_total_bytes(s) : 0;
    pthread_mutex_unlock(&s->lock);
}

int llmem_spill_gc(const struct llmem_spill_config *c, struct llmem_spill_stats *stats) {
    struct llmem_spill_config g = *c;
    g.verify = 1;
    g.no_writer = 1;
    struct llmem_spill *s = NULL;
    int status = spill_open(&g, 1, &s, NULL, 0);
    if (status != LLMEM_OK)
        return status;
    llmem_spill_stats(s, stats);
    llmem_spill_close(s);
    return LLMEM_OK;
}

/*
 * bank/spill_writer.c — the spill store's writes (see llmem/spill.h): llmem_spill_submit builds
 * each chunk not yet on disk in staging memory and queues it (bounded by queue_bytes); the writer
 * thread waits for a chunk's copies, skips it when a sibling already covers it, and otherwise
 * writes it within the disk floor, the hourly budget and the cap.
 *
 * Guarantees: a manifest row is added only after its file was written in full, fsynced and
 * renamed into place (and the directory fsynced), so a process killed anywhere leaves the manifest
 * pointing only at complete files; the writer reads only the staging buffers filled for it, never
 * the KV pool.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "bank/spill_int.h"
#include "core/hash.h"
#include "core/log.h"
#include "llmem/size.h"
#include "llmem/sys.h"

/* ---- writing --------------------------------------------------------------------------------- */

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

int64_t llmem_spill_free_disk(const struct llmem_spill *s) {
    return s->cfg.free_probe != NULL ? s->cfg.free_probe(s->cfg.free_probe_arg, s->dir)
                                     : llmem_sys_disk_free(s->dir);
}

/* Waits for the copies that fill a job's buffer (on the writer's thread: the thread that
 * generates does not wait for them); LLMEM_EIO (logged) when one failed. */
static int job_filled(struct job *j) {
    const struct llmem_kv *kv = j->copies;
    j->copies = NULL;
    return kv != NULL ? llmem_kv_copies_wait(kv) : LLMEM_OK;
}

void llmem_spill_free_job(struct llmem_spill *s, struct job *j) {
    (void)job_filled(j); /* no copy may still write into the buffer */
    buf_free(s, j->buf);
    free(j);
}

/* A partial chunk whose tokens begin a longer sibling's is already on disk; a shorter sibling
 * whose tokens begin this chunk's is redundant once it is written (drop_shorter). Returns 1 when
 * covered. */
static int sibling_pass(struct llmem_spill *s, const struct job *j, int drop_shorter) {
    struct sibling sib[MAX_CANDIDATES];
    pthread_mutex_lock(&s->lock);
    int n = llmem_spill_children(s, j->parent, sib);
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
        if (llmem_spill_read_tokens(s, sib[i].key, theirs, common) != common ||
            memcmp(theirs, mine, (size_t)common * 4) != 0)
            continue;
        if (!drop_shorter)
            return 1;
        pthread_mutex_lock(&s->lock);
        llmem_spill_drop_chunk(s, sib[i].key, sib[i].bytes);
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
    llmem_spill_chunk_name(j->key, name);
    snprintf(tmp, sizeof(tmp), "%s.tmp", name);

    pthread_mutex_lock(&s->lock);
    int present = llmem_spill_db_exists(s, j->key);
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
    int64_t disk = llmem_spill_free_disk(s);
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
    if (llmem_spill_make_room(s, j->bytes) != 0) {
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
    if (ok && llmem_spill_db_insert(s, &h, j->bytes, j->when) != 0) {
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

void *llmem_spill_writer_main(void *arg) {
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
        llmem_spill_free_job(s, j);
        pthread_mutex_lock(&s->lock);
        if (s->head == NULL)
            pthread_cond_broadcast(&s->idle);
    }
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* ---- the queue ------------------------------------------------------------------------------- */

static int pending(const struct llmem_spill *s, const uint8_t key[32]) {
    if (s->current != NULL && memcmp(s->current->key, key, 32) == 0)
        return 1;
    for (const struct job *j = s->head; j != NULL; j = j->next)
        if (memcmp(j->key, key, 32) == 0)
            return 1;
    return 0;
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
    uint8_t(*h)[32] = llmem_spill_chain_hashes(root, tokens, n_blocks, bs);
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
    llmem_spill_fill_geometry(&hd, kv);
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
        int present = llmem_spill_db_exists(s, hd.key) || pending(s, hd.key);
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
        llmem_spill_header_encode(&hd, buf);
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

/*
 * llmem/spill.h — the session bank's spill tier (SPEC §6.3): KV prefixes kept on disk, so that a
 * prefix the RAM tier has let go of, or one computed by an earlier process, is loaded instead of
 * prefilled.
 *
 * A store is a directory (default $XDG_CACHE_HOME/llmem/bank, else ~/.cache/llmem/bank) holding
 *   manifest.sqlite   a SQLite database in WAL mode: one row per chunk — its chain hash (the key),
 *                     its parent's chain hash, file, first token position, tokens, bytes, created,
 *                     last access (ms since the epoch) and hits;
 *   <key hex>.kv      one file per chunk of up to 16 blocks (256 tokens with blocks of 16): a
 *                     192-byte header (magic, version, the model identity's root, the chunk's key,
 *                     parent and position, token and block counts, the KV format and geometry,
 *                     payload size, and an XXH3-128 checksum of the whole file), the token
 *                     ids, then each block's raw bytes as llmem_kv_block_copy_out gives them.
 *
 * A chunk's key is the chain hash of its last block (llmem/bank.h), so a file is addressed by its
 * content: the same tokens under the same identity are the same file, and a chunk already on disk
 * is never written again. Chunks start at multiples of 16 blocks from the start of the prefix; the
 * last chunk of a prefix may hold fewer whole blocks, and a lookup may use the first blocks of a
 * longer chunk whose tokens agree with the prompt.
 *
 * One process owns a store at a time: flock on the directory. Another process that finds it locked
 * gets a store that reads nothing and writes nothing, and says so once (WARN).
 *
 * Writing happens off the generation path: llmem_spill_submit copies the blocks of the chunks that
 * are not on disk yet into staging memory (from the store's allocator, tag bank, bounded by
 * queue_bytes) and queues them; a writer thread writes each chunk to a temp file, fsyncs it,
 * renames it into place, fsyncs the directory, and only then adds the manifest row. A device
 * cache's blocks are copied on the device's own copy queue (llmem_kv_blocks_copy_out_async: pinned
 * staging memory makes them asynchronous), which the writer waits for, not the thread that
 * generates; the cache must outlive the store. The KV pool is never read by the writer, and blocks
 * given out again, or a pool that grows (and moves), are written only after those copies: a
 * pending write is safe. A
 * process killed at any point leaves at worst an orphan or temp file (removed at the next open),
 * never a row that points at an incomplete file. Closing flushes what is pending for up to 10 s.
 *
 * Bounds: the store's size cap counts every file in the directory (chunks, temp files, the
 * manifest, anything else); before each write the least recently used chunks (the deepest of a
 * chain first among equals) are evicted until the new one fits. Writing stops while the disk has
 * less than min_free_bytes free, and once hourly_write_bytes were written within the hour.
 *
 * Opening reconciles the directory with the manifest: stale temp files and orphan chunk files (no
 * row) are removed; rows whose file is missing, of the wrong size or with a bad header are dropped
 * (with `verify`, every file's checksum is checked too: llmem gc). A manifest that is not a
 * readable database is replaced by one rebuilt from the chunk files that verify. Loads check the
 * header, the identity, the KV format and geometry, the token ids and the checksum: a mismatch is a
 * miss (counted by reason, the row and file dropped), never served.
 */
#ifndef LLMEM_SPILL_H
#define LLMEM_SPILL_H

#include "llmem/api.h"

#include <stddef.h>
#include <stdint.h>

#include "llmem/kv.h"
#include "llmem/mem.h"
#include "llmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLMEM_SPILL_CHUNK_BLOCKS   16  /* blocks per chunk file (at most) */
#define LLMEM_SPILL_MIN_TOKENS     512 /* shorter prefixes are not written */
#define LLMEM_SPILL_FLUSH_S        10.0
#define LLMEM_SPILL_MIN_FREE_BYTES ((int64_t)1 << 30)
#define LLMEM_SPILL_HOURLY_BYTES   ((int64_t)128 << 30)
#define LLMEM_SPILL_QUEUE_BYTES    ((int64_t)256 << 20)

/* Free bytes on the disk holding dir (tests force a full disk with one); LLMEM_SYS_UNKNOWN when
 * unknown. */
typedef int64_t (*llmem_spill_free_fn)(void *arg, const char *dir);
/* Asked before blocks are loaded: make `blocks` KV blocks free if possible (the engine evicts
 * banked blocks); returns how many are free now. */
typedef int64_t (*llmem_spill_room_fn)(void *arg, int64_t blocks);

struct llmem_spill_config {
    const char *dir;            /* NULL: llmem_spill_default_dir */
    int64_t max_bytes;          /* the size cap; 0: llmem_spill_default_max of this machine's RAM,
                                 * at most (free disk + the store's files) / 4 */
    int64_t ram_bytes;          /* for the default cap; 0: this machine's RAM */
    int64_t min_free_bytes;     /* 0: 1 GiB; < 0: no floor */
    int64_t hourly_write_bytes; /* 0: 128 GiB */
    int64_t queue_bytes;        /* staging memory for pending writes; 0: 256 MiB */
    int64_t min_tokens;         /* 0: 512 */
    int verify;                 /* reconcile reads every chunk and checks its checksum */
    int no_writer;              /* no writer thread (llmem gc): submit skips everything */
    struct llmem_mem *mem;      /* (optional) staging and read buffers, tag bank; NULL: malloc */
    llmem_spill_free_fn free_probe; /* (optional) replaces statvfs */
    void *free_probe_arg;
};
LLMEM_API void llmem_spill_config_default(struct llmem_spill_config *c);

/* The default directory into buf: $XDG_CACHE_HOME/llmem/bank (an absolute XDG_CACHE_HOME), else
 * $HOME/.cache/llmem/bank. LLMEM_ENOENT (logged) when neither variable is usable, LLMEM_ERANGE
 * (logged) when buf is too small. */
LLMEM_API int llmem_spill_default_dir(char *buf, size_t size);
/* The default cap for a machine with ram_bytes of RAM: 16 GiB up to 16 GiB of RAM, 24 GiB up to
 * 32, 32 GiB up to 64, 100 GiB above. */
LLMEM_API int64_t llmem_spill_default_max(int64_t ram_bytes);

struct llmem_spill;

/* Opens (creating the directory and the manifest) and reconciles the store. A store locked by
 * another process opens as a store that neither reads nor writes (llmem_spill_owned() == 0).
 * LLMEM_EIO (logged, naming the path) when the directory or the manifest cannot be made or read,
 * LLMEM_ENOMEM. */
LLMEM_API int llmem_spill_open(const struct llmem_spill_config *c, struct llmem_spill **out);
/* Flushes pending writes for up to LLMEM_SPILL_FLUSH_S seconds (what is left is dropped and
 * counted), stops the writer, releases the lock. NULL is a no-op. */
LLMEM_API void llmem_spill_close(struct llmem_spill *s);
LLMEM_API int llmem_spill_owned(const struct llmem_spill *s);
LLMEM_API const char *llmem_spill_dir(const struct llmem_spill *s);

/* Queues the chunks of a finished prefix that are not on disk yet: blocks ids[0 .. n_blocks) of
 * kv (paged) hold tokens[0 .. n_blocks × block_size) under the chain rooted in root. Prefixes of
 * fewer than min_tokens tokens are skipped, as is everything when the store is not owned or the
 * queue is full. Returns the number of chunks queued (≥ 0); never fails the caller. */
LLMEM_API int64_t llmem_spill_submit(struct llmem_spill *s, struct llmem_kv *kv,
                                     const uint8_t root[32], const int32_t *tokens,
                                     const int64_t *ids, int64_t n_blocks);

/* Continues a lookup on disk: the prompt's first `from` blocks are already found (in RAM); loads
 * the chunks that follow, verified, into fresh blocks of kv, up to max_blocks blocks in all.
 * Their ids go to ids[0 ..) in order, each held once by the caller (llmem_kv_block_release);
 * returns how many. room (optional) is asked for free blocks before each chunk; without room the
 * lookup stops there. */
LLMEM_API int64_t llmem_spill_load(struct llmem_spill *s, struct llmem_kv *kv,
                                   const uint8_t root[32], const int32_t *tokens, int64_t n_tokens,
                                   int64_t from, int64_t max_blocks, int64_t *ids,
                                   llmem_spill_room_fn room, void *room_arg);

/* Waits until every queued write is done or timeout_s passed; returns the number of chunks still
 * pending (0: all written or skipped). */
LLMEM_API int64_t llmem_spill_flush(struct llmem_spill *s, double timeout_s);

#define LLMEM_SPILL_STATS_FIELDS(X)                                                                \
    X(owned)     /* 1: this process owns the store */                                              \
    X(files)     /* chunk files */                                                                 \
    X(bytes)     /* every file in the directory */                                                 \
    X(cap_bytes) /* the size cap */                                                                \
    X(lookups)   /* loads that wanted at least one block */                                        \
    X(hit_chunks)                                                                                  \
    X(read_blocks)                                                                                 \
    X(read_bytes)                                                                                  \
    X(miss_absent)    /* no chunk on disk continues the prompt */                                  \
    X(miss_identity)  /* a file of another model identity */                                       \
    X(miss_format)    /* a file of another KV format or geometry */                                \
    X(miss_corrupt)   /* bad magic, version, header or checksum */                                 \
    X(miss_truncated) /* a file shorter or longer than its header and row say */                   \
    X(miss_io)        /* a file that could not be opened or read */                                \
    X(miss_no_room)   /* no KV blocks free for it */                                               \
    X(miss_no_memory) /* no memory to read it into */                                              \
    X(written_chunks)                                                                              \
    X(write_bytes)                                                                                 \
    X(skip_short)       /* prefixes under min_tokens */                                            \
    X(skip_present)     /* chunks already on disk or queued */                                     \
    X(skip_cap)         /* a chunk larger than what the cap can make room for */                   \
    X(skip_disk_low)    /* chunks not written while the disk was nearly full */                    \
    X(skip_budget)      /* chunks over the hourly write budget */                                  \
    X(skip_queue_full)  /* chunks over the staging bound */                                        \
    X(skip_no_memory)   /* no staging memory */                                                    \
    X(skip_write_error) /* a failed write, fsync, rename or manifest insert */                     \
    X(skip_not_owner)   /* chunks not written: another process owns the store */                   \
    X(skip_shutdown)    /* chunks dropped when the flush at close ran out of time */               \
    X(evicted_files)                                                                               \
    X(evicted_bytes)                                                                               \
    X(rows_dropped)    /* rows whose file was missing, truncated or corrupt */                     \
    X(orphans_removed) /* chunk files without a row */                                             \
    X(temps_removed)                                                                               \
    X(rows_rebuilt) /* rows recovered from chunk files when the manifest was unreadable */         \
    X(queued_bytes)                                                                                \
    X(queue_peak_bytes)

#define LLMEM_SPILL_STATS_FIELD_(name) int64_t name;
struct llmem_spill_stats {
    LLMEM_SPILL_STATS_FIELDS(LLMEM_SPILL_STATS_FIELD_)
};
#undef LLMEM_SPILL_STATS_FIELD_
LLMEM_API void llmem_spill_stats(struct llmem_spill *s, struct llmem_spill_stats *stats);

/* `llmem gc`: opens the store without a writer, reconciles it with every checksum verified, holds
 * it to the cap, and reports what it found in *stats. It creates nothing: LLMEM_ENOENT (logged)
 * when the directory does not exist. LLMEM_EIO (logged) when another process owns it, or as
 * llmem_spill_open. */
LLMEM_API int llmem_spill_gc(const struct llmem_spill_config *c, struct llmem_spill_stats *stats);

#ifdef __cplusplus
}
#endif

#endif

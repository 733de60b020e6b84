/*
 * llmem/bank.h — the session bank (SPEC §6): reusable KV prefixes, found by a collision-resistant
 * chain of block hashes rooted in the identity of the model that computed them.
 *
 * Identity: h_0 = SHA-256 of a domain tag, the digest of the weight files' **bytes** (XXH3-128 per
 * file, in the tensor table's order), the digest of tokenizer.json, the KV format and layout, the
 * engine's numerics version and an optional salt (per tenant). Two fine-tunes with the same
 * config and header never share an h_0, nor do two KV formats. The per-file digests are cached by
 * path, size and modification time in a small text file, so a 100 GB model is read once.
 *
 * Blocks: h_i = SHA-256(h_{i−1} ‖ the block's token ids as little-endian int32).
 */
#ifndef LLMEM_BANK_H
#define LLMEM_BANK_H

#include "llmem/api.h"

#include <stdint.h>

#include "llmem/kv.h"
#include "llmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever the engine's numerics change what a KV block holds for the same tokens. */
#define LLMEM_BANK_NUMERICS_VERSION 1

struct llmem_bank_identity {
    uint8_t weights[16];   /* XXH3-128 over the per-file digests of the weight files and
                            * config.json (a GGUF file: its one digest) */
    uint8_t tokenizer[16]; /* XXH3-128 of tokenizer.json */
    uint8_t root[32];      /* h_0 */
};

/* The identity of MODEL_DIR's KV in a format and layout. cache_path (optional) is the digest
 * cache file (created or updated with a temp file + rename; an unreadable or malformed cache is
 * ignored and rewritten); salt may be NULL. LLMEM_ENOENT / LLMEM_EFORMAT / LLMEM_EIO (logged) for
 * a model directory whose files cannot be read. */
LLMEM_API int llmem_bank_identity(const char *model_dir, enum llmem_kv_format format,
                                  enum llmem_kv_layout layout, const char *salt,
                                  const char *cache_path, struct llmem_bank_identity *out);

/* h = SHA-256(prev ‖ tokens[0..n) as little-endian int32). */
LLMEM_API void llmem_bank_block_hash(const uint8_t prev[32], const int32_t *tokens, int n,
                                     uint8_t out[32]);

/* ---------------------------------------------------------------------------------------------
 * The RAM tier (SPEC §6.1, §6.2)
 *
 * Full KV blocks of finished sequences stay in the paged pool, held by the bank (llmem_kv_block_
 * hold) and keyed by their chain hash. A new prompt walks its hashes from the root and takes every
 * block the bank has, in order, until the first miss; only the rest is prefilled. Eviction is
 * least recently used, and a chain is touched from its last block back to its first, so the
 * blocks at the end of chains go first and every banked block stays reachable from the root.
 * ------------------------------------------------------------------------------------------- */

struct llmem_bank;

/* A bank over kv (paged) for chains rooted in `root`. LLMEM_ENOMEM (logged). */
LLMEM_API int llmem_bank_create(struct llmem_kv *kv, const uint8_t root[32],
                                struct llmem_bank **out);
/* Releases every block the bank holds. NULL is a no-op. */
LLMEM_API void llmem_bank_destroy(struct llmem_bank *bank);

/* The banked blocks that begin `tokens`: up to max_blocks ids into ids (in order), their count
 * returned; hits and misses are counted. The caller starts a sequence from them with
 * llmem_kv_seq_new_from_blocks. */
LLMEM_API int64_t llmem_bank_lookup(struct llmem_bank *bank, const int32_t *tokens,
                                    int64_t n_tokens, int64_t max_blocks, int64_t *ids);
/* Banks the full blocks of a sequence: block i holds tokens[i·bs, (i+1)·bs) (n_tokens ≥ the
 * sequence's length rounded down to whole blocks). Blocks already banked (by hash) are only
 * touched. LLMEM_ENOMEM (logged; the bank is unchanged past what it could add). */
LLMEM_API int llmem_bank_insert(struct llmem_bank *bank, int seq, const int32_t *tokens,
                                int64_t n_tokens);
/* Evicts least recently used blocks until the bank holds at most max_bytes; returns the bytes
 * released back to the pool (a block also used by a live sequence stays in the pool until that
 * sequence lets go). */
LLMEM_API int64_t llmem_bank_trim(struct llmem_bank *bank, int64_t max_bytes);

#define LLMEM_BANK_STATS_FIELDS(X)                                                                 \
    X(blocks) /* blocks held */                                                                    \
    X(bytes)  /* their KV bytes */                                                                 \
    X(lookups)                                                                                     \
    X(hit_blocks)   /* blocks handed to new sequences */                                           \
    X(miss_lookups) /* lookups that matched nothing */                                             \
    X(inserted_blocks)                                                                             \
    X(evicted_blocks)
#define LLMEM_BANK_STATS_FIELD_(name) int64_t name;
struct llmem_bank_stats {
    LLMEM_BANK_STATS_FIELDS(LLMEM_BANK_STATS_FIELD_)
};
#undef LLMEM_BANK_STATS_FIELD_
LLMEM_API void llmem_bank_stats(const struct llmem_bank *bank, struct llmem_bank_stats *stats);

#ifdef __cplusplus
}
#endif

#endif

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

#include <stdint.h>

#include "llmem/kv.h"
#include "llmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever the engine's numerics change what a KV block holds for the same tokens. */
#define LLMEM_BANK_NUMERICS_VERSION 1

struct llmem_bank_identity {
    uint8_t weights[16];   /* XXH3-128 over the per-file digests of the weight files */
    uint8_t tokenizer[16]; /* XXH3-128 of tokenizer.json */
    uint8_t root[32];      /* h_0 */
};

/* The identity of MODEL_DIR's KV in a format and layout. cache_path (optional) is the digest
 * cache file (created or updated with a temp file + rename; an unreadable or malformed cache is
 * ignored and rewritten); salt may be NULL. LLMEM_ENOENT / LLMEM_EFORMAT / LLMEM_EIO (logged) for
 * a model directory whose files cannot be read. */
int llmem_bank_identity(const char *model_dir, enum llmem_kv_format format,
                        enum llmem_kv_layout layout, const char *salt, const char *cache_path,
                        struct llmem_bank_identity *out);

/* h = SHA-256(prev ‖ tokens[0..n) as little-endian int32). */
void llmem_bank_block_hash(const uint8_t prev[32], const int32_t *tokens, int n, uint8_t out[32]);

#ifdef __cplusplus
}
#endif

#endif

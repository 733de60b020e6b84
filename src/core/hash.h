/*
 * core/hash.h — the project's hashes, one per purpose:
 *   llmem_hash64       XXH3-64 with a seed: hash tables (fast, not collision resistant);
 *   llmem_digest_file  XXH3-128 over a file's bytes: content identity of large files (the model
 *   llmem_digest       weights), at memory speed, and the same over bytes in memory (the checksum
 *                      of a session bank spill file);
 *   llmem_sha256       SHA-256: collision-resistant chains over untrusted content (the KV
 *                      prefix hashes of the session bank), through OpenSSL's libcrypto.
 */
#ifndef LLMEM_CORE_HASH_H
#define LLMEM_CORE_HASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* XXH3-64 of n bytes at p; the same input and seed give the same value on every run. */
uint64_t llmem_hash64(const void *p, size_t n, uint64_t seed);

/* XXH3-128 of the whole file at path, read in 4 MiB steps (big-endian canonical bytes, as
 * `xxhsum -H2` prints them). LLMEM_ENOENT or LLMEM_EIO (logged, naming the file). */
int llmem_digest_file(const char *path, uint8_t out[16]);

/* XXH3-128 of n bytes at p, in the same canonical byte order as llmem_digest_file. */
void llmem_digest(const void *p, size_t n, uint8_t out[16]);

/* SHA-256 of the concatenation of n_parts byte ranges. */
void llmem_sha256(const void *const *parts, const size_t *sizes, int n_parts, uint8_t out[32]);

#ifdef __cplusplus
}
#endif

#endif

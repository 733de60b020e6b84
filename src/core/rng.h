/*
 * core/rng.h — splitmix64 (Steele, Lea and Flood, 2014), the one seed expander and 64-bit mixer:
 * the state advances by the golden gamma 0x9e3779b97f4a7c15 and each output is the new state
 * mixed. The sequence from a given state is fixed: seeded sampling, the KV rotation's signs and
 * the tests that check them depend on it.
 */
#ifndef LLMEM_CORE_RNG_H
#define LLMEM_CORE_RNG_H

#include <stdint.h>

/* The next output; advances *state. */
static inline uint64_t llmem_splitmix64_next(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The first output from state x: x mixed into 64 well-spread bits (seeds, ids). */
static inline uint64_t llmem_splitmix64(uint64_t x) {
    return llmem_splitmix64_next(&x);
}

#endif

/*
 * kv/codec_x86.h — what the x86-64 kernel files share: whether they are built (KV_X86), their
 * tables (codec_avx2.c, codec_avx512.c, chosen in codec_simd.c), the prefetches of the tile
 * kernels, and the names of the tile kernels in a table. The kernels are compiled with GCC/Clang
 * target attributes, so no file needs -m flags and the library runs on any x86-64.
 */
#ifndef LLMEM_KV_CODEC_X86_H
#define LLMEM_KV_CODEC_X86_H

#include <stddef.h>
#include <stdint.h>

#include "kv/codec_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_X86 1
#include <immintrin.h>
#else
#define KV_X86 0
#endif

#if KV_X86
/* The kernels of each instruction set. */
extern const struct llmem_kv_kernels llmem_kv_kernels_avx2;
extern const struct llmem_kv_kernels llmem_kv_kernels_avx512;

/* ---- the prefetches of the tile kernels (both instruction sets) ------------------------------ */

/* The prefetches of a tile kernel (struct llmem_kv_prefetch): `quota` lines a step of its loops,
 * enough for all of them in `steps` steps (unless there are fewer steps than pages) and a divisor
 * of a slice's lines, so that a step's lines lie in one slice. The kernels' loops are short of
 * registers and of branch slots, so the walk is kept to two tests a step (in cache it costs a
 * tile about 6 %; a test a line, twice that): p is the next line, stop the end of its slice,
 * skip the gap to the next page's slice (addresses as integers: the walk steps past the end of
 * the bytes before it stops). */
struct pf_spread {
    uintptr_t p, stop, end, skip;
    int quota;
};

static inline struct pf_spread pf_spread_init(struct llmem_kv_prefetch pf, int steps) {
    struct pf_spread s = {0, UINTPTR_MAX, 0, 0, 0}; /* nothing: p never reaches stop or end */
    if (pf.len > 0 && pf.off < pf.bytes && steps > 0) {
        const size_t slice = (pf.len + 63) / 64; /* lines */
        const size_t pages = (pf.bytes - pf.off + LLMEM_KV_PF_PAGE - 1) / LLMEM_KV_PF_PAGE;
        size_t quota = (pages * slice + (size_t)steps - 1) / (size_t)steps;
        if (quota > slice) /* fewer steps than pages (a short tile): some pages are left out */
            quota = slice;
        while (slice % quota != 0)
            quota++;
        const uintptr_t at = (uintptr_t)pf.at;
        s = (struct pf_spread){at + pf.off, at + pf.off + 64 * slice, at + pf.bytes,
                               LLMEM_KV_PF_PAGE - 64 * slice, (int)quota};
    }
    return s;
}

static inline void pf_step(struct pf_spread *s) {
    if (s->p == s->stop) { /* the next page's slice */
        s->p += s->skip;
        s->stop += LLMEM_KV_PF_PAGE;
    }
    if (s->p < s->end) { /* two lines unconditionally (one more than a quota of 1 asks) */
        __builtin_prefetch((const void *)s->p, 0, 3);
        __builtin_prefetch((const void *)(s->p + 64), 0, 3);
        for (int r = 2; r < s->quota; r++)
            __builtin_prefetch((const void *)(s->p + 64 * (uintptr_t)r), 0, 3);
        s->p += 64 * (uintptr_t)s->quota;
    }
}

static inline uint16_t get_u16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}

/* The tile kernels of both instruction sets are named attn_scores<P>_<format>_<isa> and
 * attn_values<P>_<format>_<isa>, P empty for four query heads, 2 for two and 1 for one; TILE_TABLE
 * lists one instruction set's kernels for one of those group sizes (struct llmem_kv_kernels). */
#define TILE_ENTRY(P, fmt, FMT, isa)                                                               \
    [LLMEM_KV_FORMAT_##FMT] = {attn_scores##P##_##fmt##_##isa, attn_values##P##_##fmt##_##isa}
#define TILE_TABLE(P, isa)                                                                         \
    {                                                                                              \
        TILE_ENTRY(P, f32, F32, isa), TILE_ENTRY(P, f16, F16, isa),                                \
            TILE_ENTRY(P, bf16, BF16, isa), TILE_ENTRY(P, q8, Q8, isa),                            \
            TILE_ENTRY(P, q4, Q4, isa), TILE_ENTRY(P, tq, TQ, isa)                                 \
    }
#endif /* KV_X86 */

#endif

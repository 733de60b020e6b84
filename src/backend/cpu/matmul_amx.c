/*
 * backend/cpu/matmul_amx.c — bf16 weights at fast precision on the AMX tiles (TDPBF16PS), for
 * every row count: decode and prefill take the same arithmetic, so a row of x gives the same bits
 * alone or in any batch.
 *
 * The weights are the tiles' left operand as they lie in the file or the mapping: a tile is 16
 * weight rows × 32 columns, loaded with the row pitch, nothing repacked. The activations are
 * rounded to bf16 (to nearest even, as VCVTNE2PS2BF16 rounds) and packed once per call, 16 rows
 * of x a strip, each 32-column chunk of a strip one 1 KiB tile in the pair layout TDPBF16PS
 * reads (row p of the tile: the pair (2p, 2p + 1) of the chunk for each of the 16 rows of x).
 *
 * The AMX order: an output's f32 accumulator starts at zero and takes the chunks of 32 columns in
 * order, each by one TDPBF16PS (weights and x zero past the row's end); then the bias is added.
 * How TDPBF16PS sums the 32 products of a chunk into its accumulator is the hardware's: it is not
 * the VDPBF16PS order, so results differ from the AVX512-BF16 kernels' in the last bits, within
 * the same bound (test-cpuops). A block of 32 weight rows × 32 rows of x is four accumulator
 * tiles; with fewer rows or columns left, the missing ones are zeros copied into a tile buffer.
 */
#include <string.h>

#include "backend/cpu/cpu_int.h"
#include "backend/cpu/x86_int.h"
#include "core/log.h"
#include "llmem/pool.h"
#include "llmem/sys.h"

/* Parts of an activation: 1 (x rounded to bf16), or for weights marked f32_x = 1 (the matrices
 * whose inputs stay f32 at fast precision; 2 never takes the tiles) x ≈ hi + lo, hi = x rounded to
 * bf16 and lo = the rest rounded to bf16: within 2⁻¹⁸ |x|, about the f32 accumulation's own error
 * over a row of thousands, at twice the tile operations. */
#define AMX_F32X_PARTS 2
static int parts_of(const struct llmem_weight *w) {
    return w->f32_x ? AMX_F32X_PARTS : 1;
}

/* Chunks of 32 columns in a block of the prefill's loop (16 KiB of weight tiles), and the most
 * strips of x a part multiplies at once (their accumulators wait in the thread's scratch between
 * blocks: 4 KiB a pair). */
#define AMX_KC 8
/* Decode reads its weight tiles in place: the chunks it prefetches ahead of the one it loads. */
#define AMX_AHEAD 8
#ifndef AMX_XBLOCK_BYTES
#define AMX_XBLOCK_BYTES ((size_t)1 << 20)
#endif
#define AMX_STRIPS_MAX 128
_Static_assert((AMX_KC * 2 * 1024 + AMX_STRIPS_MAX / 2 * 4096) / 4 <= CPU_GEMM_THREAD_FLOATS,
               "the thread's scratch holds a block of weight tiles and the waiting accumulators");

/* The bytes of x's packed form per strip of 16 rows: a 1 KiB tile per chunk of 32 columns and
 * part. */
static size_t strip_bytes(const struct llmem_weight *w) {
    return (size_t)((w->cols + 31) / 32) * 1024 * (size_t)parts_of(w);
}

int llmem_cpu_amx_takes(const struct cpu_ctx *c, const struct llmem_weight *w) {
#if CPU_X86
    return !c->no_amx && w->quant == 0 && w->dtype == LLMEM_DTYPE_BF16 && w->f32_x < 2 &&
           llmem_cpu_bf16_fast(c) && (llmem_sys_isa_features() & LLMEM_ISA_AMX_BF16) != 0 &&
           w->cols > 0 && strip_bytes(w) <= CPU_GEMM_XT_BYTES;
#else
    (void)c, (void)w;
    return 0;
#endif
}

/* Rows [t0[i], t0[i] + nt[i]) of each x[i] times w[i]: pack task k is strip k of them all (16 rows
 * of one x), part task k a range of one matrix's weight rows; the i-th matrix's strips and parts
 * are those from strip0[i] and part0[i]. */
struct amx_job {
    int count;
    const struct llmem_weight *const *w;
    const float *const *x;
    const int64_t *t0, *nt;
    float *const *y;
    const float *const *bias;
    const uint8_t *xt;                   /* the packed strips, one after another */
    float *wpanel;                       /* the threads' scratch (cpu_ctx) */
    int strip0[CPU_MATMUL_MANY_MAX + 1]; /* (the total at [count]) */
    int part0[CPU_MATMUL_MANY_MAX + 1];  /* (the total at [count]) */
    size_t xoff[CPU_MATMUL_MANY_MAX];    /* byte offset of the i-th x's strips in xt */
    int64_t per[CPU_MATMUL_MANY_MAX];    /* the i-th matrix's rows per part, a multiple of 32 */
};

/* The matrix a task index falls in (strip0 or part0 as first). */
static int job_matrix(const int *first, int count, int task) {
    int i = 0;
    while (i + 1 < count && first[i + 1] <= task)
        i++;
    return i;
}

#if CPU_X86
struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-3 accumulators (16 × 16 f32), 4-5 weights, 6-7 x (16 rows of 64 bytes each). */
TARGET_AMX static void amx_configure(void) {
    struct amx_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

TARGET_AMX static void amx_pack_task(void *arg, int task, int thread) {
    (void)thread;
    const struct amx_job *j = arg;
    const int i = job_matrix(j->strip0, j->count, task);
    const int64_t cols = j->w[i]->cols, nk = (cols + 31) / 32, t = (task - j->strip0[i]) * 16;
    const int nt = j->nt[i] - t < 16 ? (int)(j->nt[i] - t) : 16, parts = parts_of(j->w[i]);
    const float *x = j->x[i] + (j->t0[i] + t) * cols;
    float *dst = (float *)(j->xt + j->xoff[i] + (size_t)(t / 16) * strip_bytes(j->w[i]));
    for (int64_t s = 0; s < nk; s++) {
        __m512 r[AMX_F32X_PARTS][16];
        for (int jj = 0; jj < 16; jj++) {
            __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
            if (jj < nt)
                x32_load(x + jj * cols + s * 32, cols - s * 32, &lo, &hi);
            for (int p = 0; p < parts; p++) {
                __m512i b = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                r[p][jj] = _mm512_castsi512_ps(b);
                if (p + 1 == parts)
                    break;
                /* what the part leaves: exact (the part is x's leading bits, rounded) */
                __m512i b_lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(b));
                __m512i b_hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1));
                lo = _mm512_sub_ps(lo, _mm512_castsi512_ps(_mm512_slli_epi32(b_lo, 16)));
                hi = _mm512_sub_ps(hi, _mm512_castsi512_ps(_mm512_slli_epi32(b_hi, 16)));
            }
        }
        for (int p = 0; p < parts; p++) {
            transpose16_avx512(r[p]);
            for (int kk = 0; kk < 16; kk++)
                _mm512_storeu_ps(dst + (((size_t)s * (size_t)parts + (size_t)p) * 16 + (size_t)kk) *
                                           16,
                                 r[p][kk]);
        }
    }
}

/* Rows [0, m) of chunk s (from row, ld bytes apart) into the tile buffer buf, zeros past m rows
 * and past cols. */
static void copy_tile(const uint8_t *row, int64_t ld, int m, int64_t s, int64_t cols,
                      uint16_t *buf) {
    int64_t k = s * 32, width = cols - k < 32 ? cols - k : 32;
    memset(buf, 0, 16 * 64);
    for (int i = 0; i < m; i++)
        memcpy(buf + i * 32, row + i * ld + k * 2, (size_t)width * 2);
}

/* The weight tile of rows [0, m) and chunk s: in place when whole (the row pitch in *stride),
 * else copied into buf. */
static ALWAYS_INLINE const void *weight_tile(const uint8_t *row, int64_t ld, int m, int64_t s,
                                             int64_t cols, uint16_t *buf, int64_t *stride) {
    if (m == 16 && cols - s * 32 >= 32) {
        *stride = ld;
        return row + s * 64;
    }
    copy_tile(row, ld, m, s, cols, buf);
    *stride = 64;
    return buf;
}

/* The weight tiles of rows [r, r + m0 + m1) (m1 = 0: one tile a chunk) for chunks [s0, s1), one
 * after another into blk: [chunk][tile][16 rows × 64 bytes]. A tile loaded from there reads 1 KiB
 * in a row, where one read in place reads 16 rows a pitch apart (a pitch of 4 KiB puts all 16 in
 * one set of the L1 cache). The rows of the next block are prefetched into L2 (s1 < s2). */
TARGET_AMX static void pack_weights(const uint8_t *row, int64_t ld, int m0, int m1, int64_t cols,
                                    int64_t s0, int64_t s1, int64_t s2, uint16_t *blk) {
    const int tiles = m1 > 0 ? 2 : 1;
    for (int h = 0; h < tiles; h++) {
        const int m = h ? m1 : m0;
        const uint8_t *src = row + h * 16 * ld;
        for (int64_t s = s0; s < s1; s++) {
            uint16_t *dst = blk + ((size_t)(s - s0) * (size_t)tiles + (size_t)h) * 512;
            if (m < 16 || cols - s * 32 < 32)
                copy_tile(src, ld, m, s, cols, dst);
            else
                for (int i = 0; i < 16; i++)
                    _mm512_storeu_si512(dst + i * 32, _mm512_loadu_si512(src + i * ld + s * 64));
        }
        for (int i = 0; i < m; i++)
            for (int64_t s = s1; s < s2; s++)
                _mm_prefetch((const char *)src + i * ld + s * 64, _MM_HINT_T1);
    }
}

/* A part: its weight rows 32 at a time (tiles 4 and 5), times every pair of strips of x (tiles 6
 * and 7), into the accumulators 0-3. With one or two strips (decode) the weight tiles are read in
 * place, every chunk at once. With more, the chunks go in blocks of AMX_KC: a block's weight tiles
 * are packed, stay in the L1 cache while every pair of strips passes, and the accumulators of a
 * pair wait in the thread's scratch between blocks (stored and loaded exactly). */
TARGET_AMX static void amx_part_task(void *arg, int task, int thread) {
    const struct amx_job *j = arg;
    const int i = job_matrix(j->part0, j->count, task);
    const struct llmem_weight *w = j->w[i];
    const int64_t rows = w->rows, cols = w->cols, nk = (cols + 31) / 32, n = j->nt[i];
    const int64_t ld = llmem_weight_row_bytes(w), strips = (n + 15) / 16;
    const int64_t r_begin = (task - j->part0[i]) * j->per[i];
    const int64_t r_end = r_begin + j->per[i] < rows ? r_begin + j->per[i] : rows;
    const uint32_t *xp = (const uint32_t *)(j->xt + j->xoff[i]);
    const int parts = parts_of(w);
    const size_t strip = strip_bytes(w) / 4, tile = 256; /* (uint32 pairs) */
    float *y = j->y[i] + j->t0[i] * rows;
    const float *bias = j->bias != NULL ? j->bias[i] : NULL;
    const int blocked = strips > 2;
    const int64_t kc = blocked ? AMX_KC : nk;
    uint16_t *blk = (uint16_t *)(j->wpanel + (size_t)thread * CPU_GEMM_THREAD_FLOATS);
    float *wait = (float *)(blk + AMX_KC * 2 * 512); /* 4 tiles a pair of strips */
    _Alignas(64) float acc[4][256];
    _Alignas(64) uint16_t buf[2][16 * 32];
    amx_configure();
    const int64_t rstep = blocked ? 32 : 16;
    for (int64_t r = r_begin; r < r_end; r += rstep) {
        const int m0 = r_end - r < 16 ? (int)(r_end - r) : 16;
        const int m1 = !blocked || r_end - r - 16 <= 0 ? 0
                       : r_end - r - 16 < 16          ? (int)(r_end - r - 16)
                                                      : 16;
        const int tiles = m1 > 0 ? 2 : 1;
        const uint8_t *a0 = (const uint8_t *)w->data + r * ld, *a1 = a0 + 16 * ld;
        for (int64_t s0 = 0; s0 < nk; s0 += kc) {
            const int64_t s1 = s0 + kc < nk ? s0 + kc : nk;
            if (blocked)
                pack_weights(a0, ld, m0, m1, cols, s0, s1, s1 + kc < nk ? s1 + kc : nk, blk);
            for (int64_t q = 0; q < strips; q += 2) {
                const int two = q + 1 < strips;
                const uint32_t *b0 = xp + (size_t)q * strip, *b1 = b0 + strip;
                float *wq = wait + (size_t)(q / 2) * 4 * 256;
                if (s0 == 0) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else {
                    _tile_loadd(0, wq, 64);
                    _tile_loadd(1, wq + 256, 64);
                    _tile_loadd(2, wq + 512, 64);
                    _tile_loadd(3, wq + 768, 64);
                }
                for (int64_t s = s0; s < s1; s++) {
                    int64_t l0 = 64, l1 = 64;
                    const uint16_t *p0 = blk + (size_t)(s - s0) * (size_t)tiles * 512;
                    if (!blocked) { /* the tile AMX_AHEAD chunks on (in the next strip at the
                                     * end of this one) into L2, where the 16 rows of a 4 KiB
                                     * pitch fit (in L1 they share a set) */
                        const int64_t sa = s + AMX_AHEAD;
                        const uint8_t *pa = sa < nk          ? a0 + sa * 64
                                            : r + 16 < r_end ? a0 + 16 * ld + (sa - nk) * 64
                                                             : NULL;
                        for (int ii = 0; pa != NULL && ii < 16; ii++)
                            _mm_prefetch((const char *)pa + ii * ld, _MM_HINT_T1);
                    }
                    _tile_loadd(4, blocked ? p0 : weight_tile(a0, ld, m0, s, cols, buf[0], &l0),
                                l0);
                    if (m1 > 0)
                        _tile_loadd(
                            5, blocked ? p0 + 512 : weight_tile(a1, ld, m1, s, cols, buf[1], &l1),
                            l1);
                    for (int pt = 0; pt < parts; pt++) {
                        const size_t at = ((size_t)s * (size_t)parts + (size_t)pt) * tile;
                        _tile_loadd(6, b0 + at, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two) {
                            _tile_loadd(7, b1 + at, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (m1 > 0) {
                            _tile_dpbf16ps(2, 5, 6);
                            if (two)
                                _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                }
                if (s1 < nk) {
                    _tile_stored(0, wq, 64);
                    _tile_stored(1, wq + 256, 64);
                    _tile_stored(2, wq + 512, 64);
                    _tile_stored(3, wq + 768, 64);
                    continue;
                }
                _tile_stored(0, acc[0], 64); /* (those that hold outputs) */
                if (two)
                    _tile_stored(1, acc[1], 64);
                if (m1 > 0)
                    _tile_stored(2, acc[2], 64);
                if (two && m1 > 0)
                    _tile_stored(3, acc[3], 64);
                /* acc[h · 2 + g]: weight rows r + 16 h + ii (the tile's rows), rows of x
                 * 16 (q + g) + jj (its columns); transposed, a row of x is 16 outputs */
                for (int h = 0; h < 2; h++) {
                    const int mi = h ? m1 : m0;
                    const int64_t o = r + 16 * h;
                    const __mmask16 mask = (__mmask16)((1u << mi) - 1);
                    const __m512 bv =
                        bias != NULL ? _mm512_maskz_loadu_ps(mask, bias + o) : _mm512_setzero_ps();
                    for (int g = 0; g <= two && mi > 0; g++) {
                        const int64_t t = (q + g) * 16;
                        const int nj = n - t < 16 ? (int)(n - t) : 16;
                        __m512 v[16];
                        for (int ii = 0; ii < 16; ii++)
                            v[ii] = _mm512_load_ps(acc[h * 2 + g] + ii * 16);
                        transpose16_avx512(v);
                        for (int jj = 0; jj < nj; jj++)
                            _mm512_mask_storeu_ps(y + (t + jj) * rows + o, mask,
                                                  bias != NULL ? _mm512_add_ps(v[jj], bv) : v[jj]);
                    }
                }
            }
        }
    }
    _tile_release();
}
#else
static void amx_pack_task(void *arg, int task, int thread) {
    (void)arg, (void)task, (void)thread;
}
static void amx_part_task(void *arg, int task, int thread) {
    (void)arg, (void)task, (void)thread;
}
#endif

/* Rows [t0[i], t0[i] + nt[i]) of every x[i] (their packed forms fit the scratch together):
 * packed, then every matrix's rows in parts (split as the decode kernels split them, in blocks of
 * 32 rows). */
static void amx_block(struct cpu_ctx *c, int count, const struct llmem_weight *const *w,
                      const float *const *x, const int64_t *t0, const int64_t *nt, float *const *y,
                      const float *const *bias) {
    struct amx_job job = {count,     w,   x,   t0,  nt, y, bias, (const uint8_t *)c->xt,
                          c->wpanel, {0}, {0}, {0}, {0}};
    int64_t work = 0;
    for (int i = 0; i < count; i++)
        work += w[i]->rows * w[i]->cols * nt[i];
    size_t xoff = 0;
    for (int i = 0; i < count; i++) {
        int tasks = work < (int64_t)1 << 16 ? 1 : c->n_threads;
        if (tasks > 1) { /* parts of at least 1 MiB of weights, up to 16 per thread */
            int64_t by_size = w[i]->rows * llmem_weight_row_bytes(w[i]) >> 20;
            int64_t most = (int64_t)tasks * 16;
            tasks = (int)(by_size < tasks ? tasks : by_size > most ? most : by_size);
        }
        job.per[i] = ((w[i]->rows + tasks - 1) / tasks + 31) / 32 * 32;
        job.part0[i + 1] = job.part0[i] + (int)((w[i]->rows + job.per[i] - 1) / job.per[i]);
        job.strip0[i + 1] = job.strip0[i] + (int)((nt[i] + 15) / 16);
        job.xoff[i] = xoff;
        xoff += (size_t)(job.strip0[i + 1] - job.strip0[i]) * strip_bytes(w[i]);
    }
    LLMEM_ASSERT(xoff <= CPU_GEMM_XT_BYTES);
    if (job.strip0[count] == 1)
        amx_pack_task(&job, 0, 0);
    else
        llmem_pool_run(c->pool, job.strip0[count], amx_pack_task, &job);
    llmem_pool_run(c->pool, job.part0[count], amx_part_task, &job);
}

int llmem_cpu_matmul_amx(struct cpu_ctx *c, int count, const struct llmem_weight *const *w,
                         const float *const *x, const int64_t *n, float *const *y,
                         const float *const *bias) {
    LLMEM_ASSERT(count >= 1 && count <= CPU_MATMUL_MANY_MAX);
    int64_t t0[CPU_MATMUL_MANY_MAX] = {0};
    if (count > 1) { /* every x at once, or nothing done */
        size_t need = 0;
        for (int i = 0; i < count; i++) {
            LLMEM_ASSERT(llmem_cpu_amx_takes(c, w[i]) && n[i] > 0);
            need += (size_t)((n[i] + 15) / 16) * strip_bytes(w[i]);
        }
        for (int i = 0; i < count; i++)
            if ((n[i] + 15) / 16 > AMX_STRIPS_MAX)
                return LLMEM_ENOMEM;
        if (need > CPU_GEMM_XT_BYTES)
            return LLMEM_ENOMEM;
        amx_block(c, count, w, x, t0, n, y, bias);
        return LLMEM_OK;
    }
    LLMEM_ASSERT(llmem_cpu_amx_takes(c, w[0]));
    /* Blocks of rows of x whose packed strips fit the scratch (at least one strip does). */
    int64_t nb = (int64_t)(AMX_XBLOCK_BYTES / strip_bytes(w[0]));
    nb = (nb < 4 ? 4 : nb > AMX_STRIPS_MAX ? AMX_STRIPS_MAX : nb) * 16;
    if ((size_t)nb / 16 * strip_bytes(w[0]) > CPU_GEMM_XT_BYTES)
        nb = (int64_t)(CPU_GEMM_XT_BYTES / strip_bytes(w[0])) * 16;
    for (int64_t t = 0; t < n[0]; t += nb) {
        int64_t nt = n[0] - t < nb ? n[0] - t : nb;
        amx_block(c, 1, w, x, &t, &nt, y, bias);
    }
    return LLMEM_OK;
}

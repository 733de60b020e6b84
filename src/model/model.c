/*
 * model/model.c — a model directory loaded for inference: config.json read in full, the
 * safetensors files memory-mapped read-only and their tensors bound to the layers of a Llama-family
 * decoder, in place (bf16, f16 or f32), with every shape checked against the config before
 * anything runs.
 *
 * Guarantees: the mapped bytes are tracked by the allocator under the tag `weights` (so the memory
 * limit and the peaks see them) and the small per-channel vectors (norms, biases) are f32 copies
 * from the same allocator; a missing tensor, a wrong shape or dtype, or an unsupported feature
 * (rope type, activation) fails the load with one line naming it, and nothing stays mapped.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <fcntl.h>

#include "core/file.h"
#include "core/log.h"
#include "model/gguf.h"
#include "model/model_int.h"
#include "quant/quant.h"
#include "llmem/config.h"
#include "llmem/dtype.h"
#include "llmem/safetensors.h"

#define LOAD_FUNC       "llmem_model_load"
#define LOAD_ERROR(...) LLMEM_ERROR_AS(LOAD_FUNC, __VA_ARGS__)

/* ---- mapping -------------------------------------------------------------------------------- */

/* Reads a whole file into anonymous memory backed by transparent huge pages where the kernel
 * offers them (a decode step streams every weight: 2 MiB pages spare the TLB walks of 4 KiB
 * file pages), dropping the file's page-cache copy behind the reads. MAP_FAILED on failure. */
void *llmem_model_read_into_memory(int fd, size_t size, const char *path, size_t *mapped) {
    const size_t huge = (size_t)2 << 20;
    *mapped = (size + huge - 1) & ~(huge - 1);
    void *p = mmap(NULL, *mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        LOAD_ERROR("%s: cannot allocate %zu bytes for the weights: %s", path, *mapped,
                   strerror(errno));
        return MAP_FAILED;
    }
    madvise(p, *mapped, MADV_HUGEPAGE);
    for (size_t got = 0; got < size;) {
        size_t want = size - got < ((size_t)64 << 20) ? size - got : (size_t)64 << 20;
        ssize_t r = pread(fd, (char *)p + got, want, (off_t)got);
        if (r <= 0) {
            LOAD_ERROR("%s: read failed at byte %zu: %s", path, got,
                       r < 0 ? strerror(errno) : "unexpected end of file");
            munmap(p, *mapped);
            return MAP_FAILED;
        }
        posix_fadvise(fd, (off_t)got, (off_t)r, POSIX_FADV_DONTNEED);
        got += (size_t)r;
    }
    mprotect(p, *mapped, PROT_READ);
    return p;
}

static int map_files(struct llmem_model *m, llmem_progress_fn progress, void *arg, int flags) {
    const struct llmem_safetensors *st = m->st;
    m->maps = calloc((size_t)st->n_files, sizeof(*m->maps));
    m->map_bytes = calloc((size_t)st->n_files, sizeof(*m->map_bytes));
    if (m->maps == NULL || m->map_bytes == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    int64_t total = 0, done = 0;
    for (int f = 0; f < st->n_files; f++)
        total += st->files[f].file_bytes;
    for (int f = 0; f < st->n_files; f++) {
        const struct llmem_st_file *file = &st->files[f];
        int fd;
        int opened = llmem_file_open_regular(file->path, LOAD_FUNC, &fd);
        if (opened != LLMEM_OK)
            return opened;
        off_t size = lseek(fd, 0, SEEK_END);
        if (size != (off_t)file->file_bytes) {
            close(fd);
            LOAD_ERROR("%s: the file changed size since its header was read (%" PRId64
                       " bytes, now %lld)",
                       file->path, file->file_bytes, (long long)size);
            return LLMEM_EFORMAT;
        }
        size_t mapped = (size_t)size;
        void *p = (flags & LLMEM_MODEL_LOAD_NO_MMAP)
                      ? llmem_model_read_into_memory(fd, (size_t)size, file->path, &mapped)
                      : mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
        close(fd);
        if (p == MAP_FAILED) {
            if (!(flags & LLMEM_MODEL_LOAD_NO_MMAP))
                LOAD_ERROR("%s: mmap of %lld bytes failed: %s", file->path, (long long)size,
                           strerror(errno));
            return LLMEM_EIO;
        }
        m->maps[f] = p;
        m->map_bytes[f] = mapped;
        int status = llmem_mem_track(m->mem, p, mapped, LLMEM_TAG_WEIGHTS);
        if (status != LLMEM_OK) {
            munmap(p, mapped);
            m->maps[f] = NULL;
            return status;
        }
        llmem_model_fault_in(p, (size_t)size, done, total, progress, arg);
        done += (int64_t)size;
    }
    return LLMEM_OK;
}

/* The weights of LLMEM_MODEL_LOAD_DUMMY: the table of a bf16 checkpoint, its bytes made in
 * anonymous memory (on huge pages where the kernel offers them), tracked as a mapped file is. */
static int make_dummy(struct llmem_model *m, int deferred, llmem_progress_fn progress, void *arg) {
    int status = llmem_model_dummy_table(&m->cfg, &m->st);
    if (status != LLMEM_OK)
        return status;
    m->maps = calloc(1, sizeof(*m->maps));
    m->map_bytes = calloc(1, sizeof(*m->map_bytes));
    if (m->maps == NULL || m->map_bytes == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    const size_t huge = (size_t)2 << 20;
    const size_t size = ((size_t)m->st->n_bytes + huge - 1) & ~(huge - 1);
    /* deferred: only the vectors' pages are ever written; the rest stays unbacked */
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (deferred ? MAP_NORESERVE : 0), -1, 0);
    if (p == MAP_FAILED) {
        LOAD_ERROR("%s: cannot allocate %zu bytes for random weights: %s", m->cfg.geom.source,
                   size, strerror(errno));
        return LLMEM_ENOMEM;
    }
    if (!deferred)
        madvise(p, size, MADV_HUGEPAGE);
    status = llmem_mem_track(m->mem, p, size, LLMEM_TAG_WEIGHTS);
    if (status != LLMEM_OK) {
        munmap(p, size);
        return status;
    }
    m->maps[0] = p;
    m->map_bytes[0] = size;
    llmem_model_dummy_fill(m->st, p, deferred, progress, arg);
    m->dummy_deferred = deferred;
    mprotect(p, size, PROT_READ);
    return LLMEM_OK;
}

void llmem_model_fault_in(const void *p, size_t size, int64_t done, int64_t total,
                          llmem_progress_fn progress, void *arg) {
    const size_t step = (size_t)64 << 20, page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t off = 0; off < size; off += step) {
        size_t n = size - off < step ? size - off : step;
        madvise((char *)p + off, n, MADV_WILLNEED);
        volatile const char *q = (const char *)p + off;
        for (size_t i = 0; i < n; i += page)
            (void)q[i];
        done += (int64_t)n;
        if (progress != NULL)
            progress(arg, done, total);
    }
}

/* ---- binding -------------------------------------------------------------------------------- */

static const struct llmem_st_tensor *find(const struct llmem_model *m, const char *name,
                                          int required) {
    const struct llmem_st_tensor *t = llmem_safetensors_find(m->st, name);
    if (t == NULL && required)
        LOAD_ERROR("%s: tensor '%s' is missing", m->cfg.geom.source, name);
    return t;
}

static int check_shape(const struct llmem_model *m, const struct llmem_st_tensor *t, int n_dims,
                       int64_t d0, int64_t d1) {
    int ok = t->n_dims == n_dims && t->shape[0] == d0 && (n_dims == 1 || t->shape[1] == d1);
    if (!ok) {
        char want[64], got[96];
        if (n_dims == 1)
            snprintf(want, sizeof(want), "[%" PRId64 "]", d0);
        else
            snprintf(want, sizeof(want), "[%" PRId64 ", %" PRId64 "]", d0, d1);
        int len = snprintf(got, sizeof(got), "[");
        for (int i = 0; i < t->n_dims && len < (int)sizeof(got) - 24; i++)
            len += snprintf(got + len, sizeof(got) - (size_t)len, "%s%" PRId64, i ? ", " : "",
                            t->shape[i]);
        snprintf(got + len, sizeof(got) - (size_t)len, "]");
        LOAD_ERROR("%s: tensor '%s' has shape %s; the config says %s", m->cfg.geom.source, t->name,
                   got, want);
        return LLMEM_EFORMAT;
    }
    if (t->dtype != LLMEM_DTYPE_F32 && t->dtype != LLMEM_DTYPE_F16 &&
        t->dtype != LLMEM_DTYPE_BF16) {
        LOAD_ERROR("%s: tensor '%s' is %s; llmem runs F32, F16 and BF16 weights",
                   m->cfg.geom.source, t->name, llmem_dtype_name(t->dtype));
        return LLMEM_EUNSUPPORTED;
    }
    return LLMEM_OK;
}

static const void *tensor_data(const struct llmem_model *m, const struct llmem_st_tensor *t) {
    return (const char *)m->maps[t->file_index] + m->st->files[t->file_index].data_offset +
           t->offset_begin;
}

/* How the module of `weight` (its name without ".weight") is quantized: *bits 0 when it is not.
 * A per-module entry of config.json's `quantization` decides; else the module is quantized with
 * the default bits and group when its `.scales` tensor exists (mlx-lm's load_model predicate). */
static void quant_of(const struct llmem_model *m, const char *module, int *bits, int *group) {
    const struct llmem_model_config *c = &m->cfg;
    *bits = 0;
    *group = 0;
    if (c->quant_bits == 0)
        return;
    for (int i = 0; i < c->n_quant_overrides; i++)
        if (strcmp(c->quant_overrides[i].module, module) == 0) {
            *bits = c->quant_overrides[i].bits;
            *group = c->quant_overrides[i].group_size;
            return;
        }
    char name[240];
    snprintf(name, sizeof(name), "%s.scales", module);
    if (llmem_safetensors_find(m->st, name) != NULL) {
        *bits = c->quant_bits;
        *group = c->quant_group_size;
    }
}

/* An MLX matrix [rows, cols]: module.weight (U32 codes [rows, cols·bits/32]), module.scales and
 * module.biases ([rows, cols/group], one float dtype), used in place. */
static int bind_mlx(struct llmem_model *m, const char *module, int bits, int group, int64_t rows,
                    int64_t cols, struct llmem_weight *w) {
    const char *src = m->cfg.geom.source;
    if (cols % group != 0) {
        LOAD_ERROR("%s: '%s' has %" PRId64 " columns, not a multiple of its quantization group "
                   "(%d)",
                   src, module, cols, group);
        return LLMEM_EFORMAT;
    }
    char name[3][240];
    const struct llmem_st_tensor *t[3];
    const char *suffix[3] = {"weight", "scales", "biases"};
    const int64_t width[3] = {cols * bits / 32, cols / group, cols / group};
    for (int i = 0; i < 3; i++) {
        snprintf(name[i], sizeof(name[i]), "%s.%s", module, suffix[i]);
        if ((t[i] = find(m, name[i], 1)) == NULL)
            return LLMEM_ENOENT;
        if (t[i]->n_dims != 2 || t[i]->shape[0] != rows || t[i]->shape[1] != width[i]) {
            char got[96];
            int len = snprintf(got, sizeof(got), "[");
            for (int d = 0; d < t[i]->n_dims && len < (int)sizeof(got) - 24; d++)
                len += snprintf(got + len, sizeof(got) - (size_t)len, "%s%" PRId64, d ? ", " : "",
                                t[i]->shape[d]);
            snprintf(got + len, sizeof(got) - (size_t)len, "]");
            LOAD_ERROR("%s: tensor '%s' has shape %s; the config says [%" PRId64 ", %" PRId64
                       "] (%d-bit, groups of %d, of a [%" PRId64 ", %" PRId64 "] matrix)",
                       src, name[i], got, rows, width[i], bits, group, rows, cols);
            return LLMEM_EFORMAT;
        }
    }
    if (t[0]->dtype != LLMEM_DTYPE_U32) {
        LOAD_ERROR("%s: tensor '%s' is %s; MLX's quantized codes are U32", src, name[0],
                   llmem_dtype_name(t[0]->dtype));
        return LLMEM_EFORMAT;
    }
    int st = t[1]->dtype == LLMEM_DTYPE_F32    ? LLMEM_QTYPE_F32
             : t[1]->dtype == LLMEM_DTYPE_F16  ? LLMEM_QTYPE_F16
             : t[1]->dtype == LLMEM_DTYPE_BF16 ? LLMEM_QTYPE_BF16
                                               : -1;
    if (st < 0 || t[2]->dtype != t[1]->dtype) {
        LOAD_ERROR("%s: tensors '%s' and '%s' are %s and %s; llmem reads F32, F16 or BF16 scales "
                   "and biases of one dtype",
                   src, name[1], name[2], llmem_dtype_name(t[1]->dtype),
                   llmem_dtype_name(t[2]->dtype));
        return LLMEM_EUNSUPPORTED;
    }
    *w = (struct llmem_weight){.data = tensor_data(m, t[0]),
                               .dtype = t[1]->dtype,
                               .rows = rows,
                               .cols = cols,
                               .quant = llmem_qtype_mlx(bits, group, st),
                               .scales = tensor_data(m, t[1]),
                               .biases = tensor_data(m, t[2])};
    return LLMEM_OK;
}

static int bind_matrix(struct llmem_model *m, const char *name, int64_t rows, int64_t cols,
                       struct llmem_weight *w) {
    size_t len = strlen(name);
    if (len > 7 && len < 200 && strcmp(name + len - 7, ".weight") == 0) {
        char module[200];
        snprintf(module, sizeof(module), "%.*s", (int)(len - 7), name);
        int bits, group;
        quant_of(m, module, &bits, &group);
        if (bits != 0)
            return bind_mlx(m, module, bits, group, rows, cols, w);
    }
    const struct llmem_st_tensor *t = find(m, name, 1);
    if (t == NULL)
        return LLMEM_ENOENT;
    if (m->cfg.quant_bits != 0 && t->dtype == LLMEM_DTYPE_U32 && len > 7 && len < 200) {
        LOAD_ERROR("%s: tensor '%.*s.scales' is missing ('%s' is U32: MLX's quantized codes)",
                   m->cfg.geom.source, (int)(len - 7), name, name);
        return LLMEM_EFORMAT;
    }
    int status = check_shape(m, t, 2, rows, cols);
    if (status != LLMEM_OK)
        return status;
    *w = (struct llmem_weight){
        .data = tensor_data(m, t), .dtype = t->dtype, .rows = rows, .cols = cols};
    return LLMEM_OK;
}

static float to_f32(const void *data, enum llmem_dtype dtype, int64_t i) {
    if (dtype == LLMEM_DTYPE_F32) {
        float f;
        memcpy(&f, (const char *)data + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, (const char *)data + 2 * i, 2);
    if (dtype == LLMEM_DTYPE_BF16) {
        uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    _Float16 f16;
    memcpy(&f16, &h, 2);
    return (float)f16;
}

/* An f32 copy of a vector tensor of n elements; optional ones may be absent (*out = NULL). */
static int bind_vector(struct llmem_model *m, const char *name, int64_t n, int required,
                       float **out) {
    *out = NULL;
    const struct llmem_st_tensor *t = find(m, name, required);
    if (t == NULL)
        return required ? LLMEM_ENOENT : LLMEM_OK;
    int status = check_shape(m, t, 1, n, 0);
    if (status != LLMEM_OK)
        return status;
    float *v = llmem_mem_alloc(m->mem, (size_t)n * sizeof(float), LLMEM_TAG_WEIGHTS);
    if (v == NULL)
        return LLMEM_ENOMEM;
    const void *data = tensor_data(m, t);
    for (int64_t i = 0; i < n; i++)
        v[i] = to_f32(data, t->dtype, i);
    m->vector_bytes += n * (int64_t)sizeof(float);
    *out = v;
    return LLMEM_OK;
}

int llmem_model_layer_experts(struct llmem_model *m, struct model_layer *L) {
    const struct llmem_model_geometry *g = &m->cfg.geom;
    const int64_t E = g->n_experts;
    L->experts = calloc((size_t)(3 * E), sizeof(*L->experts));
    if (L->experts == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    L->moe = (struct llmem_backend_moe){.n_experts = E,
                                        .k = g->n_experts_used,
                                        .norm_topk = m->cfg.moe_norm_topk,
                                        .gate = L->experts,
                                        .up = L->experts + E,
                                        .down = L->experts + 2 * E};
    return LLMEM_OK;
}

/* Expert e's three matrices from transformers' stacked tensors: `gate_up` [E, 2·inter, hidden]
 * (each expert's gate rows, then its up rows) and `down` [E, hidden, inter]. */
static int bind_stacked_experts(struct llmem_model *m, const char *gate_up, const char *down,
                                struct model_layer *L) {
    const struct llmem_model_geometry *g = &m->cfg.geom;
    const int64_t E = g->n_experts, inter = g->expert_intermediate, h = g->hidden_size;
    const struct llmem_st_tensor *t[2] = {find(m, gate_up, 1), NULL};
    if (t[0] == NULL || (t[1] = find(m, down, 1)) == NULL)
        return LLMEM_ENOENT;
    const int64_t want[2][3] = {{E, 2 * inter, h}, {E, h, inter}};
    for (int i = 0; i < 2; i++) {
        const struct llmem_st_tensor *x = t[i];
        if (x->n_dims != 3 || x->shape[0] != want[i][0] || x->shape[1] != want[i][1] ||
            x->shape[2] != want[i][2]) {
            LOAD_ERROR("%s: tensor '%s' is not [%" PRId64 ", %" PRId64 ", %" PRId64
                       "] (experts, rows, columns) as the config says",
                       g->source, x->name, want[i][0], want[i][1], want[i][2]);
            return LLMEM_EFORMAT;
        }
        if (x->dtype != LLMEM_DTYPE_F32 && x->dtype != LLMEM_DTYPE_F16 &&
            x->dtype != LLMEM_DTYPE_BF16) {
            LOAD_ERROR("%s: tensor '%s' is %s; llmem runs F32, F16 and BF16 weights", g->source,
                       x->name, llmem_dtype_name(x->dtype));
            return LLMEM_EUNSUPPORTED;
        }
    }
    const int64_t s0 = llmem_dtype_size(t[0]->dtype), s1 = llmem_dtype_size(t[1]->dtype);
    const char *gu = tensor_data(m, t[0]), *d = tensor_data(m, t[1]);
    for (int64_t e = 0; e < E; e++) {
        const char *at = gu + e * 2 * inter * h * s0;
        L->experts[e] = (struct llmem_weight){
            .data = at, .dtype = t[0]->dtype, .rows = inter, .cols = h};
        L->experts[E + e] = (struct llmem_weight){
            .data = at + inter * h * s0, .dtype = t[0]->dtype, .rows = inter, .cols = h};
        L->experts[2 * E + e] = (struct llmem_weight){
            .data = d + e * h * inter * s1, .dtype = t[1]->dtype, .rows = h, .cols = inter};
    }
    return LLMEM_OK;
}

/* Expert e's three matrices from mlx-lm's stacked SwitchGLU, `<block>.switch_mlp.P.weight` for
 * P gate_proj, up_proj and down_proj: [E, rows, cols] floats, or MLX-quantized codes
 * [E, rows, cols·bits/32] with scales and biases [E, rows, cols/group] beside them (its entry in
 * config.json's `quantization`, or its .scales tensor, says which). */
static int bind_switch_experts(struct llmem_model *m, const char *block, struct model_layer *L) {
    const struct llmem_model_geometry *g = &m->cfg.geom;
    const int64_t E = g->n_experts, fe = g->expert_intermediate, h = g->hidden_size;
    static const char *const parts[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int p = 0; p < 3; p++) {
        const int64_t rows = p < 2 ? fe : h, cols = p < 2 ? h : fe;
        char module[160], name[3][200];
        snprintf(module, sizeof(module), "%s.switch_mlp.%s", block, parts[p]);
        int bits, group;
        quant_of(m, module, &bits, &group);
        static const char *const suffix[3] = {"weight", "scales", "biases"};
        const struct llmem_st_tensor *t[3] = {NULL, NULL, NULL};
        const int64_t width[3] = {bits ? cols * bits / 32 : cols, bits ? cols / group : 0,
                                  bits ? cols / group : 0};
        for (int i = 0; i < (bits ? 3 : 1); i++) {
            snprintf(name[i], sizeof(name[i]), "%s.%s", module, suffix[i]);
            if ((t[i] = find(m, name[i], 1)) == NULL)
                return LLMEM_ENOENT;
            if (t[i]->n_dims != 3 || t[i]->shape[0] != E || t[i]->shape[1] != rows ||
                t[i]->shape[2] != width[i]) {
                LOAD_ERROR("%s: tensor '%s' is not [%" PRId64 ", %" PRId64 ", %" PRId64
                           "] (experts, rows, %s) as the config says",
                           g->source, name[i], E, rows, width[i],
                           i == 0 && bits ? "32-bit words of codes" : i ? "groups" : "columns");
                return LLMEM_EFORMAT;
            }
        }
        if (bits && cols % group != 0) {
            LOAD_ERROR("%s: '%s' has %" PRId64 " columns, not a multiple of its quantization "
                       "group (%d)",
                       g->source, module, cols, group);
            return LLMEM_EFORMAT;
        }
        const enum llmem_dtype dt = bits ? t[1]->dtype : t[0]->dtype;
        if (dt != LLMEM_DTYPE_F32 && dt != LLMEM_DTYPE_F16 && dt != LLMEM_DTYPE_BF16) {
            LOAD_ERROR("%s: tensor '%s' is %s; llmem runs F32, F16 and BF16 %s", g->source,
                       name[bits ? 1 : 0], llmem_dtype_name(dt), bits ? "scales" : "weights");
            return LLMEM_EUNSUPPORTED;
        }
        if (bits && (t[0]->dtype != LLMEM_DTYPE_U32 || t[2]->dtype != dt)) {
            LOAD_ERROR("%s: '%s' needs U32 codes and scales and biases of one dtype", g->source,
                       module);
            return LLMEM_EFORMAT;
        }
        const int st = dt == LLMEM_DTYPE_F32 ? LLMEM_QTYPE_F32
                       : dt == LLMEM_DTYPE_F16 ? LLMEM_QTYPE_F16
                                               : LLMEM_QTYPE_BF16;
        const int64_t code_bytes = rows * width[0] * (bits ? 4 : llmem_dtype_size(dt));
        const int64_t group_bytes = rows * width[1] * llmem_dtype_size(dt);
        for (int64_t e = 0; e < E; e++) {
            struct llmem_weight *w = &L->experts[p * E + e];
            *w = (struct llmem_weight){.data = (const char *)tensor_data(m, t[0]) + e * code_bytes,
                                       .dtype = dt,
                                       .rows = rows,
                                       .cols = cols};
            if (bits) {
                w->quant = llmem_qtype_mlx(bits, group, st);
                w->scales = (const char *)tensor_data(m, t[1]) + e * group_bytes;
                w->biases = (const char *)tensor_data(m, t[2]) + e * group_bytes;
            }
        }
    }
    return LLMEM_OK;
}

/* A mixture-of-experts layer's router and experts: Qwen3-MoE's mlp.gate and
 * mlp.experts.N.{gate,up,down}_proj, Mixtral's block_sparse_moe.gate and
 * block_sparse_moe.experts.N.{w1,w3,w2} (one tensor per expert, as the Hub stores them), either
 * family's experts stacked as transformers holds them (mlp.experts.gate_up_proj, .down_proj), or
 * as mlx-lm stacks them (switch_mlp, float or MLX-quantized). */
static int bind_moe(struct llmem_model *m, int64_t i, struct model_layer *L) {
    const struct llmem_model_geometry *g = &m->cfg.geom;
    const int64_t E = g->n_experts, inter = g->expert_intermediate, h = g->hidden_size;
    char block[96], name[200];
    snprintf(block, sizeof(block), "model.layers.%" PRId64 ".mlp", i);
    snprintf(name, sizeof(name), "%s.gate.weight", block);
    if (strcmp(g->arch, "mixtral") == 0 && find(m, name, 0) == NULL)
        snprintf(block, sizeof(block), "model.layers.%" PRId64 ".block_sparse_moe", i);
    snprintf(name, sizeof(name), "%s.gate.weight", block);
    int status = bind_matrix(m, name, E, h, &L->router);
    if (status != LLMEM_OK || (status = llmem_model_layer_experts(m, L)) != LLMEM_OK)
        return status;
    /* one tensor per expert, else the stacked pair */
    static const char *const names[2][3] = {{"gate_proj", "up_proj", "down_proj"},
                                            {"w1", "w3", "w2"}};
    const int family = strstr(block, "block_sparse_moe") != NULL;
    snprintf(name, sizeof(name), "%s.experts.0.%s.weight", block, names[family][0]);
    char scales[220];
    snprintf(scales, sizeof(scales), "%s.experts.0.%s.scales", block, names[family][0]);
    char switch_mlp[220];
    snprintf(switch_mlp, sizeof(switch_mlp), "%s.switch_mlp.gate_proj.weight", block);
    if (find(m, switch_mlp, 0) != NULL)
        return bind_switch_experts(m, block, L);
    if (find(m, name, 0) == NULL && find(m, scales, 0) == NULL) {
        char gate_up[200], down[200];
        snprintf(gate_up, sizeof(gate_up), "%s.experts.gate_up_proj", block);
        snprintf(down, sizeof(down), "%s.experts.down_proj", block);
        if (find(m, gate_up, 0) != NULL)
            return bind_stacked_experts(m, gate_up, down, L);
    }
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            snprintf(name, sizeof(name), "%s.experts.%" PRId64 ".%s.weight", block, e,
                     names[family][p]);
            status = p < 2 ? bind_matrix(m, name, inter, h, &L->experts[p * E + e])
                           : bind_matrix(m, name, h, inter, &L->experts[p * E + e]);
            if (status != LLMEM_OK)
                return status;
        }
    return LLMEM_OK;
}

static int bind_layer(struct llmem_model *m, int64_t i) {
    const struct llmem_model_geometry *g = &m->cfg.geom;
    struct model_layer *L = &m->layers[i];
    const int64_t q_dim = g->n_heads * g->head_dim, kv_dim = g->n_kv_heads * g->head_dim;
    char name[160];
    int status = LLMEM_OK;
#define NAME(suffix) (snprintf(name, sizeof(name), "model.layers.%" PRId64 ".%s", i, suffix), name)
    if ((status = bind_matrix(m, NAME("self_attn.q_proj.weight"), q_dim, g->hidden_size, &L->wq)) ||
        (status =
             bind_matrix(m, NAME("self_attn.k_proj.weight"), kv_dim, g->hidden_size, &L->wk)) ||
        (status =
             bind_matrix(m, NAME("self_attn.v_proj.weight"), kv_dim, g->hidden_size, &L->wv)) ||
        (status = bind_matrix(m, NAME("self_attn.o_proj.weight"), g->hidden_size, q_dim, &L->wo)) ||
        (status =
             bind_vector(m, NAME("input_layernorm.weight"), g->hidden_size, 1, &L->attn_norm)) ||
        (status = bind_vector(m, NAME("post_attention_layernorm.weight"), g->hidden_size, 1,
                              &L->mlp_norm)))
        return status;
    if (g->attention_bias &&
        ((status = bind_vector(m, NAME("self_attn.q_proj.bias"), q_dim, 1, &L->bq)) ||
         (status = bind_vector(m, NAME("self_attn.k_proj.bias"), kv_dim, 1, &L->bk)) ||
         (status = bind_vector(m, NAME("self_attn.v_proj.bias"), kv_dim, 1, &L->bv))))
        return status;
    if (g->qk_norm &&
        ((status = bind_vector(m, NAME("self_attn.q_norm.weight"), g->head_dim, 1, &L->q_norm)) ||
         (status = bind_vector(m, NAME("self_attn.k_norm.weight"), g->head_dim, 1, &L->k_norm))))
        return status;
    if (m->cfg.layer_moe != NULL && m->cfg.layer_moe[i])
        status = bind_moe(m, i, L);
    else if ((status = bind_matrix(m, NAME("mlp.gate_proj.weight"), g->intermediate_size,
                                   g->hidden_size, &L->w_gate)) == LLMEM_OK &&
             (status = bind_matrix(m, NAME("mlp.up_proj.weight"), g->intermediate_size,
                                   g->hidden_size, &L->w_up)) == LLMEM_OK)
        status = bind_matrix(m, NAME("mlp.down_proj.weight"), g->hidden_size,
                             g->intermediate_size, &L->w_down);
    if (status != LLMEM_OK)
        return status;
#undef NAME
    L->window = m->cfg.layer_sliding != NULL && m->cfg.layer_sliding[i] ? g->sliding_window : 0;
    return LLMEM_OK;
}

int llmem_model_check_layer_of(const char *path, const char *name, const char *prefix,
                               int64_t n_layers) {
    const size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) != 0 || name[n] < '0' || name[n] > '9')
        return LLMEM_OK;
    int64_t layer = 0; /* grown while below n_layers (more digits only make it larger) */
    const char *c = name + n;
    for (; *c >= '0' && *c <= '9'; c++)
        layer = layer < n_layers ? layer * 10 + (*c - '0') : layer;
    if (*c != '.' || layer < n_layers)
        return LLMEM_OK;
    LOAD_ERROR("%s: tensor '%s' belongs to a layer past the %" PRId64
               " the configuration declares: the weights hold more layers than it says",
               path, name, n_layers);
    return LLMEM_EFORMAT;
}

int llmem_model_check_supported(const struct llmem_model *m) {
    const struct llmem_model_config *c = &m->cfg;
    if (strcmp(c->hidden_act, "silu") != 0) {
        LOAD_ERROR("%s: hidden_act '%s' is not supported (llmem runs silu)", c->geom.source,
                   c->hidden_act);
        return LLMEM_EUNSUPPORTED;
    }
    if (strcmp(c->rope_type, "default") != 0 && strcmp(c->rope_type, "linear") != 0 &&
        strcmp(c->rope_type, "llama3") != 0) {
        LOAD_ERROR("%s: rope type '%s' is not supported (llmem runs default, linear and llama3)",
                   c->geom.source, c->rope_type);
        return LLMEM_EUNSUPPORTED;
    }
    if (c->geom.head_dim % 32 != 0) {
        LOAD_ERROR("%s: head_dim %" PRId64 " is not a multiple of 32 (the KV codecs need it)",
                   c->geom.source, c->geom.head_dim);
        return LLMEM_EUNSUPPORTED;
    }
    return LLMEM_OK;
}

/* The matrices whose activations stay f32 at fast precision (llmem_weight.f32_x): the down
 * projections (dense and every expert's), the LM head, and the routers, exactly (their rounding
 * would move a token to other experts; a GGUF file keeps them f32 anyway, and a bf16 router must
 * route as that f32 copy does). */
static void keep_f32_inputs(struct llmem_model *m) {
    const struct llmem_model_geometry *g = &m->cfg.geom;
    m->lm_head.f32_x = 1;
    for (int64_t i = 0; i < g->n_layers; i++) {
        struct model_layer *L = &m->layers[i];
        L->w_down.f32_x = 1;
        L->router.f32_x = 2;
        for (int64_t e = 0; L->experts != NULL && e < g->n_experts; e++)
            L->experts[2 * g->n_experts + e].f32_x = 1;
    }
}

int llmem_model_load(const char *model_dir, struct llmem_mem *mem, int flags,
                     llmem_progress_fn progress, void *progress_arg, struct llmem_model **out) {
    struct llmem_model *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    m->mem = mem;
    m->ranks = 1;
    int status;
    if (llmem_gguf_is_gguf(model_dir) && !(flags & LLMEM_MODEL_LOAD_DUMMY)) {
        if ((status = llmem_model_load_gguf(m, model_dir, flags, progress, progress_arg)) !=
            LLMEM_OK)
            goto fail;
        keep_f32_inputs(m);
        *out = m;
        return LLMEM_OK;
    }
    if ((status = llmem_model_config_load(model_dir, &m->cfg)) != LLMEM_OK)
        goto fail;
    struct llmem_model_geometry *g = &m->cfg.geom;
    if ((status = llmem_model_check_supported(m)) != LLMEM_OK)
        goto fail;
    if (flags & LLMEM_MODEL_LOAD_DUMMY) {
        m->cfg.quant_bits = 0; /* bf16 weights whatever the config says */
        if ((status = make_dummy(m, (flags & LLMEM_MODEL_LOAD_DUMMY_DEFERRED) != 0, progress,
                                 progress_arg)) != LLMEM_OK)
            goto fail;
    } else if ((status = llmem_safetensors_load_dir(model_dir, &m->st)) != LLMEM_OK ||
               (status = map_files(m, progress, progress_arg, flags)) != LLMEM_OK) {
        goto fail;
    }
    g->n_params = llmem_model_count_params(m->st, &m->cfg);
    g->weights_bytes = m->st->n_bytes;
    g->quantized = m->cfg.quant_bits != 0;
    g->expert_bytes = g->n_experts > 0 ? llmem_model_expert_bytes(m->st) : 0;
    for (int i = 0; i < m->st->n_tensors; i++)
        if ((status = llmem_model_check_layer_of(model_dir, m->st->tensors[i].name, "model.layers.",
                                                 g->n_layers)) != LLMEM_OK)
            goto fail;

    if ((status = bind_matrix(m, "model.embed_tokens.weight", g->vocab_size, g->hidden_size,
                              &m->embed)) != LLMEM_OK)
        goto fail;
    if (find(m, "lm_head.weight", 0) != NULL && !g->tied_embeddings) {
        status = bind_matrix(m, "lm_head.weight", g->vocab_size, g->hidden_size, &m->lm_head);
    } else { /* (llmem_model_geometry_load, which plans it first, warns of a missing lm_head) */
        g->tied_embeddings = 1;
        m->lm_head = m->embed;
    }
    if (status != LLMEM_OK ||
        (status = bind_vector(m, "model.norm.weight", g->hidden_size, 1, &m->final_norm)))
        goto fail;
    m->layers = calloc((size_t)g->n_layers, sizeof(*m->layers));
    m->inv_freq = llmem_mem_alloc(mem, (size_t)g->head_dim / 2 * sizeof(float), LLMEM_TAG_WEIGHTS);
    if (m->layers == NULL || m->inv_freq == NULL) {
        LOAD_ERROR("out of memory");
        status = LLMEM_ENOMEM;
        goto fail;
    }
    llmem_rope_inv_freq(&m->cfg, m->inv_freq);
    for (int64_t i = 0; i < g->n_layers; i++)
        if ((status = bind_layer(m, i)) != LLMEM_OK)
            goto fail;
    keep_f32_inputs(m);
    *out = m;
    return LLMEM_OK;
fail:
    llmem_model_free(m);
    return status;
}

/* A device copy's matrix: its bytes, and an MLX type's scales and biases (each in a buffer of
 * its own: model/device.c). */
static void free_device_weight(struct llmem_model *m, const struct llmem_weight *w) {
    if (w == NULL)
        return;
    llmem_mem_free(m->mem, (void *)w->data);
    llmem_mem_free(m->mem, (void *)w->scales);
    llmem_mem_free(m->mem, (void *)w->biases);
}

void llmem_model_free(struct llmem_model *m) {
    if (m == NULL)
        return;
    if (m->on_device) {
        for (int64_t i = 0; m->layers != NULL && i < m->cfg.geom.n_layers; i++) {
            const struct model_layer *L = &m->layers[i];
            /* the second of a pair in one buffer goes with the first */
            const struct llmem_weight *w[] = {
                &L->wq,    &L->wk,     llmem_weight_follows(&L->wk, &L->wv) ? NULL : &L->wv,
                &L->wo,    &L->w_gate, llmem_weight_follows(&L->w_gate, &L->w_up) ? NULL : &L->w_up,
                &L->w_down};
            for (size_t k = 0; k < sizeof(w) / sizeof(w[0]); k++)
                free_device_weight(m, w[k]);
            if (L->experts != NULL) /* the router, and each stack with its expert 0 */
                free_device_weight(m, &L->router);
            for (int s = 0; L->experts != NULL && !L->experts_on_host && s < 3; s++)
                free_device_weight(m, &L->experts[s * L->moe.n_experts]);
        }
        if (m->lm_head.data != m->embed.data)
            free_device_weight(m, &m->lm_head);
        free_device_weight(m, &m->embed);
        free(m->inv_freq);
        m->inv_freq = NULL;
    }
    if (m->layers != NULL) {
        for (int64_t i = 0; i < m->cfg.geom.n_layers; i++) {
            struct model_layer *L = &m->layers[i];
            float *v[] = {L->attn_norm, L->mlp_norm, L->bq, L->bk, L->bv, L->q_norm, L->k_norm};
            for (size_t k = 0; k < sizeof(v) / sizeof(v[0]); k++)
                llmem_mem_free(m->mem, v[k]);
            free(L->experts);
        }
        free(m->layers);
    }
    llmem_mem_free(m->mem, m->final_norm);
    llmem_mem_free(m->mem, m->inv_freq);
    for (int f = 0; m->maps != NULL && f < m->st->n_files; f++) {
        if (m->maps[f] == NULL)
            continue;
        llmem_mem_untrack(m->mem, m->maps[f]);
        munmap(m->maps[f], m->map_bytes[f]);
    }
    free(m->maps);
    free(m->map_bytes);
    if (m->gguf_tracked != NULL)
        llmem_mem_untrack(m->mem, m->gguf_tracked);
    llmem_gguf_free(m->gguf);
    if (m->gguf_copy != NULL)
        munmap(m->gguf_copy, m->gguf_copy_bytes);
    llmem_safetensors_free(m->st);
    llmem_model_config_free(&m->cfg);
    free(m);
}

const struct llmem_model_config *llmem_model_get_config(const struct llmem_model *m) {
    return &m->cfg;
}

int llmem_model_limit_vocab(struct llmem_model *m, int64_t n) {
    LLMEM_ASSERT(m != NULL);
    const int share = m->vocab_first != 0 || m->lm_head.rows != m->cfg.geom.vocab_size;
    if (n < 1 || share) {
        LLMEM_ERROR("cannot end the logits at %lld ids%s", (long long)n,
                    share ? ": a share of a split model holds only its part of the vocabulary"
                          : "");
        return LLMEM_EINVAL;
    }
    if (n < m->cfg.geom.vocab_size)
        m->lm_head.rows = n, m->cfg.geom.vocab_size = n;
    return LLMEM_OK;
}

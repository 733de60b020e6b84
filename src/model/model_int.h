/*
 * model/model_int.h — functions shared by the files of model/: the model directory check, and
 * building a tensor table file by file (safetensors.c parses one file's header; model_dir.c
 * gathers the shards of a model directory).
 */
#ifndef LLMEM_MODEL_MODEL_INT_H
#define LLMEM_MODEL_MODEL_INT_H

#include "backend/ops.h"
#include "llmem/mem.h"
#include "llmem/forward.h"
#include "llmem/model.h"
#include "llmem/safetensors.h"
#include "llmem/config.h"
#include "llmem/dtype.h"

/* Bounds on the geometry: far above any published model, low enough that the planner's products
 * (layers × hidden × intermediate, heads × head_dim × hidden × layers, vocab × hidden) stay well
 * inside int64. */
#define MAX_LAYERS       ((int64_t)1 << 16)
#define MAX_HIDDEN       ((int64_t)1 << 20)
#define MAX_HEADS        ((int64_t)1 << 16)
#define MAX_HEAD_DIM     ((int64_t)1 << 16)
#define MAX_ATTN_WIDTH   ((int64_t)1 << 20) /* n_heads × head_dim */
#define MAX_INTERMEDIATE ((int64_t)1 << 22)
#define MAX_VOCAB        ((int64_t)1 << 24)
#define MAX_CONTEXT      ((int64_t)1 << 32)

/* Copies the n bytes at src into dst[size], cut short at a UTF-8 character boundary. */
void llmem_model_copy_head(char *dst, size_t size, const char *src, size_t n);
/* Copies src into dst[size]; when too long, "..." and the end of src (from a character start). */
void llmem_model_copy_tail(char *dst, size_t size, const char *src);

/* A GGUF file (model/gguf.h) read for its geometry, or with cfg for its full configuration (then
 * geom is unused). In model_dir.c. */
int llmem_model_gguf_geometry(const char *path, struct llmem_model_geometry *geom,
                              struct llmem_model_config *cfg, const char *func);

/* The model's parameters in a directory's tensors: Σ elements, except that an MLX-quantized
 * matrix (cfg's `quantization`) counts the values of its codes and not its scales and biases. In
 * model_dir.c. */
int64_t llmem_model_count_params(const struct llmem_safetensors *st,
                                 const struct llmem_model_config *cfg);

/* The rotary inverse frequencies, as transformers computes them in f32: inv_freq[i] =
 * 1 / theta^(2i / head_dim) for i < head_dim / 2, then scaled by `linear` (÷ factor) or `llama3`
 * (wavelength-dependent: long wavelengths ÷ factor, short unchanged, smooth in between). */
void llmem_rope_inv_freq(const struct llmem_model_config *cfg, float *inv_freq);

/* The bytes of a directory's expert tensors (names with ".experts.": one tensor per expert as the
 * Hub stores them, or transformers' stacked experts.gate_up_proj and experts.down_proj; with
 * ".switch_mlp.": mlx-lm's, with their scales and biases). In model_dir.c. */
int64_t llmem_model_expert_bytes(const struct llmem_safetensors *st);

/* LLMEM_OK when dir is an existing directory; else LLMEM_ENOENT (missing) or LLMEM_EINVAL (not a
 * directory), logged as from `func` with the path. In config.c. */
int llmem_model_dir_check(const char *dir, const char *func);

/* An empty table (NULL on out of memory, logged). Free with llmem_safetensors_free. */
struct llmem_safetensors *llmem_st_table_new(const char *func);

/* Reads one file's header and appends the file and its tensors to the table, checking each tensor,
 * that no name repeats and that no two tensors overlap in this file. `func` names the public entry
 * point in the error line. On failure the table stays valid (free it). */
int llmem_st_table_add_file(struct llmem_safetensors *st, const char *path, const char *func);

/* Sorts the tensors by name, rejects a name found in two files, and sums the element and byte
 * counts. */
int llmem_st_table_finish(struct llmem_safetensors *st, const char *func);

/* The n bytes of fd read into anonymous memory backed by transparent huge pages (rounded up to
 * 2 MiB in *mapped), the page cache dropped behind the reads; MAP_FAILED (logged) on failure. */
void *llmem_model_read_into_memory(int fd, size_t size, const char *path, size_t *mapped);
/* Reads in the pages of a mapping now, in 64 MiB steps reported to progress (done and total
 * bytes, done counted from `done`), rather than at the first token. */
void llmem_model_fault_in(const void *p, size_t size, int64_t done, int64_t total,
                          llmem_progress_fn progress, void *arg);
/* LLMEM_EUNSUPPORTED (logged) for an activation, rope type or head_dim llmem does not run. */
struct llmem_model;
int llmem_model_check_supported(const struct llmem_model *m);
/* LLMEM_EFORMAT (logged) when `name` is a layer's tensor — `prefix`, a decimal index, '.' — of a
 * layer at or past n_layers: a configuration declaring fewer layers than the weights hold would
 * run a truncated model. LLMEM_OK for any other name. In model.c. */
int llmem_model_check_layer_of(const char *path, const char *name, const char *prefix,
                               int64_t n_layers);
/* Loads the GGUF file at path into m (model_gguf.c): config, mapping, tensors bound. On failure m
 * holds what was made (llmem_model_free releases it). */
int llmem_model_load_gguf(struct llmem_model *m, const char *path, int flags,
                          llmem_progress_fn progress, void *progress_arg);

/* LLMEM_ERANGE (logged) for a geometry of more parameters than seeded random weights are made for
 * (their bytes and offsets stay far inside int64_t). In model/dummy.c. */
#define LLMEM_MODEL_DUMMY_MAX_PARAMS ((int64_t)1 << 44)
int llmem_model_dummy_check(const struct llmem_model_geometry *g);
/* The tensor table of a bf16 checkpoint of cfg's model, laid out as one file standing for the
 * memory that llmem_model_dummy_fill fills (model/dummy.c: LLMEM_MODEL_LOAD_DUMMY; with
 * vectors_only the 1-D tensors alone, LLMEM_MODEL_LOAD_DUMMY_DEFERRED). */
int llmem_model_dummy_table(const struct llmem_model_config *cfg, struct llmem_safetensors **out);
void llmem_model_dummy_fill(const struct llmem_safetensors *st, void *data, int vectors_only,
                            llmem_progress_fn progress, void *arg);
/* Elements [first, first + count) of the dummy tensor t, the table's index-th, into out (bf16):
 * what llmem_model_dummy_fill writes there, made for any range (llmem quantize's chunks). */
void llmem_model_dummy_values(const struct llmem_st_tensor *t, int index, int64_t first,
                              int64_t count, uint16_t *out);
/* Of a deferred dummy model's matrix w (a view of its table's bytes: a tensor, or an expert's
 * part of a stacked one), rows [row, row + rows) and columns [col, col + cols) made into out
 * (bf16, rows × cols): the values LLMEM_MODEL_LOAD_DUMMY would have filled there. */
void llmem_model_dummy_matrix(const struct llmem_model *m, const struct llmem_weight *w,
                              int64_t row, int64_t rows, int64_t col, int64_t cols, uint16_t *out);

/* One decoder layer's weights: matrices used in place from the mapped files, small vectors as f32
 * copies (tag weights). */
struct model_layer {
    struct llmem_weight wq, wk, wv,
        wo; /* (n_heads·hd, hidden) (kv·hd, hidden) … (hidden, n_heads·hd) */
    struct llmem_weight w_gate, w_up, w_down; /* (inter, hidden) (inter, hidden) (hidden, inter) */
    float *attn_norm;                         /* (hidden) input_layernorm */
    float *mlp_norm;                          /* (hidden) post_attention_layernorm */
    float *bq, *bk, *bv;                      /* (n_heads·hd) (kv·hd) (kv·hd), or NULL */
    float *q_norm, *k_norm;                   /* (hd), or NULL */
    /* a mixture-of-experts layer (cfg.layer_moe): the router (n_experts, hidden) and the experts
     * (w_gate, w_up and w_down unused); `experts` holds the 3 × n_experts matrices the moe
     * table points into (gates, then ups, then downs); NULL in a dense layer */
    struct llmem_weight router;
    struct llmem_backend_moe moe;
    struct llmem_weight *experts;
    int experts_on_host; /* a device's copy whose experts are the host model's (the router is the
                          * device's): the forward pass runs them on its host backend */
    int64_t window;                           /* 0, or the sliding window of this layer */
};

/* A MoE layer's table of 3 × n_experts matrices (zeroed, for the binder to fill) and its moe
 * operation's view of them, with the model's k and router rule. In model.c. */
struct llmem_model;
int llmem_model_layer_experts(struct llmem_model *m, struct model_layer *L);

struct llmem_model {
    struct llmem_model_config cfg;
    struct llmem_safetensors *st;
    struct llmem_mem *mem;
    void **maps;                 /* (st->n_files) the mapped files */
    size_t *map_bytes;           /* (st->n_files) */
    struct llmem_weight embed;   /* (vocab, hidden) */
    struct llmem_weight lm_head; /* (vocab, hidden): embed when tied */
    float *final_norm;           /* (hidden) */
    float *inv_freq;             /* (hd / 2) */
    struct model_layer *layers;  /* (n_layers) */
    int64_t vector_bytes;        /* the f32 copies, for the accounting */
    struct llmem_gguf *gguf;     /* a GGUF file's tensors (model_gguf.c), or NULL */
    void *gguf_copy;             /* the file read into memory (LLMEM_MODEL_LOAD_NO_MMAP), or NULL */
    size_t gguf_copy_bytes;
    void *gguf_tracked; /* what llmem_mem_track was given for the GGUF file, or NULL */
    int rank, ranks;    /* a copy holding rank's share of a model split over `ranks` devices
                         * (device.c; 0 and 1 else): its geometry's heads and widths the share's,
                         * its vocabulary the model's */
    int64_t vocab_first; /* the first row of the vocabulary its embed and lm_head hold */
    int dummy_deferred;  /* LLMEM_MODEL_LOAD_DUMMY_DEFERRED: the matrices' bytes in maps[0]
                          * were never made; llmem_model_dummy_matrix makes them */
    int on_device;      /* a copy in a device's memory (device.c): the matrices are
                         * buffers of mem too, inv_freq a malloc'd host array; wk and wv,
                         * w_gate and w_up one buffer each where the pair has one shape
                         * and dtype (llmem_weight_follows) */
};

#endif

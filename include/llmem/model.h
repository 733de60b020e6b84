/*
 * llmem/model.h — a Hugging Face model directory read into numbers (SPEC §2.5, §5).
 *
 * Two things live here:
 *  - the model geometry (`struct llmem_model_geometry`, declared in plan.h) read from config.json
 *    and the safetensors headers, which is what `llmem plan MODEL_DIR` hands to the planner;
 *  - the safetensors tensor table: every tensor's name, dtype, shape and byte range, read from the
 *    headers of a single `model.safetensors` or of the shards listed by
 *    `model.safetensors.index.json`. Only the 8-byte length prefix and the JSON header of each file
 *    are read, never the tensor data; the loader maps the data later using these offsets.
 *
 * Every function returns an `enum llmem_status`; a failure is logged once (one line naming the
 * file and, where there is one, the tensor or field) and leaves the outputs untouched.
 * Hostile files are expected: sizes, offsets and element counts are all checked before use.
 */
#ifndef LLMEM_MODEL_H
#define LLMEM_MODEL_H

#include <stdint.h>

#include "llmem/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Element types (the safetensors dtype spellings)
 * ------------------------------------------------------------------------------------------- */

enum llmem_dtype {
    LLMEM_DTYPE_F32 = 0,
    LLMEM_DTYPE_F16,
    LLMEM_DTYPE_BF16,
    LLMEM_DTYPE_F64,
    LLMEM_DTYPE_F8_E4M3,
    LLMEM_DTYPE_F8_E5M2,
    LLMEM_DTYPE_I8,
    LLMEM_DTYPE_U8,
    LLMEM_DTYPE_I16,
    LLMEM_DTYPE_U16,
    LLMEM_DTYPE_I32,
    LLMEM_DTYPE_U32,
    LLMEM_DTYPE_I64,
    LLMEM_DTYPE_U64,
    LLMEM_DTYPE_BOOL,
    LLMEM_DTYPE_COUNT
};

/* The safetensors spelling ("BF16"); "?" for a value out of range. */
const char *llmem_dtype_name(enum llmem_dtype dtype);
/* Bytes per element (BF16 2, F32 4, BOOL 1 ...); 0 for a value out of range. */
int64_t llmem_dtype_size(enum llmem_dtype dtype);
/* "BF16" → LLMEM_DTYPE_BF16 (exact, case-sensitive, as safetensors writes it); LLMEM_ENOENT when
 * unknown. Not logged: the caller names the file and tensor. */
int llmem_dtype_parse(const char *name, enum llmem_dtype *dtype);

/* ---------------------------------------------------------------------------------------------
 * The safetensors tensor table
 * ------------------------------------------------------------------------------------------- */

#define LLMEM_ST_MAX_DIMS 8
/* Header lengths above this are refused (the reference implementation's limit is 100 MB). */
#define LLMEM_ST_MAX_HEADER_BYTES ((int64_t)100 << 20)

struct llmem_st_tensor {
    char *name; /* owned by the table */
    enum llmem_dtype dtype;
    int n_dims;
    int64_t shape[LLMEM_ST_MAX_DIMS]; /* (n_dims), outermost first; the rest 0 */
    int64_t n_elements;               /* product of shape; 1 for a scalar */
    int64_t n_bytes;                  /* n_elements × dtype size = offset_end − offset_begin */
    int64_t offset_begin;             /* data_offsets[0], relative to the file's data section */
    int64_t offset_end;               /* data_offsets[1] */
    int file_index;                   /* into llmem_safetensors.files */
};

struct llmem_st_file {
    char *path;
    int64_t file_bytes;   /* the file's size when its header was read */
    int64_t header_bytes; /* the JSON header's length (the value of the 8-byte prefix) */
    int64_t data_offset;  /* 8 + header_bytes: where offset 0 of the data section lies */
};

/* The tensors of one file or of one model directory. A tensor's bytes are at file position
 * files[t->file_index].data_offset + t->offset_begin, for t->n_bytes bytes. Guarantees after a
 * successful load: names are unique; every dtype is known; every byte range lies inside its
 * file's data section, matches the shape, and overlaps no other tensor's range in that file. */
struct llmem_safetensors {
    int n_files;
    struct llmem_st_file *files; /* (n_files) */
    int n_tensors;
    struct llmem_st_tensor *tensors; /* (n_tensors), sorted by name (strcmp) */
    int64_t n_elements;              /* Σ n_elements: the parameters as stored */
    int64_t n_bytes;                 /* Σ n_bytes: the weights as stored */
};

/* Reads the header of one .safetensors file (8-byte little-endian length, then the JSON header;
 * `__metadata__` is checked to be an object of strings and skipped). LLMEM_ENOENT when the file
 * is missing, LLMEM_EFORMAT for a malformed or inconsistent header, LLMEM_EIO, LLMEM_ENOMEM. */
int llmem_safetensors_load(const char *path, struct llmem_safetensors **out);

/* Reads the tensor table of a model directory: `model.safetensors` when present, else the shards
 * named by `model.safetensors.index.json` (each shard read once; every tensor of the weight map
 * must be in the shard it names; a tensor in two shards is an error). LLMEM_ENOENT when the
 * directory, both files or a listed shard is missing; otherwise as llmem_safetensors_load. */
int llmem_safetensors_load_dir(const char *model_dir, struct llmem_safetensors **out);

/* NULL is a no-op. */
void llmem_safetensors_free(struct llmem_safetensors *st);

/* The tensor with this name (binary search), or NULL. Not logged. */
const struct llmem_st_tensor *llmem_safetensors_find(const struct llmem_safetensors *st,
                                                     const char *name);

/* ---------------------------------------------------------------------------------------------
 * Geometry
 * ------------------------------------------------------------------------------------------- */

/* Fills *geom from MODEL_DIR/config.json alone (n_params and weights_bytes stay 0). Families:
 * llama, mistral, qwen2, qwen3 (by model_type, else by architectures), also nested under
 * `text_config`. head_dim falls back to hidden_size / num_attention_heads, num_key_value_heads to
 * num_attention_heads; sliding_window counts when use_sliding_window is true, when layer_types has
 * "sliding_attention", or (mistral) whenever it is set; rope_theta / rope_scaling /
 * rope_parameters are checked for type. name is the directory's base name, source the path.
 * LLMEM_ENOENT for a missing directory or config.json, LLMEM_EFORMAT for a missing, mistyped or
 * out-of-range field, LLMEM_EUNSUPPORTED for another architecture. */
int llmem_model_geometry_load_config(const char *model_dir, struct llmem_model_geometry *geom);

/* llmem_model_geometry_load_config, then the safetensors headers (llmem_safetensors_load_dir):
 * n_params = Σ elements, weights_bytes = Σ tensor bytes. A checkpoint that has
 * model.embed_tokens.weight but no lm_head.weight is recorded as tied whatever the config says
 * (logged as a warning). */
int llmem_model_geometry_load(const char *model_dir, struct llmem_model_geometry *geom);

/* ---------------------------------------------------------------------------------------------
 * The full configuration: what the forward pass runs on
 * ------------------------------------------------------------------------------------------- */

#define LLMEM_MAX_EOS 8

struct llmem_model_config {
    struct llmem_model_geometry geom;
    double rms_norm_eps; /* 1e-6 when absent */
    char hidden_act[16]; /* "silu" (the only one supported) */
    double rope_theta;   /* 10000 when absent */
    char rope_type[24];  /* "default", "linear", "llama3"; others are refused at load */
    double rope_factor;  /* linear, llama3 */
    double rope_low_freq_factor, rope_high_freq_factor; /* llama3 */
    int64_t rope_original_max_context;                  /* llama3 */
    uint8_t *layer_sliding; /* (n_layers) 1 where the layer attends within geom.sliding_window */
    int32_t bos_id;         /* config.json's; −1 when absent */
    int32_t eos_ids[LLMEM_MAX_EOS];
    int n_eos;
};

/* Reads MODEL_DIR/config.json as llmem_model_geometry_load_config does, plus the RoPE numbers,
 * rms_norm_eps, hidden_act, bos/eos ids and which layers slide. Free with
 * llmem_model_config_free. */
int llmem_model_config_load(const char *model_dir, struct llmem_model_config *cfg);
void llmem_model_config_free(struct llmem_model_config *cfg);

/* The rotary inverse frequencies, as transformers computes them in f32: inv_freq[i] =
 * 1 / theta^(2i / head_dim) for i < head_dim / 2, then scaled by `linear` (÷ factor) or `llama3`
 * (wavelength-dependent: long wavelengths ÷ factor, short unchanged, smooth in between). */
void llmem_rope_inv_freq(const struct llmem_model_config *cfg, float *inv_freq);

/* ---------------------------------------------------------------------------------------------
 * A model loaded for inference
 * ------------------------------------------------------------------------------------------- */

struct llmem_mem;
struct llmem_model;

/* Progress of long work: done of total units (bytes for a load). */
typedef void (*llmem_progress_fn)(void *arg, int64_t done, int64_t total);

/* Loads a model directory: config.json in full, the safetensors files memory-mapped and used in
 * place (tracked by mem under the tag weights, read in with progress reported), every tensor of
 * the architecture bound and checked against the config. With LLMEM_MODEL_LOAD_NO_MMAP the files
 * are read into anonymous memory instead, on transparent huge pages where the kernel offers them
 * (fewer TLB misses when every decode step streams all weights; the bytes are the same, but not
 * reclaimable as page cache). progress may be NULL. LLMEM_ENOENT (missing directory, file or
 * tensor), LLMEM_EFORMAT (a malformed file, a shape that disagrees with the config),
 * LLMEM_EUNSUPPORTED (an architecture, dtype, rope type or activation llmem does not run),
 * LLMEM_ENOMEM (the memory limit), LLMEM_EIO — each logged once, naming the file and tensor. */
#define LLMEM_MODEL_LOAD_NO_MMAP 1
int llmem_model_load(const char *model_dir, struct llmem_mem *mem, int flags,
                     llmem_progress_fn progress, void *progress_arg, struct llmem_model **out);
/* NULL is a no-op. */
void llmem_model_free(struct llmem_model *model);
/* A copy of a loaded model in the memory of a device backend (backend/ops.h): every matrix and
 * vector allocated from mem (tag weights) and copied through the backend, progress per layer.
 * The copy runs the forward pass on that backend; the original can be freed. LLMEM_ENOMEM or
 * the backend's failure (logged); nothing is left allocated on failure. */
struct llmem_backend;
int llmem_model_to_device(const struct llmem_model *model, const struct llmem_backend *backend,
                          struct llmem_mem *mem, llmem_progress_fn progress, void *progress_arg,
                          struct llmem_model **out);
/* The configuration; geom.n_params and geom.weights_bytes are those of the files. */
const struct llmem_model_config *llmem_model_get_config(const struct llmem_model *model);

/* ---------------------------------------------------------------------------------------------
 * The forward pass
 * ------------------------------------------------------------------------------------------- */

struct llmem_backend;
struct llmem_kv;
struct llmem_forward;

/* One sequence's part of a batch: n_tokens consecutive tokens at positions [pos, pos + n_tokens)
 * of KV sequence `seq` (pos at most the sequence's length: tokens past it are rewritten). */
struct llmem_batch_seq {
    int seq;
    int64_t pos;
    int64_t n_tokens;
    int all_logits; /* 1: logits of every token; 0: of the last one */
};

/* A forward pass of `model` on `backend` over `kv` (whose geometry must match the model), for
 * batches of up to max_batch_tokens tokens; its activations come from the model's allocator (tag
 * scratch). LLMEM_ENOMEM (logged). */
int llmem_forward_create(struct llmem_model *model, const struct llmem_backend *backend,
                         struct llmem_kv *kv, int64_t max_batch_tokens, struct llmem_forward **out);
void llmem_forward_free(struct llmem_forward *forward);
int64_t llmem_forward_max_tokens(const struct llmem_forward *forward);

/* Runs one batch: tokens holds each sequence's tokens in order; logits receives the requested rows
 * ([Σ (all_logits ? n_tokens : 1), vocab], in order). The KV of every sequence is extended (or
 * rewritten) first; on any failure (LLMEM_ENOMEM from the cache, LLMEM_EINVAL for a token id out
 * of the vocabulary or a bad position — logged) the sequences keep their previous lengths. */
int llmem_forward_run(struct llmem_forward *forward, const int32_t *tokens,
                      const struct llmem_batch_seq *seqs, int n_seqs, float *logits);

/* The most entries of a row that llmem_forward_run_top returns. */
#define LLMEM_TOP_K_MAX 64

/* Whether llmem_forward_run_top can run: the model is on a device whose backend selects the
 * largest logits there. */
int llmem_forward_has_top(const struct llmem_forward *forward);

/* llmem_forward_run, but of each logits row only its k (1 to LLMEM_TOP_K_MAX) largest entries
 * come back, selected on the device: ids and vals [rows, k], by logit descending and equal logits
 * by the lower id — all that greedy decoding (k = 1) or a sampler with top_k ≤ k needs, in a
 * fraction of the bytes. LLMEM_EINVAL (logged) where llmem_forward_has_top is 0. */
int llmem_forward_run_top(struct llmem_forward *forward, const int32_t *tokens,
                          const struct llmem_batch_seq *seqs, int n_seqs, int k, int32_t *ids,
                          float *vals);

/* llmem_forward_run_top in two halves, for a caller with work to do while the device computes:
 * start returns once the pass is queued (a failure to queue it is returned at once, the lengths
 * restored); llmem_forward_wait waits for it, and ids and vals hold its rows when it returns
 * LLMEM_OK (on a failure the sequences keep their previous lengths). One pass at a time (but for
 * llmem_forward_start_next): every start is followed by a wait before the next pass; wait without
 * a pass started returns LLMEM_OK.
 * The KV of the pass's sequences must not be freed, trimmed or forked in between. */
int llmem_forward_start_top(struct llmem_forward *forward, const int32_t *tokens,
                            const struct llmem_batch_seq *seqs, int n_seqs, int k, int32_t *ids,
                            float *vals);
int llmem_forward_wait(struct llmem_forward *forward);

/* Whether llmem_forward_start_next can run: llmem_forward_has_top, and the backend can read a
 * pass's tokens on the device. */
int llmem_forward_has_next(const struct llmem_forward *forward);

/* A greedy decode step queued behind the one pass in flight (llmem_forward_start_top with k = 1,
 * one token for each sequence, not yet waited for) before that pass's results reach the host: the
 * same sequences in the same order, each fed the id that pass selected for it, at the position
 * after it; ids and vals as llmem_forward_start_top's with k = 1 (other arrays than the pass
 * before's). Two passes are then in flight, and each llmem_forward_wait waits for the older one.
 * A caller that does not take a selected id (it stops the sequence there) discards this step's
 * result for it and sets the sequence's length back by one once the step is waited for.
 * LLMEM_EINVAL (logged) without such a pass or where llmem_forward_has_next is 0; other failures
 * as llmem_forward_start_top's. */
int llmem_forward_start_next(struct llmem_forward *forward, int32_t *ids, float *vals);

/* Whether a decode step of n_seqs sequences (one token each, at their ends) would replay a
 * recorded pass on the device: then starting it takes little of the host's time. */
int llmem_forward_replays(const struct llmem_forward *forward, int n_seqs);

#ifdef __cplusplus
}
#endif

#endif

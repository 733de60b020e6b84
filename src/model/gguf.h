/*
 * model/gguf.h — a GGUF file (versions 2 and 3, ggml's docs/gguf.md) read in place: the header,
 * every metadata key/value, every tensor info, the alignment and the data section, all validated
 * before anything is handed out; then typed access to the metadata and the tensors, and the
 * model's geometry and configuration from them (gguf_config.c).
 *
 * The file is memory-mapped read-only (or, for the fuzzer and the tests, a caller's buffer is
 * borrowed); keys, strings and tensor data are pointers into it. GGUF strings are length-prefixed
 * and not NUL-terminated: they come back as (pointer, length). Tensor names and keys are copied
 * NUL-terminated, for lookup and messages.
 *
 * Every failure logs exactly one line, as the public function that was called, naming the file
 * and the key or tensor (and, for a value of the wrong type, the type it has and the one
 * expected), and returns LLMEM_EFORMAT (malformed), LLMEM_ENOENT (missing file), LLMEM_EIO or
 * LLMEM_ENOMEM. A getter asked for a key that is not there returns LLMEM_ENOENT without logging:
 * many keys are optional, and the caller that needs one says so.
 */
#ifndef LLMEM_MODEL_GGUF_H
#define LLMEM_MODEL_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "llmem/config.h"
#include "llmem/plan.h"

#define LLMEM_GGUF_MAGIC             0x46554747u /* "GGUF" read as a little-endian u32 */
#define LLMEM_GGUF_MAX_DIMS          4
#define LLMEM_GGUF_DEFAULT_ALIGNMENT 32
/* Keys and tensor names longer than this are refused, and so are names holding a control
 * character, so that a message naming one stays one readable line (the spec allows keys up to
 * 65535 bytes, but its keys are short dotted ASCII; ggml's tensor names are below 64 bytes). */
#define LLMEM_GGUF_MAX_NAME 1024

/* The metadata value types, numbered as in the file. */
enum llmem_gguf_type {
    LLMEM_GGUF_U8 = 0,
    LLMEM_GGUF_I8 = 1,
    LLMEM_GGUF_U16 = 2,
    LLMEM_GGUF_I16 = 3,
    LLMEM_GGUF_U32 = 4,
    LLMEM_GGUF_I32 = 5,
    LLMEM_GGUF_F32 = 6,
    LLMEM_GGUF_BOOL = 7,
    LLMEM_GGUF_STRING = 8,
    LLMEM_GGUF_ARRAY = 9,
    LLMEM_GGUF_U64 = 10,
    LLMEM_GGUF_I64 = 11,
    LLMEM_GGUF_F64 = 12,
    LLMEM_GGUF_TYPE_COUNT
};
/* "u32", "string", "array" ...; "unknown" for other values. */
const char *llmem_gguf_type_name(int type);

/* A GGUF string: `len` bytes at `ptr` (inside the file), no terminator. */
struct llmem_gguf_str {
    const char *ptr;
    uint64_t len;
};

struct llmem_gguf_kv {
    char *key; /* NUL-terminated copy */
    enum llmem_gguf_type type;
    enum llmem_gguf_type elem_type; /* arrays: the elements' type (never ARRAY) */
    uint64_t n;                     /* arrays: the number of elements; 1 otherwise */
    const uint8_t *value;  /* the value's bytes (an array's first element, a string's length) */
    uint64_t *str_offsets; /* string arrays: (n) each element's offset from value; else NULL */
};

struct llmem_gguf_tensor {
    char *name;                        /* NUL-terminated copy */
    int type;                          /* ggml type id (quant/quant.h), known to the table */
    int n_dims;                        /* 1..4 */
    int64_t dims[LLMEM_GGUF_MAX_DIMS]; /* (n_dims) ggml's ne: dims[0] is the row length
                                        * (innermost); the rest 1 */
    int64_t n_elements;                /* product of dims */
    int64_t n_bytes;                   /* llmem_qtype_bytes(type, n_elements) */
    uint64_t offset;                   /* from the start of the data section; aligned */
    const void *data;                  /* inside the mapping */
};

/* A parsed file. Guarantees after a successful open: keys are unique, every value lies inside
 * the file, arrays are not nested; tensor names are unique, every type is known, every row length
 * is a whole number of blocks, every byte range is aligned, inside the file's data section and
 * overlaps no other tensor. */
struct llmem_gguf {
    char *path;          /* for messages ("<buffer>" when parsed from memory) */
    const uint8_t *base; /* the file's bytes */
    size_t size;
    int mapped;           /* base is our mapping (unmapped by llmem_gguf_free) */
    uint32_t version;     /* 2 or 3 */
    uint32_t alignment;   /* general.alignment, else 32 */
    uint64_t data_offset; /* where the data section starts (aligned) */
    int64_t n_kv;
    struct llmem_gguf_kv *kv;         /* (n_kv) in file order */
    struct llmem_gguf_kv **kv_sorted; /* (n_kv) sorted by key */
    int64_t n_tensors;
    struct llmem_gguf_tensor *tensors;         /* (n_tensors) in file order */
    struct llmem_gguf_tensor **tensors_sorted; /* (n_tensors) sorted by name */
    int64_t n_elements;                        /* Σ n_elements */
    int64_t n_bytes;                           /* Σ n_bytes */
};

/* Opens a regular file (never a FIFO or a device), maps it and parses it. */
int llmem_gguf_open(const char *path, struct llmem_gguf **out);
/* Parses size bytes at data, which must outlive the result (borrowed, not copied). name is used
 * in messages (NULL: "<buffer>"). */
int llmem_gguf_parse(const void *data, size_t size, const char *name, struct llmem_gguf **out);
/* NULL is a no-op. */
void llmem_gguf_free(struct llmem_gguf *g);

/* 1 when path names a GGUF file: a path ending in ".gguf" that is not a directory (a missing one
 * too, so that opening it says why), or a regular file whose first four bytes are "GGUF". Logs
 * nothing. */
int llmem_gguf_is_gguf(const char *path);

/* ---- metadata ------------------------------------------------------------------------------ */

/* The key/value, or NULL (not logged). */
const struct llmem_gguf_kv *llmem_gguf_find_key(const struct llmem_gguf *g, const char *key);

/* Typed getters: LLMEM_ENOENT (not logged) when the key is absent; LLMEM_EFORMAT (logged: the key,
 * its type and the type expected) when the value does not fit. The integer getters take any
 * integer type whose value is in range (a writer may store a count as u32 or u64); the float
 * getters f32 or f64; bool only bool; string only string. */
int llmem_gguf_get_u32(const struct llmem_gguf *g, const char *key, uint32_t *out);
int llmem_gguf_get_i32(const struct llmem_gguf *g, const char *key, int32_t *out);
int llmem_gguf_get_u64(const struct llmem_gguf *g, const char *key, uint64_t *out);
int llmem_gguf_get_f32(const struct llmem_gguf *g, const char *key, float *out);
int llmem_gguf_get_f64(const struct llmem_gguf *g, const char *key, double *out);
int llmem_gguf_get_bool(const struct llmem_gguf *g, const char *key, int *out);
int llmem_gguf_get_string(const struct llmem_gguf *g, const char *key, struct llmem_gguf_str *out);
/* An array: its element type and length. elem_type ≥ 0 asks for that element type (else
 * LLMEM_EFORMAT, logged); −1 takes any. */
int llmem_gguf_get_array(const struct llmem_gguf *g, const char *key, int elem_type,
                         const struct llmem_gguf_kv **out);

/* Elements of an array kv (i < kv->n, the type as the array's; API misuse asserts). */
struct llmem_gguf_str llmem_gguf_array_str(const struct llmem_gguf_kv *kv, uint64_t i);
/* An integer element of any integer type (u64 above INT64_MAX: LLMEM_ERANGE, not logged). */
int llmem_gguf_array_int(const struct llmem_gguf_kv *kv, uint64_t i, int64_t *out);
/* A float element (f32 or f64). */
double llmem_gguf_array_float(const struct llmem_gguf_kv *kv, uint64_t i);

/* ---- tensors ------------------------------------------------------------------------------- */

/* The tensor with this name (binary search), or NULL (not logged). Iterate over g->tensors. */
const struct llmem_gguf_tensor *llmem_gguf_find_tensor(const struct llmem_gguf *g,
                                                       const char *name);

/* ---- the model (gguf_config.c) ------------------------------------------------------------- */

/* The geometry of the model in g (architectures llama, qwen2, qwen3), as
 * llmem_model_geometry_load does for a directory: weights_bytes and n_params are the tensors'.
 * `func` names the public entry point in the error line. */
int llmem_gguf_geometry(const struct llmem_gguf *g, struct llmem_model_geometry *geom,
                        const char *func);
/* The full configuration (geometry, RoPE, norm epsilon, token ids). Free with
 * llmem_model_config_free. */
int llmem_gguf_config(const struct llmem_gguf *g, struct llmem_model_config *cfg, const char *func);

/* ---- writing (gguf_write.c) ---------------------------------------------------------------- */

/* A GGUF file (version 3, alignment 32) written as a stream: add every key/value and every tensor
 * info first, then the tensors' bytes in the order their infos were added, in pieces of any size
 * (llmem_gguf_writer_write); close checks that every byte came and renames PATH.part, where the
 * file is written, to PATH. Free without a successful close removes the partial file. Failures
 * log one line (the function, the file) and return LLMEM_EIO, LLMEM_EINVAL or LLMEM_ENOMEM; a
 * key/value or tensor info added after the first write is API misuse (asserted). */
struct llmem_gguf_writer;
int llmem_gguf_writer_open(const char *path, struct llmem_gguf_writer **out);
/* NULL is a no-op. */
void llmem_gguf_writer_free(struct llmem_gguf_writer *w);
/* A scalar of any numeric or bool type (value: its bytes, little-endian as in memory). */
int llmem_gguf_writer_add_scalar(struct llmem_gguf_writer *w, const char *key, int type,
                                 const void *value);
int llmem_gguf_writer_add_u32(struct llmem_gguf_writer *w, const char *key, uint32_t v);
int llmem_gguf_writer_add_i32(struct llmem_gguf_writer *w, const char *key, int32_t v);
int llmem_gguf_writer_add_f32(struct llmem_gguf_writer *w, const char *key, float v);
int llmem_gguf_writer_add_bool(struct llmem_gguf_writer *w, const char *key, int v);
/* A string of len bytes (any bytes; not NUL-terminated in the file). */
int llmem_gguf_writer_add_str(struct llmem_gguf_writer *w, const char *key, const char *s,
                              size_t len);
/* An array of n numeric or bool elements of elem_type at data. */
int llmem_gguf_writer_add_array(struct llmem_gguf_writer *w, const char *key, int elem_type,
                                const void *data, uint64_t n);
int llmem_gguf_writer_add_str_array(struct llmem_gguf_writer *w, const char *key,
                                    const struct llmem_gguf_str *strs, uint64_t n);
/* A tensor info: ggml type, dims innermost first (ggml's ne). LLMEM_EINVAL (logged) when the row
 * length is not a whole number of the type's blocks. */
int llmem_gguf_writer_add_tensor(struct llmem_gguf_writer *w, const char *name, int type,
                                 int n_dims, const int64_t *dims);
/* The next n bytes of tensor data (the header is written before the first). */
int llmem_gguf_writer_write(struct llmem_gguf_writer *w, const void *data, size_t n);
int llmem_gguf_writer_close(struct llmem_gguf_writer *w);

/* ---- a model directory → GGUF (convert.c) --------------------------------------------------- */

/* llama.cpp's file types (LLAMA_FTYPE_*, general.file_type) that llmem writes. */
enum llmem_gguf_ftype {
    LLMEM_GGUF_FTYPE_F16 = 1,
    LLMEM_GGUF_FTYPE_Q4_0 = 2,
    LLMEM_GGUF_FTYPE_Q8_0 = 7,
    LLMEM_GGUF_FTYPE_Q4_K_M = 15,
    LLMEM_GGUF_FTYPE_Q5_K_M = 17,
    LLMEM_GGUF_FTYPE_Q6_K = 18,
    LLMEM_GGUF_FTYPE_BF16 = 32,
};
/* "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "f16", "bf16" (any case) → the type; −1 otherwise. */
int llmem_gguf_ftype_parse(const char *name);
const char *llmem_gguf_ftype_name(int ftype);

/* The ggml type llama-quantize gives tensor `name` (GGUF name) of a file of this type: ne0 is its
 * row length, n_dims its dimensions, n_layers the model's, tied whether the file has no
 * output.weight. *fallback is set to 1 when the row length forced a type other than the rule's
 * (and to 2 where llama-quantize would stop with an error: Q8_0 / Q4_0 rows that are not a
 * multiple of 32; llmem writes F16 then). */
int llmem_gguf_tensor_type(int ftype, const char *name, int n_dims, int64_t ne0, int64_t n_layers,
                           int tied, int *fallback);

/* The Hugging Face name of a GGUF tensor of these architectures ("blk.3.attn_q.weight" →
 * "model.layers.3.self_attn.q_proj.weight") into out; 0 for a name that has none
 * (rope_freqs.weight, or not one of theirs). */
int llmem_gguf_hf_name(const char *gguf, char *out, size_t size);

/* The bytes of the tensors of a GGUF file of type ftype holding a model of geometry g (its
 * embeddings, layers, norms and, unless tied, output), each of the type llmem_gguf_tensor_type
 * gives it: what `llmem quantize` would write, for planning before it exists. A mixture of
 * experts is priced as llama.cpp stores one (the router F32, each MoE layer's experts stacked in
 * ffn_{gate,up,down}_exps with the dense MLP's rules), its MoE layers taken as the last ones. */
int64_t llmem_gguf_weights_bytes(const struct llmem_model_geometry *g, int ftype);

typedef void (*llmem_gguf_progress_fn)(void *arg, int64_t done, int64_t total);
/* Converts the Hugging Face model directory dir (config.json, safetensors in bf16/f16/f32,
 * tokenizer.json; architectures llama — Mistral too —, qwen2, qwen3) into the GGUF file out of
 * type ftype, as llama.cpp's convert_hf_to_gguf.py followed by llama-quantize would: metadata
 * keys, tokenizer.ggml.*, tensor names, llama's q/k rows permuted, Llama 3's rope_freqs.weight,
 * the per-tensor types of llama_tensor_get_type. Tensors are read, converted and written a chunk
 * of rows at a time, quantized on n_threads threads (≤ 0: the online CPUs; the bytes do not
 * depend on it). name: general.name (NULL: the directory's base name). dummy: the weights are
 * not read but made from config.json alone, those of LLMEM_MODEL_LOAD_DUMMY (the same seeded
 * values). progress (optional) gets the source bytes done. Errors are logged (one line) and
 * returned. */
int llmem_gguf_convert(const char *dir, const char *out, int ftype, const char *name, int n_threads,
                       int dummy, llmem_gguf_progress_fn progress, void *progress_arg);

#endif

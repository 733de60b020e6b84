/*
 * core/options.h — the process's environment, read in one place: every LLMEM_* variable the
 * library and the CLI read, in one table, and the cache directory (XDG_CACHE_HOME, HOME).
 *
 * The table gives each variable its name, type (a boolean, an integer in a range, a size with
 * K/M/G/T in a range, or one of a list of names), default and a line of documentation. The
 * variables are read once, on the first call that asks for any of them (thread-safe); an unset
 * or empty variable takes its default. A malformed value is kept as read: every call that asks
 * for it gets LLMEM_EINVAL and logs one line naming the variable, its value and what is
 * accepted, so that the operation that needs it fails instead of silently falling back.
 */
#ifndef LLMEM_CORE_OPTIONS_H
#define LLMEM_CORE_OPTIONS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum llmem_option {
    LLMEM_OPT_VERBOSE,
    LLMEM_OPT_KV_LAYOUT,
    LLMEM_OPT_KV_FORMAT,
    LLMEM_OPT_KV_BLOCK_SIZE,
    LLMEM_OPT_KV_NUM_BLOCKS,
    LLMEM_OPT_KV_DYNAMIC,
    LLMEM_OPT_SAMPLE_ON_DEVICE,
    LLMEM_OPT_DECODE_AHEAD,
    LLMEM_OPT_CUDA_GRAPHS,
    LLMEM_OPT_SPLIT_ONE_DEVICE,
    LLMEM_OPT_CUDA_PROFILE,
    LLMEM_OPT_CUDA_ATTN_STAGES,
    LLMEM_OPT_CUDA_ATTN_BF16_STAGES,
    LLMEM_OPT_CUDA_ATTN_F16_STAGES,
    LLMEM_OPT_CUDA_ATTN_Q8_STAGES,
    LLMEM_OPT_CUDA_ATTN_CTAS,
    LLMEM_OPT_CUDA_ATTN_BF16_CTAS,
    LLMEM_OPT_CUDA_ATTN_F16_CTAS,
    LLMEM_OPT_CUDA_ATTN_Q8_CTAS,
    LLMEM_OPT_CUDA_ATTN_FUSE,
    LLMEM_OPT_CUDA_ATTN_MERGE_DIMS,
    LLMEM_OPT_CUDA_ATTN_SERIAL_FROM,
    LLMEM_OPT_CUDA_PREFILL_FROM,
    LLMEM_OPT_CUDA_PREFILL_MBLOCKS,
    LLMEM_OPT_CUDA_PREFILL_WGMMA,
    LLMEM_OPT_COUNT
};

enum llmem_option_type {
    LLMEM_OPTION_BOOL, /* 1, 0, true, false, yes, no, on, off (any case) */
    LLMEM_OPTION_INT,  /* a decimal integer in [min, max] */
    LLMEM_OPTION_SIZE, /* llmem_size_parse's sizes ("512M", "4G") in [min, max] bytes */
    LLMEM_OPTION_ENUM  /* one of choices (any case) */
};

struct llmem_option_info {
    const char *name; /* the variable: "LLMEM_…" */
    enum llmem_option_type type;
    const char *def;            /* the default as the variable would spell it; NULL: none (doc) */
    int64_t min, max;           /* INT and SIZE: the accepted range */
    const char *const *choices; /* ENUM: the accepted names, NULL-terminated */
    const char *doc;            /* one line: what it does, and for def NULL what applies */
};

/* The table's entry; NULL for an id out of range. */
const struct llmem_option_info *llmem_option_info(enum llmem_option id);
/* "bool", "int", "size" or "enum". */
const char *llmem_option_type_name(enum llmem_option_type type);

/* The typed getters. *out gets the variable's value, or its default when unset; with no default
 * (def NULL) and unset, *out is left as it is, so the caller's own value stands. LLMEM_EINVAL
 * (logged, *out untouched) when the value is malformed. Asking for an option as another type
 * than its own is a programming error (LLMEM_ASSERT). BOOL gives 0 or 1; ENUM the canonical
 * spelling of the choice, which lives as long as the process. */
int llmem_option_bool(enum llmem_option id, int *out);
int llmem_option_int(enum llmem_option id, int64_t *out);
int llmem_option_size(enum llmem_option id, int64_t *out);
int llmem_option_enum(enum llmem_option id, const char **out);

/* LLMEM_OK when the option is unset or well formed, else LLMEM_EINVAL with the getters' line: for
 * a call that reads options later where it cannot fail, or reads them as text. */
int llmem_option_check(enum llmem_option id);

/* The variable's text as read (or set), NULL when unset or empty. */
const char *llmem_option_text(enum llmem_option id);

/* What the option accepts, for people ("0 or 1 (also true/false, yes/no, on/off)", "an integer
 * in [0, 256]", "one of paged, contiguous, blocks, ragged"), into buf (truncated to fit). */
void llmem_option_accepted(const struct llmem_option_info *info, char *buf, size_t size);

/* Parses text as a value of `info`: LLMEM_OK with *out (BOOL 0/1, INT and SIZE the number, ENUM
 * the choice's index), or LLMEM_EINVAL. Logs nothing: the getters say which variable it was. */
int llmem_option_parse(const struct llmem_option_info *info, const char *text, int64_t *out);

/* From now on, as if the variable held `text` (NULL: unset); a malformed text is reported by the
 * getters as one read from the environment would be. For tests and programs that set options
 * before they open anything: not safe while another thread reads options. */
void llmem_option_set(enum llmem_option id, const char *text);

/* The cache directory: $XDG_CACHE_HOME/llmem when XDG_CACHE_HOME is an absolute path, else
 * $HOME/.cache/llmem, with "/sub" appended when sub is not NULL; the directories are not made.
 * Read at every call. LLMEM_OK, LLMEM_ENOENT when neither variable is an absolute path, or
 * LLMEM_ERANGE when the path does not fit in buf; nothing is logged, since whether a missing
 * cache is a failure is the caller's to say. */
int llmem_cache_dir(const char *sub, char *buf, size_t size);

/* The directory for temporary files: TMPDIR when set and not empty, else "/tmp". */
const char *llmem_tmp_dir(void);

#ifdef __cplusplus
}
#endif

#endif

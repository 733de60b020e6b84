/*
 * tok/tok_int.h — the tokenizer's internal form, shared by the files of tok/.
 *
 * load.c reads tokenizer.json and tokenizer_config.json into this struct; encode.c runs the
 * pipeline (added tokens → normalizer → pre-tokenizer → BPE); decode.c runs the decoder and the
 * streaming detokenizer; chat.c renders chat templates; nfc.c is the NFC normalizer; util.c holds
 * the buffer, UTF-8, byte-map and hash-table helpers; vocab.c builds the same struct from a GGUF
 * file's tokenizer.ggml.* vocabulary (tok/vocab.h).
 */
#ifndef LLMEM_TOK_INT_H
#define LLMEM_TOK_INT_H

#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "llmem/tokenizer.h"

/* ---- strings -------------------------------------------------------------------------------- */

struct tok_str {
    char *p; /* owned, NUL-terminated */
    size_t n;
};

/* A growable byte buffer; every append returns LLMEM_OK or LLMEM_ENOMEM (not logged). */
struct tok_buf {
    char *p;
    size_t n, cap;
};
int llmem_tok_buf_reserve(struct tok_buf *b, size_t extra);
int llmem_tok_buf_add(struct tok_buf *b, const void *p, size_t n);
void llmem_tok_buf_free(struct tok_buf *b);

/* ---- UTF-8 (util.c) ------------------------------------------------------------------------- */

/* Length of the valid UTF-8 character at p (at most n bytes available), 0 when invalid
 * (overlong, surrogate, above U+10FFFF, truncated); *cp gets the code point. */
size_t llmem_tok_utf8_char(const unsigned char *p, size_t n, uint32_t *cp);
/* Byte offset of the first invalid sequence, or n when all of it is valid. */
size_t llmem_tok_utf8_check(const char *p, size_t n);
/* Appends the UTF-8 form of cp. */
int llmem_tok_utf8_put(struct tok_buf *b, uint32_t cp);
/* Appends p with every invalid sequence replaced by U+FFFD, one per maximal subpart (what Rust's
 * String::from_utf8_lossy and Python's errors="replace" do). */
int llmem_tok_utf8_lossy(struct tok_buf *b, const char *p, size_t n);

/* Appends the NFC form of valid UTF-8 text (nfc.c). */
int llmem_tok_nfc(struct tok_buf *out, const char *s, size_t n);

/* The GPT-2 byte ↔ character map of ByteLevel: the printable bytes of Latin-1 stand for
 * themselves, the 68 others for U+0100… in byte order. */
uint32_t llmem_tok_byte_cp(unsigned b);
/* The byte of a code point of the map, −1 for any other code point. */
int llmem_tok_cp_byte(uint32_t cp);

/* ---- hash tables ---------------------------------------------------------------------------- */

/* Strings → ids: open addressing over ids, the strings kept by the owner (`keys`). */
struct tok_strmap {
    int32_t *slots;             /* (cap) id, −1 empty */
    size_t mask;                /* cap − 1 */
    const struct tok_str *keys; /* (n_ids) the owner's strings, by id */
};
int llmem_tok_strmap_init(struct tok_strmap *m, size_t n, const struct tok_str *keys);
/* Inserts id (keys[id] must be set); an equal string already present is replaced. */
void llmem_tok_strmap_put(struct tok_strmap *m, int32_t id);
int32_t llmem_tok_strmap_get(const struct tok_strmap *m, const char *s,
                             size_t n); /* −1 when absent */
void llmem_tok_strmap_free(struct tok_strmap *m);

/* A pair of ids → the merge's rank and the merged id. */
struct tok_merge {
    uint64_t key; /* left << 32 | right; UINT64_MAX empty */
    int32_t rank;
    int32_t id;
};
struct tok_mergemap {
    struct tok_merge *slots; /* (cap) */
    size_t mask;
};

int llmem_tok_mergemap_init(struct tok_mergemap *m, size_t n);
/* Inserts or replaces the merge of (left, right). */
void llmem_tok_mergemap_put(struct tok_mergemap *m, int32_t left, int32_t right, int32_t rank,
                            int32_t id);
void llmem_tok_mergemap_free(struct tok_mergemap *m);

/* ---- pipeline steps ------------------------------------------------------------------------- */

enum tok_norm_kind { TOK_NORM_PREPEND, TOK_NORM_REPLACE, TOK_NORM_NFC };
struct tok_norm {
    enum tok_norm_kind kind;
    struct tok_str a; /* Prepend: the prefix; Replace: the pattern */
    struct tok_str b; /* Replace: the content */
};

enum tok_pre_kind { TOK_PRE_SPLIT, TOK_PRE_BYTELEVEL, TOK_PRE_METASPACE };
enum tok_prepend { TOK_PREPEND_ALWAYS, TOK_PREPEND_FIRST, TOK_PREPEND_NEVER };
struct tok_pre {
    enum tok_pre_kind kind;
    pcre2_code *re;           /* Split, ByteLevel with use_regex (else NULL) */
    int add_prefix_space;     /* ByteLevel */
    struct tok_str repl;      /* Metaspace: the replacement ("▁") */
    enum tok_prepend prepend; /* Metaspace */
    int split;                /* Metaspace: split before each replacement */
};

enum tok_dec_kind {
    TOK_DEC_BYTELEVEL,
    TOK_DEC_METASPACE,
    TOK_DEC_REPLACE,
    TOK_DEC_BYTEFALLBACK,
    TOK_DEC_FUSE,
    TOK_DEC_STRIP
};
struct tok_dec {
    enum tok_dec_kind kind;
    struct tok_str a; /* Metaspace: replacement; Replace: pattern; Strip: the character */
    struct tok_str b; /* Replace: content */
    int prepend;      /* Metaspace: prepend_scheme is not "never" */
    int start, stop;  /* Strip */
};

/* An added token, matched on the raw text before the pipeline. */
struct tok_added {
    struct tok_str content;
    int32_t id;
    int special;
    int lstrip, rstrip; /* absorb the whitespace on that side */
};

enum tok_kind { TOK_KIND_NONE = 0, TOK_KIND_VOCAB, TOK_KIND_ADDED, TOK_KIND_SPECIAL };

struct llmem_tokenizer {
    int32_t n_vocab;         /* max id + 1 */
    struct tok_str *pieces;  /* (n_vocab) the model vocabulary's strings; p NULL for a gap */
    uint8_t *kind;           /* (n_vocab) enum tok_kind */
    int32_t *added_of;       /* (n_vocab) index into added[] for added ids, else −1 */
    size_t max_token_bytes;  /* the longest token's string: a text of n bytes is ≥ n / it ids */
    struct tok_strmap vocab; /* model vocabulary: string → id */
    struct tok_mergemap merges;
    int32_t n_merges;

    /* BPE options */
    int32_t *score_rank; /* (n_vocab) SentencePiece-style merging by score (GGUF model "llama"):
                            each id's place in descending score order, equal scores sharing one;
                            NULL for merges by rank */
    int ignore_merges;
    int byte_fallback;
    int fuse_unk;
    int32_t unk_id;             /* −1 without unk_token */
    int32_t byte_ids[256];      /* <0xNN> ids for byte_fallback, −1 when absent */
    int32_t bytelevel_ids[256]; /* the id of each byte's ByteLevel character, −1 when absent */

    struct tok_added *added; /* (n_added) */
    int n_added;
    int32_t *added_by_byte[256]; /* indexes into added[] by first byte, longest first, −1 ended */

    struct tok_norm *norms;
    int n_norms;
    struct tok_pre *pres;
    int n_pres;
    int byte_level; /* some pre-tokenizer step is ByteLevel */
    struct tok_dec *decs;
    int n_decs;
    int has_decoder;       /* 0: tokens are joined with spaces (no decoder) */
    int dec_byte_fallback; /* a decoder step is ByteFallback */

    int32_t bos_id, eos_id;
    int add_bos, add_eos;      /* GGUF's tokenizer.ggml.add_bos_token/add_eos_token; 0 from JSON */
    char *bos_text, *eos_text; /* from tokenizer_config.json, NULL when absent */
    char *chat_template;       /* the template text, NULL when none */
};

/* Merge lookup: the rank (and *id) of the pair, −1 when the pair does not merge. */
int32_t llmem_tok_merge_get(const struct tok_mergemap *m, int32_t left, int32_t right, int32_t *id);

/* The GPT-2 split pattern of ByteLevel(use_regex) (load.c). */
extern const char llmem_tok_gpt2_pattern[];

/* Fills added_by_byte from added[] (LLMEM_ENOMEM, not logged). */
int llmem_tok_index_added(struct llmem_tokenizer *tok);
/* Fills byte_ids (<0xNN>) and bytelevel_ids from the vocabulary. */
void llmem_tok_index_bytes(struct llmem_tokenizer *tok);
/* Adds the merge a + b at rank (joined is scratch): LLMEM_ENOENT when a, b or a + b is not in the
 * vocabulary, LLMEM_ENOMEM; nothing is logged. */
int llmem_tok_merge_add(struct llmem_tokenizer *tok, const char *a, size_t na, const char *b,
                        size_t nb, int32_t rank, struct tok_buf *joined);

/* The id of an added token or vocabulary piece with this text, −1 when none. */
int32_t llmem_tok_piece_id(const struct llmem_tokenizer *tok, const char *s, size_t n);

/* The tokenizer of the GGUF file at path (gguf_load.c): its tokenizer.ggml.* keys. */
int llmem_tok_load_gguf(const char *path, struct llmem_tokenizer **out);

/* Bytes of the first pre-tokenizer step's pieces encode cuts at a time (encode.c; 64 KiB):
 * tests set it small, or SIZE_MAX for the whole text at once, to check batches change nothing. */
extern size_t llmem_tok_encode_batch;

#endif

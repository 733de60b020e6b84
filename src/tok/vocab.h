/*
 * tok/vocab.h — a tokenizer from the vocabulary a GGUF file carries (its tokenizer.ggml.* keys),
 * given as plain data: the GGUF parser reads the keys, this builds the same struct
 * llmem_tokenizer that tokenizer.json gives, so encode, decode, the streaming detokenizer, special
 * tokens and chat templates work unchanged.
 *
 * The meaning of each key follows llama.cpp (src/llama-vocab.cpp):
 *  - model "gpt2": byte-level BPE by merge rank; `pre` names the pre-tokenizer of the family:
 *    "llama-bpe" (also "llama3", "llama-v3", "falcon3", "pixtral": the Llama 3 split regex, and a
 *    word that is itself a token is taken whole, as llama.cpp's ignore_merges), "qwen2" (also
 *    "deepseek-r1-qwen": Qwen2's regex, digits one by one, after the NFC normalizer of Qwen's
 *    tokenizer.json), "gpt-2" (GPT-2's ByteLevel regex), "default" or none (llama.cpp's default
 *    chain of four regexes; none is warned about, as llama.cpp does). Any other name is refused
 *    by name, as llama.cpp refuses it.
 *  - model "llama": SentencePiece — spaces become "▁", "▁" is put before the text and after every
 *    special token (add_space_prefix), adjacent symbols merge while their concatenation is a
 *    token, the highest score first (leftmost on ties), and what is left outside the vocabulary
 *    becomes its <0xNN> byte tokens (else the unknown token). `pre` is ignored. Decoding turns "▁"
 *    back into spaces, byte tokens into bytes and drops the first leading space.
 *  - token types (llama.cpp's LLAMA_TOKEN_TYPE_*): CONTROL and UNKNOWN tokens are special added
 *    tokens, USER_DEFINED ones added tokens that are not special, all three matched in the raw
 *    text before the model runs; NORMAL, BYTE, UNUSED and UNDEFINED are vocabulary pieces.
 *  - the special ids default as in llama.cpp: "llama" bos 1, eos 2, unk 0; "gpt2" none (llama.cpp's
 *    placeholder 11 is not taken). add_bos defaults to 1 for "llama" and the Llama 3 names, else 0;
 *    add_eos to 0.
 * Refused with one error line naming the problem (LLMEM_EFORMAT unless said): no tokens, an empty
 * or duplicate token, a token type outside 0..6, scores missing for "llama" or not finite, merges
 * missing for "gpt2", a merge that is not "a b" or names a token not in the vocabulary, a special
 * id out of range, a chat template holding a NUL; LLMEM_EUNSUPPORTED for an unknown model or pre
 * name.
 */
#ifndef LLMEM_TOK_VOCAB_H
#define LLMEM_TOK_VOCAB_H

#include <stddef.h>
#include <stdint.h>

#include "llmem/tokenizer.h"

/* GGUF's token types (tokenizer.ggml.token_type). */
enum llmem_tok_type {
    LLMEM_TOK_TYPE_UNDEFINED = 0,
    LLMEM_TOK_TYPE_NORMAL = 1,
    LLMEM_TOK_TYPE_UNKNOWN = 2,
    LLMEM_TOK_TYPE_CONTROL = 3,
    LLMEM_TOK_TYPE_USER_DEFINED = 4,
    LLMEM_TOK_TYPE_UNUSED = 5,
    LLMEM_TOK_TYPE_BYTE = 6,
};

/* A GGUF string: not NUL-terminated, any bytes. */
struct llmem_tok_bytes {
    const char *p;
    size_t n;
};

/* What tokenizer.ggml.* holds; everything is borrowed for the call only. */
struct llmem_tok_vocab {
    const char *model;                    /* tokenizer.ggml.model: "gpt2" | "llama" */
    const char *pre;                      /* tokenizer.ggml.pre, NULL when absent */
    int64_t n_tokens;                     /* tokenizer.ggml.tokens: id → text */
    const struct llmem_tok_bytes *tokens; /* (n_tokens) */
    const float *scores;                  /* (n_tokens) tokenizer.ggml.scores, or NULL */
    const int32_t *token_types;           /* (n_tokens) enum llmem_tok_type, or NULL: all NORMAL */
    int64_t n_merges;
    const struct llmem_tok_bytes *merges;   /* (n_merges) "a b", by rank; NULL when absent */
    int64_t bos_id, eos_id, unk_id, pad_id; /* −1 when absent */
    int add_bos, add_eos;                   /* 0 / 1, −1 when absent: the model's default */
    int add_space_prefix;                   /* tokenizer.ggml.add_space_prefix; −1: default (1) */
    const char *chat_template;              /* tokenizer.chat_template, NULL when absent */
    size_t chat_template_len;
};

/* Builds the tokenizer of v (see above). LLMEM_EFORMAT / LLMEM_EUNSUPPORTED (logged as
 * "llmem_tokenizer_from_vocab: …"), LLMEM_ENOMEM. Free with llmem_tokenizer_free. */
int llmem_tokenizer_from_vocab(const struct llmem_tok_vocab *v, struct llmem_tokenizer **out);

/* Whether the model wants BOS (EOS) put before (after) an encoded prompt: GGUF's add_bos_token /
 * add_eos_token with their defaults; 0 for a tokenizer.json tokenizer (whose post-processor is not
 * applied). */
int llmem_tokenizer_add_bos(const struct llmem_tokenizer *tok);
int llmem_tokenizer_add_eos(const struct llmem_tokenizer *tok);

#endif

/*
 * llmem/tokenizer.h — text ↔ token ids from a Hugging Face `tokenizer.json`, and chat templates
 * (SPEC §5).
 *
 * Supported forms (anything else is a clear load error, never a silent mis-tokenization):
 *  - BPE models, merges spelled "a b" or ["a", "b"], `ignore_merges`, `byte_fallback` (<0xNN>);
 *  - pre-tokenizers: Sequence[Split(regex, Isolated), ByteLevel(use_regex=false)] (the regex run
 *    by PCRE2 with Unicode properties), ByteLevel(use_regex=true) (the GPT-2 pattern), Metaspace,
 *    none;
 *  - normalizers: none, NFC (Qwen), Prepend, Replace (String pattern), Sequence of those;
 *  - decoders: ByteLevel, Metaspace, Sequence[Replace, ByteFallback, Fuse, Strip];
 *  - added tokens (special or not, lstrip/rstrip) split out of the raw text before the model runs
 *    (leftmost-longest match).
 * The post_processor is not applied: encode never adds BOS/EOS (callers add bos ids themselves).
 * Chat templates are recognized, not interpreted: the template text of tokenizer_config.json (or
 * chat_template.jinja) is matched to one of the families ChatML/Qwen, Llama 3 and Mistral, which
 * are then rendered by C code (see llmem_chat_render for the exact forms).
 * A loaded tokenizer is read-only: encode and decode may run on several threads at once.
 */
#ifndef LLMEM_TOKENIZER_H
#define LLMEM_TOKENIZER_H

#include "llmem/api.h"

#include <stddef.h>
#include <stdint.h>

#include "llmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct llmem_tokenizer;

/* Loads MODEL_DIR/tokenizer.json and, when present, MODEL_DIR/tokenizer_config.json (bos/eos
 * token names, chat_template) and MODEL_DIR/chat_template.jinja. LLMEM_ENOENT for a missing
 * tokenizer.json, LLMEM_EFORMAT for malformed JSON or fields (naming the field),
 * LLMEM_EUNSUPPORTED for a construct outside the list above (naming it), LLMEM_ENOMEM. */
LLMEM_API int llmem_tokenizer_load(const char *model_dir, struct llmem_tokenizer **out);
/* NULL is a no-op. */
LLMEM_API void llmem_tokenizer_free(struct llmem_tokenizer *tok);

LLMEM_API int32_t llmem_tokenizer_vocab_size(const struct llmem_tokenizer *tok); /* max id + 1 */
/* The ids of tokenizer_config's bos_token / eos_token (strings or {"content": …} objects); −1
 * when absent or not in the vocabulary. */
LLMEM_API int32_t llmem_tokenizer_bos(const struct llmem_tokenizer *tok);
LLMEM_API int32_t llmem_tokenizer_eos(const struct llmem_tokenizer *tok);
/* The id of a token's text ("<|im_end|>"), −1 when there is none. */
LLMEM_API int32_t llmem_tokenizer_token_id(const struct llmem_tokenizer *tok, const char *piece);
/* 1 when the id is a special added token. */
LLMEM_API int llmem_tokenizer_is_special(const struct llmem_tokenizer *tok, int32_t id);

/* Encodes len bytes of UTF-8 text (no BOS is added). Added tokens found in the text are emitted
 * as their ids. *ids is malloc'ed (free()); *n its length. LLMEM_EINVAL (logged) for text that is
 * not valid UTF-8, LLMEM_ENOMEM. */
LLMEM_API int llmem_tokenizer_encode(const struct llmem_tokenizer *tok, const char *text,
                                     size_t len, int32_t **ids, int64_t *n);
/* The same, stopping once the text has more than max_ids tokens: LLMEM_ERANGE (logged, "more
 * than max_ids tokens"), so that a text far longer than a context costs no more memory than one
 * that fills it. */
LLMEM_API int llmem_tokenizer_encode_max(const struct llmem_tokenizer *tok, const char *text,
                                         size_t len, int64_t max_ids, int32_t **ids, int64_t *n);

/* Decodes ids to UTF-8 text, the inverse of encode (special tokens are written as their text
 * unless skip_special). *text is malloc'ed and NUL-terminated; *len excludes the NUL. Invalid
 * byte sequences (a token split inside a character) come out as U+FFFD, as transformers does.
 * LLMEM_EINVAL (logged) for an id out of range, LLMEM_ENOMEM. */
LLMEM_API int llmem_tokenizer_decode(const struct llmem_tokenizer *tok, const int32_t *ids,
                                     int64_t n, int skip_special, char **text, size_t *len);

/* The bytes token `id` adds to a decoded text, as they are (a byte token's one byte, a piece of a
 * character as its bytes; special tokens their text), into buf (cap bytes; *len set).
 * LLMEM_EINVAL for an id out of range, LLMEM_ERANGE when cap is too small, LLMEM_ENOMEM. */
LLMEM_API int llmem_tokenizer_token_bytes(const struct llmem_tokenizer *tok, int32_t id,
                                          char *buf, size_t cap, size_t *len);

/* Streaming decode: feed ids one at a time, get back the text that is now complete (a character
 * split over several byte tokens is held back until it is whole). The pieces, finish included,
 * add up to llmem_tokenizer_decode of all ids fed (the pieces are NUL-terminated strings, so a
 * decoded NUL character ends its piece early). With a ByteFallback decoder a run of <0xNN> byte
 * tokens is held until a token ends it (a later byte can turn the whole run into U+FFFD), so a
 * newline spelled <0x0A> appears one token late. Each push costs O(the ids since the last
 * complete character). */
struct llmem_detok;
LLMEM_API int llmem_detok_create(const struct llmem_tokenizer *tok, int skip_special,
                                 struct llmem_detok **out);
LLMEM_API void llmem_detok_free(struct llmem_detok *d);
/* Appends the new text for `id` to *piece (malloc'ed, NUL-terminated, possibly empty). */
LLMEM_API int llmem_detok_push(struct llmem_detok *d, int32_t id, char **piece);
/* What is still held back, flushed (incomplete characters become U+FFFD). */
LLMEM_API int llmem_detok_finish(struct llmem_detok *d, char **piece);

/* ---------------------------------------------------------------------------------------------
 * Chat templates
 * ------------------------------------------------------------------------------------------- */

enum llmem_chat_template {
    LLMEM_CHAT_NONE = 0, /* the tokenizer has no template */
    LLMEM_CHAT_CHATML,   /* <|im_start|>role\ncontent<|im_end|>\n … (Qwen) */
    LLMEM_CHAT_LLAMA3,   /* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
    LLMEM_CHAT_MISTRAL,  /* <s>[INST] user [/INST] assistant</s> */
};

LLMEM_API const char *llmem_chat_template_name(enum llmem_chat_template t); /* "chatml", … "none" */
/* "chatml" | "llama3" | "mistral" → the enum; LLMEM_EINVAL (logged, listing them) otherwise. */
LLMEM_API int llmem_chat_template_parse(const char *name, enum llmem_chat_template *t);

/* The family of the tokenizer's own template: LLMEM_CHAT_NONE when it has none; LLMEM_EUNSUPPORTED
 * (logged: "unrecognized chat template; pass --chat-template chatml|llama3|mistral") when it has
 * one that matches no family. */
LLMEM_API int llmem_tokenizer_chat_template(const struct llmem_tokenizer *tok,
                                            enum llmem_chat_template *t);

struct llmem_chat_message {
    /* "system", "user", "assistant"; Llama 3's "ipython" (a tool's result); Mistral's
     * "available_tools", "tool_calls" and "tool_results" (the template's tool turns, written as
     * they come, a tool_calls turn then the EOS) */
    const char *role;
    const char *content;
    size_t content_len; /* the content's bytes, NULs included; 0: strlen(content) */
};

/* Renders messages with a family's template as text to be encoded (special tokens inline, a BOS
 * text where the family starts with one), ending with the assistant header when
 * add_generation_prompt. *text is malloc'ed and NUL-terminated; *len (unless NULL) is its length
 * without the terminator, which counts the NULs a content may hold. LLMEM_EINVAL (logged) for
 * LLMEM_CHAT_NONE, an unknown role or a role order the family refuses (Mistral: alternating
 * user/assistant). The forms, as the Hugging Face templates render conversations without tools:
 *  - ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, "<|im_start|>assistant\n"
 *    to prompt. When the tokenizer's own template carries Qwen2.5's default system prompt ("You
 *    are Qwen, created by Alibaba Cloud. You are a helpful assistant.") and the first message is
 *    not a system message, that system message comes first, as Qwen2.5 renders it.
 *  - Llama 3: "<|begin_of_text|>" then "<|start_header_id|>{role}<|end_header_id|>\n\n{content,
 *    whitespace-trimmed}<|eot_id|>" per message, "<|start_header_id|>assistant<|end_header_id|>
 *    \n\n" to prompt (Llama 3.0's form: 3.1's "Cutting Knowledge Date" header is not added);
 *    an ipython message (a tool's result) as it came, untrimmed, as 3.1's template writes it.
 *  - Mistral (Instruct v0.2, and without a template): "<s>" then "[INST] {user} [/INST]
 *    {assistant}</s>" (no space after [/INST]) per exchange; a leading system message is put
 *    before the first user message with a blank line between; add_generation_prompt adds nothing
 *    (the text already ends with [/INST]). The spacing of v0.1's and v0.3's templates is read
 *    from their text (" [INST] u [/INST] a</s>"; "[INST] u[/INST] a</s>" with the system message
 *    on the last user turn when it is the last message, else none, as v0.3's writes it).
 * BOS/EOS texts are the tokenizer's bos_token/eos_token when it has them. */
LLMEM_API int llmem_chat_render(const struct llmem_tokenizer *tok, enum llmem_chat_template t,
                                const struct llmem_chat_message *messages, int n_messages,
                                int add_generation_prompt, char **text, size_t *len);
/* The ids that end an assistant turn in this family (ChatML: <|im_end|>, <|endoftext|>; Llama 3:
 * <|eot_id|>, <|eom_id|>; Mistral: the eos text or </s>), to stop on besides the tokenizer's eos:
 * up to `max` into ids, returning how many exist in the vocabulary. */
LLMEM_API int llmem_chat_stop_ids(const struct llmem_tokenizer *tok, enum llmem_chat_template t,
                                  int32_t *ids, int max);

#ifdef __cplusplus
}
#endif

#endif

/*
 * llmem/grammar.h — constrained decoding: a JSON Schema (or "any JSON object") compiled into a
 * grammar over bytes, and a matcher that says which tokens of a vocabulary may come next, so that
 * a sampler only ever picks tokens that keep the output inside the grammar and ends it only where
 * the grammar is complete.
 *
 * The schemas: `type` string, number, integer, boolean, null, object, array (or a list of them);
 * `properties` (written in their order) with `required` (the others optional, in order) — no
 * other keys (additionalProperties is taken as false); `items` with `minItems` / `maxItems`;
 * `enum` and `const` of any JSON values; `anyOf` / `oneOf`; `$ref` to "#", "#/$defs/NAME" or
 * "#/definitions/NAME" (recursion allowed); string `minLength` / `maxLength`; `{}` or `true`:
 * any JSON value. Annotations (title, description, $schema, examples, default, strict, $id,
 * $comment) are ignored. Anything else that constrains (`pattern`, `format`, `minimum`,
 * `allOf`, `not`, `if`, `prefixItems`, `patternProperties`, `additionalProperties` other than
 * false, …) is refused with a message naming it. Strings are valid UTF-8 with JSON's escapes;
 * numbers JSON's; whitespace between tokens at most a newline or a few spaces and tabs.
 */
#ifndef LLMEM_GRAMMAR_H
#define LLMEM_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "llmem/api.h"

#ifdef __cplusplus
extern "C" {
#endif

struct llmem_grammar;    /* a compiled schema: immutable, shared by any number of matchers */
struct llmem_tokenizer;

/* The most rules a schema may compile to, and the most bytes its tables may take (a larger one
 * is refused as too large): what the plan holds for a request's grammar (below). */
#define LLMEM_GRAMMAR_MAX_RULES 4096
#define LLMEM_GRAMMAR_MAX_BYTES ((int64_t)256 << 10)
/* The most bytes a matcher's sets of parse stacks may hold; a matcher that needs more fails as
 * out of memory (llmem_grammar_state_status). */
#define LLMEM_GRAMMAR_STACK_BYTES ((int64_t)512 << 10)
/* The most a request's grammar holds for a vocabulary of n_vocab tokens: its tables, its matcher
 * (stacks, cached masks) and the allowed array a caller passes it. The plan counts this for every
 * running sequence in the runtime baseline (llmem_engine_runtime_baseline): the memory lies
 * outside the allocator. */
LLMEM_API int64_t llmem_grammar_request_bytes(int64_t n_vocab);

/* Compiles the JSON Schema in schema[0, len) (NULL: any JSON object, OpenAI's json_object mode).
 * LLMEM_EINVAL for a schema that is not JSON, not a schema, or uses what the engine does not
 * compile, with one line saying which into why (why_size bytes, always NUL-terminated; not
 * logged: the caller reports it, a server as a 400), LLMEM_ENOMEM. */
LLMEM_API int llmem_grammar_compile(const char *schema, size_t len, char *why, size_t why_size,
                                    struct llmem_grammar **out);
/* A tool (a function the model may call) for llmem_grammar_compile_tools: its name and the JSON
 * Schema of its arguments (parameters[0, len); NULL: any JSON object). */
struct llmem_grammar_tool {
    const char *name;
    const char *parameters;
    size_t len;
};
#define LLMEM_GRAMMAR_MAX_TOOLS 64
/* How a model family writes a call (its chat template's convention). */
enum llmem_tool_format {
    /* Hermes-style (Qwen2.5 and 3): "<tool_call>\n" {"name": NAME, "arguments": ARGS}
     * "\n</tool_call>" */
    LLMEM_TOOL_FORMAT_HERMES,
    /* Llama 3.1 to 3.3: {"name": NAME, "parameters": ARGS} as the whole answer */
    LLMEM_TOOL_FORMAT_LLAMA3,
    /* Mistral (Instruct v0.3's template): "[TOOL_CALLS]" (a control token) then a JSON array of
     * {"name": NAME, "arguments": ARGS} as the whole answer */
    LLMEM_TOOL_FORMAT_MISTRAL,
};
/* A grammar for one call of one of n tools as `format` writes it, the arguments to that tool's
 * schema. The same results as llmem_grammar_compile (the reason names what a tool's schema uses
 * that the engine does not compile). */
LLMEM_API int llmem_grammar_compile_tools(const struct llmem_grammar_tool *tools, int n,
                                          enum llmem_tool_format format, char *why,
                                          size_t why_size, struct llmem_grammar **out);
LLMEM_API void llmem_grammar_free(struct llmem_grammar *g);
/* The bytes the compiled grammar holds (its rules and character sets), for the plan's count. */
LLMEM_API int64_t llmem_grammar_bytes(const struct llmem_grammar *g);

/* A tokenizer's vocabulary as the matcher walks it: every token's bytes in a trie (special tokens
 * left out: the tokens that end an output are the sampler's to allow; but for Mistral's
 * [TOOL_CALLS], which the tools' grammar writes). Built once per tokenizer.
 * LLMEM_ENOMEM (logged). */
struct llmem_grammar_vocab;
LLMEM_API int llmem_grammar_vocab_create(const struct llmem_tokenizer *tok,
                                         struct llmem_grammar_vocab **out);
/* The tokenizer's vocabulary size (the allowed array's length). */
LLMEM_API int32_t llmem_grammar_vocab_size(const struct llmem_grammar_vocab *v);
/* Token id's bytes as the matcher reads them (*len of them), or NULL for a token it never walks
 * (special, empty). */
LLMEM_API const char *llmem_grammar_vocab_token(const struct llmem_grammar_vocab *v, int32_t id,
                                                size_t *len);
LLMEM_API void llmem_grammar_vocab_free(struct llmem_grammar_vocab *v);

/* A matcher: where one output stands in a grammar. */
struct llmem_grammar_state;
LLMEM_API int llmem_grammar_state_create(const struct llmem_grammar *g,
                                         const struct llmem_grammar_vocab *v,
                                         struct llmem_grammar_state **out);
LLMEM_API void llmem_grammar_state_free(struct llmem_grammar_state *s);
/* LLMEM_OK, or LLMEM_ENOMEM once the matcher ran out of memory or of its planned stack bytes
 * (it then allows nothing more: the caller ends the output as an error). */
LLMEM_API int llmem_grammar_state_status(const struct llmem_grammar_state *s);
/* allowed[id] = 1 for the tokens that may come next (llmem_grammar_vocab_size bytes), 0 for the
 * others (an end of the output, where llmem_grammar_complete says it may come, is the caller's).
 * With remaining ≥ 1 tokens left for the output (0: no budget), only tokens after which the
 * shortest completion fits the tokens then left (a byte a token at worst) are allowed, so that
 * the output is complete in time; where its bytes already outnumber the tokens left, only the
 * tokens that spell a prefix of it after which the fewest tokens that spell the rest still fit
 * (where none does, those on a fewest-token way: the output will be cut). Returns how many are
 * allowed. */
LLMEM_API int64_t llmem_grammar_allowed(struct llmem_grammar_state *s, int64_t remaining,
                                        uint8_t *allowed);
/* Walkers that split a mask's walk over a pool's threads, one a thread (n ≥ the pool's threads),
 * shared by any matchers that do not make masks at the same time; each holds up to
 * LLMEM_GRAMMAR_STACK_BYTES of parse stacks: llmem_grammar_walkers_bytes(n) in all, which a
 * caller plans beside its requests' (LLMEM_ENOMEM, logged). */
struct llmem_grammar_walkers;
struct llmem_pool;
LLMEM_API int llmem_grammar_walkers_create(int n, struct llmem_grammar_walkers **out);
LLMEM_API void llmem_grammar_walkers_free(struct llmem_grammar_walkers *w);
LLMEM_API int64_t llmem_grammar_walkers_bytes(int n);
/* llmem_grammar_allowed with the walk over the vocabulary (a mask not cached) on the pool's
 * threads: the same mask, sooner (a pool of one thread, or no walkers: the same as
 * llmem_grammar_allowed). */
LLMEM_API int64_t llmem_grammar_allowed_on(struct llmem_grammar_state *s, int64_t remaining,
                                           uint8_t *allowed, struct llmem_grammar_walkers *w,
                                           struct llmem_pool *pool);
/* Moves past token id (LLMEM_EINVAL when the grammar does not allow it, or it is special: the
 * state is unchanged). */
LLMEM_API int llmem_grammar_accept(struct llmem_grammar_state *s, int32_t id);
/* Moves past bytes (the same rule). */
LLMEM_API int llmem_grammar_accept_bytes(struct llmem_grammar_state *s, const char *bytes,
                                         size_t n);
/* Whether the output so far is complete (an end may come now), and whether it must end (nothing
 * else may come). */
LLMEM_API int llmem_grammar_complete(const struct llmem_grammar_state *s);
LLMEM_API int llmem_grammar_must_end(const struct llmem_grammar_state *s);

#ifdef __cplusplus
}
#endif

#endif

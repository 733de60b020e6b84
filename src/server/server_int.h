/*
 * server/server_int.h — what the server's files share: a growable text buffer, the OpenAI
 * request as validated parameters and the OpenAI response shapes (openai.c), and the /metrics and
 * /health documents (metrics.c). Everything here is a pure function of its arguments (no network,
 * no engine), so tests/test-server.c runs it alone; server.c puts it on the wire.
 */
#ifndef LLMEM_SERVER_INT_H
#define LLMEM_SERVER_INT_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "llmem/engine.h"
#include "llmem/tokenizer.h"
#include "llmem/sampler.h"

/* ---- text ------------------------------------------------------------------------------------ */

/* A growable NUL-terminated buffer. On out of memory it stops growing and remembers (`failed`);
 * check once at the end. */
struct srv_buf {
    char *data;
    size_t len, cap;
    int failed;
};
void llmem_srv_buf_append(struct srv_buf *b, const char *s, size_t n);
void llmem_srv_buf_printf(struct srv_buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void llmem_srv_buf_free(struct srv_buf *b);

/* 1 when the n bytes are well-formed UTF-8 (no overlongs, no surrogates, at most U+10FFFF). */
int llmem_srv_utf8_valid(const char *s, size_t n);

/* ---- errors ---------------------------------------------------------------------------------- */

struct srv_error {
    int http;          /* 400, 401, 404, 405, 413, 500, 503, 507 */
    const char *type;  /* "invalid_request_error", "insufficient_memory", "server_error", … */
    const char *param; /* the offending field, or NULL (static strings or the request's keys) */
    const char *code;  /* "invalid_type", "model_not_found", … or NULL */
    char message[1024];
};
/* Fills e (printf-style message); returns -1 so a validator can `return llmem_srv_fail(...)`. */
int llmem_srv_fail(struct srv_error *e, int http, const char *type, const char *param,
                   const char *code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* {"error": {"message", "type", "param", "code"}}, malloc'ed; NULL on out of memory. */
char *llmem_srv_error_json(const struct srv_error *e);

/* ---- requests -------------------------------------------------------------------------------- */

enum srv_kind { SRV_COMPLETIONS, SRV_CHAT };

#define SRV_MAX_STOP     16
#define SRV_MAX_N        16 /* choices of one request */
#define SRV_MAX_TOOL_DEPTH 32 /* levels a tool's JSON nests (its prompt is indented) */
#define SRV_MAX_MESSAGES 1024

/* What a request may ask of this model. */
struct srv_model {
    const char *name; /* the only model id served */
    int64_t vocab;
    int64_t context; /* the engine's context window: max_tokens above it is refused */
    int max_choices; /* the requests the engine holds (queued and running): more never start */
    int64_t max_values; /* the JSON values a body may hold (0: no bound) */
    int tools;       /* its chat template has a tool-call convention: */
    enum llmem_tool_format
        tool_format; /* chatml Hermes-style, llama3 Llama 3.1's, mistral v0.3's */
};

/* A string of the body whose bytes hold a NUL (U+0000), which cJSON's C strings cut short. */
struct srv_span {
    const char *s; /* a string of `root` */
    size_t n;      /* its decoded length, NULs included */
};

/* A validated request. Strings point into `root` (or into `owned`), which it keeps alive. */
struct srv_request {
    enum srv_kind kind;
    cJSON *root;
    struct srv_span *spans; /* malloc'ed */
    int n_spans;
    /* completions: the prompt as text (prompt_len bytes, NULs included) or as token ids
     * (malloc'ed) */
    const char *prompt_text;
    size_t prompt_len;
    int32_t *prompt_ids;
    int64_t n_prompt_ids;
    /* chat */
    struct llmem_chat_message *messages; /* malloc'ed; content_len set (NULs included) */
    int n_messages;
    char **owned; /* contents joined from parts */
    int n_owned;
    /* generation */
    int64_t max_tokens; /* 0: up to the context */
    struct llmem_sampling sampling; /* its logit_bias: logit_bias below */
    struct llmem_logit_bias *logit_bias; /* (n_logit_bias) malloc'ed */
    int n_logit_bias;
    struct llmem_grammar *grammar; /* response_format's or a forced tool call's, or NULL */
    /* tools (chat): how many, and whether the model may (auto) or must (required, or one named
     * function) call one; the tools are rendered into the system message */
    int n_tools;
    const char *tool_names[LLMEM_GRAMMAR_MAX_TOOLS]; /* (n_tools) the functions declared */
    enum { SRV_TOOLS_NONE, SRV_TOOLS_AUTO, SRV_TOOLS_REQUIRED } tool_mode;
    int have_seed; /* 0: the server picks a seed */
    int n;         /* choices (1 to SRV_MAX_N), each its own request after the first's prompt */
    const char *stop[SRV_MAX_STOP];
    int n_stop;
    int logprobs; /* −1: none; else the alternatives per token (0–20) */
    int ignore_eos;
    int stream, include_usage;
};

/* Parses and validates a request body (any bytes; len of them). On success fills req (free with
 * llmem_srv_request_free) and returns 0; otherwise fills err (400 for malformed JSON, invalid
 * UTF-8, wrong types and out-of-range values; 404 for another model) and returns -1. Nothing is
 * logged. */
int llmem_srv_request_parse(enum srv_kind kind, const char *body, size_t len,
                            const struct srv_model *m, struct srv_request *req,
                            struct srv_error *err);
void llmem_srv_request_free(struct srv_request *req);

/* The prompt's length, and with it the completion's max_tokens (0: the rest of the context),
 * against the context: 0, or -1 with a 400 (context_length_exceeded), as OpenAI and vLLM answer
 * rather than a completion cut short. */
int llmem_srv_check_prompt(enum srv_kind kind, int64_t n_prompt, int64_t max_tokens,
                           const struct srv_model *m, struct srv_error *err);

/* ---- responses ------------------------------------------------------------------------------- */

/* One generated token with its log-probabilities (as the engine reports them). */
struct srv_token {
    int32_t id;
    float logprob;
    int n_top;
    int32_t top_ids[LLMEM_MAX_TOP_LOGPROBS];
    float top_logprobs[LLMEM_MAX_TOP_LOGPROBS];
};

/* The text of one token (malloc'ed; NULL on out of memory), for logprobs. */
typedef char *(*srv_piece_fn)(void *arg, int32_t id);
/* A token's bytes as they are (a piece of a character as its bytes, not U+FFFD), into buf (cap
 * bytes; *len set): 0, or −1 when it has none or they do not fit. */
typedef int (*srv_bytes_fn)(void *arg, int32_t id, char *buf, size_t cap, size_t *len);

/* What every response of one request shares. */
struct srv_render {
    enum srv_kind kind;
    const char *id; /* "cmpl-…" / "chatcmpl-…" */
    const char *model;
    int64_t created; /* Unix seconds */
    int logprobs;    /* as in the request */
    int include_usage;
    srv_piece_fn piece;
    srv_bytes_fn bytes; /* for logprobs' "bytes" (NULL: the piece's UTF-8) */
    void *piece_arg;
    int64_t text_offset; /* completions logprobs: where the next token's text starts */
    int tools;           /* the text may hold tool calls: answered as tool_calls */
    const char *const *tool_names; /* (n_tools) the functions a call may name; any other is text */
    int n_tools;
    enum llmem_tool_format tool_format; /* as the model writes them */
    uint64_t call_seed;  /* the tool calls' ids are drawn from it */
    int called;          /* a choice or chunk rendered held tool calls */
    int n_calls;         /* calls rendered so far: a stream's next call's index */
};

/* A streamed answer that may hold tool calls, split as its text comes: the text from `from` to
 * the end of what is known (len bytes; done: the answer is complete) gives the next piece to
 * send, text[*start, *end) (*end: the next call's `from`; what lies between from and *start is
 * whitespace before a call). Returns its kind:
 *  - SRV_PIECE_NONE: nothing may go out yet (a call, or what may begin one, is still open);
 *  - SRV_PIECE_CONTENT: content (never a tail that may begin a call's marker);
 *  - SRV_PIECE_CALLS: one call, or the rest of a finished answer that may be one (render it with
 *    r->tools). Hermes-style: each <tool_call> block as it closes; Llama 3.1: an answer that
 *    opens with '{' whole at the end, any other as content as it comes. */
enum srv_piece { SRV_PIECE_NONE, SRV_PIECE_CONTENT, SRV_PIECE_CALLS };
enum srv_piece llmem_srv_tool_piece(enum llmem_tool_format format, const char *text, size_t len,
                                    size_t from, int done, size_t *start, size_t *end);

/* One choice of a response: its text, the tokens' logprobs, why it ended. */
struct srv_choice {
    const char *text;
    size_t len;
    const struct srv_token *toks;
    int64_t n_toks;
    const char *finish_reason;
};

/* The whole non-streaming response with its n choices, malloc'ed (NULL on out of memory). */
char *llmem_srv_render_response(struct srv_render *r, const struct srv_choice *choices, int n,
                                int64_t prompt_tokens, int64_t completion_tokens);
/* One streaming chunk (the JSON after "data: "): a text delta with its tokens' logprobs, and a
 * finish_reason (NULL while it goes on). first: the chat chunk that carries the role. */
char *llmem_srv_render_chunk(struct srv_render *r, const char *text, size_t len,
                             const struct srv_token *toks, int64_t n_toks,
                             const char *finish_reason, int first);
/* The last chunk with include_usage: no choices, the usage. */
char *llmem_srv_render_usage_chunk(const struct srv_render *r, int64_t prompt_tokens,
                                   int64_t completion_tokens);
/* GET /v1/models, and GET /v1/models/{id}. */
char *llmem_srv_render_models(const struct srv_model *m, int64_t created);
char *llmem_srv_render_model(const struct srv_model *m, int64_t created);

/* ---- /metrics and /health -------------------------------------------------------------------- */

/* The server's own counts (requests that never reached the engine). */
struct srv_counters {
    int64_t rejected;     /* 503: the queue was full */
    int64_t invalid;      /* 4xx before the engine: bad JSON, fields, auth, size */
    int64_t disconnected; /* clients that left before their request ended */
};

/* Prometheus text exposition (version 0.0.4), malloc'ed. */
char *llmem_srv_render_metrics(const struct llmem_engine_metrics *m, const struct srv_counters *c);

/* What /health reports besides the engine's metrics. */
struct srv_health {
    const char *model;
    const struct llmem_plan *plan;
    const char *limits_line;                     /* llmem_engine_limits_line */
    const struct llmem_mem_stats *mem;           /* the allocator now */
    int64_t resident_bytes, resident_peak_bytes; /* the process now and at its peak */
    const char *kv_format, *kv_layout;
    const char *chat_template; /* "none" when chat is unavailable */
};
char *llmem_srv_render_health(const struct srv_health *h, const struct llmem_engine_metrics *m,
                              const struct srv_counters *c);

#endif

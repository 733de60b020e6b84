/*
 * llmem/server.h — the OpenAI-compatible HTTP server over a serving engine (SPEC §7).
 *
 * Routes: POST /v1/completions and /v1/chat/completions (non-streaming, or `stream: true` as
 * server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health (the plan, the limits
 * applied, memory, KV blocks, bank, guard), GET /metrics (Prometheus text, names `llmem_…`) and
 * POST /admin/cache/clear. Errors are OpenAI error objects `{"error": {"message", "type",
 * "param", "code"}}` with a 4xx/5xx status: 400 for a malformed or invalid request, 401 without
 * the API key, 404 for an unknown route or model, 413 for a body over the size limit, 503 (with
 * Retry-After) when the engine's queue is full, 507 `insufficient_memory` when the engine refuses
 * a request for memory before it starts. After a stream has started, an error is sent as an SSE
 * event carrying the error object, and the stream ends.
 *
 * Threads: each connection runs on its own thread; the engine's scheduler thread only queues
 * tokens into the request's buffer and signals it. A client that goes away (the socket closes)
 * cancels its request, so its KV blocks are freed at the next scheduler step.
 */
#ifndef LLMEM_SERVER_H
#define LLMEM_SERVER_H

#include "llmem/api.h"

#include <stdint.h>

#include "llmem/engine.h"
#include "llmem/status.h"
#include "llmem/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLMEM_SERVER_MAX_BODY_BYTES ((int64_t)4 << 20)

struct llmem_server_config {
    const char *host;       /* the address to bind ("127.0.0.1"; a name is resolved) */
    int port;               /* 8080; 0: a free port (see llmem_server_port) */
    const char *api_key;    /* (optional) Bearer key every route but /health requires: one
                             * word of printable characters; a bind to an address that is not
                             * loopback needs one */
    const char *model_name; /* the model id of /v1/models and responses (required) */
    enum llmem_chat_template chat_template; /* LLMEM_CHAT_NONE: the tokenizer's own, if any */
    int64_t max_queue;      /* waiting requests beyond which a request gets 503 (0: 256) */
    int64_t max_body_bytes; /* 0: LLMEM_SERVER_MAX_BODY_BYTES */
    int body_timeout_s;     /* a request body arrives within this many seconds of its headers,
                             * with no pause of more than a third of it, or its connection is
                             * closed and its bytes released: slow clients cannot hold the
                             * bodies' budget (0: LLMEM_SERVER_BODY_TIMEOUT_S) */
};
#define LLMEM_SERVER_BODY_TIMEOUT_S 60
/* The JSON values a body may hold: one every 24 of its largest bytes (a 4 MiB body: 174,762, a
 * prompt of as many token ids), so that its parse tree — LLMEM_SERVER_VALUE_BYTES a value — is
 * bounded and planned; a body of more is refused before it is parsed. */
#define LLMEM_SERVER_BODY_VALUES(max_body) ((max_body) / 24)
#define LLMEM_SERVER_VALUE_BYTES           80
LLMEM_API void llmem_server_config_default(struct llmem_server_config *c);

/* Request bodies the server holds at once, in bytes of the largest body: a body arriving beyond
 * that gets a 503 with Retry-After, so that what the server holds stays within its reserve. */
#define LLMEM_SERVER_BODIES_IN_FLIGHT 2
/* What a server of this configuration holds outside the engine's allocator at most, for the
 * engine's runtime baseline (llmem_engine_config.runtime_reserve_bytes): the bodies in flight
 * three times over (as received, parsed, and as the prompt they render) with their parse trees,
 * and the stacks of the
 * connection threads that work at once (one per running sequence and a few more). */
LLMEM_API int64_t llmem_server_runtime_reserve(const struct llmem_server_config *c,
                                               int64_t max_sequences);

struct llmem_server;

/* Checks a configuration without binding anything: the model name, the port's range, that the
 * host resolves, and that a host which is not loopback comes with an API key. LLMEM_EINVAL
 * (logged) otherwise. llmem_server_start checks the same. */
LLMEM_API int llmem_server_config_check(const struct llmem_server_config *config);

/* Starts serving the engine (llmem_engine_serve_start) and listening. LLMEM_EINVAL (logged) for
 * a non-loopback host without an API key, an unresolvable host or a missing model name; LLMEM_EIO
 * (logged) when the address cannot be bound; LLMEM_ENOMEM. */
LLMEM_API int llmem_server_start(struct llmem_engine *e, const struct llmem_server_config *config,
                                 struct llmem_server **out);
/* Stops accepting requests, ends the ones in flight (cancelled; streams get an error event),
 * stops the engine's serving thread and closes every connection. NULL is a no-op. The engine
 * stays open. */
LLMEM_API void llmem_server_stop(struct llmem_server *s);

/* The port bound, and the base URL ("http://127.0.0.1:8080"). */
LLMEM_API int llmem_server_port(const struct llmem_server *s);
LLMEM_API const char *llmem_server_url(const struct llmem_server *s);

#ifdef __cplusplus
}
#endif

#endif

/*
 * server/server.c — the HTTP server (libmicrohttpd): routes, authentication, body limits, and the
 * life of a generation request between a connection and the engine's scheduler.
 *
 * Threads. MHD runs one thread per connection. A generation request (a "job") is submitted to the
 * engine and then waited for on that connection's thread: the scheduler's callbacks only append
 * the token to the job's queue under the job's mutex, so the scheduler never blocks on a client.
 * Waking the connection is the waker thread's work: the scheduler hands it the job (one list
 * under one mutex; waking the waker costs a system call only when it sleeps, once for a step's
 * many tokens), and the waker signals each job's condition variable — a step's hundred wake-ups,
 * each a system call, off the scheduler's thread. A streaming response is a content reader that
 * sleeps on that condition variable and turns queued tokens into SSE chunks.
 *
 * Clients that go away. While a connection thread waits (for a non-streaming result, for a
 * stream's first token, between a stream's tokens) it polls its socket every 100 ms, however
 * often tokens wake it (a non-streaming wait is woken only by the end);
 * a peer that has closed (POLLRDHUP, POLLHUP, or a read of 0 bytes) cancels the job
 * (llmem_engine_cancel), and the scheduler frees its KV blocks at its next step. A failed write
 * ends the response and cancels it the same way (the response's free callback).
 *
 * Lifetime. A job has two references: the connection side (the handler, then the streaming
 * response) and the engine (released in on_done, which the engine calls exactly once for every
 * request it accepted). Submissions happen under the server's mutex while it is accepting, and
 * stopping clears that flag before it stops the engine, so every submitted job gets its on_done.
 *
 * Status codes: 400 bad request, 401 missing or wrong API key, 404 unknown route or model, 405
 * wrong method, 413 body over the limit, 500 internal, 503 queue full (Retry-After) or shutting
 * down, 507 insufficient_memory (the engine refused the request for memory before it started).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "core/clock.h"
#include "core/log.h"
#include "core/rng.h"
#include "llmem/server.h"
#include "llmem/size.h"
#include "llmem/sys.h"
#include "server/server_int.h"

#define POLL_MS        100 /* how often a waiting connection looks at its socket */
#define MAX_CHAT_STOPS 8
#define RETRY_AFTER_S  "1"
#define CONN_TIMEOUT_S 120

struct llmem_server {
    struct llmem_engine *engine;
    const struct llmem_tokenizer *tok;
    struct MHD_Daemon *daemon;
    struct srv_model model;
    char *name, *api_key;
    enum llmem_chat_template tmpl; /* LLMEM_CHAT_NONE: chat is refused */
    int32_t chat_stops[MAX_CHAT_STOPS];
    int n_chat_stops;
    int64_t max_body;
    int64_t bodies_max; /* LLMEM_SERVER_BODIES_IN_FLIGHT × max_body */
    int body_timeout_s;
    int port;
    char url[160];
    uint64_t salt; /* random: response ids and default seeds differ between runs */

    /* the waker (see Threads above) */
    pthread_t waker;
    int waker_on;
    pthread_mutex_t wake_mu; /* what follows */
    pthread_cond_t wake_cv;
    struct job *wake_head; /* jobs to wake, each holding a reference */
    int wake_stop;

    pthread_mutex_t mu;  /* what follows */
    pthread_cond_t idle; /* n_jobs_alive dropped to 0 */
    int accepting;
    int64_t n_jobs_alive; /* jobs not yet freed (their responses are still being written) */
    int64_t bodies;       /* bytes of request bodies held (received or being answered) */
    struct srv_counters counters;
    uint64_t n_jobs;
};

void llmem_server_config_default(struct llmem_server_config *c) {
    memset(c, 0, sizeof(*c));
    c->host = "127.0.0.1";
    c->port = 8080;
    c->max_queue = 256;
    c->max_body_bytes = LLMEM_SERVER_MAX_BODY_BYTES;
}

/* Stacks of the connection threads, what each touches at most (its handler and the libraries'
 * frames), for the threads that work at once beyond the running sequences. */
#define CONN_STACK_TOUCHED (128 << 10)
#define CONN_THREADS_EXTRA 8

int64_t llmem_server_runtime_reserve(const struct llmem_server_config *c, int64_t max_sequences) {
    int64_t body = c->max_body_bytes > 0 ? c->max_body_bytes : LLMEM_SERVER_MAX_BODY_BYTES;
    return LLMEM_SERVER_BODIES_IN_FLIGHT *
               (3 * body + LLMEM_SERVER_BODY_VALUES(body) * LLMEM_SERVER_VALUE_BYTES) +
           (max_sequences + CONN_THREADS_EXTRA) * CONN_STACK_TOUCHED;
}

static void count(struct llmem_server *s, int64_t *counter) {
    pthread_mutex_lock(&s->mu);
    (*counter)++;
    pthread_mutex_unlock(&s->mu);
}

/* ---- jobs: one generation request ------------------------------------------------------------ */

/* What the scheduler handed over: a piece of text and, unless id < 0, its token. */
struct event {
    struct event *next;
    struct srv_token tok;
    size_t len;
    char text[];
};

struct job {
    struct llmem_server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* under mu */
    int fd;   /* the client's socket */
    uint64_t id;
    struct srv_request req; /* a choice after the first: its parent's, borrowed */
    struct job *parent;     /* (n > 1) the first choice's job, which owns req; else NULL */
    int choice;             /* its index among the request's choices */
    struct srv_render render;
    char id_str[48];

    /* from the scheduler, under mu */
    struct event *head, **tail;
    int wake_queued;       /* on the waker's list */
    struct job *wake_next; /* (under the server's wake_mu) */
    int done, status, abandoned;
    char finish_reason[16];
    char *message;
    char *text; /* the result's text (non-streaming) */
    size_t text_len;
    int64_t prompt_tokens, completion_tokens;

    /* the connection's side */
    struct srv_token *toks; /* logprobs of a non-streaming answer */
    int64_t n_toks, cap_toks;
    struct srv_buf out; /* SSE bytes not yet handed to MHD */
    size_t out_pos;
    int started, finished;
    struct srv_buf answer; /* a streamed tools answer's text so far */
    size_t answer_sent;    /* the bytes of it sent (or skipped) */
};

static void job_release(struct job *j);

static void job_release(struct job *j) {
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last)
        return;
    struct llmem_server *s = j->srv;
    for (struct event *e = j->head, *next; e != NULL; e = next) {
        next = e->next;
        free(e);
    }
    if (j->parent == NULL)
        llmem_srv_request_free(&j->req);
    else
        job_release(j->parent);
    free(j->message);
    free(j->text);
    free(j->toks);
    llmem_srv_buf_free(&j->out);
    llmem_srv_buf_free(&j->answer);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j);
    pthread_mutex_lock(&s->mu);
    if (--s->n_jobs_alive == 0)
        pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->mu);
}

/* Scheduler thread: hands j to the waker, which signals its connection. */
static void wake_later(struct llmem_server *s, struct job *j) {
    pthread_mutex_lock(&s->wake_mu);
    j->wake_next = s->wake_head;
    s->wake_head = j;
    pthread_cond_signal(&s->wake_cv);
    pthread_mutex_unlock(&s->wake_mu);
}

static void *waker_main(void *arg) {
    struct llmem_server *s = arg;
    pthread_mutex_lock(&s->wake_mu);
    for (;;) {
        while (s->wake_head == NULL && !s->wake_stop)
            pthread_cond_wait(&s->wake_cv, &s->wake_mu);
        struct job *list = s->wake_head;
        s->wake_head = NULL;
        if (list == NULL)
            break; /* stopping, nothing left */
        pthread_mutex_unlock(&s->wake_mu);
        for (struct job *j = list, *next; j != NULL; j = next) {
            next = j->wake_next;
            pthread_mutex_lock(&j->mu);
            j->wake_queued = 0;
            pthread_cond_signal(&j->cv);
            pthread_mutex_unlock(&j->mu);
            job_release(j); /* the list's reference */
        }
        pthread_mutex_lock(&s->wake_mu);
    }
    pthread_mutex_unlock(&s->wake_mu);
    return NULL;
}

static void waker_start(struct llmem_server *s) {
    pthread_mutex_init(&s->wake_mu, NULL);
    pthread_cond_init(&s->wake_cv, NULL);
    /* without it (no thread to be had) the scheduler signals the connections itself */
    s->waker_on = pthread_create(&s->waker, NULL, waker_main, s) == 0;
}

/* After the last callback: the jobs still listed are woken and let go. */
static void waker_stop(struct llmem_server *s) {
    if (s->waker_on) {
        pthread_mutex_lock(&s->wake_mu);
        s->wake_stop = 1;
        pthread_cond_signal(&s->wake_cv);
        pthread_mutex_unlock(&s->wake_mu);
        pthread_join(s->waker, NULL);
        s->waker_on = 0;
    }
    pthread_cond_destroy(&s->wake_cv);
    pthread_mutex_destroy(&s->wake_mu);
}

/* Scheduler thread: queue the piece, have the connection woken. */
static int job_on_token(void *arg, const struct llmem_token_event *ev) {
    struct job *j = arg;
    struct event *e = malloc(sizeof(*e) + ev->len + 1);
    pthread_mutex_lock(&j->mu);
    if (e != NULL) {
        e->next = NULL;
        e->tok.id = ev->id;
        e->tok.logprob = ev->logprob;
        e->tok.n_top = ev->n_top < LLMEM_MAX_TOP_LOGPROBS ? ev->n_top : LLMEM_MAX_TOP_LOGPROBS;
        for (int k = 0; k < e->tok.n_top; k++) {
            e->tok.top_ids[k] = ev->top_ids[k];
            e->tok.top_logprobs[k] = ev->top_logprobs[k];
        }
        e->len = ev->len;
        memcpy(e->text, ev->text, ev->len);
        e->text[ev->len] = '\0';
        *j->tail = e;
        j->tail = &e->next;
    }
    int cancel = j->abandoned || e == NULL; /* a token we cannot keep ends the request */
    struct llmem_server *s = j->srv;
    int wake = j->req.stream; /* a non-streaming answer waits for on_done alone */
    int queue = wake && s->waker_on && !j->wake_queued;
    if (queue)
        j->wake_queued = 1, j->refs++;
    else if (wake && !s->waker_on)
        pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (queue)
        wake_later(s, j);
    return cancel;
}

static void job_on_done(void *arg, int status, const struct llmem_generate_result *res,
                        const char *message) {
    struct job *j = arg;
    char *text = NULL;
    const int whole = !j->req.stream || j->req.tool_mode != SRV_TOOLS_NONE; /* the text kept */
    if (status == LLMEM_OK && whole && (text = malloc(res->text_len + 1)) != NULL)
        memcpy(text, res->text, res->text_len + 1);
    char *msg = message != NULL ? strdup(message) : NULL;
    pthread_mutex_lock(&j->mu);
    j->done = 1;
    j->status = status;
    j->message = msg;
    if (status == LLMEM_OK) {
        snprintf(j->finish_reason, sizeof(j->finish_reason), "%s", res->finish_reason);
        j->prompt_tokens = res->prompt_tokens;
        j->completion_tokens = res->n_ids;
        j->text = text;
        j->text_len = res->text_len;
        if (whole && text == NULL)
            j->status = LLMEM_ENOMEM;
    }
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    job_release(j); /* the engine's reference */
}

/* 1 when the client has closed its end of the connection. */
static int peer_closed(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (fd < 0 || poll(&p, 1, 0) <= 0)
        return 0;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))
        return 1;
    char c;
    return (p.revents & POLLIN) && recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

/* The client is gone: the engine frees the request's KV at its next step. */
static void job_abandon(struct job *j) {
    pthread_mutex_lock(&j->mu);
    int was = j->abandoned, done = j->done;
    j->abandoned = 1;
    pthread_mutex_unlock(&j->mu);
    if (!was && !done) {
        llmem_engine_cancel(j->srv->engine, j->id);
        count(j->srv, &j->srv->counters.disconnected);
        LLMEM_DEBUG("request %s: the client went away; cancelled", j->id_str);
    }
}

/* Waits (j->mu held) until there are events (or, with `all`, until done), looking at the socket
 * every POLL_MS. The deadline is absolute and moves only after a look, so wake-ups that come
 * sooner than POLL_MS (a token a step) do not put the look off. Returns 0, or -1 when the client
 * has gone (mu still held). */
static int job_wait(struct job *j, int all) {
    struct timespec until = llmem_clock_deadline(POLL_MS * 1e-3);
    while (!j->done && (all || j->head == NULL)) {
        if (pthread_cond_timedwait(&j->cv, &j->mu, &until) != ETIMEDOUT)
            continue;
        if (peer_closed(j->fd)) {
            pthread_mutex_unlock(&j->mu);
            job_abandon(j);
            pthread_mutex_lock(&j->mu);
            return -1;
        }
        until = llmem_clock_deadline(POLL_MS * 1e-3);
    }
    return 0;
}

/* The error a finished job ended with, as the client should see it. */
static void job_error(const struct job *j, struct srv_error *err) {
    const char *msg = j->message != NULL && *j->message ? j->message : llmem_status_str(j->status);
    if (j->status == LLMEM_OK) /* cancelled, and not by the client: the server is stopping */
        llmem_srv_fail(err, 503, "server_error", NULL, "server_shutting_down",
                       "the request was cancelled: the server is shutting down");
    else if (j->status == LLMEM_ENOMEM)
        llmem_srv_fail(err, 507, "insufficient_memory", NULL, "insufficient_memory", "%s", msg);
    else if (j->status == LLMEM_EINVAL)
        llmem_srv_fail(err, 400, "invalid_request_error", NULL, NULL, "%s", msg);
    else
        llmem_srv_fail(err, 500, "server_error", NULL, NULL, "%s", msg);
}

/* ---- responses ------------------------------------------------------------------------------- */

static enum MHD_Result respond(struct MHD_Connection *c, unsigned status, const char *type,
                               char *body, const char *h1, const char *v1) {
    if (body == NULL)
        return MHD_NO; /* out of memory: drop the connection */
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (r == NULL) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (h1 != NULL)
        MHD_add_response_header(r, h1, v1);
    enum MHD_Result ok = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ok;
}

static enum MHD_Result respond_json(struct MHD_Connection *c, unsigned status, char *body) {
    return respond(c, status, "application/json", body, NULL, NULL);
}

static enum MHD_Result respond_error(struct llmem_server *s, struct MHD_Connection *c,
                                     const struct srv_error *err) {
    const char *h = NULL, *v = NULL;
    if (err->http == 401)
        h = MHD_HTTP_HEADER_WWW_AUTHENTICATE, v = "Bearer";
    else if (err->http == 503)
        h = MHD_HTTP_HEADER_RETRY_AFTER, v = RETRY_AFTER_S;
    else if (err->http == 405)
        h = MHD_HTTP_HEADER_ALLOW, v = err->param;
    if (err->http >= 400 && err->http < 500)
        count(s, &s->counters.invalid);
    LLMEM_DEBUG("%d %s", err->http, err->message);
    return respond(c, (unsigned)err->http, "application/json", llmem_srv_error_json(err), h, v);
}

/* ---- streaming --------------------------------------------------------------------------------
 */

static void sse(struct job *j, char *json) {
    if (json == NULL) {
        j->out.failed = 1;
        return;
    }
    llmem_srv_buf_printf(&j->out, "data: %s\n\n", json);
    free(json);
}

/* The pieces of a streamed tools answer that may go out (llmem_srv_tool_piece): content as it
 * comes, each call once whole (content after a call is not content: as answered whole). */
static void stream_tool_pieces(struct job *j, const char *text, size_t len, int done) {
    struct srv_render *r = &j->render;
    size_t start, end;
    enum srv_piece p;
    while ((p = llmem_srv_tool_piece(r->tool_format, text, len, j->answer_sent, done, &start,
                                     &end)) != SRV_PIECE_NONE) {
        j->answer_sent = end;
        if (p == SRV_PIECE_CONTENT && r->n_calls > 0)
            continue;
        r->tools = p == SRV_PIECE_CALLS;
        sse(j, llmem_srv_render_chunk(r, text + start, end - start, NULL, 0, NULL, 0));
        r->tools = 1;
    }
}

/* Turns the events taken from the queue into chunks (one per batch of events), and the end. */
static void stream_render(struct job *j, struct event *evs, int done) {
    struct srv_render *r = &j->render;
    if (!j->started && r->kind == SRV_CHAT) /* the role comes first, as OpenAI sends it */
        sse(j, llmem_srv_render_chunk(r, "", 0, NULL, 0, NULL, 1));
    j->started = 1;
    struct srv_buf text = {0};
    struct srv_token toks[32];
    int n = 0;
    /* with tools the answer may hold calls: its text goes out in pieces, each call whole */
    const int held = j->req.tool_mode != SRV_TOOLS_NONE;
    for (struct event *e = evs, *next; e != NULL; e = next) {
        next = e->next;
        llmem_srv_buf_append(held ? &j->answer : &text, e->text, e->len);
        if (!held && e->tok.id >= 0 && r->logprobs >= 0)
            toks[n++] = e->tok;
        free(e);
        if (n == 32 || (next == NULL && (text.len > 0 || n > 0))) {
            sse(j, llmem_srv_render_chunk(r, text.data != NULL ? text.data : "", text.len, toks, n,
                                          NULL, 0));
            text.len = 0;
            n = 0;
        }
    }
    llmem_srv_buf_free(&text);
    if (held && !done && j->answer.data != NULL)
        stream_tool_pieces(j, j->answer.data, j->answer.len, 0);
    if (!done)
        return;
    if (j->status == LLMEM_OK && !j->abandoned && strcmp(j->finish_reason, "cancelled") != 0) {
        if (held && j->text_len >= j->answer_sent) /* (the whole text: what a stop string cut) */
            stream_tool_pieces(j, j->text, j->text_len, 1);
        sse(j, llmem_srv_render_chunk(r, "", 0, NULL, 0, j->finish_reason, 0));
        if (r->include_usage)
            sse(j, llmem_srv_render_usage_chunk(r, j->prompt_tokens, j->completion_tokens));
        LLMEM_DEBUG("request %s: 200 (stream), %" PRId64 " prompt + %" PRId64 " tokens (%s)",
                    j->id_str, j->prompt_tokens, j->completion_tokens, j->finish_reason);
    } else {
        struct srv_error err;
        job_error(j, &err);
        LLMEM_DEBUG("request %s: the stream ends with an error: %s", j->id_str, err.message);
        sse(j, llmem_srv_error_json(&err));
    }
    llmem_srv_buf_append(&j->out, "data: [DONE]\n\n", 14);
    j->finished = 1;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    struct job *j = cls;
    for (;;) {
        if (j->out.failed)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        if (j->out_pos < j->out.len) {
            size_t n = j->out.len - j->out_pos < max ? j->out.len - j->out_pos : max;
            memcpy(buf, j->out.data + j->out_pos, n);
            j->out_pos += n;
            if (j->out_pos == j->out.len)
                j->out_pos = j->out.len = 0;
            return (ssize_t)n;
        }
        if (j->finished)
            return MHD_CONTENT_READER_END_OF_STREAM;
        pthread_mutex_lock(&j->mu);
        if (job_wait(j, 0) != 0) {
            pthread_mutex_unlock(&j->mu);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        struct event *evs = j->head;
        j->head = NULL;
        j->tail = &j->head;
        int done = j->done;
        pthread_mutex_unlock(&j->mu);
        stream_render(j, evs, done);
    }
}

/* The response is gone (sent, or the connection failed): a job still running loses its client. */
static void stream_free(void *cls) {
    struct job *j = cls;
    if (!j->finished)
        job_abandon(j);
    job_release(j);
}

/* ---- generation requests --------------------------------------------------------------------- */

static char *token_piece(void *arg, int32_t id) {
    char *text = NULL;
    size_t len = 0;
    if (llmem_tokenizer_decode(arg, &id, 1, 0, &text, &len) != LLMEM_OK)
        return strdup("");
    return text;
}

static int token_bytes(void *arg, int32_t id, char *buf, size_t cap, size_t *len) {
    return llmem_tokenizer_token_bytes(arg, id, buf, cap, len) == LLMEM_OK ? 0 : -1;
}

/* The prompt's token ids (malloc'ed) from the request. */
static int tokenize(struct llmem_server *s, const struct srv_request *req, int32_t **ids,
                    int64_t *n, struct srv_error *err) {
    if (req->kind == SRV_COMPLETIONS && req->prompt_ids != NULL) {
        *ids = malloc((size_t)req->n_prompt_ids * sizeof(int32_t));
        if (*ids == NULL)
            return llmem_srv_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        memcpy(*ids, req->prompt_ids, (size_t)req->n_prompt_ids * sizeof(int32_t));
        *n = req->n_prompt_ids;
        return 0;
    }
    char *rendered = NULL;
    const char *text = req->prompt_text;
    size_t len = req->prompt_len;
    if (req->kind == SRV_CHAT) {
        if (s->tmpl == LLMEM_CHAT_NONE)
            return llmem_srv_fail(err, 400, "invalid_request_error", "messages",
                                  "chat_template_missing",
                                  "the model '%s' has no chat template; start the server with "
                                  "--chat-template chatml|llama3|mistral",
                                  s->name);
        if (llmem_chat_render(s->tok, s->tmpl, req->messages, req->n_messages, 1, &rendered,
                              &len) != LLMEM_OK)
            return llmem_srv_fail(err, 400, "invalid_request_error", "messages", NULL, "%s",
                                  llmem_last_error());
        text = rendered;
    }
    /* (a prompt longer than the context is refused once it is: its ids are never all made) */
    int status = llmem_tokenizer_encode_max(s->tok, text, len, s->model.context, ids, n);
    free(rendered);
    if (status == LLMEM_ERANGE)
        return llmem_srv_fail(
            err, 400, "invalid_request_error", req->kind == SRV_CHAT ? "messages" : "prompt",
            "context_length_exceeded",
            "This model's maximum context length is %" PRId64 " tokens; the prompt has more",
            s->model.context);
    if (status != LLMEM_OK)
        return llmem_srv_fail(err, status == LLMEM_ENOMEM ? 500 : 400,
                              status == LLMEM_ENOMEM ? "server_error" : "invalid_request_error",
                              NULL, NULL, "%s", llmem_last_error());
    return 0;
}

/* Submits the job (under the server's mutex, while accepting). */
static int submit(struct llmem_server *s, struct job *j, const int32_t *ids, int64_t n,
                  struct srv_error *err) {
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = j->req.max_tokens;
    p.sampling = j->req.sampling;
    p.stop = j->req.stop;
    p.n_stop = j->req.n_stop;
    p.ignore_eos = j->req.ignore_eos;
    /* (Mistral's calls open with a control token, which the answer's reading looks for) */
    p.keep_special =
        j->req.tool_mode != SRV_TOOLS_NONE && s->model.tool_format == LLMEM_TOOL_FORMAT_MISTRAL;
    p.logprobs = j->req.logprobs;
    p.sampling.seed += (uint64_t)j->choice; /* each choice its own draws */
    p.follow = j->parent != NULL ? j->parent->id : 0;
    if (j->req.kind == SRV_CHAT) {
        p.stop_ids = s->chat_stops;
        p.n_stop_ids = s->n_chat_stops;
    }
    struct llmem_request_events ev = {.on_token = job_on_token, .on_done = job_on_done, .arg = j};
    pthread_mutex_lock(&s->mu);
    if (!j->req.have_seed)
        p.sampling.seed = llmem_splitmix64(s->salt + s->n_jobs);
    s->n_jobs++;
    int status = LLMEM_EBUSY;
    if (s->accepting) {
        j->refs++; /* the engine's, released by on_done */
        status = llmem_engine_submit(s->engine, ids, n, &p, &ev, &j->id);
        if (status != LLMEM_OK)
            j->refs--;
    }
    if (status == LLMEM_EBUSY)
        s->counters.rejected++;
    int accepting = s->accepting;
    pthread_mutex_unlock(&s->mu);
    if (status == LLMEM_OK)
        return 0;
    if (!accepting)
        return llmem_srv_fail(err, 503, "server_error", NULL, "server_shutting_down",
                              "the server is shutting down");
    if (status == LLMEM_EBUSY)
        return llmem_srv_fail(err, 503, "server_error", NULL, "queue_full",
                              "the server is busy: the request queue is full; retry later");
    if (status == LLMEM_EINVAL)
        return llmem_srv_fail(err, 400, "invalid_request_error", NULL, NULL, "%s",
                              llmem_last_error());
    return llmem_srv_fail(err, 500, "server_error", NULL, NULL, "%s", llmem_last_error());
}

/* A finished job's events: its tokens' logprobs kept (unless the client is gone). */
static void job_collect(struct job *j, int gone) {
    pthread_mutex_lock(&j->mu);
    struct event *evs = j->head;
    j->head = NULL;
    j->tail = &j->head;
    pthread_mutex_unlock(&j->mu);
    for (struct event *e = evs, *next; e != NULL; e = next) {
        next = e->next;
        if (!gone && e->tok.id >= 0 && j->req.logprobs >= 0) {
            if (j->n_toks == j->cap_toks) {
                int64_t cap = j->cap_toks ? 2 * j->cap_toks : 64;
                struct srv_token *t = realloc(j->toks, (size_t)cap * sizeof(*t));
                if (t != NULL)
                    j->toks = t, j->cap_toks = cap;
            }
            if (j->n_toks < j->cap_toks)
                j->toks[j->n_toks++] = e->tok;
        }
        free(e);
    }
}

/* Non-streaming: every choice's job to its end, then the whole answer (the first error of them
 * instead, if any). */
static enum MHD_Result finish_plain(struct llmem_server *s, struct MHD_Connection *c,
                                    struct job *const *jobs, int n) {
    int gone = 0;
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&jobs[i]->mu);
        gone = gone || job_wait(jobs[i], 1) != 0;
        pthread_mutex_unlock(&jobs[i]->mu);
        job_collect(jobs[i], gone);
    }
    if (gone) {
        for (int i = 0; i < n; i++)
            job_abandon(jobs[i]);
        return MHD_NO; /* nobody to answer */
    }
    struct srv_choice choices[SRV_MAX_N];
    int64_t completion = 0;
    for (int i = 0; i < n; i++) {
        const struct job *j = jobs[i];
        if (j->status != LLMEM_OK || strcmp(j->finish_reason, "cancelled") == 0) {
            struct srv_error err;
            job_error(j, &err);
            return respond_error(s, c, &err);
        }
        choices[i] = (struct srv_choice){j->text, j->text_len, j->toks, j->n_toks,
                                         j->finish_reason};
        completion += j->completion_tokens;
    }
    const struct job *j = jobs[0];
    char *body = llmem_srv_render_response(&jobs[0]->render, choices, n, j->prompt_tokens,
                                           completion);
    LLMEM_DEBUG("request %s: 200, %" PRId64 " prompt + %" PRId64 " tokens in %d choices (%s)",
                j->id_str, j->prompt_tokens, completion, n, j->finish_reason);
    return respond_json(c, 200, body);
}

/* Streaming: wait for the first event; a request that ends before any token is an error
 * response with its status (507 for a memory refusal), else the SSE response starts. */
static enum MHD_Result start_stream(struct llmem_server *s, struct MHD_Connection *c,
                                    struct job *j) {
    pthread_mutex_lock(&j->mu);
    int gone = job_wait(j, 0) != 0;
    int failed = j->done && j->head == NULL &&
                 (j->status != LLMEM_OK || strcmp(j->finish_reason, "cancelled") == 0);
    pthread_mutex_unlock(&j->mu);
    if (gone)
        return MHD_NO;
    if (failed) {
        struct srv_error err;
        job_error(j, &err);
        return respond_error(s, c, &err);
    }
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, j, stream_free);
    if (r == NULL)
        return MHD_NO;
    pthread_mutex_lock(&j->mu);
    j->refs++; /* the response's, released by stream_free */
    pthread_mutex_unlock(&j->mu);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ok = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r);
    return ok;
}

/* A job of connection c, holding the connection's reference; NULL on out of memory. */
static struct job *job_new(struct llmem_server *s, struct MHD_Connection *c) {
    struct job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    j->refs = 1; /* the connection's */
    j->srv = s;
    pthread_mutex_lock(&s->mu);
    s->n_jobs_alive++;
    pthread_mutex_unlock(&s->mu);
    j->tail = &j->head;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    j->fd = ci != NULL ? ci->connect_fd : -1;
    return j;
}

static enum MHD_Result generate(struct llmem_server *s, struct MHD_Connection *c,
                                enum srv_kind kind, const char *body, size_t len) {
    struct job *j = job_new(s, c), *jobs[SRV_MAX_N] = {j};
    struct srv_error err;
    int n_jobs = 1;
    if (j == NULL)
        return MHD_NO;
    int32_t *ids = NULL;
    int64_t n = 0;
    enum MHD_Result ok;
    if (llmem_srv_request_parse(kind, body, len, &s->model, &j->req, &err) != 0 ||
        tokenize(s, &j->req, &ids, &n, &err) != 0 ||
        llmem_srv_check_prompt(kind, n, j->req.max_tokens, &s->model, &err) != 0 ||
        submit(s, j, ids, n, &err) != 0) {
        ok = respond_error(s, c, &err);
        goto out;
    }
    snprintf(j->id_str, sizeof(j->id_str), "%s-%016" PRIx64, kind == SRV_CHAT ? "chatcmpl" : "cmpl",
             llmem_splitmix64(s->salt ^ j->id));
    j->render = (struct srv_render){.kind = kind,
                                    .id = j->id_str,
                                    .model = s->name,
                                    .created = (int64_t)time(NULL),
                                    .logprobs = j->req.logprobs,
                                    .include_usage = j->req.include_usage,
                                    .piece = token_piece,
                                    .bytes = token_bytes,
                                    .piece_arg = (void *)s->tok,
                                    .tools = j->req.tool_mode != SRV_TOOLS_NONE,
                                    .tool_names = j->req.tool_names,
                                    .n_tools = j->req.n_tools,
                                    .tool_format = s->model.tool_format,
                                    .call_seed = llmem_splitmix64(s->salt + j->id)};
    /* n > 1: a request a choice, each after the first's prompt is in the cache (follow) */
    for (; n_jobs < j->req.n; n_jobs++) {
        struct job *k = job_new(s, c);
        if (k == NULL) {
            llmem_srv_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
            break;
        }
        pthread_mutex_lock(&j->mu);
        j->refs++; /* k's, for the request it borrows */
        pthread_mutex_unlock(&j->mu);
        k->req = j->req, k->parent = j, k->choice = n_jobs, k->render = j->render;
        jobs[n_jobs] = k;
        if (submit(s, k, ids, n, &err) != 0) {
            job_release(k); /* (never submitted) */
            break;
        }
    }
    if (n_jobs < j->req.n) { /* a choice could not start: the others end unanswered */
        for (int i = 0; i < n_jobs; i++)
            llmem_engine_cancel(s->engine, jobs[i]->id);
        ok = respond_error(s, c, &err);
    } else {
        ok = j->req.stream ? start_stream(s, c, j) : finish_plain(s, c, jobs, n_jobs);
    }
out:
    free(ids);
    for (int i = n_jobs - 1; i >= 0; i--)
        job_release(jobs[i]);
    return ok;
}

/* ---- the other routes ------------------------------------------------------------------------ */

static enum MHD_Result health(struct llmem_server *s, struct MHD_Connection *c) {
    struct llmem_engine_metrics m;
    llmem_engine_metrics(s->engine, &m);
    struct llmem_mem_stats st;
    llmem_mem_stats(llmem_engine_mem(s->engine), &st);
    char line[512];
    llmem_engine_limits_line(s->engine, line, sizeof(line));
    const struct llmem_plan *plan = llmem_engine_plan(s->engine);
    struct srv_counters counters;
    pthread_mutex_lock(&s->mu);
    counters = s->counters;
    pthread_mutex_unlock(&s->mu);
    const struct llmem_engine_config *ec = llmem_engine_get_config(s->engine);
    struct llmem_sys_resident rss;
    llmem_sys_resident_read(&rss);
    struct srv_health h = {.model = s->name,
                           .resident_bytes = rss.current_bytes,
                           .resident_peak_bytes = rss.peak_bytes,
                           .plan = plan,
                           .limits_line = line,
                           .mem = &st,
                           .kv_format = llmem_kv_format_name(ec->kv_format),
                           .kv_layout = llmem_kv_layout_name(ec->kv_layout),
                           .chat_template = llmem_chat_template_name(s->tmpl)};
    return respond_json(c, 200, llmem_srv_render_health(&h, &m, &counters));
}

static enum MHD_Result metrics(struct llmem_server *s, struct MHD_Connection *c) {
    struct llmem_engine_metrics m;
    llmem_engine_metrics(s->engine, &m);
    struct srv_counters counters;
    pthread_mutex_lock(&s->mu);
    counters = s->counters;
    pthread_mutex_unlock(&s->mu);
    return respond(c, 200, "text/plain; version=0.0.4; charset=utf-8",
                   llmem_srv_render_metrics(&m, &counters), NULL, NULL);
}

static enum MHD_Result cache_clear(struct llmem_server *s, struct MHD_Connection *c) {
    int64_t bytes = llmem_engine_clear_cache(s->engine);
    char *body = malloc(64);
    if (body != NULL)
        snprintf(body, 64, "{\"released_bytes\": %" PRId64 "}", bytes);
    char b[32];
    LLMEM_INFO("cache cleared: %s released", llmem_size_format_short(bytes, b, sizeof(b)));
    return respond_json(c, 200, body);
}

/* ---- routing --------------------------------------------------------------------------------- */

enum route { R_NONE, R_HEALTH, R_METRICS, R_MODELS, R_MODEL, R_COMPLETIONS, R_CHAT, R_CLEAR };

static enum route route_of(const char *url, const char **method) {
    static const struct {
        const char *path, *method;
        enum route r;
    } routes[] = {
        {"/health", "GET", R_HEALTH},
        {"/metrics", "GET", R_METRICS},
        {"/v1/models", "GET", R_MODELS},
        {"/v1/completions", "POST", R_COMPLETIONS},
        {"/v1/chat/completions", "POST", R_CHAT},
        {"/admin/cache/clear", "POST", R_CLEAR},
    };
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        if (strcmp(url, routes[i].path) == 0) {
            *method = routes[i].method;
            return routes[i].r;
        }
    }
    if (strncmp(url, "/v1/models/", 11) == 0) {
        *method = "GET";
        return R_MODEL;
    }
    return R_NONE;
}

/* Constant time in the key's length: the comparison does not leak how much of it matched. */
static int authorized(const struct llmem_server *s, struct MHD_Connection *c) {
    if (s->api_key == NULL)
        return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (h == NULL || strncasecmp(h, "Bearer ", 7) != 0)
        return 0;
    h += 7;
    while (*h == ' ')
        h++;
    size_t n = strlen(s->api_key), m = strlen(h);
    unsigned diff = (unsigned)(n != m);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)s->api_key[i] ^ (unsigned char)(i < m ? h[i] : 0);
    return diff == 0;
}

/* Per HTTP request: the route and the body as it arrives. */
struct conn {
    enum route route;
    const char *method; /* the route's */
    struct srv_buf body;
    int64_t held; /* bytes of the server's body budget this request holds */
    int too_large;
    int busy;     /* the bodies in flight reached the server's budget */
    int answered; /* a response was queued before the body was read */
    uint64_t start_ns; /* the headers' arrival: the body's deadline runs from it */
};

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls) {
    (void)version;
    struct llmem_server *s = cls;
    struct conn *cn = *con_cls;
    struct srv_error err;
    if (cn == NULL) { /* the headers: decide what can be decided before the body */
        if ((cn = calloc(1, sizeof(*cn))) == NULL)
            return MHD_NO;
        *con_cls = cn;
        cn->route = route_of(url, &cn->method);
        const char *cl =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl != NULL && strtoll(cl, NULL, 10) > s->max_body) {
            cn->answered = 1;
            char b[32];
            llmem_srv_fail(&err, 413, "invalid_request_error", NULL, "request_too_large",
                           "the request body has %s bytes; the limit is %s", cl,
                           llmem_size_format(s->max_body, b, sizeof(b)));
            return respond_error(s, c, &err);
        }
        /* while the body comes, a pause of a third of its time closes the connection */
        cn->start_ns = llmem_clock_ns();
        MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                                  (unsigned)(s->body_timeout_s > 3 ? s->body_timeout_s / 3 : 1));
        return MHD_YES;
    }
    if (*upload_size > 0 &&
        llmem_clock_ns() - cn->start_ns > (uint64_t)s->body_timeout_s * 1000000000u) {
        LLMEM_WARN("a request body took over %d s to arrive; its connection is closed",
                   s->body_timeout_s);
        return MHD_NO; /* (completed() releases what it held) */
    }
    if (*upload_size > 0) { /* a piece of the body */
        if (!cn->answered && !cn->too_large && !cn->busy) {
            if ((int64_t)(cn->body.len + *upload_size) > s->max_body) {
                cn->too_large = 1;
            } else {
                pthread_mutex_lock(&s->mu);
                cn->busy = s->bodies + (int64_t)*upload_size > s->bodies_max;
                if (!cn->busy) {
                    s->bodies += (int64_t)*upload_size;
                    cn->held += (int64_t)*upload_size;
                }
                pthread_mutex_unlock(&s->mu);
                if (!cn->busy)
                    llmem_srv_buf_append(&cn->body, upload, *upload_size);
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (cn->answered)
        return MHD_YES;
    cn->answered = 1;
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)CONN_TIMEOUT_S);

    enum route r = cn->route;
    const char *want = cn->method;
    if (r != R_HEALTH && !authorized(s, c)) {
        llmem_srv_fail(&err, 401, "invalid_request_error", NULL, "invalid_api_key",
                       "Incorrect or missing API key: send 'Authorization: Bearer <key>'");
        return respond_error(s, c, &err);
    }
    if (r == R_NONE) {
        llmem_srv_fail(&err, 404, "invalid_request_error", NULL, "not_found", "no route for %s %s",
                       method, url);
        return respond_error(s, c, &err);
    }
    if (strcmp(method, want) != 0) {
        llmem_srv_fail(&err, 405, "invalid_request_error", want, "method_not_allowed",
                       "%s takes %s, not %s", url, want, method);
        return respond_error(s, c, &err);
    }
    if (cn->too_large) {
        char b[32];
        llmem_srv_fail(&err, 413, "invalid_request_error", NULL, "request_too_large",
                       "the request body is over the limit of %s",
                       llmem_size_format(s->max_body, b, sizeof(b)));
        return respond_error(s, c, &err);
    }
    if (cn->busy) {
        char b[32];
        count(s, &s->counters.rejected);
        llmem_srv_fail(&err, 503, "server_error", NULL, "server_busy",
                       "the server holds as many request bodies as it plans for (%s); retry",
                       llmem_size_format(s->bodies_max, b, sizeof(b)));
        return respond_error(s, c, &err);
    }
    if (cn->body.failed)
        return MHD_NO;
    switch (r) {
    case R_HEALTH: return health(s, c);
    case R_METRICS: return metrics(s, c);
    case R_MODELS:
        return respond_json(c, 200, llmem_srv_render_models(&s->model, (int64_t)time(NULL)));
    case R_MODEL:
        if (strcmp(url + 11, s->name) != 0) {
            llmem_srv_fail(&err, 404, "invalid_request_error", "model", "model_not_found",
                           "The model '%s' does not exist; this server serves '%s'", url + 11,
                           s->name);
            return respond_error(s, c, &err);
        }
        return respond_json(c, 200, llmem_srv_render_model(&s->model, (int64_t)time(NULL)));
    case R_COMPLETIONS:
    case R_CHAT:
        return generate(s, c, r == R_CHAT ? SRV_CHAT : SRV_COMPLETIONS,
                        cn->body.data != NULL ? cn->body.data : "", cn->body.len);
    case R_CLEAR: return cache_clear(s, c);
    default: return MHD_NO;
    }
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
    (void)c, (void)toe;
    struct conn *cn = *con_cls;
    if (cn != NULL) {
        struct llmem_server *s = cls;
        pthread_mutex_lock(&s->mu);
        s->bodies -= cn->held;
        pthread_mutex_unlock(&s->mu);
        llmem_srv_buf_free(&cn->body);
        free(cn);
        *con_cls = NULL;
    }
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof(line), fmt, ap);
    line[strcspn(line, "\n")] = '\0';
    LLMEM_WARN("http: %s", line);
}

/* ---- start and stop -------------------------------------------------------------------------- */

static int is_loopback(const struct sockaddr *a) {
    if (a->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr) >> 24) == 127;
    if (a->sa_family == AF_INET6) {
        const struct in6_addr *v6 = &((const struct sockaddr_in6 *)a)->sin6_addr;
        return IN6_IS_ADDR_LOOPBACK(v6) || (IN6_IS_ADDR_V4MAPPED(v6) && v6->s6_addr[12] == 127);
    }
    return 0;
}

/* The address to bind (freeaddrinfo), checked: LLMEM_EINVAL (logged) for a bad configuration. */
static int resolve(const struct llmem_server_config *cfg, struct addrinfo **ai) {
    if (cfg->model_name == NULL || *cfg->model_name == '\0') {
        LLMEM_ERROR_AS("llmem_server_start", "the server needs a model name");
        return LLMEM_EINVAL;
    }
    for (const char *k = cfg->api_key; k != NULL && *k; k++)
        if ((unsigned char)*k <= ' ' || *k == 0x7f) {
            LLMEM_ERROR_AS("llmem_server_start",
                           "the API key holds a space or a control character: a Bearer key is one "
                           "word of printable characters");
            return LLMEM_EINVAL;
        }
    if (cfg->max_queue < 0 || cfg->max_body_bytes < 0 || cfg->body_timeout_s < 0 ||
        (unsigned)cfg->chat_template > LLMEM_CHAT_MISTRAL) {
        LLMEM_ERROR_AS("llmem_server_start",
                       "max_queue %" PRId64 ", max_body_bytes %" PRId64
                       " and body_timeout_s %d must be ≥ 0 (0: the default), and chat_template "
                       "one of enum llmem_chat_template",
                       cfg->max_queue, cfg->max_body_bytes, cfg->body_timeout_s);
        return LLMEM_EINVAL;
    }
    const char *host = cfg->host != NULL ? cfg->host : "127.0.0.1";
    if (cfg->port < 0 || cfg->port > 65535) {
        LLMEM_ERROR_AS("llmem_server_start", "port %d is out of range [0, 65535]", cfg->port);
        return LLMEM_EINVAL;
    }
    char port[16];
    snprintf(port, sizeof(port), "%d", cfg->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    int gai = getaddrinfo(host, port, &hints, ai);
    if (gai != 0) {
        LLMEM_ERROR_AS("llmem_server_start", "cannot resolve the host '%s': %s", host,
                       gai_strerror(gai));
        return LLMEM_EINVAL;
    }
    if (!is_loopback((*ai)->ai_addr) && (cfg->api_key == NULL || *cfg->api_key == '\0')) {
        LLMEM_ERROR_AS("llmem_server_start",
                       "binding '%s' (not a loopback address) needs an API key (--api-key): "
                       "without one the server would be open to the network",
                       host);
        freeaddrinfo(*ai);
        return LLMEM_EINVAL;
    }
    return LLMEM_OK;
}

int llmem_server_config_check(const struct llmem_server_config *cfg) {
    struct addrinfo *ai = NULL;
    int status = resolve(cfg, &ai);
    if (status == LLMEM_OK)
        freeaddrinfo(ai);
    return status;
}

int llmem_server_start(struct llmem_engine *e, const struct llmem_server_config *cfg,
                       struct llmem_server **out) {
    struct addrinfo *ai = NULL;
    int status = resolve(cfg, &ai);
    if (status != LLMEM_OK)
        return status;
    const char *host = cfg->host != NULL ? cfg->host : "127.0.0.1";

    struct llmem_server *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        freeaddrinfo(ai);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->idle, &ca);
    pthread_condattr_destroy(&ca);
    waker_start(s);
    s->engine = e;
    s->tok = llmem_engine_tokenizer(e);
    s->name = strdup(cfg->model_name);
    s->api_key = cfg->api_key != NULL && *cfg->api_key ? strdup(cfg->api_key) : NULL;
    s->max_body = cfg->max_body_bytes > 0 ? cfg->max_body_bytes : LLMEM_SERVER_MAX_BODY_BYTES;
    s->bodies_max = LLMEM_SERVER_BODIES_IN_FLIGHT * s->max_body;
    s->body_timeout_s = cfg->body_timeout_s > 0 ? cfg->body_timeout_s : LLMEM_SERVER_BODY_TIMEOUT_S;
    s->model =
        (struct srv_model){.name = s->name,
                           .vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size,
                           .context = llmem_engine_plan(e)->context_window_resolved,
                           .max_choices = (int)((cfg->max_queue > 0 ? cfg->max_queue : 256) +
                                                llmem_engine_plan(e)->max_sequences),
                           .max_values = LLMEM_SERVER_BODY_VALUES(s->max_body)};
    if (getrandom(&s->salt, sizeof(s->salt), 0) != (ssize_t)sizeof(s->salt))
        s->salt = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)s;
    if (s->name == NULL || (cfg->api_key != NULL && *cfg->api_key && s->api_key == NULL)) {
        LLMEM_ERROR("out of memory");
        status = LLMEM_ENOMEM;
        goto fail;
    }

    s->tmpl = cfg->chat_template;
    if (s->tmpl == LLMEM_CHAT_NONE && llmem_tokenizer_chat_template(s->tok, &s->tmpl) != LLMEM_OK)
        s->tmpl = LLMEM_CHAT_NONE; /* logged: unrecognized; chat then says so per request */
    if (s->tmpl != LLMEM_CHAT_NONE)
        s->n_chat_stops = llmem_chat_stop_ids(s->tok, s->tmpl, s->chat_stops, MAX_CHAT_STOPS);
    /* Mistral's convention where its tokenizer has the control token a call opens with */
    const int mistral_tools =
        s->tmpl == LLMEM_CHAT_MISTRAL && llmem_tokenizer_token_id(s->tok, "[TOOL_CALLS]") >= 0;
    s->model.tools = s->tmpl == LLMEM_CHAT_CHATML || s->tmpl == LLMEM_CHAT_LLAMA3 || mistral_tools;
    s->model.tool_format = s->tmpl == LLMEM_CHAT_LLAMA3 ? LLMEM_TOOL_FORMAT_LLAMA3
                           : mistral_tools              ? LLMEM_TOOL_FORMAT_MISTRAL
                                                        : LLMEM_TOOL_FORMAT_HERMES;

    struct llmem_serve_config sc = {.max_queue = cfg->max_queue};
    if ((status = llmem_engine_serve_start(e, &sc)) != LLMEM_OK)
        goto fail;
    s->accepting = 1;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_POLL | MHD_USE_ERROR_LOG | MHD_USE_ITC; /* ITC: quiesce at stop */
    if (ai->ai_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    int64_t max_queue = cfg->max_queue > 0 ? cfg->max_queue : 256;
    unsigned limit = (unsigned)(max_queue + llmem_engine_plan(e)->max_sequences + 64);
    s->daemon = MHD_start_daemon(
        flags, (uint16_t)cfg->port, NULL, NULL, handle, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log,
        NULL, MHD_OPTION_SOCK_ADDR, ai->ai_addr, MHD_OPTION_NOTIFY_COMPLETED, completed, s,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)CONN_TIMEOUT_S, MHD_OPTION_CONNECTION_LIMIT, limit,
        MHD_OPTION_THREAD_STACK_SIZE, (size_t)(512 << 10), MHD_OPTION_END);
    if (s->daemon == NULL) {
        LLMEM_ERROR("cannot listen on %s port %d (is the port in use?)", host, cfg->port);
        llmem_engine_serve_stop(e);
        status = LLMEM_EIO;
        goto fail;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di != NULL ? di->port : cfg->port;
    char addr[INET6_ADDRSTRLEN] = "";
    if (ai->ai_family == AF_INET6)
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr, addr, sizeof(addr));
    else
        inet_ntop(AF_INET, &((struct sockaddr_in *)ai->ai_addr)->sin_addr, addr, sizeof(addr));
    snprintf(s->url, sizeof(s->url), ai->ai_family == AF_INET6 ? "http://[%s]:%d" : "http://%s:%d",
             addr, s->port);
    freeaddrinfo(ai);
    *out = s;
    return LLMEM_OK;
fail:
    freeaddrinfo(ai);
    waker_stop(s);
    free(s->name);
    free(s->api_key);
    pthread_cond_destroy(&s->idle);
    pthread_mutex_destroy(&s->mu);
    free(s);
    return status;
}

#define STOP_GRACE_S 5 /* how long stop waits for the answers in flight to be written */

void llmem_server_stop(struct llmem_server *s) {
    if (s == NULL)
        return;
    MHD_socket listen = MHD_quiesce_daemon(s->daemon); /* no new connections */
    pthread_mutex_lock(&s->mu);
    s->accepting = 0; /* no submit from here on: every job submitted gets its on_done below */
    pthread_mutex_unlock(&s->mu);
    llmem_engine_serve_stop(s->engine); /* requests in flight end as cancelled */
    /* their connections answer (a stream ends with an error event); give them time to write it
     * before the daemon closes every socket */
    struct timespec until = llmem_clock_deadline(STOP_GRACE_S);
    pthread_mutex_lock(&s->mu);
    while (s->n_jobs_alive > 0 && pthread_cond_timedwait(&s->idle, &s->mu, &until) == 0)
        ;
    if (s->n_jobs_alive > 0)
        LLMEM_WARN("stopping with %" PRId64 " answer(s) unfinished", s->n_jobs_alive);
    pthread_mutex_unlock(&s->mu);
    MHD_stop_daemon(s->daemon);
    if (listen != MHD_INVALID_SOCKET)
        close(listen);
    waker_stop(s);
    free(s->name);
    free(s->api_key);
    pthread_cond_destroy(&s->idle);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int llmem_server_port(const struct llmem_server *s) {
    return s->port;
}

const char *llmem_server_url(const struct llmem_server *s) {
    return s->url;
}

/*
 * tests/e2e/e2e-soak.c — a bounded soak of the HTTP server: one engine (pycoder, 4 sequences) and
 * its server in this process on a loopback port, and a few client threads sending a seeded random
 * mix of requests on raw sockets: completions and chat, streaming and not, prompts sharing
 * prefixes (bank hits), streams abandoned after a few events, plain requests whose socket closes
 * after a short delay (cancelled), cache clears under load, and hostile requests (truncated JSON,
 * wrong types, huge numbers, invalid UTF-8, a NUL in the prompt, an oversize Content-Length,
 * garbage, an empty body, wrong methods and paths, bytes that are not HTTP).
 *
 * It asserts: no failed request (every request the client did not abandon gets its expected
 * status with a well-formed body — a 200 with choices, or a 4xx with an OpenAI error object — and
 * no 5xx, no hang: every socket has a timeout); every greedy request gets the same text for the
 * same prompt throughout; once idle, no KV block is held by a request, and after
 * /admin/cache/clear none at all; the process's resident memory after the clear is within a margin
 * of what it was after the warm-up round; and the fixed greedy request at the end returns the text
 * it returned at the start. A timing is never asserted.
 *
 * Scale: LLMEM_SOAK_REQUESTS (requests per client and round; fewer in a sanitizer build) and
 * LLMEM_SOAK_SEED (printed, so that a failure's mix can be replayed).
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/rng.h"
#include "engine/hooks.h"
#include "llmem/engine.h"
#include "llmem/server.h"
#include "testutil.h"

#define PYCODER LLMEM_SOURCE_DIR "/models/pycoder"

enum {
    N_CLIENTS = 4,
    N_ROUNDS = 3, /* the warm-up round, then the soak */
    /* A hang fails the request: no answer is that slow on this model, even sanitized. */
    TIMEOUT_S = TU_ASAN ? 120 : 60,
    /* The fixed greedy request of the start and the end. */
    FIXED_TOKENS = 24,
};

/* ---- the mix --------------------------------------------------------------------------------- */

enum kind {
    K_COMPLETE,
    K_COMPLETE_STREAM,
    K_CHAT,
    K_CHAT_STREAM,
    K_ABANDON_STREAM, /* read a few events, then close */
    K_ABANDON_PLAIN,  /* close after a short delay, before the answer */
    K_HOSTILE,
    K_CLEAR, /* POST /admin/cache/clear under load */
    N_KINDS
};
static const char *const kind_names[N_KINDS] = {
    "complete",       "complete-stream", "chat",    "chat-stream",
    "abandon-stream", "abandon-plain",   "hostile", "clear"};
/* Out of 100. */
static const int kind_weights[N_KINDS] = {20, 16, 14, 12, 9, 9, 18, 2};

/* Prompts share long prefixes so that later requests find their first blocks in the bank. */
enum { N_PREFIXES = 3, N_SUFFIXES = 6 };
static char prefixes[N_PREFIXES][2048];
static const char *const suffixes[N_SUFFIXES] = {
    "def parse(line):\n",    "class Cache:\n",          "def main():\n",
    "async def fetch(u):\n", "def test_parse():\n    ", "if __name__ == '__main__':\n",
};

static void make_prefixes(void) {
    for (int p = 0; p < N_PREFIXES; p++) {
        char *b = prefixes[p];
        size_t at =
            (size_t)snprintf(b, sizeof(prefixes[p]), "# module %d\nimport os\nimport sys\n", p);
        for (int l = 0; l < 12; l++)
            at +=
                (size_t)snprintf(b + at, sizeof(prefixes[p]) - at,
                                 "\n\ndef helper_%d_%d(x):\n    return x * %d + %d\n", p, l, l, p);
        snprintf(b + at, sizeof(prefixes[p]) - at, "\n\n");
    }
}

/* ---- one client ------------------------------------------------------------------------------ */

struct client {
    const char *url;
    int id, n_requests;
    uint64_t rng;
    int64_t sent[N_KINDS];
    int64_t ok;              /* 200s checked */
    int64_t refused;         /* hostile requests answered by their 4xx */
    int64_t protocol_closed; /* not-HTTP requests the server closed without an answer */
    int failed;
    char why[2048]; /* the first failure */
};

/* The greedy texts seen so far, by prompt and length: every later one must equal the first. */
static struct {
    pthread_mutex_t mu;
    char *text[2][N_PREFIXES][N_SUFFIXES][25]; /* [chat][prefix][suffix][max_tokens] */
    int64_t compared;
} greedy = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t next(struct client *c, uint64_t n) {
    return llmem_splitmix64_next(&c->rng) % n;
}

/* The first failure is kept; a client stops at it. */
static void failf(struct client *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void failf(struct client *c, const char *fmt, ...) {
    if (c->failed++)
        return;
    int at = snprintf(c->why, sizeof(c->why), "client %d, request %" PRId64 ": ", c->id,
                      c->sent[0] + c->sent[1] + c->sent[2] + c->sent[3] + c->sent[4] + c->sent[5] +
                          c->sent[6] + c->sent[7]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->why + at, sizeof(c->why) - (size_t)at, fmt, ap);
    va_end(ap);
}

/* A request's bytes: the request line, the headers (Content-Length from len unless the caller
 * names one) and the body. */
static char *request_bytes(const char *method, const char *path, const char *body, size_t len,
                           const char *content_length, size_t *out_len) {
    char head[512];
    char cl[32];
    snprintf(cl, sizeof(cl), "%zu", len);
    int n = snprintf(head, sizeof(head),
                     "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: %s\r\nConnection: close\r\n\r\n",
                     method, path, content_length != NULL ? content_length : cl);
    char *req = malloc((size_t)n + len);
    if (req == NULL)
        return NULL;
    memcpy(req, head, (size_t)n);
    if (len > 0)
        memcpy(req + n, body, len);
    *out_len = (size_t)n + len;
    return req;
}

/* Opens a connection and sends a request: the socket, or -1 (a failure recorded). */
static int send_request(struct client *c, const char *method, const char *path, const char *body,
                        size_t len, const char *content_length) {
    size_t n = 0;
    char *req = request_bytes(method, path, body, len, content_length, &n);
    int fd = req != NULL ? tu_http_connect(c->url, TIMEOUT_S) : -1;
    if (fd < 0) {
        failf(c, "cannot connect: %s", strerror(errno));
    } else if (tu_http_send(fd, req, (long)n) != 0) {
        failf(c, "%s %s: the request could not be sent: %s", method, path, strerror(errno));
        close(fd);
        fd = -1;
    }
    free(req);
    return fd;
}

/* One whole exchange; 0 with the response in h, or -1 (a failure recorded). */
static int exchange(struct client *c, const char *method, const char *path, const char *body,
                    size_t len, const char *content_length, struct tu_http *h) {
    int fd = send_request(c, method, path, body, len, content_length);
    if (fd < 0)
        return -1;
    char why[512];
    int rc = tu_http_read(fd, h, why, sizeof(why));
    close(fd);
    if (rc != 0)
        failf(c, "%s %s %.200s: %s", method, path, body != NULL ? body : "", why);
    return rc;
}

/* A normal request's body: greedy (remembered) or sampled with a seed, up to 24 tokens. */
struct normal {
    int chat, stream, prefix, suffix, max_tokens, greedy;
};

static char *normal_body(const struct normal *n, uint64_t seed) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model", "pycoder");
    if (n->chat) {
        cJSON *messages = cJSON_AddArrayToObject(root, "messages");
        cJSON *sys = cJSON_CreateObject(), *user = cJSON_CreateObject();
        cJSON_AddStringToObject(sys, "role", "system");
        cJSON_AddStringToObject(sys, "content", prefixes[n->prefix]);
        cJSON_AddStringToObject(user, "role", "user");
        cJSON_AddStringToObject(user, "content", suffixes[n->suffix]);
        cJSON_AddItemToArray(messages, sys);
        cJSON_AddItemToArray(messages, user);
    } else {
        char prompt[2560];
        snprintf(prompt, sizeof(prompt), "%s%s", prefixes[n->prefix], suffixes[n->suffix]);
        cJSON_AddStringToObject(root, "prompt", prompt);
    }
    cJSON_AddNumberToObject(root, "max_tokens", n->max_tokens);
    cJSON_AddBoolToObject(root, "ignore_eos", 1);
    cJSON_AddBoolToObject(root, "stream", n->stream);
    if (n->greedy) {
        cJSON_AddNumberToObject(root, "temperature", 0);
    } else {
        cJSON_AddNumberToObject(root, "temperature", 0.8);
        cJSON_AddNumberToObject(root, "seed", (double)(seed % 1000000));
    }
    char *body = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return body;
}

/* The text of one choice of a response or of a stream's chunk (NULL when it has none). */
static const char *choice_text(const cJSON *root, int chat, int stream) {
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    const cJSON *t = !chat    ? cJSON_GetObjectItem(c, "text")
                     : stream ? cJSON_GetObjectItem(cJSON_GetObjectItem(c, "delta"), "content")
                              : cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

/* A 200's body checked: its object, the choice, finish_reason "length" and the usage (plain),
 * or chunks ending in a finish chunk and [DONE] (stream). Returns the text (malloc'ed) or NULL
 * (a failure recorded). */
static char *check_answer(struct client *c, const struct normal *n, const struct tu_http *h) {
    const char *object =
        n->chat ? (n->stream ? "chat.completion.chunk" : "chat.completion") : "text_completion";
    char *text = NULL;
    if (!n->stream) {
        cJSON *root = cJSON_Parse(h->body);
        const cJSON *o = cJSON_GetObjectItem(root, "object");
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
        const cJSON *fin = cJSON_GetObjectItem(ch, "finish_reason");
        const cJSON *used =
            cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "completion_tokens");
        const char *t = choice_text(root, n->chat, 0);
        if (!cJSON_IsString(o) || strcmp(o->valuestring, object) != 0 || t == NULL ||
            !cJSON_IsString(fin) || strcmp(fin->valuestring, "length") != 0 ||
            !cJSON_IsNumber(used) || used->valueint != n->max_tokens)
            failf(c, "a malformed answer: %.500s", h->body);
        else
            text = strdup(t);
        cJSON_Delete(root);
        return text;
    }
    if (strstr(h->headers, "text/event-stream") == NULL) {
        failf(c, "a stream without text/event-stream: %.300s", h->headers);
        return NULL;
    }
    cJSON *ev[64];
    int k = tu_sse_parse(h->body, ev, 64);
    if (k < 1) {
        failf(c, "not SSE events ending in [DONE]: %.500s", h->body);
        return NULL;
    }
    size_t size = 1, len = 0;
    text = calloc(1, 1);
    const char *fin = NULL;
    for (int i = 0; i < k && text != NULL; i++) {
        const cJSON *o = cJSON_GetObjectItem(ev[i], "object");
        if (!cJSON_IsString(o) || strcmp(o->valuestring, object) != 0) {
            failf(c, "event %d of %d is not a %s: %.500s", i, k, object, h->body);
            free(text);
            text = NULL;
            break;
        }
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(ev[i], "choices"), 0);
        const cJSON *f = cJSON_GetObjectItem(ch, "finish_reason");
        if (cJSON_IsString(f))
            fin = f->valuestring;
        const char *t = choice_text(ev[i], n->chat, 1);
        if (t != NULL) {
            size_t add = strlen(t);
            char *more = realloc(text, size + add);
            if (more == NULL) {
                free(text);
                text = NULL;
                break;
            }
            text = more;
            memcpy(text + len, t, add + 1);
            len += add, size += add;
        }
    }
    if (text != NULL && (fin == NULL || strcmp(fin, "length") != 0)) {
        failf(c, "a stream that does not finish with \"length\": %.500s", h->body);
        free(text);
        text = NULL;
    }
    for (int i = 0; i < k; i++)
        cJSON_Delete(ev[i]);
    return text;
}

static void remember_greedy(struct client *c, const struct normal *n, const char *text) {
    pthread_mutex_lock(&greedy.mu);
    char **slot = &greedy.text[n->chat][n->prefix][n->suffix][n->max_tokens];
    if (*slot == NULL) {
        *slot = strdup(text);
    } else {
        greedy.compared++;
        if (strcmp(*slot, text) != 0)
            failf(c, "greedy %s (prefix %d, suffix %d, %d tokens, %s) changed:\n%s\nthen:\n%s",
                  n->chat ? "chat" : "completion", n->prefix, n->suffix, n->max_tokens,
                  n->stream ? "stream" : "plain", *slot, text);
    }
    pthread_mutex_unlock(&greedy.mu);
}

static void do_normal(struct client *c, enum kind k) {
    struct normal n = {.chat = k == K_CHAT || k == K_CHAT_STREAM,
                       .stream = k == K_COMPLETE_STREAM || k == K_CHAT_STREAM,
                       .prefix = (int)next(c, N_PREFIXES),
                       .suffix = (int)next(c, N_SUFFIXES),
                       .max_tokens = 8 * (1 + (int)next(c, 3)),
                       .greedy = next(c, 3) != 0};
    if (!n.greedy)
        n.max_tokens = 4 + (int)next(c, 21);
    char *body = normal_body(&n, llmem_splitmix64_next(&c->rng));
    const char *path = n.chat ? "/v1/chat/completions" : "/v1/completions";
    struct tu_http h;
    if (exchange(c, "POST", path, body, strlen(body), NULL, &h) == 0) {
        if (h.status != 200) {
            failf(c, "HTTP %d for %s %.300s: %.500s", h.status, path, body, h.body);
        } else {
            char *text = check_answer(c, &n, &h);
            if (text != NULL) {
                c->ok++;
                if (n.greedy)
                    remember_greedy(c, &n, text);
            }
            free(text);
        }
        tu_http_free(&h);
    }
    free(body);
}

/* A long stream read until its k-th event (or its end), then closed. */
static void do_abandon_stream(struct client *c) {
    struct normal n = {.chat = (int)next(c, 2),
                       .stream = 1,
                       .prefix = (int)next(c, N_PREFIXES),
                       .suffix = (int)next(c, N_SUFFIXES),
                       .max_tokens = 24,
                       .greedy = 1};
    char *body = normal_body(&n, 0);
    cJSON *root = cJSON_Parse(body); /* longer than any answer the soak waits for */
    cJSON_ReplaceItemInObject(root, "max_tokens", cJSON_CreateNumber(400));
    free(body);
    body = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    int want = 1 + (int)next(c, 4);
    int fd = send_request(c, "POST", n.chat ? "/v1/chat/completions" : "/v1/completions", body,
                          strlen(body), NULL);
    free(body);
    if (fd < 0)
        return;
    char buf[16384];
    size_t got = 0;
    int events = 0;
    while (events < want && got < sizeof(buf) - 1) {
        ssize_t r = recv(fd, buf + got, sizeof(buf) - 1 - got, 0);
        if (r <= 0) {
            if (r < 0)
                failf(c, "an abandoned stream: %s after %zu bytes", strerror(errno), got);
            break;
        }
        got += (size_t)r;
        buf[got] = '\0';
        events = 0;
        for (const char *p = buf; (p = strstr(p, "data: {")) != NULL; p++)
            events++;
    }
    buf[got] = '\0';
    if (strncmp(buf, "HTTP/1.1 200", 12) != 0)
        failf(c, "an abandoned stream got: %.300s", buf);
    close(fd);
}

/* A plain request whose client goes away after 0–200 ms: the server must cancel it. */
static void do_abandon_plain(struct client *c) {
    struct normal n = {.chat = (int)next(c, 2),
                       .prefix = (int)next(c, N_PREFIXES),
                       .suffix = (int)next(c, N_SUFFIXES),
                       .max_tokens = 24,
                       .greedy = 1};
    char *body = normal_body(&n, 0);
    cJSON *root = cJSON_Parse(body);
    cJSON_ReplaceItemInObject(root, "max_tokens", cJSON_CreateNumber(400));
    free(body);
    body = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    struct timespec ts = {0, (long)next(c, 200) * 1000 * 1000};
    int fd = send_request(c, "POST", n.chat ? "/v1/chat/completions" : "/v1/completions", body,
                          strlen(body), NULL);
    free(body);
    if (fd < 0)
        return;
    nanosleep(&ts, NULL);
    close(fd);
}

static void do_clear(struct client *c) {
    struct tu_http h;
    if (exchange(c, "POST", "/admin/cache/clear", "", 0, NULL, &h) != 0)
        return;
    cJSON *root = cJSON_Parse(h.body);
    if (h.status != 200 || !cJSON_IsNumber(cJSON_GetObjectItem(root, "released_bytes")))
        failf(c, "cache clear: HTTP %d %.300s", h.status, h.body);
    else
        c->ok++;
    cJSON_Delete(root);
    tu_http_free(&h);
}

/* ---- hostile requests ------------------------------------------------------------------------ */

struct hostile {
    const char *method, *path;
    char body[8192];
    size_t len;
    const char *content_length; /* (optional) instead of the body's length */
    int status;                 /* the status expected with an error object; 200: served; 0: the
                                 * bytes are not HTTP: a 4xx of any body, or the connection closed */
};

static const char *const wrong_types[] = {
    "{\"prompt\": 42}",
    "{\"prompt\": {\"a\": 1}}",
    "{\"prompt\": \"x\", \"max_tokens\": \"10\"}",
    "{\"prompt\": \"x\", \"temperature\": [1]}",
    "{\"prompt\": \"x\", \"stream\": \"yes\"}",
    "{\"prompt\": \"x\", \"stop\": 3}",
    "{\"prompt\": [\"a\", 1]}",
    "{\"prompt\": null}",
    "{\"messages\": \"hi\"}",
    "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}",
    "{\"messages\": [{\"role\": 7, \"content\": \"x\"}]}",
    "[1, 2, 3]",
    "\"just a string\"",
};
static const char *const huge_numbers[] = {
    "{\"prompt\": \"x\", \"max_tokens\": 1e300}",
    "{\"prompt\": \"x\", \"max_tokens\": 18446744073709551617}",
    "{\"prompt\": \"x\", \"max_tokens\": -9223372036854775809}",
    "{\"prompt\": \"x\", \"temperature\": 1e308}",
    "{\"prompt\": \"x\", \"logprobs\": 1e9}",
    "{\"prompt\": \"x\", \"top_k\": -1e20}",
    "{\"prompt\": [1e12]}",
    "{\"prompt\": \"x\", \"max_tokens\": 3000000}",
};
static const char *const bad_utf8[] = {
    "{\"prompt\": \"a\xff\xfe\"}",
    "{\"prompt\": \"\xed\xa0\x80\"}", /* a surrogate */
    "{\"prompt\": \"\xc0\xaf\"}",     /* overlong */
    "{\"prompt\": \"abc\xc3\"}",      /* cut short */
    "{\"prompt\": \"\\ud800 lone\"}", /* an escaped lone surrogate */
    "{\"messages\": [{\"role\": \"user\", \"content\": \"\xf8\x88\x80\x80\x80\"}]}",
};

static void make_hostile(struct client *c, struct hostile *h) {
    memset(h, 0, sizeof(*h));
    h->method = "POST";
    h->path = next(c, 2) ? "/v1/completions" : "/v1/chat/completions";
    h->status = 400;
    switch (next(c, 12)) {
    case 0: { /* valid JSON cut short: a strict prefix of an object is never one */
        int chat = strcmp(h->path, "/v1/chat/completions") == 0;
        struct normal n = {.chat = chat, .prefix = 0, .suffix = 0, .max_tokens = 4, .greedy = 1};
        char *body = normal_body(&n, 0);
        size_t len = strlen(body);
        h->len = 1 + (size_t)next(c, len - 1);
        memcpy(h->body, body, h->len);
        free(body);
        break;
    }
    case 1: {
        const char *b = wrong_types[next(c, sizeof(wrong_types) / sizeof(wrong_types[0]))];
        h->path = b[2] == 'm' ? "/v1/chat/completions" : "/v1/completions";
        h->len = (size_t)snprintf(h->body, sizeof(h->body), "%s", b);
        break;
    }
    case 2:
        h->path = "/v1/completions";
        h->len =
            (size_t)snprintf(h->body, sizeof(h->body), "%s",
                             huge_numbers[next(c, sizeof(huge_numbers) / sizeof(huge_numbers[0]))]);
        break;
    case 3: {
        const char *b = bad_utf8[next(c, sizeof(bad_utf8) / sizeof(bad_utf8[0]))];
        h->path = b[2] == 'm' ? "/v1/chat/completions" : "/v1/completions";
        h->len = (size_t)snprintf(h->body, sizeof(h->body), "%s", b);
        break;
    }
    case 4: /* a NUL in the prompt is a character like any other: served */
        h->path = "/v1/completions";
        h->len = (size_t)snprintf(h->body, sizeof(h->body),
                                  "{\"prompt\": \"def f():\\u0000 return\", \"max_tokens\": 3, "
                                  "\"temperature\": 0}");
        h->status = 200;
        break;
    case 5: /* a raw NUL byte in a string: read as cJSON reads raw control characters, like
             * "\u0000" (the body's strings are measured, not cut at the NUL): served */
        h->path = "/v1/completions";
        h->len = (size_t)snprintf(h->body, sizeof(h->body),
                                  "{\"prompt\": \"ab#cd\", \"max_tokens\": 3, \"temperature\": 0}");
        h->body[14] = '\0';
        h->status = 200;
        break;
    case 6: /* a Content-Length far over the limit, with a small body */
        h->len = (size_t)snprintf(h->body, sizeof(h->body), "{\"prompt\": \"x\"}");
        h->content_length = "67108864";
        h->status = 413;
        if (next(c, 2)) {
            /* One beyond 64 bits never reaches the server's handler: libmicrohttpd answers it
             * with a 413 of its own (HTML, and 0.9.75 sends its header block twice). */
            h->content_length = "99999999999999999999999";
            h->status = 0;
        }
        break;
    case 7: /* garbage bytes */
        h->len = 1 + (size_t)next(c, 512);
        for (size_t i = 0; i < h->len; i++)
            h->body[i] = (char)next(c, 256);
        h->body[0] = (char)(0x80 | next(c, 128)); /* not the start of a JSON value */
        break;
    case 8: /* empty */ break;
    case 9: { /* deeply nested */
        size_t depth = 2000 + (size_t)next(c, 2000);
        for (size_t i = 0; i < depth; i++)
            h->body[i] = '[';
        h->len = depth;
        break;
    }
    case 10: { /* a wrong method or path */
        static const struct {
            const char *method, *path;
            int status;
        } routes[] = {
            {"GET", "/v1/completions", 405},
            {"PUT", "/v1/chat/completions", 405},
            {"DELETE", "/v1/completions", 405},
            {"GET", "/admin/cache/clear", 405},
            {"POST", "/v1/complete", 404},
            {"POST", "/v2/completions", 404},
            {"GET", "/v1/completions/../../etc", 404},
            {"POST", "/health/x", 404},
        };
        size_t r = (size_t)next(c, sizeof(routes) / sizeof(routes[0]));
        h->method = routes[r].method;
        h->path = routes[r].path;
        h->status = routes[r].status;
        h->len = (size_t)snprintf(h->body, sizeof(h->body), "{\"prompt\": \"x\"}");
        break;
    }
    default: /* bytes that are not HTTP at all */
        h->method = NULL;
        h->len = 1 + (size_t)next(c, 256);
        for (size_t i = 0; i < h->len; i++)
            h->body[i] = (char)next(c, 256);
        memcpy(h->body + h->len, "\r\n\r\n", 4);
        h->len += 4;
        h->status = 0;
        break;
    }
}

static void do_hostile(struct client *c) {
    struct hostile x;
    make_hostile(c, &x);
    struct tu_http h;
    char why[512];
    if (x.status == 0) { /* the server answers 4xx or closes; it never hangs nor crashes */
        size_t n = x.len;
        char *req = x.method != NULL
                        ? request_bytes(x.method, x.path, x.body, x.len, x.content_length, &n)
                        : NULL;
        int fd = tu_http_connect(c->url, TIMEOUT_S);
        if (fd < 0) {
            failf(c, "cannot connect: %s", strerror(errno));
            free(req);
            return;
        }
        tu_http_send(fd, req != NULL ? req : x.body, (long)n); /* it may close before it all */
        free(req);
        shutdown(fd, SHUT_WR);
        if (tu_http_read(fd, &h, why, sizeof(why)) == 0) {
            if (h.status < 400 || h.status > 499)
                failf(c, "bytes that are not HTTP got HTTP %d: %.300s", h.status, h.body);
            else
                c->refused++;
            tu_http_free(&h);
        } else if (strstr(why, "timed out") != NULL) {
            failf(c, "bytes that are not HTTP: %s", why);
        } else {
            c->protocol_closed++;
        }
        close(fd);
        return;
    }
    if (exchange(c, x.method, x.path, x.body, x.len, x.content_length, &h) != 0)
        return;
    cJSON *root = cJSON_Parse(h.body);
    if (h.status != x.status) {
        failf(c, "%s %s with %zu bytes (%.200s): HTTP %d, expected %d: %.500s", x.method, x.path,
              x.len, x.body, h.status, x.status, h.body);
    } else if (x.status == 200) {
        if (choice_text(root, 0, 0) == NULL)
            failf(c, "%.200s: no choice: %.500s", x.body, h.body);
        else
            c->ok++;
    } else if (!tu_is_error_object(root)) {
        failf(c, "%s %s (%.200s): HTTP %d without an error object: %.500s", x.method, x.path,
              x.body, h.status, h.body);
    } else {
        c->refused++;
    }
    cJSON_Delete(root);
    tu_http_free(&h);
}

static void *client_main(void *arg) {
    struct client *c = arg;
    for (int i = 0; i < c->n_requests && !c->failed; i++) {
        int roll = (int)next(c, 100), k = 0;
        while (roll >= kind_weights[k])
            roll -= kind_weights[k++];
        c->sent[k]++;
        switch ((enum kind)k) {
        case K_ABANDON_STREAM: do_abandon_stream(c); break;
        case K_ABANDON_PLAIN: do_abandon_plain(c); break;
        case K_HOSTILE: do_hostile(c); break;
        case K_CLEAR: do_clear(c); break;
        default: do_normal(c, (enum kind)k); break;
        }
    }
    return NULL;
}

/* ---- the soak -------------------------------------------------------------------------------- */

/* The guard reads no pressure: the soak is about the server, and the machine the suite shares
 * with other tests must not turn its requests into 507s. */
static void calm_guard(void *arg, struct llmem_guard_reading *r) {
    (void)arg;
    r->resident_bytes = 0;
    r->psi_some = r->psi_full = 0;
    r->cgroup_high_rise = r->cgroup_max_rise = 0;
}

static long rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    assert_non_null(f);
    char line[256];
    long kib = -1;
    while (fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, "VmRSS:", 6) == 0)
            kib = strtol(line + 6, NULL, 10);
    fclose(f);
    assert_true(kib > 0);
    return kib;
}

static char *fixed_greedy(const struct tu_server *s) {
    char url[256];
    snprintf(url, sizeof(url), "%s/v1/completions", s->url);
    char body[256];
    snprintf(body, sizeof(body),
             "{\"prompt\": \"def fibonacci(n):\\n\", \"max_tokens\": %d, \"temperature\": 0, "
             "\"ignore_eos\": true}",
             FIXED_TOKENS);
    struct tu_http h = tu_http("POST", url, body);
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    const char *text = choice_text(root, 0, 0);
    assert_non_null(text);
    char *out = strdup(text);
    cJSON_Delete(root);
    tu_http_free(&h);
    return out;
}

static void clear_cache(const struct tu_server *s) {
    char url[256];
    snprintf(url, sizeof(url), "%s/admin/cache/clear", s->url);
    struct tu_http h = tu_http("POST", url, NULL);
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
}

/* Once idle, only the bank holds KV blocks; after a clear, nothing does. A block the spill
 * writer is still copying to disk is held until the write ends: both checks wait that out, for a
 * few seconds at most. */
static void check_idle_blocks(const struct tu_server *s) {
    tu_wait_idle(s);
    double used = 0, bank = 0;
    for (int i = 0; i < 100; i++) {
        used = tu_metric(s, "llmem_kv_blocks_used"), bank = tu_metric(s, "llmem_bank_blocks");
        if (used == bank)
            break;
        if (i == 0)
            printf("  idle: %.0f KV blocks used, %.0f in the bank; waiting\n", used, bank);
        usleep(50 * 1000);
    }
    assert_true(used == bank);
    clear_cache(s);
    for (int i = 0; i < 100 && tu_metric(s, "llmem_kv_blocks_used") != 0; i++) {
        usleep(50 * 1000);
        clear_cache(s);
    }
    assert_true(tu_metric(s, "llmem_kv_blocks_used") == 0);
    assert_true(tu_metric(s, "llmem_bank_blocks") == 0);
}

static void run_round(const char *url, uint64_t seed, int round, int n_requests,
                      int64_t totals[N_KINDS], int64_t *ok, int64_t *refused, int64_t *closed) {
    struct client clients[N_CLIENTS];
    pthread_t threads[N_CLIENTS];
    for (int i = 0; i < N_CLIENTS; i++) {
        memset(&clients[i], 0, sizeof(clients[i]));
        clients[i].url = url;
        clients[i].id = i;
        clients[i].n_requests = n_requests;
        clients[i].rng = llmem_splitmix64(seed ^ ((uint64_t)(round * N_CLIENTS + i + 1) << 32));
        assert_int_equal(pthread_create(&threads[i], NULL, client_main, &clients[i]), 0);
    }
    int failed = 0;
    for (int i = 0; i < N_CLIENTS; i++) {
        pthread_join(threads[i], NULL);
        for (int k = 0; k < N_KINDS; k++)
            totals[k] += clients[i].sent[k];
        *ok += clients[i].ok;
        *refused += clients[i].refused;
        *closed += clients[i].protocol_closed;
        if (clients[i].failed) {
            print_error("round %d: %s\n", round, clients[i].why);
            failed = 1;
        }
    }
    if (failed)
        fail_msg("round %d failed (seed %" PRIu64 ")", round, seed);
}

static void test_soak(void **state) {
    (void)state;
    uint64_t seed = 1;
    int n_requests = TU_ASAN ? 6 : 80;
    const char *env = getenv("LLMEM_SOAK_SEED");
    if (env != NULL)
        seed = strtoull(env, NULL, 0);
    if ((env = getenv("LLMEM_SOAK_REQUESTS")) != NULL)
        n_requests = atoi(env);
    printf("  seed %" PRIu64 " (LLMEM_SOAK_SEED), %d clients x %d rounds x %d requests\n", seed,
           N_CLIENTS, N_ROUNDS, n_requests);
    make_prefixes();

    struct llmem_server_config sc;
    llmem_server_config_default(&sc);
    sc.chat_template = LLMEM_CHAT_CHATML;
    struct llmem_engine *e = NULL;
    struct llmem_server *s = NULL;
    struct tu_server view;
    tu_library_serve(PYCODER, calm_guard, &sc, &e, &s, &view);

    char *start = fixed_greedy(&view);
    int64_t totals[N_KINDS] = {0}, ok = 0, refused = 0, closed = 0;
    long rss_start = rss_kib(), rss_warm = 0;
    for (int round = 0; round < N_ROUNDS; round++) {
        run_round(view.url, seed, round, n_requests, totals, &ok, &refused, &closed);
        check_idle_blocks(&view);
        long rss = rss_kib();
        printf("  round %d: RSS %ld KiB after the cache clear\n", round, rss);
        if (round == 0)
            rss_warm = rss;
    }
    long rss_end = rss_kib();
    assert_true(tu_metric(&view, "llmem_requests_total{outcome=\"failed\"}") == 0);
    double cancelled = tu_metric(&view, "llmem_requests_total{outcome=\"cancelled\"}");
    double gone = tu_metric(&view, "llmem_client_disconnects_total");
    double hits = tu_metric(&view, "llmem_bank_hits_total");
    if (totals[K_ABANDON_STREAM] > 0) /* a stream abandoned with ~400 tokens to go is cancelled */
        assert_true(cancelled >= 1 && gone >= 1);

    char *end = fixed_greedy(&view);
    assert_string_equal(end, start);
    free(end);
    end = fixed_greedy(&view); /* again, from the bank */
    assert_string_equal(end, start);
    free(end);

    printf("  soak:");
    for (int k = 0; k < N_KINDS; k++)
        printf(" %s %" PRId64 ",", kind_names[k], totals[k]);
    printf(" ok %" PRId64 ", hostile refused %" PRId64 " (+%" PRId64
           " closed), greedy compared %" PRId64 ", cancelled %.0f, disconnects %.0f, bank hits "
           "%.0f; RSS %ld KiB at start, %ld after warm-up, %ld at end\n",
           ok, refused, closed, greedy.compared, cancelled, gone, hits, rss_start, rss_warm,
           rss_end);
    /* After the warm-up round the engine's memory is at its high-water mark and the clear hands
     * the allocator's cache back, so what later rounds may add to resident memory is the C
     * library's: malloc's per-thread arenas (one per connection thread, up to 8 per core) keep
     * freed chunks below their trim threshold, and cJSON's and libmicrohttpd's small blocks
     * fragment them. Measured: 0.2–0.4 MiB over the two rounds, whatever their length (30 to 100
     * requests a client). 4 MiB is ten times that, and what a leak of 8 KiB a request would pass
     * over the ~640 requests of the rounds. Under AddressSanitizer freed memory sits in its
     * quarantine (up to 256 MiB), so resident memory says nothing there: LeakSanitizer checks for
     * leaks instead, when the process ends. */
    if (!TU_ASAN)
        assert_true(rss_end <= rss_warm + 4 * 1024);

    llmem_server_stop(s);
    llmem_engine_close(e);
    free(start);
    for (int a = 0; a < 2; a++)
        for (int p = 0; p < N_PREFIXES; p++)
            for (int q = 0; q < N_SUFFIXES; q++)
                for (int t = 0; t < 25; t++)
                    free(greedy.text[a][p][q][t]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_soak),
    };
    return cmocka_run_group_tests_name("e2e-soak", tests, NULL, NULL);
}

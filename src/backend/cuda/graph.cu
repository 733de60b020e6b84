/*
 * backend/cuda/graph.cu — the per-call data's upload ring (the small host arrays each operation
 * hands its kernels, through pinned slots) and the passes recorded and replayed as CUDA graphs.
 *
 * Graphs (graph_begin / graph_end / graph_launch): a pass the caller repeats with the same shapes
 * (a decode step) is run once as usual, recorded into a CUDA graph the second time, and from then
 * on replayed with one launch: its operations then only stage their small per-call arrays (at the
 * offsets the recording used) and extend a hash of every operation and argument, and the graph is
 * held for launch when that hash equals the recording's; else nothing has run, and the caller
 * runs the pass again (as usual, which also sizes any scratch the new shapes need; the next such
 * pass is recorded afresh). graph_launch launches what graph_end held, or drops it (the ranks of
 * a split launch together or not at all). LLMEM_CUDA_GRAPHS=0 turns them off.
 */
#include "backend/cuda/ops_int.h"

namespace llmem_cuda {

/* Copies a small host array to the device for the next kernel, queued on the stream: through the
 * next pinned slot of the ring, which is free once the work queued after its last upload is done
 * (an event recorded at the following upload; the ring is long enough that this rarely waits). */
static const void *arena_upload(struct cuda_ctx *c, const void *host, size_t bytes);

const void *small_upload(struct cuda_ctx *c, const void *host, size_t bytes) {
    if (c->mode != PASS_NOW)
        return arena_upload(c, host, bytes);
    if (c->ring_stale) { /* a graph's data lay in the ring's memory: wait for it */
        if (check(c, cudaStreamSynchronize(c->stream), "synchronize") != LLMEM_OK)
            return NULL;
        c->arena_queued = 0;
        memset(c->small_size, 0, sizeof(c->small_size));
        c->ring_stale = 0;
    }
    if (bytes > c->small_bytes) {
        LLMEM_ERROR("cuda backend: %zu bytes of per-call data (at most %zu)", bytes,
                    c->small_bytes);
        fail(c, LLMEM_EINVAL, "per-call data", NULL);
        return NULL;
    }
    /* The same bytes as one of the last few uploads (every layer's positions and block table):
     * its device copy again. A device slot is only rewritten by a copy queued after every kernel
     * already queued, so a kernel queued now still reads these bytes. */
    for (int i = 1; i <= SMALL_REUSE; i++) {
        const int slot = (c->small_next + SMALL_SLOTS - i) % SMALL_SLOTS;
        if (c->small_size[slot] == bytes &&
            memcmp((uint8_t *)c->small_host + (size_t)slot * c->small_bytes, host, bytes) == 0)
            return (uint8_t *)c->small + (size_t)slot * c->small_bytes;
    }
    const int prev = (c->small_next + SMALL_SLOTS - 1) % SMALL_SLOTS, slot = c->small_next;
    c->small_next = (slot + 1) % SMALL_SLOTS;
    if (check(c, cudaEventRecord(c->small_done[prev], c->stream), "event") != LLMEM_OK ||
        check(c, cudaEventSynchronize(c->small_done[slot]), "event") != LLMEM_OK)
        return NULL;
    uint8_t *h = (uint8_t *)c->small_host + (size_t)slot * c->small_bytes;
    uint8_t *d = (uint8_t *)c->small + (size_t)slot * c->small_bytes;
    memcpy(h, host, bytes);
    c->small_size[slot] = bytes;
    c->idle = 0;
    c->ring_live = 1;
    if (check(c, cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, c->stream), "upload") !=
        LLMEM_OK)
        return NULL;
    return d;
}

/* ---- graphs ----------------------------------------------------------------------------------
 */

/* A pass's per-call data, staged from the start of the ring's memory (free then: graph_begin
 * waited for the stream), at offsets that depend only on the sizes and order of the uploads and on
 * which of them repeat one of the last few; graph_end copies it to the device in one piece. */
static const void *arena_upload(struct cuda_ctx *c, const void *host, size_t bytes) {
    uint8_t *h = (uint8_t *)c->small_host, *d = (uint8_t *)c->small;
    for (int i = 0; i < c->arena_n && i < SMALL_REUSE; i++)
        if (c->arena_size[i] == bytes && memcmp(h + c->arena_off[i], host, bytes) == 0)
            return d + c->arena_off[i];
    const size_t off = (c->arena_used + 15) & ~(size_t)15;
    if (off + bytes > c->small_bytes * SMALL_SLOTS) {
        c->pass_bad = 1;
        return NULL;
    }
    memcpy(h + off, host, bytes);
    c->arena_off[c->arena_n % SMALL_REUSE] = off;
    c->arena_size[c->arena_n % SMALL_REUSE] = bytes;
    c->arena_n++;
    c->arena_used = off + bytes;
    return d + off;
}

/* Called by every operation before it launches anything: its arguments extend the pass's hash.
 * 1: do not launch (the pass is staged for a recorded graph). */
int staged(struct cuda_ctx *c, int op, std::initializer_list<uint64_t> args) {
    c->idle = 0;            /* (every operation stages before it queues anything) */
    if (op != OP_KV_ENCODE) /* which may take it */
        rope_flush(c);
    if (op != OP_MATMUL && op != OP_GEMV_SET && op != OP_MATMUL_W && op != OP_MATMUL_MULTI &&
        op != OP_GEMV_SWIGLU)
        c->shadow_x = NULL; /* only the GEMMs read a shadow; any other operation may write */
    if (c->pass == NULL)
        return 0;
    uint64_t v[24];
    size_t n = 0;
    LLMEM_ASSERT(args.size() < sizeof(v) / sizeof(v[0]));
    v[n++] = (uint64_t)op;
    for (uint64_t a : args)
        v[n++] = a;
    c->sig = llmem_hash64(v, n * sizeof(uint64_t), c->sig);
    return c->mode == PASS_STAGE;
}

void graph_drop(struct graph *g) {
    if (g->exec != NULL)
        cudaGraphExecDestroy(g->exec);
    g->exec = NULL;
}

/* Adds the oldest `n` timed replays' device time to the counters (waiting for them). */
void replay_time(struct cuda_ctx *c, int n) {
    for (; n > 0 && c->replay_pending > 0; n--) {
        cudaEvent_t *e = &c->replay[2 * c->replay_first];
        float ms = 0;
        if (cudaEventSynchronize(e[1]) == cudaSuccess &&
            cudaEventElapsedTime(&ms, e[0], e[1]) == cudaSuccess)
            c->counters.graphs_device_s += ms * 1e-3;
        (void)cudaGetLastError();
        c->replay_first = (c->replay_first + 1) % REPLAY_TIMES;
        c->replay_pending--;
    }
}

/* How graph_begin would run a pass of key g (NULL: a new key): LLMEM_GRAPH_RUN, _RECORD or
 * _REPLAY. */
static int mode_of(const struct cuda_ctx *c, const struct graph *g) {
    if (!c->graphs_on || c->failed || g == NULL || g->state == GRAPH_OFF)
        return LLMEM_GRAPH_RUN;
    if (g->state == GRAPH_READY)
        return LLMEM_GRAPH_REPLAY;
    return g->exec == NULL && g->sig != 0 ? LLMEM_GRAPH_RECORD : LLMEM_GRAPH_RUN;
}

static struct graph *graph_of(struct cuda_ctx *c, uint64_t key) {
    for (int i = 0; i < GRAPHS; i++)
        if (c->graphs[i].used != 0 && c->graphs[i].key == key)
            return &c->graphs[i];
    return NULL;
}

int cuda_graph_want(void *ctx, uint64_t key) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    return mode_of(c, graph_of(c, key));
}

int cuda_graph_begin(void *ctx, uint64_t key, int most) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    rope_flush(c);
    LLMEM_ASSERT(c->pass == NULL && c->held == NULL);
    c->shadow_x = NULL;
    if (!c->graphs_on || c->failed)
        return c->failed;
    /* exactly the way asked where it is less than the graph's (a split's ranks all run a pass
     * the same way): as usual, its recording kept; or recorded afresh in place of a recording
     * the other ranks lack */
    struct graph *g = graph_of(c, key);
    const int want = mode_of(c, g);
    if (g != NULL && want > most && most == LLMEM_GRAPH_RUN) {
        g->used = ++c->passes;
        return LLMEM_OK;
    }
    if (g != NULL && want > most) { /* (most LLMEM_GRAPH_RECORD: g is ready) */
        graph_drop(g);
        g->state = GRAPH_SEEN; /* its sig kept: recorded below */
    }
    if (g == NULL) { /* a new pass: run as usual this time */
        struct graph *lru = &c->graphs[0];
        for (int i = 1; i < GRAPHS; i++)
            if (c->graphs[i].used < lru->used)
                lru = &c->graphs[i];
        graph_drop(lru);
        memset(lru, 0, sizeof(*lru));
        lru->key = key;
        lru->state = GRAPH_SEEN;
        g = lru;
    }
    g->used = ++c->passes;
    if (g->state == GRAPH_OFF)
        return LLMEM_OK;
    c->pass = g;
    c->sig = key;
    c->pass_bad = c->pass_once = 0;
    c->arena_used = 0;
    c->arena_n = 0;
    c->mode = PASS_NOW;
    if (g->state == GRAPH_READY || (g->exec == NULL && g->sig != 0)) {
        /* the ring's pinned memory takes this pass's data: no copy queued may still read it.
         * When only a pass's data was copied from it since the stream last synchronized, that
         * copy is waited for, not the pass (its copy for this pass is queued after the pass). */
        if (!c->idle && c->arena_queued && !c->ring_live) {
            if (check(c, cudaEventSynchronize(c->arena_done), "synchronize") != LLMEM_OK)
                return c->failed;
        } else if (!c->idle) {
            if (check(c, cudaStreamSynchronize(c->stream), "synchronize") != LLMEM_OK)
                return c->failed;
            c->ring_live = c->arena_queued = 0;
        }
        c->ring_stale = 1;
        c->mode = g->state == GRAPH_READY ? PASS_STAGE : PASS_CAPTURE;
    }
    if (c->mode == PASS_CAPTURE &&
        cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed) != cudaSuccess) {
        (void)cudaGetLastError();
        g->state = GRAPH_OFF;
        c->mode = PASS_NOW;
    }
    return LLMEM_OK;
}

int cuda_graph_end(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    rope_flush(c);
    c->shadow_x = NULL;
    struct graph *g = c->pass;
    if (g == NULL)
        return c->failed;
    const enum pass_mode mode = c->mode;
    c->pass = NULL;
    c->mode = PASS_NOW;
    /* what the kernels were given as scratch */
    const uint64_t v[3] = {c->sig, arg(c->scratch), arg(c->lt_ws)};
    const uint64_t sig = llmem_hash64(v, sizeof(v), 0) | 1;
    if (mode == PASS_NOW) { /* ran as usual: the next pass of this key is recorded */
        g->sig = sig;
        return c->failed;
    }
    if (mode == PASS_CAPTURE) {
        cudaGraph_t graph = NULL;
        cudaError_t err = cudaStreamEndCapture(c->stream, &graph);
        if (err == cudaSuccess && !c->pass_bad)
            err = cudaGraphInstantiate(&g->exec, graph, 0);
        if (graph != NULL)
            cudaGraphDestroy(graph);
        if (err != cudaSuccess || c->pass_bad || c->failed) { /* nothing ran: again, */
            (void)cudaGetLastError();
            g->exec = NULL;
            g->sig = 0; /* as usual (which sizes the scratch it lacked), then recorded */
            g->state = err != cudaSuccess || ++g->misses >= GRAPH_MISSES ? GRAPH_OFF : GRAPH_SEEN;
            return c->failed ? c->failed : LLMEM_EBUSY;
        }
        g->sig = sig;
        g->state = GRAPH_READY;
        c->counters.graphs_recorded++;
    } else if (c->pass_bad || sig != g->sig) { /* nothing ran: again, as usual, then recorded */
        c->counters.graphs_missed++;
        graph_drop(g);
        g->sig = 0;
        g->state = ++g->misses >= GRAPH_MISSES ? GRAPH_OFF : GRAPH_SEEN;
        return LLMEM_EBUSY;
    }
    if (c->failed) /* (a replay staged after a failure: nothing to launch) */
        return c->failed;
    c->held = g;
    c->held_mode = mode;
    return LLMEM_OK;
}

int cuda_graph_launch(void *ctx, int go) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    struct graph *g = c->held;
    if (g == NULL)
        return c->failed;
    const enum pass_mode mode = c->held_mode;
    c->held = NULL;
    if (!go) { /* nothing of the pass ran; a new recording is not kept (a split's ranks keep
                * only the recordings they made together and launched) */
        if (mode == PASS_CAPTURE || c->pass_once) {
            graph_drop(g);
            g->state = GRAPH_SEEN;
        }
        return c->failed;
    }
    c->idle = 0;
    if (c->arena_used > 0 &&
        check(c,
              cudaMemcpyAsync(c->small, c->small_host, c->arena_used, cudaMemcpyHostToDevice,
                              c->stream),
              "upload") == LLMEM_OK &&
        check(c, cudaEventRecord(c->arena_done, c->stream), "event") == LLMEM_OK)
        c->arena_queued = 1;
    if (mode == PASS_STAGE && c->replay_pending == REPLAY_TIMES)
        replay_time(c, 1); /* its pair is needed again */
    cudaEvent_t *e = &c->replay[2 * ((c->replay_first + c->replay_pending) % REPLAY_TIMES)];
    const int timed = mode == PASS_STAGE && cudaEventRecord(e[0], c->stream) == cudaSuccess;
    check(c, cudaGraphLaunch(g->exec, c->stream), "cudaGraphLaunch");
    if (timed && cudaEventRecord(e[1], c->stream) == cudaSuccess)
        c->replay_pending++;
    if (mode == PASS_STAGE) {
        c->counters.graphs_replayed++;
        g->misses = 0; /* only misses in a row give a key up */
    }
    if (c->pass_once) { /* it held a copy of this pass's own */
        graph_drop(g);
        g->state = GRAPH_SEEN;
    }
    return c->failed;
}

void graph_drop_all(struct cuda_ctx *c) {
    for (int i = 0; i < GRAPHS; i++) {
        graph_drop(&c->graphs[i]);
        memset(&c->graphs[i], 0, sizeof(c->graphs[i]));
    }
}

} // namespace llmem_cuda

/*
 * bench/llmem-bench/bw.c — a CUDA device's bandwidth, measured in the run that reports against
 * it: a device-to-device copy through the backend, bytes read + written (SPEC §8). (The host's
 * probe is cli/bandwidth.c.)
 */
#include <stdint.h>
#include <stdlib.h>

#include "bench.h"
#include "cli/common.h"
#include "core/clock.h"

#include "backend/ops.h"
#include "llmem/mem.h"

struct bench_device_probe {
    struct llmem_mem *mem;
    struct llmem_backend *be;
    uint8_t *a, *b;
    int64_t bytes;
};

void bench_device_probe_close(struct bench_device_probe *p) {
    if (p == NULL)
        return;
    if (p->mem != NULL) {
        llmem_mem_free(p->mem, p->a);
        llmem_mem_free(p->mem, p->b);
    }
    llmem_backend_destroy(p->be);
    llmem_mem_destroy(p->mem);
    free(p);
}

int bench_device_probe_open(int device, int64_t bytes, struct bench_device_probe **out) {
    struct llmem_mem_config mc = {.ops = llmem_backend_cuda_memory(device)};
    struct bench_device_probe *p = calloc(1, sizeof(*p));
    *out = NULL;
    if (p == NULL)
        return CLI_FAIL;
    p->bytes = bytes;
    if (mc.ops == NULL || llmem_mem_create(&mc, &p->mem) != LLMEM_OK ||
        llmem_backend_cuda_create(device, LLMEM_PRECISION_FAST, NULL, &p->be) != LLMEM_OK ||
        (p->a = llmem_mem_alloc(p->mem, (size_t)bytes, LLMEM_TAG_SCRATCH)) == NULL ||
        (p->b = llmem_mem_alloc(p->mem, (size_t)bytes, LLMEM_TAG_SCRATCH)) == NULL) {
        bench_device_probe_close(p);
        return CLI_FAIL;
    }
    *out = p;
    return CLI_OK;
}

int bench_device_probe_run(struct bench_device_probe *p, double *copy_gbps) {
    const int passes = 10;
    double best = 0;
    for (int i = 0; i <= passes; i++) { /* the first is a warm-up */
        double t0 = llmem_clock_s();
        if (p->be->ops->copy(p->be->ctx, p->b, p->a, (size_t)p->bytes) != LLMEM_OK)
            return CLI_FAIL;
        double s = llmem_clock_s() - t0;
        double gbps = 2.0 * (double)p->bytes / s * 1e-9;
        if (i > 0 && gbps > best)
            best = gbps;
    }
    *copy_gbps = best;
    return CLI_OK;
}

int bench_device_copy_bandwidth(int device, int64_t bytes, double *copy_gbps) {
    struct bench_device_probe *p = NULL;
    int rc = bench_device_probe_open(device, bytes, &p);
    if (rc == CLI_OK)
        rc = bench_device_probe_run(p, copy_gbps);
    bench_device_probe_close(p);
    return rc;
}

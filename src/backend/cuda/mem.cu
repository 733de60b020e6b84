/*
 * backend/cuda/mem.cu — the raw memory kinds of the CUDA backend for the caching allocator
 * (mem/mem.c): device memory by cudaMalloc on one GPU, and page-locked host memory for
 * transfers. The allocator does the caching, limits and accounting; these only ask the runtime.
 */
#include "backend/cuda/backend.h"

#include <cuda_runtime.h>

#include "backend/cuda/device.h"
#include "core/log.h"

#define MAX_DEVICES 64

/* Runs the allocation on `device`, then puts the caller's current device back. */
static void *device_alloc(void *ctx, size_t bytes, int large) {
    (void)large;
    int device = (int)(intptr_t)ctx, previous = -1;
    cudaGetDevice(&previous);
    if (previous != device && cudaSetDevice(device) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        (void)cudaGetLastError(); /* out of device memory: the allocator reports it */
        p = NULL;
    }
    if (previous >= 0 && previous != device)
        cudaSetDevice(previous);
    return p;
}

static void device_free(void *ctx, void *ptr, size_t bytes, int large) {
    (void)ctx, (void)bytes, (void)large;
    cudaError_t err = cudaFree(ptr); /* any device: the pointer says which */
    if (err != cudaSuccess) {
        LLMEM_WARN("cudaFree: %s", cudaGetErrorString(err));
        (void)cudaGetLastError();
    }
}

static void *pinned_alloc(void *ctx, size_t bytes, int large) {
    (void)ctx, (void)large;
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void pinned_free(void *ctx, void *ptr, size_t bytes, int large) {
    (void)ctx, (void)bytes, (void)large;
    if (cudaFreeHost(ptr) != cudaSuccess)
        (void)cudaGetLastError();
}

static struct llmem_mem_raw_ops device_ops[MAX_DEVICES];
static int device_ops_ready[MAX_DEVICES];

extern "C" const struct llmem_mem_raw_ops *llmem_cuda_mem_ops(int device) {
    if (device < 0 || device >= MAX_DEVICES || device >= llmem_cuda_device_count())
        return NULL;
    if (!__atomic_load_n(&device_ops_ready[device], __ATOMIC_ACQUIRE)) {
        /* every thread writes the same values: a race here is harmless */
        struct llmem_mem_raw_ops o = {};
        o.name = "cuda";
        o.alloc = device_alloc;
        o.free = device_free;
        o.ctx = (void *)(intptr_t)device;
        o.large_min = (size_t)2 << 20; /* cudaMalloc rounds to 2 MiB pages */
        device_ops[device] = o;
        __atomic_store_n(&device_ops_ready[device], 1, __ATOMIC_RELEASE);
    }
    return &device_ops[device];
}

extern "C" const struct llmem_mem_raw_ops *llmem_cuda_pinned_ops(void) {
    static const struct llmem_mem_raw_ops ops = {
        "pinned", pinned_alloc, pinned_free, NULL, NULL, NULL, 0,
    };
    return &ops;
}

/*
 * tests/test-cuda-comm.c — the collectives of a model split over GPUs (backend/cuda/comm.h): a
 * group of one device (the identity), and of every device the machine has (each rank's values
 * the sum of all ranks', exactly: small integers in f32, bf16 and f16); bad groups refused by
 * name. Skips without a GPU; the groups of several devices need a machine with several (and an
 * NCCL build).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/comm.h"
#include "llmem/backend.h"
#include "llmem/status.h"
#include "testutil.h"

#define CU(call) assert_int_equal((int)(call), (int)cudaSuccess)
#define COUNT    4099 /* (not a multiple of any vector width) */

/* bits of v (a small integer) as a value of dt */
static void put(enum llmem_dtype dt, void *p, int64_t i, float v) {
    if (dt == LLMEM_DTYPE_F32) {
        ((float *)p)[i] = v;
        return;
    }
    uint32_t u;
    memcpy(&u, &v, 4);
    uint16_t h;
    if (dt == LLMEM_DTYPE_BF16) {
        h = (uint16_t)(u >> 16); /* exact: small integers */
    } else {                     /* f16 of a small non-negative integer */
        const int e = (int)((u >> 23) & 0xff) - 127;
        h = v == 0.0f ? 0 : (uint16_t)(((e + 15) << 10) | ((u >> 13) & 0x3ff));
    }
    ((uint16_t *)p)[i] = h;
}

static float get(enum llmem_dtype dt, const void *p, int64_t i) {
    if (dt == LLMEM_DTYPE_F32)
        return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    uint32_t u;
    if (dt == LLMEM_DTYPE_BF16) {
        u = (uint32_t)h << 16;
    } else {
        const int e = (h >> 10) & 0x1f;
        u = h == 0 ? 0 : ((uint32_t)(e - 15 + 127) << 23) | ((uint32_t)(h & 0x3ff) << 13);
    }
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* A group over devices 0 … n − 1: rank r holds (r + 1) · (i mod 7) at i; after the sum every
 * rank holds Σ_r (r + 1) · (i mod 7). */
static void check_group(int n, enum llmem_dtype dt) {
    int devices[8];
    for (int r = 0; r < n; r++)
        devices[r] = r;
    struct llmem_cuda_comm *c = NULL;
    assert_int_equal(llmem_cuda_comm_create(n, devices, &c), LLMEM_OK);
    assert_int_equal(llmem_cuda_comm_size(c), n);
    const size_t es = dt == LLMEM_DTYPE_F32 ? 4 : 2, bytes = COUNT * es;
    void *host = malloc(bytes), *buf[8];
    cudaStream_t streams[8];
    assert_non_null(host);
    for (int r = 0; r < n; r++) {
        for (int64_t i = 0; i < COUNT; i++)
            put(dt, host, i, (float)((r + 1) * (i % 7)));
        CU(cudaSetDevice(r));
        CU(cudaMalloc(&buf[r], bytes));
        CU(cudaMemcpy(buf[r], host, bytes, cudaMemcpyHostToDevice));
        CU(cudaStreamCreate(&streams[r]));
    }
    assert_int_equal(llmem_cuda_comm_allreduce(c, buf, COUNT, dt, streams), LLMEM_OK);
    const float ranks = (float)(n * (n + 1) / 2);
    for (int r = 0; r < n; r++) {
        CU(cudaSetDevice(r));
        CU(cudaStreamSynchronize(streams[r]));
        CU(cudaMemcpy(host, buf[r], bytes, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < COUNT; i++)
            if (get(dt, host, i) != ranks * (float)(i % 7))
                fail_msg("%d ranks, %s: rank %d holds %g at %lld, not %g", n, llmem_dtype_name(dt),
                         r, (double)get(dt, host, i), (long long)i,
                         (double)(ranks * (float)(i % 7)));
        CU(cudaStreamDestroy(streams[r]));
        CU(cudaFree(buf[r]));
    }
    CU(cudaSetDevice(0));
    free(host);
    llmem_cuda_comm_free(c);
}

static void test_one_device(void **state) {
    (void)state;
    check_group(1, LLMEM_DTYPE_F32);
    check_group(1, LLMEM_DTYPE_BF16);
}

static void test_every_device(void **state) {
    (void)state;
    int n = 0;
    llmem_backend_device_count(&n);
    n = n > 8 ? 8 : n;
    if (n < 2 || !llmem_cuda_comm_nccl()) {
        printf("  %d device(s)%s: the groups of several are not run\n", n,
               llmem_cuda_comm_nccl() ? "" : ", no NCCL");
        skip();
    }
    for (int k = 2; k <= n; k *= 2) {
        check_group(k, LLMEM_DTYPE_F32);
        check_group(k, LLMEM_DTYPE_BF16);
        check_group(k, LLMEM_DTYPE_F16);
        printf("  %d ranks: f32, bf16 and f16 sums exact\n", k);
    }
}

static void test_refused(void **state) {
    (void)state;
    int n = 0;
    llmem_backend_device_count(&n);
    struct llmem_cuda_comm *c = NULL;
    const int absent[1] = {n}, twice[2] = {0, 0};
    tu_expect_failure(llmem_cuda_comm_create(1, absent, &c), LLMEM_EINVAL, "no CUDA device");
    tu_expect_failure(llmem_cuda_comm_create(2, twice, &c), LLMEM_EINVAL, "named twice");
    tu_expect_failure(llmem_cuda_comm_create(0, twice, &c), LLMEM_EINVAL, "a group of 0 devices");
    assert_null(c);
    int one[1] = {0};
    assert_int_equal(llmem_cuda_comm_create(1, one, &c), LLMEM_OK);
    void *buf[1] = {NULL};
    cudaStream_t s[1] = {0};
    tu_expect_failure(llmem_cuda_comm_allreduce(c, buf, 8, LLMEM_DTYPE_I8, s), LLMEM_EINVAL,
                      "an all-reduce of");
    llmem_cuda_comm_free(c);
}

int main(void) {
    if (tu_no_gpu())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_device),
        cmocka_unit_test(test_every_device),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests_name("cuda collectives", tests, NULL, NULL);
}

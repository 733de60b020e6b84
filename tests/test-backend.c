/*
 * tests/test-backend.c — the backend registry and CUDA device discovery. The registry checks run
 * everywhere; the device checks (the group "cuda", ctest test-backend:cuda) need a CUDA build and
 * a GPU, and skip without them.
 */
#include <stdio.h>
#include <string.h>

#include "testutil.h"

#include "llmem/backend.h"
#include "llmem/status.h"
#include "llmem/sys.h"

static void test_registry(void **state) {
    (void)state;
    int n = -1;
    assert_int_equal(llmem_backend_device_count(&n), LLMEM_OK);
    assert_true(n >= 0);
    if (!llmem_backend_cuda_available())
        assert_int_equal(n, 0);
    struct llmem_device_info info;
    assert_int_equal(llmem_backend_device_info(n, &info), LLMEM_EINVAL);
    assert_int_equal(llmem_backend_device_info(-1, &info), LLMEM_EINVAL);
    assert_non_null(strstr(llmem_last_error(), "no device"));
    /* the device's scratch as the plan counts it: x rounded to 16 bits, and beside it a 64 MiB
     * slice of quantized weights dequantized to f16; at f32 precision one 64 MiB slice */
    const int64_t slice = (int64_t)64 << 20;
    assert_int_equal(llmem_backend_cuda_scratch_bytes(LLMEM_PRECISION_FAST, 512, 4096, 0),
                     512 * 4096 * 2);
    assert_int_equal(llmem_backend_cuda_scratch_bytes(LLMEM_PRECISION_FAST, 512, 4096, 1),
                     512 * 4096 * 2 + slice);
    assert_int_equal(llmem_backend_cuda_scratch_bytes(LLMEM_PRECISION_F32, 512, 4096, 1), slice);
}

static void test_devices(void **state) {
    (void)state;
    int n = 0;
    assert_int_equal(llmem_backend_device_count(&n), LLMEM_OK);
    for (int i = 0; i < n; i++) {
        struct llmem_device_info info;
        assert_int_equal(llmem_backend_device_info(i, &info), LLMEM_OK);
        assert_int_equal(info.kind, LLMEM_DEVICE_CUDA);
        assert_int_equal(info.index, i);
        assert_true(info.name[0] != '\0');
        assert_true(strncmp(info.arch, "sm_", 3) == 0 && strlen(info.arch) >= 5);
        assert_true(info.memory_size > 0);
        assert_int_equal(info.max_recommended_working_set_size, info.memory_size);
        assert_int_equal(info.max_buffer_length, info.memory_size);
        assert_int_equal(info.ceiling_source, LLMEM_CEILING_DEVICE);
        assert_true(info.available > 0 && info.available <= info.memory_size);
        printf("cuda %d: %s %s, %lld bytes, %lld free\n", i, info.name, info.arch,
               (long long)info.memory_size, (long long)info.available);
    }
}

int main(int argc, char **argv) {
    const struct CMUnitTest registry[] = {cmocka_unit_test(test_registry)};
    const struct CMUnitTest devices[] = {cmocka_unit_test(test_devices)};
    const struct tu_group groups[] = {
        TU_GROUP("registry", registry, NULL),
        TU_GROUP("cuda", devices, tu_gpu_unavailable),
    };
    return tu_main(argc, argv, groups, sizeof(groups) / sizeof(groups[0]));
}

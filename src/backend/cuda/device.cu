/*
 * backend/cuda/device.cu — CUDA device discovery through the runtime API: count, name, compute
 * capability, total and free memory. A missing driver or GPU is a normal outcome (zero devices),
 * logged at INFO; the count is computed once per process.
 */
#include "backend/cuda/device.h"

#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "core/log.h"

static int query_device_count(void) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        LLMEM_INFO("no CUDA devices: %s (%s)", cudaGetErrorString(err), cudaGetErrorName(err));
        (void)cudaGetLastError(); /* reset the runtime's last error */
        return 0;
    }
    if (n == 0)
        LLMEM_INFO("no CUDA devices");
    return n;
}

extern "C" int llmem_cuda_device_count(void) {
    static const int n = query_device_count(); /* initialized once, thread-safe */
    return n;
}

extern "C" int llmem_cuda_device_info(int index, struct llmem_device_info *info) {
    llmem_sys_device_info_init(info, LLMEM_DEVICE_CUDA, index);
    cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, index);
    if (err != cudaSuccess) {
        LLMEM_ERROR("cudaGetDeviceProperties(%d): %s", index, cudaGetErrorString(err));
        return LLMEM_EIO;
    }
    size_t name_len = strnlen(prop.name, sizeof(info->name) - 1);
    memcpy(info->name, prop.name, name_len);
    info->name[name_len] = '\0';
    snprintf(info->arch, sizeof(info->arch), "sm_%d%d", prop.major, prop.minor);

    /* cudaMemGetInfo reports for the current device: switch, ask, switch back. */
    int previous = -1;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaGetDevice(&previous) != cudaSuccess)
        previous = -1;
    err = cudaSetDevice(index);
    if (err == cudaSuccess)
        err = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (previous >= 0 && previous != index)
        cudaSetDevice(previous);

    int64_t total = (int64_t)prop.totalGlobalMem;
    if (err == cudaSuccess) {
        total = (int64_t)total_bytes;
        info->available = (int64_t)free_bytes;
    } else {
        LLMEM_WARN("cudaMemGetInfo(%d): %s; free memory is unknown", index,
                   cudaGetErrorString(err));
        (void)cudaGetLastError();
    }
    info->memory_size = total;
    info->max_recommended_working_set_size = total;
    info->ceiling_source = LLMEM_CEILING_DEVICE;
    info->max_buffer_length = total;
    int clock_khz = 0;
    if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, index) == cudaSuccess &&
        clock_khz > 0 && prop.memoryBusWidth > 0) /* double data rate: two transfers a clock */
        info->memory_bandwidth = 2 * (int64_t)clock_khz * 1000 * (prop.memoryBusWidth / 8);
    else
        (void)cudaGetLastError();
    return LLMEM_OK;
}

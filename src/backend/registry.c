/*
 * backend/registry.c — which backends this build has, and their devices. The only file that
 * knows whether CUDA is built in (CMake defines LLMEM_CUDA for it alone), so everything else
 * compiles the same with and without CUDA.
 */
#include "llmem/backend.h"

#include "core/log.h"

#ifdef LLMEM_CUDA
#include "backend/cuda/device.h"
#endif

int llmem_backend_cuda_available(void) {
#ifdef LLMEM_CUDA
    return 1;
#else
    return 0;
#endif
}

int llmem_backend_device_count(int *n) {
    LLMEM_ASSERT(n != NULL);
#ifdef LLMEM_CUDA
    *n = llmem_cuda_device_count();
#else
    *n = 0;
#endif
    return LLMEM_OK;
}

int llmem_backend_device_info(int index, struct llmem_device_info *info) {
    LLMEM_ASSERT(info != NULL);
    int n = 0;
    llmem_backend_device_count(&n);
    if (index < 0 || index >= n) {
        LLMEM_ERROR("no device %d (%d device%s present)", index, n, n == 1 ? "" : "s");
        return LLMEM_EINVAL;
    }
#ifdef LLMEM_CUDA
    return llmem_cuda_device_info(index, info);
#else
    return LLMEM_EUNSUPPORTED; /* unreachable: n is 0 */
#endif
}

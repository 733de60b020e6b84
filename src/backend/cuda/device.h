/*
 * backend/cuda/device.h — CUDA device discovery, callable from C (implemented in device.cu).
 * Only backend/registry.c includes this, and only in a CUDA build.
 */
#ifndef LLMEM_BACKEND_CUDA_DEVICE_H
#define LLMEM_BACKEND_CUDA_DEVICE_H

#include "llmem/sys.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Devices the CUDA runtime sees; 0 (logged at INFO with the reason) without a driver or GPU. */
int llmem_cuda_device_count(void);

/* See llmem_backend_device_info. */
int llmem_cuda_device_info(int index, struct llmem_device_info *info);

#ifdef __cplusplus
}
#endif

#endif

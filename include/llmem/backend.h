/*
 * llmem/backend.h — the backends built into this library and the devices they see.
 *
 * The host (CPU backend) is always present and described by llmem_sys_probe_host (llmem/sys.h).
 * Accelerator devices — CUDA GPUs in a build with the CUDA backend — are listed here, numbered
 * 0 … n−1 in the order of the CUDA runtime. No GPU, no driver or a build without CUDA simply
 * means zero devices: that is not an error.
 */
#ifndef LLMEM_BACKEND_H
#define LLMEM_BACKEND_H

#include "llmem/sys.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this library was built with the CUDA backend, else 0. */
int llmem_backend_cuda_available(void);

/* The number of usable accelerator devices into *n (0 without CUDA, without a driver or without
 * a GPU; why is logged at INFO). Returns LLMEM_OK. */
int llmem_backend_device_count(int *n);

/* Fills *info for device `index` (kind LLMEM_DEVICE_CUDA): name, arch "sm_<major><minor>",
 * memory_size = max_recommended_working_set_size = max_buffer_length = total device memory,
 * available = free device memory (cudaMemGetInfo; creates the device's context). Host-only
 * fields stay unknown. LLMEM_EINVAL (logged) for an index out of range, LLMEM_EIO (logged) when
 * the runtime fails. */
int llmem_backend_device_info(int index, struct llmem_device_info *info);

#ifdef __cplusplus
}
#endif

#endif

/*
 * llmem/backend.h — the backends built into this library and the devices they see.
 *
 * The host (CPU backend) is always present and described by llmem_sys_probe_host (llmem/sys.h).
 * Accelerator devices — CUDA GPUs in a build with the CUDA backend — are listed here, numbered
 * 0 … n−1 in the order of the CUDA runtime. No GPU, no driver or a build without CUDA simply
 * means zero devices: that is not an error.
 *
 * A backend instance (`struct llmem_backend`, opaque here) runs the operations of a forward pass
 * (llmem/forward.h) on the host or on one GPU; its table of operations is internal.
 */
#ifndef LLMEM_BACKEND_H
#define LLMEM_BACKEND_H

#include <stdint.h>

#include "llmem/api.h"
#include "llmem/mem.h"
#include "llmem/pool.h"
#include "llmem/sys.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which backend runs the forward pass. */
enum llmem_backend_kind {
    LLMEM_BACKEND_CPU = 0,
    LLMEM_BACKEND_CUDA,
};

/* "cpu" / "cuda" → *kind; LLMEM_EINVAL (logged) otherwise. */
LLMEM_API int llmem_backend_kind_parse(const char *name, enum llmem_backend_kind *kind);

/* How a backend multiplies: f32 computes in f32 throughout (the reference); fast lets the GEMMs
 * of prefill and large batches run on bf16 tensor cores with f32 accumulation (the activations
 * rounded to the weights' 16-bit type). On the CPU, fast multiplies quantized weights (GGUF
 * blocks) by integer dot products with the activations quantized to 8 bits per block, and bf16
 * weights by VDPBF16PS with the activations rounded to bf16 where the CPU has AVX512-BF16 (the
 * down projections, routers and LM head excepted: llmem_weight.f32_x); f32 dequantizes and widens
 * weights exactly and multiplies in f32; f16 and f32 weights are f32 either way. */
enum llmem_backend_precision {
    LLMEM_PRECISION_FAST = 0,
    LLMEM_PRECISION_F32,
};

/* The most scratch the CUDA backend takes for passes of up to max_tokens rows whose widest matrix
 * has max_cols columns: the activations rounded to 16 bits (fast), or a slice of weights widened
 * to f32 (f32); with quantized weights at fast precision, a slice of them dequantized to f16 as
 * well. */
LLMEM_API int64_t llmem_backend_cuda_scratch_bytes(enum llmem_backend_precision precision,
                                                   int64_t max_tokens, int64_t max_cols,
                                                   int quantized);

/* "fast" / "f32" → *precision; LLMEM_EINVAL (logged) otherwise. */
LLMEM_API int llmem_backend_precision_parse(const char *name,
                                            enum llmem_backend_precision *precision);
LLMEM_API const char *llmem_backend_precision_name(enum llmem_backend_precision precision);

/* 1 when this library was built with the CUDA backend, else 0. */
LLMEM_API int llmem_backend_cuda_available(void);
/* 1 when it was built with NCCL too: a model splits over several CUDA devices
 * (--tensor-parallel), else 0. */
LLMEM_API int llmem_backend_nccl_available(void);

/* The number of usable accelerator devices into *n (0 without CUDA, without a driver or without
 * a GPU; why is logged at INFO). Returns LLMEM_OK. */
LLMEM_API int llmem_backend_device_count(int *n);

/* Fills *info for device `index` (kind LLMEM_DEVICE_CUDA): name, arch "sm_<major><minor>",
 * memory_size = max_recommended_working_set_size = max_buffer_length = total device memory,
 * available = free device memory (cudaMemGetInfo; creates the device's context). Host-only
 * fields stay unknown. LLMEM_EINVAL (logged) for an index out of range, LLMEM_EIO (logged) when
 * the runtime fails. */
LLMEM_API int llmem_backend_device_info(int index, struct llmem_device_info *info);

/* ---------------------------------------------------------------------------------------------
 * Backend instances
 * ------------------------------------------------------------------------------------------- */

struct llmem_backend;

/* The CPU backend with n_threads threads (≤ 0: the online CPUs). LLMEM_ENOMEM / LLMEM_EIO
 * (logged). */
LLMEM_API int llmem_backend_cpu_create(int n_threads, struct llmem_backend **out);
/* The CPU backend on the caller's thread pool (shared with its other kernels, so that no two pools
 * spin against each other; not destroyed with the backend), with its GEMM scratch
 * (llmem_backend_cpu_scratch_bytes) from mem under the tag scratch. */
LLMEM_API int llmem_backend_cpu_create_shared(struct llmem_pool *pool, struct llmem_mem *mem,
                                              struct llmem_backend **out);
/* The precision of a CPU backend's matmuls of quantized and bf16 weights (fast at creation). */
LLMEM_API void llmem_backend_cpu_set_precision(struct llmem_backend *backend,
                                               enum llmem_backend_precision precision);
/* The instruction set of the CPU's integer kernels for quantized weights at fast precision:
 * "avx512_vnni", "avx2" or "scalar" (portable C). */
LLMEM_API const char *llmem_backend_cpu_matmul_kernels(void);
/* The kernels of the CPU's bf16 weights at fast precision: "amx_bf16" (AMX tiles, TDPBF16PS) or
 * "avx512_bf16" (VDPBF16PS) on the activations rounded to bf16, else those of f32 precision:
 * "avx512", "avx2" or "scalar" (f32 FMAs on the weights widened exactly). */
LLMEM_API const char *llmem_backend_cpu_bf16_kernels(void);
/* The fixed scratch of the CPU backend's GEMM on n_threads threads: packed activations and one
 * panel of converted weights per thread. */
LLMEM_API int64_t llmem_backend_cpu_scratch_bytes(int n_threads);
/* The CUDA backend on GPU `device` computing at `precision`, its scratch from mem (an allocator
 * over llmem_backend_cuda_memory(device), tag scratch; NULL: the backend's own). LLMEM_EUNSUPPORTED
 * (logged) in a build without CUDA, LLMEM_EINVAL (logged) for a device that does not exist,
 * LLMEM_EIO / LLMEM_ENOMEM (logged) when the runtime or cuBLAS fails to start. */
LLMEM_API int llmem_backend_cuda_create(int device, enum llmem_backend_precision precision,
                                        struct llmem_mem *mem, struct llmem_backend **out);
/* Device memory of GPU `device` for llmem_mem_create; NULL without CUDA or such a device. */
LLMEM_API const struct llmem_mem_raw_ops *llmem_backend_cuda_memory(int device);
/* Pinned host memory for llmem_mem_create (staging that copies to and from a GPU do not wait
 * for); NULL without CUDA. */
LLMEM_API const struct llmem_mem_raw_ops *llmem_backend_cuda_pinned_memory(void);
/* NULL is a no-op. */
LLMEM_API void llmem_backend_destroy(struct llmem_backend *backend);

#ifdef __cplusplus
}
#endif

#endif

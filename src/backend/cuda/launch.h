/*
 * backend/cuda/launch.h — how this backend launches its kernels: as programmatic dependents of
 * the kernel before them on the stream (Hopper's programmatic dependent launch), so that a
 * kernel's launch and prologue overlap its predecessor's tail instead of following its end; in a
 * graph of a decode step's ~200 small kernels that is most of the time between them.
 *
 * The rule every kernel launched this way keeps: pdl_begin() first, before it reads or writes
 * global memory and before any return. pdl_begin lets the next kernel start launching, then waits
 * until the kernel before it has finished and its writes are visible (so, by induction, every
 * earlier kernel). Letting the next kernel launch first costs nothing in order (it waits the same
 * way before it reads anything) and lets its blocks take the SMs' free slots while this one
 * waits and runs: a GEMV's weights (below) are then on their way while the latency-bound kernels
 * before it (norms, RoPE, attention) run, not after they end.
 *
 * The exception: before pdl_begin a kernel may read what no kernel writes, so that those loads
 * are under way while the kernel before it ends: weights (the GEMVs' first loads in gemm.cu
 * gemv_row, the norms' weights, the embedding's rows) and what the host uploaded before the pass
 * (token ids, positions and frequencies, pool slots, block tables and lengths: the embedding,
 * RoPE with the KV write, the decode attention and its merge). The decode attention also starts
 * copying the blocks older than the tokens the KV write before it writes. A GEMV thread with no
 * row, and a decode-attention warp with no work, return without waiting; their kernels still end
 * only after their other threads waited.
 */
#ifndef LLMEM_BACKEND_CUDA_LAUNCH_H
#define LLMEM_BACKEND_CUDA_LAUNCH_H

#include <cuda_runtime.h>
#include <utility>

__device__ __forceinline__ void pdl_begin() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

/* LLMEM_CUDA_PROFILE (ops.cu, one context of the process at a time): the event recorded on the
 * stream before the first launch of an operation; NULL when off. */
extern cudaEvent_t llmem_cuda_profile_start;
extern int llmem_cuda_profile_pending;

/* Spins for `cycles` clocks of the SM. */
static __global__ void profile_lead_kernel(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

/* The start of a timed operation, when profiling and none is pending: a spin of about 50 µs
 * first, so that the operation's launches are queued behind it when the start event is reached
 * and the time measured is the kernels' own, not the host's launching them. */
static inline void profile_begin(cudaStream_t stream) {
    if (llmem_cuda_profile_start == nullptr || llmem_cuda_profile_pending)
        return;
    profile_lead_kernel<<<1, 1, 0, stream>>>(100000);
    cudaEventRecord(llmem_cuda_profile_start, stream);
    llmem_cuda_profile_pending = 1;
}

/* kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch. */
template <typename... Params, typename... Args>
static inline cudaError_t pdl_launch(cudaStream_t stream, void (*kernel)(Params...), dim3 grid,
                                     dim3 block, size_t smem, Args &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    profile_begin(stream);
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

#endif

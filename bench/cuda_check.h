/*
 * bench/cuda_check.h — CHECK(call) for the CUDA benchmark programs: a failed CUDA call prints
 * where and why, and the program exits (a benchmark, not the library).
 */
#ifndef LLMEM_BENCH_CUDA_CHECK_H
#define LLMEM_BENCH_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        cudaError_t err_ = (call);                                                                 \
        if (err_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                          \
                    cudaGetErrorString(err_));                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif

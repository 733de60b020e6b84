/*
 * backend/cuda/blas.h — cuBLAS and cuBLASLt, opened when the first CUDA backend is created
 * (blas.cu). Linked, they would be mapped into every process of a CUDA build at start — cuBLASLt's
 * relocations and static data alone are about 90 MB of anonymous memory and 60 MB of file pages
 * resident — including the CPU runs, whose plan measures its runtime baseline from what the
 * process holds. The backend calls them through llmem_cuda_blas, the table filled from the
 * libraries of the major version the build was compiled against.
 */
#ifndef LLMEM_BACKEND_CUDA_BLAS_H
#define LLMEM_BACKEND_CUDA_BLAS_H

#include <cublasLt.h>
#include <cublas_v2.h>

/* The functions the backend calls, but for cublasGemmEx: X(member, the header's name) —
 * cublas_v2.h's names are macros for the _v2 symbols, which is what blas.cu looks up. */
#define LLMEM_CUDA_BLAS_FUNCTIONS(X)                                                               \
    X(create, cublasCreate)                                                                        \
    X(destroy, cublasDestroy)                                                                      \
    X(set_stream, cublasSetStream)                                                                 \
    X(status_string, cublasGetStatusString)                                                        \
    X(lt_create, cublasLtCreate)                                                                   \
    X(lt_destroy, cublasLtDestroy)                                                                 \
    X(lt_matmul, cublasLtMatmul)                                                                   \
    X(lt_algo_heuristic, cublasLtMatmulAlgoGetHeuristic)                                           \
    X(lt_desc_create, cublasLtMatmulDescCreate)                                                    \
    X(lt_desc_destroy, cublasLtMatmulDescDestroy)                                                  \
    X(lt_desc_set, cublasLtMatmulDescSetAttribute)                                                 \
    X(lt_layout_create, cublasLtMatrixLayoutCreate)                                                \
    X(lt_layout_destroy, cublasLtMatrixLayoutDestroy)                                              \
    X(lt_layout_set, cublasLtMatrixLayoutSetAttribute)                                             \
    X(lt_pref_create, cublasLtMatmulPreferenceCreate)                                              \
    X(lt_pref_destroy, cublasLtMatmulPreferenceDestroy)                                            \
    X(lt_pref_set, cublasLtMatmulPreferenceSetAttribute)

struct llmem_cuda_blas_api {
#define LLMEM_CUDA_BLAS_MEMBER(member, function) decltype(&function) member;
    LLMEM_CUDA_BLAS_FUNCTIONS(LLMEM_CUDA_BLAS_MEMBER)
#undef LLMEM_CUDA_BLAS_MEMBER
    /* cublasGemmEx, the exported one (C++ also sees an inline overload that takes the compute
     * type as a cudaDataType) */
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                              const void *, const void *, cudaDataType, int, const void *,
                              cudaDataType, int, const void *, void *, cudaDataType, int,
                              cublasComputeType_t, cublasGemmAlgo_t);
};

/* Filled by llmem_cuda_blas_load (backend.h) on its first success; read-only after. */
extern struct llmem_cuda_blas_api llmem_cuda_blas;

#endif

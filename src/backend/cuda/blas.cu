/*
 * backend/cuda/blas.cu — opens cuBLAS and cuBLASLt once per process, on the first CUDA backend's
 * creation (blas.h says why not at start), and fills the table of their functions. The libraries
 * stay open for the life of the process.
 */
#include "backend/cuda/blas.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda/backend.h"
#include "core/log.h"
#include "llmem/status.h"

#define BLAS_STR(x)  #x
#define BLAS_XSTR(x) BLAS_STR(x)
/* the sonames of the major version in the headers the build used */
#define BLAS_LIB    "libcublas.so." BLAS_XSTR(CUBLAS_VER_MAJOR)
#define BLAS_LT_LIB "libcublasLt.so." BLAS_XSTR(CUBLAS_VER_MAJOR)

struct llmem_cuda_blas_api llmem_cuda_blas;

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static int blas_status = LLMEM_EIO;
static char blas_error[512]; /* why the load failed, said again on every later call */

static void *open_library(const char *name) {
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL)
        snprintf(blas_error, sizeof(blas_error),
                 "the CUDA backend needs %s (the CUDA toolkit's cuBLAS): %s", name, dlerror());
    return h;
}

static void load(void) {
    void *blas = open_library(BLAS_LIB), *lt = blas != NULL ? open_library(BLAS_LT_LIB) : NULL;
    if (lt == NULL)
        return;
    struct llmem_cuda_blas_api api;
    /* the cuBLASLt functions from its own library, the rest from cuBLAS */
#define BLAS_LOOKUP(member, function)                                                              \
    {                                                                                              \
        const char *name = BLAS_XSTR(function);                                                    \
        void *f = dlsym(strncmp(name, "cublasLt", 8) == 0 ? lt : blas, name);                      \
        if (f == NULL) {                                                                           \
            snprintf(blas_error, sizeof(blas_error), "the CUDA backend: %s lacks %s",              \
                     BLAS_LIB " / " BLAS_LT_LIB, name);                                            \
            return;                                                                                \
        }                                                                                          \
        api.member = (decltype(api.member))f;                                                      \
    }
    LLMEM_CUDA_BLAS_FUNCTIONS(BLAS_LOOKUP)
    BLAS_LOOKUP(gemm_ex, cublasGemmEx)
#undef BLAS_LOOKUP
    llmem_cuda_blas = api;
    blas_status = LLMEM_OK;
}

extern "C" int llmem_cuda_blas_load(void) {
    pthread_once(&blas_once, load);
    if (blas_status != LLMEM_OK)
        LLMEM_ERROR("%s", blas_error);
    return blas_status;
}

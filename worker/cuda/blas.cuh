#pragma once
// cuBLAS, loaded when the first CUDA backend needs it. Linking it costs every
// process that loads libcublasLt about 94 MB of anonymous memory at start
// (its static initialisation), a CPU worker of a CUDA build and the tests
// included; loaded here with dlopen, only a worker that runs on a GPU pays
// it. The types and enums come from cublas_v2.h (a header only); the few
// entry points the backend uses go through this table. Included only by
// worker/cuda/*.cu.

#include <cublas_v2.h>

namespace ds4::cuda::blas {

/// Loads libcublas (its soname for the CUDA major version ds4 was built
/// with) once; throws ds4::Error naming the library when it cannot.
void load();

cublasStatus_t create(cublasHandle_t* handle);
cublasStatus_t destroy(cublasHandle_t handle);
cublasStatus_t set_stream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t set_workspace(cublasHandle_t handle, void* workspace, size_t bytes);
cublasStatus_t gemm_ex(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                       const void* alpha, const void* a, cudaDataType at, int lda, const void* b, cudaDataType bt,
                       int ldb, const void* beta, void* c, cudaDataType ct, int ldc, cublasComputeType_t compute,
                       cublasGemmAlgo_t algo);

}  // namespace ds4::cuda::blas

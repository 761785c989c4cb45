// cuBLAS through dlopen (blas.cuh says why).
#include "worker/cuda/blas.cuh"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "shared/error.h"

namespace ds4::cuda::blas {
namespace {

struct Table {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  // cublasGemmEx is overloaded in C++ (an older compute-type argument): the C one.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

Table table;
std::once_flag loaded;
std::string load_error;

template <typename F>
void resolve(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f && load_error.empty()) load_error = std::string("it has no ") + name;
}

const Table& get() {
  load();
  return table;
}

}  // namespace

void load() {
  static const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  std::call_once(loaded, [] {
    void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      load_error = e ? e : "dlopen failed";
      return;
    }
    resolve(lib, "cublasCreate_v2", table.create);
    resolve(lib, "cublasDestroy_v2", table.destroy);
    resolve(lib, "cublasSetStream_v2", table.set_stream);
    resolve(lib, "cublasSetWorkspace_v2", table.set_workspace);
    resolve(lib, "cublasGemmEx", table.gemm_ex);
  });
  if (!load_error.empty())
    throw Error("the CUDA backend needs cuBLAS (" + soname + "), which cannot be loaded: " + load_error);
}

cublasStatus_t create(cublasHandle_t* handle) { return get().create(handle); }
cublasStatus_t destroy(cublasHandle_t handle) { return get().destroy(handle); }
cublasStatus_t set_stream(cublasHandle_t handle, cudaStream_t stream) { return get().set_stream(handle, stream); }
cublasStatus_t set_workspace(cublasHandle_t handle, void* workspace, size_t bytes) {
  return get().set_workspace(handle, workspace, bytes);
}
cublasStatus_t gemm_ex(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                       const void* alpha, const void* a, cudaDataType at, int lda, const void* b, cudaDataType bt,
                       int ldb, const void* beta, void* c, cudaDataType ct, int ldc, cublasComputeType_t compute,
                       cublasGemmAlgo_t algo) {
  return get().gemm_ex(handle, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, compute, algo);
}

}  // namespace ds4::cuda::blas

#pragma once
// Shared pieces of the CUDA backend: error checks, owned device memory, and
// weights in the layout the kernels read. Included only by worker/cuda/*.cu.

#include "worker/cuda/blas.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "model/weights.h"
#include "shared/error.h"
#include "shared/ggml_types.h"

namespace ds4::cuda {

[[noreturn]] void fail(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void fail_blas(cublasStatus_t s, const char* call, const char* file, int line);

#define DS4_CUDA_CHECK(call)                                                    \
  do {                                                                          \
    const cudaError_t ds4_e_ = (call);                                          \
    if (ds4_e_ != cudaSuccess) ::ds4::cuda::fail(ds4_e_, #call, __FILE__, __LINE__); \
  } while (0)
#define DS4_BLAS_CHECK(call)                                                         \
  do {                                                                               \
    const cublasStatus_t ds4_s_ = (call);                                            \
    if (ds4_s_ != CUBLAS_STATUS_SUCCESS) ::ds4::cuda::fail_blas(ds4_s_, #call, __FILE__, __LINE__); \
  } while (0)
/// After a kernel launch: a bad configuration shows up here, not later.
#define DS4_CUDA_LAUNCHED() DS4_CUDA_CHECK(cudaGetLastError())

/// Device memory owned by one object (cudaMalloc, freed on destruction).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, const std::string& what);
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    swap(o);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  void swap(DeviceBuffer& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// A weight matrix in device memory. F32, F16 and BF16 keep GGUF's layout
/// (`rows` rows of `cols` elements). Q8_0 is split so that every load is 16
/// bytes and aligned: `data` holds rows x cols int8 quants, row-major, and
/// `scales` rows x cols/32 half scales (weight = scale * q, as in BlockQ8_0).
/// The other block-quantised types are in planes (quant.cuh): `data` the low
/// bits, `hi`, `sub` and `sup` the rest.
struct DeviceWeight {
  GgmlType type = GgmlType::F32;
  const void* data = nullptr;
  const __half* scales = nullptr;
  int64_t cols = 0;
  int64_t rows = 0;
  const uint8_t* hi = nullptr;
  const uint8_t* sub = nullptr;
  const uint8_t* sup = nullptr;
};

/// Device bytes a weight takes in that layout (Q8_0: the same as in GGUF).
uint64_t device_weight_bytes(const Weight& w);
/// Bytes the weight takes in the GGUF file (the host data).
uint64_t host_weight_bytes(const Weight& w);
/// True when the device layout differs from GGUF's (Q8_0 and the planes of
/// quant.cuh): the upload goes through staging and a repack.
bool repacked(GgmlType t);
/// Copies `w` (host memory) into `dst` (device memory of device_weight_bytes)
/// and returns the view. A repacked type goes through `staging`, a device
/// buffer of at least the weight's GGUF bytes, and is repacked from there.
DeviceWeight upload_weight(const Weight& w, void* dst, void* staging, cudaStream_t s);
/// The repack alone: GGUF blocks of `w` already in device memory (`blocks`)
/// into the device layout at `dst`; returns the view.
DeviceWeight repack_weight(const Weight& w, const void* blocks, void* dst, cudaStream_t s);

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Programmatic dependent launch (Hopper): a kernel may be scheduled while the
// one before it finishes. Every kernel of the backend calls pdl_wait() before
// it reads anything an earlier kernel wrote (so each waits, in turn, for all
// before it) and pdl_trigger() to let the next one start. Both are no-ops
// when a kernel was launched without the attribute.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

/// SwiGLU of one value: silu(g) * u, the one expression every kernel uses
/// (the swiglu kernel and the expert GEMV that takes it while quantising its
/// input), so both ways give the same bits.
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/// Multiprocessors of the current device (asked once a process: one GPU each).
int multiprocessor_count();

/// Whether kernels are launched with programmatic stream serialisation:
/// compute capability 9.0 or newer and DS4_CUDA_PDL unset or not "0".
bool pdl_enabled();

/// Launches `kernel` with `smem` bytes of dynamic shared memory on `s` (with
/// the PDL attribute when enabled) and checks the launch.
template <typename... Params, typename... Args>
void launch_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  DS4_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

/// launch_smem without dynamic shared memory.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t s, Args&&... args) {
  launch_smem(kernel, grid, block, 0, s, std::forward<Args>(args)...);
}

}  // namespace ds4::cuda

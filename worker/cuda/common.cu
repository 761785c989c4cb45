// Error reporting, owned device memory and weight upload for the CUDA backend.
#include <cstdlib>
#include <string>

#include "worker/cuda/common.cuh"
#include "worker/cuda/kernels.cuh"

namespace ds4::cuda {

void fail(cudaError_t e, const char* call, const char* file, int line) {
  cudaGetLastError();  // clear a sticky-free error so later calls can report their own
  throw Error(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + cudaGetErrorName(e) +
              " (" + cudaGetErrorString(e) + ")");
}

void fail_blas(cublasStatus_t s, const char* call, const char* file, int line) {
  throw Error(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: cuBLAS status " +
              std::to_string(int(s)));
}

DeviceBuffer::DeviceBuffer(size_t bytes, const std::string& what) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMalloc(&ptr_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free = 0, total = 0;
    cudaMemGetInfo(&free, &total);
    const std::string msg = "cannot allocate " + std::to_string(bytes >> 20) + " MiB of device memory for the " +
                            what + ": " + cudaGetErrorString(e) + " (" + std::to_string(free >> 20) +
                            " MiB free of " + std::to_string(total >> 20) + " MiB)";
    if (e == cudaErrorMemoryAllocation) throw DoesNotFit(msg);
    throw Error(msg);
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

bool pdl_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("DS4_CUDA_PDL");
    if (env && std::string(env) == "0") return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return major >= 9;
  }();
  return on;
}

uint64_t device_weight_bytes(const Weight& w) {
  const uint64_t n = uint64_t(w.rows) * uint64_t(w.cols);
  switch (w.type) {
    case GgmlType::F32: return n * 4;
    case GgmlType::F16:
    case GgmlType::BF16: return n * 2;
    case GgmlType::Q8_0: return n + n / 32 * 2;
    default: throw Error("CUDA backend: unsupported weight type " + std::to_string(int(w.type)));
  }
}

DeviceWeight upload_weight(const Weight& w, void* dst, void* staging, cudaStream_t s) {
  DeviceWeight d;
  d.type = w.type;
  d.cols = w.cols;
  d.rows = w.rows;
  d.data = dst;
  if (w.type != GgmlType::Q8_0) {
    DS4_CUDA_CHECK(cudaMemcpyAsync(dst, w.data, device_weight_bytes(w), cudaMemcpyHostToDevice, s));
    return d;
  }
  if (w.cols % 32 != 0) throw Error("Q8_0 weight with " + std::to_string(w.cols) + " columns");
  const int64_t n_blocks = w.rows * w.cols / 32;
  DS4_CUDA_CHECK(cudaMemcpyAsync(staging, w.data, size_t(n_blocks) * sizeof(BlockQ8_0), cudaMemcpyHostToDevice, s));
  int8_t* qs = static_cast<int8_t*>(dst);
  // Scales after the quants; rows*cols is a multiple of 32, so they stay 2-byte aligned.
  __half* scales = reinterpret_cast<__half*>(qs + w.rows * w.cols);
  repack_q8_0(staging, n_blocks, qs, scales, s);
  d.scales = scales;
  return d;
}

}  // namespace ds4::cuda

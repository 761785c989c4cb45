// Error reporting, owned device memory and weight upload for the CUDA backend.
#include <cstdlib>
#include <string>

#include "worker/cuda/common.cuh"
#include "worker/cuda/kernels.cuh"
#include "worker/cuda/quant.cuh"

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

int multiprocessor_count() {
  static const int n = [] {
    int dev = 0, n_sm = 0;
    DS4_CUDA_CHECK(cudaGetDevice(&dev));
    DS4_CUDA_CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    return n_sm;
  }();
  return n;
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
  const TypeTraits* row = type_row(w.type);
  switch (row ? row->device : DeviceLayout::none) {
    case DeviceLayout::as_is:
    case DeviceLayout::q8_split: return type_bytes(w.type, n);  // the same bytes, Q8_0's in two runs
    case DeviceLayout::planes:
      if (is_block_quant(w.type)) return quant_device_bytes(w.type, w.rows, w.cols);
      break;
    case DeviceLayout::none: break;
  }
  throw Error("CUDA backend: unsupported weight type " + std::string(row ? row->name : std::to_string(int(w.type))));
}

uint64_t host_weight_bytes(const Weight& w) {
  if (!type_row(w.type)) throw Error("CUDA backend: unknown weight type " + std::to_string(int(w.type)));
  return type_bytes(w.type, uint64_t(w.rows) * uint64_t(w.cols));
}

bool repacked(GgmlType t) {
  const TypeTraits* row = type_row(t);
  return row && (row->device == DeviceLayout::q8_split || row->device == DeviceLayout::planes);
}

DeviceWeight repack_weight(const Weight& w, const void* blocks, void* dst, cudaStream_t s) {
  if (type_row(w.type)->device == DeviceLayout::planes) return repack_quant(w.type, blocks, w.rows, w.cols, dst, s);
  if (w.cols % 32 != 0) throw Error("Q8_0 weight with " + std::to_string(w.cols) + " columns");
  DeviceWeight d;
  d.type = w.type;
  d.cols = w.cols;
  d.rows = w.rows;
  d.data = dst;
  const int64_t n_blocks = w.rows * w.cols / 32;
  int8_t* qs = static_cast<int8_t*>(dst);
  // Scales after the quants; rows*cols is a multiple of 32, so they stay 2-byte aligned.
  __half* scales = reinterpret_cast<__half*>(qs + w.rows * w.cols);
  repack_q8_0(blocks, n_blocks, qs, scales, s);
  d.scales = scales;
  return d;
}

DeviceWeight upload_weight(const Weight& w, void* dst, void* staging, cudaStream_t s) {
  DeviceWeight d;
  d.type = w.type;
  d.cols = w.cols;
  d.rows = w.rows;
  d.data = dst;
  if (!repacked(w.type)) {
    DS4_CUDA_CHECK(cudaMemcpyAsync(dst, w.data, device_weight_bytes(w), cudaMemcpyHostToDevice, s));
    return d;
  }
  device_weight_bytes(w);  // refuses a shape the type cannot take before anything is copied
  DS4_CUDA_CHECK(cudaMemcpyAsync(staging, w.data, host_weight_bytes(w), cudaMemcpyHostToDevice, s));
  return repack_weight(w, staging, dst, s);
}

}  // namespace ds4::cuda

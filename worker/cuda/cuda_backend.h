#pragma once
/// The CUDA backend: the llama forward pass on one NVIDIA GPU, behind the same
/// interface as the CPU backend (worker/backend.h). This header includes no
/// CUDA header, so the engine and the CLI can use it without nvcc.

#include <cstdint>
#include <memory>
#include <string>

#include "worker/backend.h"

namespace ds4 {

/// True when a CUDA device can be used; otherwise `why` (if given) says why:
/// no device, no driver, or a driver older than the runtime ds4 was built with.
bool cuda_available(std::string* why);

/// Device memory as cudaMemGetInfo reports it for device `device_index`.
struct CudaMemory {
  uint64_t free = 0;
  uint64_t total = 0;
};
/// Throws ds4::Error when the device cannot be queried.
CudaMemory cuda_memory(int device_index);

/// Copies the model's weights to device `device_index` (once, at
/// construction); reserve() then allocates the KV cache and scratch there.
/// Throws ds4::Error for no device, a bad index, or too little device memory.
std::unique_ptr<Backend> make_cuda_backend(const Model& model, int device_index);

}  // namespace ds4

#pragma once
/// The CUDA backend: worker/forward.h's ops on one NVIDIA GPU, behind the same
/// interface as the CPU backend (worker/backend.h). This header includes no
/// CUDA header, so the engine and the CLI can use it without nvcc.

#include <cstdint>
#include <memory>
#include <string>

#include "shared/model_store.h"
#include "worker/backend.h"
#include "worker/host_compute.h"

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

/// Where the backend's weights live on the device (`--gpu-weights`):
///   holder      mapped from the holder of this GPU (CUDA VMM memory exported as
///               a file descriptor): a restart costs no copy. When no holder
///               answers or its image does not match, the backend logs why and
///               copies instead.
///   copy        copied from the shared segment into the worker's own memory.
///   host_mapped the segment's pages used in place (unified-memory machines;
///               on a discrete GPU every read crosses the bus: slow but correct).
///   automatic   on an integrated GPU (unified memory: GB10, Grace, Jetson)
///               host_mapped, as a copy would be a second one in the same
///               memory; else holder when the holder socket exists, else copy.
enum class CudaWeightSource { automatic, holder, copy, host_mapped };
/// "auto", "holder", "copy", "host-mapped"; anything else throws ds4::Error.
CudaWeightSource parse_cuda_weight_source(const std::string& s);
const char* cuda_weight_source_name(CudaWeightSource w);
/// What `asked` comes to on a device: automatic resolved as above, anything
/// else as asked (a person's explicit choice).
CudaWeightSource resolve_weight_source(CudaWeightSource asked, bool integrated_gpu, bool holder_socket_exists);
/// True when device `device_index` shares the host's memory (cudaDevAttrIntegrated).
bool cuda_integrated(int device_index);

struct CudaWeightsOptions {
  CudaWeightSource mode = CudaWeightSource::copy;
  std::string holder_socket;  // empty: default_holder_socket(device)
  std::string model_key;      // what the holder's image must be of (holder_model_key)
  int holder_timeout_ms = 2000;
  // A mixture of experts' expert rung: the experts of the first
  // `host_expert_layers` layers are computed on the host (by `host`) from
  // the shared segment, with no device copy. The holder's image lacks the experts of its first
  // `holder_expert_layers` (-1: as many as host_expert_layers); the worker
  // copies those of layers [host_expert_layers, holder_expert_layers) itself.
  int host_expert_layers = 0;
  int holder_expert_layers = -1;
  // The host's cores (make_host_compute of worker/host_compute.h): needed
  // for host_expert_layers > 0; without it host_parallel runs on the caller.
  std::shared_ptr<HostCompute> host;
};

/// $XDG_RUNTIME_DIR/ds4/holder-cuda<N>.sock (/tmp/ds4-$UID/... without XDG_RUNTIME_DIR).
std::string default_holder_socket(int device_index);
/// The identity a holder and a worker compare: segment name and GGUF identity.
std::string holder_model_key(const store::Segment& segment);

/// What of a model's shape the CUDA backend cannot run ("" when it runs it
/// all): a head size its attention kernels do not take, an odd RoPE width, a
/// head count that is not a multiple of the KV heads'. Such a model runs on
/// the CPU under device auto and is refused naming this under cuda:N.
std::string cuda_unsupported(const HParams& hp);

/// Builds the backend on device `device_index` with the weights where
/// `weights` says; reserve() then allocates the KV cache and scratch there.
/// Throws ds4::Error for no device, a bad index, or too little device memory.
std::unique_ptr<Backend> make_cuda_backend(const Model& model, int device_index, const CudaWeightsOptions& weights = {});

/// The weights holder of one GPU: copies a model's weights once into a CUDA
/// VMM allocation laid out exactly as the backend reads them, and hands the
/// allocation's file descriptor, with a JSON description, to every process
/// that connects to its Unix socket. Workers that map it may die and restart
/// at will; the memory stays as long as the holder or any worker holds it.
class CudaHolder {
 public:
  /// Copies the weights and listens on `socket_path`. Throws ds4::Error when
  /// another holder already answers there, or on a CUDA failure.
  /// `host_expert_layers`: the first layers whose experts it does not hold
  /// (the workers' deepest expert rung).
  CudaHolder(const Model& model, int device_index, const std::string& socket_path, const std::string& model_key,
             const std::string& segment_name, int host_expert_layers = 0);
  ~CudaHolder();
  CudaHolder(const CudaHolder&) = delete;
  CudaHolder& operator=(const CudaHolder&) = delete;

  /// "holding 13.5 GiB of weights of NAME on cuda:0 (NVIDIA H200)".
  std::string status() const;
  /// Answers connections until stop(); returns then.
  void serve();
  /// Makes serve() return; safe from any thread.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds4

#pragma once
// The model's weights in the layout the kernels read (an "image": every
// distinct weight 256-byte aligned at a fixed offset, Q8_0 split into quants
// and scales), and the three places an image can live:
//   copy        this process's device memory, filled from the shared segment;
//   imported    a CUDA VMM allocation a holder process filled and exported as
//               a POSIX file descriptor, mapped here (no copy);
//   host-mapped the shared segment's pages themselves, registered and mapped
//               for the device (no second copy; Q8_0 is repacked to the device).
// Included only by worker/cuda/*.cu. The driver API is reached through the
// runtime's entry points, so binaries still load where no driver is installed.

#include <cuda.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "worker/cuda/common.cuh"

namespace ds4::cuda {

/// Changes whenever the image layout changes: a holder and a worker built
/// with different versions never share an image.
inline constexpr uint32_t kImageLayoutVersion = 4;  // 2: quantised types in planes; 3: biases, Q/K norms, rope_freqs; 4: experts

/// Where each distinct weight of a model goes in an image (token_embd and
/// output may be one tensor, laid out once).
struct ImageLayout {
  struct Entry {
    const Weight* w = nullptr;
    uint64_t offset = 0;  // from the image start, a multiple of 256
  };
  std::vector<Entry> entries;                        // in upload order
  std::unordered_map<const void*, size_t> by_data;   // host data -> entry
  uint64_t total = 0;          // image bytes
  // "q8" below: every repacked type (Q8_0 and the planes of quant.cuh).
  uint64_t max_q8_host = 0;    // largest repacked weight in GGUF bytes (staging for the repack)
  uint64_t max_q8_elems = 0;   // largest repacked matrix (prefill dequantisation scratch)
  uint64_t q8_bytes = 0;       // image bytes of all repacked weights
  uint64_t hash = 0;           // FNV-1a over the version and every entry's offset, type and shape
  uintptr_t host_lo = 0, host_hi = 0;  // host range that holds the weights

  /// Every weight the forward pass reads, except the experts of the first
  /// `host_expert_layers` layers (they stay on the host: the expert rung).
  static ImageLayout of(const ModelWeights& W, int host_expert_layers = 0);
  /// The experts of layers [from, to) only.
  static ImageLayout experts_of(const ModelWeights& W, int from, int to);
  /// Lays out `weights` in order (one entry per distinct data).
  static ImageLayout of_weights(const std::vector<const Weight*>& weights);
  const Entry& at(const Weight& w) const;
};

/// The weights as the kernels see them, wherever they live.
class WeightImage {
 public:
  virtual ~WeightImage() = default;
  virtual DeviceWeight view(const Weight& w) const = 0;
  /// Device memory this process allocated for the weights (an imported
  /// image's memory belongs to its holder and counts once on the device).
  virtual uint64_t own_device_bytes() const = 0;
  /// "copy", "holder" or "host-mapped".
  virtual const char* source() const = 0;
};

/// Fills `dst` (layout.total bytes of device memory) from the host weights,
/// pinning the host range for the copy when the system allows it.
void fill_image(const ImageLayout& l, void* dst, cudaStream_t s);

/// A copy in this process's device memory.
std::unique_ptr<WeightImage> copy_image(const ImageLayout& l, cudaStream_t s);
/// The host pages used in place (cudaHostRegister, mapped, read-only); Q8_0
/// weights are repacked into device memory (the kernels read split quants).
/// Throws ds4::Error when the pages cannot be registered.
std::unique_ptr<WeightImage> host_mapped_image(const ImageLayout& l, cudaStream_t s);

/// A VMM allocation on one device: created here (and exportable as a POSIX
/// fd) or imported from such an fd. Unmapped and released on destruction;
/// the physical memory lives until every process released it.
class VmmAllocation {
 public:
  /// At least `bytes`, rounded up to the allocation granularity.
  static std::unique_ptr<VmmAllocation> create(int device, uint64_t bytes);
  /// Takes ownership of `fd` (closed here in every case); `bytes` is the
  /// exporter's allocation size.
  static std::unique_ptr<VmmAllocation> import(int device, int fd, uint64_t bytes);
  ~VmmAllocation();
  VmmAllocation(const VmmAllocation&) = delete;
  VmmAllocation& operator=(const VmmAllocation&) = delete;

  void* ptr() const { return reinterpret_cast<void*>(va_); }
  uint64_t size() const { return size_; }
  /// A new POSIX fd for the allocation (the caller closes it).
  int export_fd() const;

 private:
  VmmAllocation() = default;
  void map(int device, bool read_only);
  CUmemGenericAllocationHandle handle_ = 0;
  CUdeviceptr va_ = 0;
  uint64_t size_ = 0;
  bool mapped_ = false;
};

/// An imported holder image viewed through `layout` (whose total must fit it).
std::unique_ptr<WeightImage> imported_image(const ImageLayout& l, std::unique_ptr<VmmAllocation> a);

/// The device's UUID as 32 hex digits (stable across CUDA_VISIBLE_DEVICES).
std::string device_uuid(int device);

}  // namespace ds4::cuda

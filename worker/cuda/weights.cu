// Weight images: layout, copy, host-mapped pages, and CUDA VMM allocations
// shared between processes through POSIX file descriptors.
#include "worker/cuda/weights.cuh"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "shared/log.h"
#include "worker/cuda/kernels.cuh"
#include "worker/cuda/quant.cuh"

namespace ds4::cuda {
namespace {

uint64_t align256(uint64_t n) { return (n + 255) / 256 * 256; }

uint64_t host_bytes(const Weight& w) { return host_weight_bytes(w); }

uint64_t fnv1a(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
}

// The VMM calls of the driver API, looked up through the runtime so that no
// binary links libcuda (it would not start on a machine without a driver).
struct Driver {
  decltype(&::cuGetErrorString) get_error_string = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) import_handle = nullptr;
};

template <typename F>
void lookup(const char* name, F& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p) {
    cudaGetLastError();
    throw Error(std::string("the CUDA driver has no ") + name + " (VMM API)");
  }
  fn = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    lookup("cuGetErrorString", d.get_error_string);
    lookup("cuDeviceGet", d.device_get);
    lookup("cuDeviceGetAttribute", d.device_get_attribute);
    lookup("cuMemGetAllocationGranularity", d.granularity);
    lookup("cuMemCreate", d.create);
    lookup("cuMemRelease", d.release);
    lookup("cuMemAddressReserve", d.reserve);
    lookup("cuMemAddressFree", d.address_free);
    lookup("cuMemMap", d.map);
    lookup("cuMemUnmap", d.unmap);
    lookup("cuMemSetAccess", d.set_access);
    lookup("cuMemExportToShareableHandle", d.export_handle);
    lookup("cuMemImportFromShareableHandle", d.import_handle);
    return d;
  }();
  return d;
}

void check(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return;
  const char* s = nullptr;
  driver().get_error_string(r, &s);
  throw Error(std::string(call) + " failed: " + (s ? s : "error " + std::to_string(int(r))));
}

CUmemAllocationProp device_prop(CUdevice dev) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

/// Pins [lo, hi) of host memory (page-rounded) for the lifetime of the object.
class HostRegistration {
 public:
  HostRegistration(uintptr_t lo, uintptr_t hi, unsigned flags) {
    const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    at_ = reinterpret_cast<void*>(lo / page * page);
    len_ = (hi - reinterpret_cast<uintptr_t>(at_) + page - 1) / page * page;
    error_ = hi > lo ? cudaHostRegister(at_, len_, flags) : cudaErrorInvalidValue;
    if (error_ != cudaSuccess) cudaGetLastError();
  }
  ~HostRegistration() {
    if (ok()) cudaHostUnregister(at_);
  }
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  bool ok() const { return error_ == cudaSuccess; }
  cudaError_t error() const { return error_; }
  void* at() const { return at_; }
  size_t size() const { return len_; }

 private:
  void* at_ = nullptr;
  size_t len_ = 0;
  cudaError_t error_ = cudaSuccess;
};

/// Views into an image laid out by `l` at device address `base`.
DeviceWeight view_at(const ImageLayout& l, const Weight& w, const void* base) {
  DeviceWeight d;
  d.type = w.type;
  d.cols = w.cols;
  d.rows = w.rows;
  d.data = static_cast<const uint8_t*>(base) + l.at(w).offset;
  if (is_block_quant(w.type)) return quant_view(w.type, d.data, w.rows, w.cols);
  if (type_row(w.type)->device == DeviceLayout::q8_split)
    d.scales = reinterpret_cast<const __half*>(static_cast<const int8_t*>(d.data) + w.rows * w.cols);
  return d;
}

class CopiedImage final : public WeightImage {
 public:
  CopiedImage(const ImageLayout& l, cudaStream_t s) : l_(l), buf_(l.total, "weights") { fill_image(l, buf_.as<void>(), s); }
  DeviceWeight view(const Weight& w) const override { return view_at(l_, w, buf_.as<void>()); }
  uint64_t own_device_bytes() const override { return buf_.size(); }
  const char* source() const override { return "copy"; }

 private:
  const ImageLayout& l_;
  DeviceBuffer buf_;
};

class ImportedImage final : public WeightImage {
 public:
  ImportedImage(const ImageLayout& l, std::unique_ptr<VmmAllocation> a) : l_(l), a_(std::move(a)) {}
  DeviceWeight view(const Weight& w) const override { return view_at(l_, w, a_->ptr()); }
  uint64_t own_device_bytes() const override { return 0; }
  const char* source() const override { return "holder"; }

 private:
  const ImageLayout& l_;
  std::unique_ptr<VmmAllocation> a_;
};

// F32/F16/BF16 are read in place through the mapping (GGUF's layout is the
// kernels' layout). Q8_0 blocks are 34 bytes, so their rows are not 16-byte
// aligned, and the other quantised types are split into planes: those weights
// are repacked, reading the mapped blocks, into device memory.
class HostMappedImage final : public WeightImage {
 public:
  HostMappedImage(const ImageLayout& l, cudaStream_t s)
      : l_(l), reg_(l.host_lo, l.host_hi, cudaHostRegisterMapped | cudaHostRegisterReadOnly) {
    if (!reg_.ok())
      throw Error(std::string("cannot map the shared weights for the device (cudaHostRegister of ") +
                  std::to_string(reg_.size() >> 20) + " MiB: " + cudaGetErrorString(reg_.error()) + ")");
    void* dev = nullptr;
    DS4_CUDA_CHECK(cudaHostGetDevicePointer(&dev, reg_.at(), 0));
    dev_base_ = static_cast<uint8_t*>(dev);
    uint64_t q8_total = 0;
    for (const auto& e : l.entries)
      if (repacked(e.w->type)) {
        q8_offset_[e.w->data] = q8_total;
        q8_total += align256(device_weight_bytes(*e.w));
      }
    q8_ = DeviceBuffer(q8_total, "quantised weights (repacked)");
    for (const auto& e : l.entries) {
      if (!repacked(e.w->type)) continue;
      repack_weight(*e.w, device_address(e.w->data), q8_.as<uint8_t>() + q8_offset_.at(e.w->data), s);
    }
    DS4_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  DeviceWeight view(const Weight& w) const override {
    DeviceWeight d;
    d.type = w.type;
    d.cols = w.cols;
    d.rows = w.rows;
    if (!repacked(w.type)) {
      d.data = device_address(w.data);
      return d;
    }
    if (is_block_quant(w.type)) return quant_view(w.type, q8_.as<uint8_t>() + q8_offset_.at(w.data), w.rows, w.cols);
    const int8_t* qs = q8_.as<int8_t>() + q8_offset_.at(w.data);
    d.data = qs;
    d.scales = reinterpret_cast<const __half*>(qs + w.rows * w.cols);
    return d;
  }
  uint64_t own_device_bytes() const override { return q8_.size(); }
  const char* source() const override { return "host-mapped"; }

 private:
  const void* device_address(const void* host) const {
    return dev_base_ + (static_cast<const uint8_t*>(host) - static_cast<const uint8_t*>(reg_.at()));
  }
  const ImageLayout& l_;
  HostRegistration reg_;
  const uint8_t* dev_base_ = nullptr;
  std::unordered_map<const void*, uint64_t> q8_offset_;
  DeviceBuffer q8_;
};

}  // namespace

namespace {
void add_experts(const LayerWeights& L, std::vector<const Weight*>& out) {
  for (const std::vector<Weight>* mats : {&L.gate_mats, &L.up_mats, &L.down_mats})
    for (const Weight& w : *mats) out.push_back(&w);
}
}  // namespace

ImageLayout ImageLayout::of(const ModelWeights& W, int host_expert_layers) {
  // Every tensor the forward pass reads; the optional ones (QKV bias, Q/K
  // norm, RoPE frequency factors) where the file has them.
  std::vector<const Weight*> all = {&W.token_embd, &W.output_norm, &W.output};
  if (W.rope_freqs) all.push_back(&W.rope_freqs);
  for (size_t i = 0; i < W.layers.size(); ++i) {
    const LayerWeights& L = W.layers[i];
    for (const Weight* w : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.bq, &L.bk, &L.bv, &L.q_norm, &L.k_norm, &L.wo,
                            &L.ffn_norm, &L.w_gate, &L.w_up, &L.w_down, &L.gate_inp, &L.gate_inp_shexp,
                            &L.gate_shexp, &L.up_shexp, &L.down_shexp})
      if (*w) all.push_back(w);
    // A mixture of experts: each expert's matrices, one entry each, unless
    // this layer's experts stay on the host.
    if (int(i) >= host_expert_layers) add_experts(L, all);
  }
  return of_weights(all);
}

ImageLayout ImageLayout::experts_of(const ModelWeights& W, int from, int to) {
  std::vector<const Weight*> all;
  for (int i = std::max(from, 0); i < std::min<int>(to, int(W.layers.size())); ++i) add_experts(W.layers[size_t(i)], all);
  return of_weights(all);
}

ImageLayout ImageLayout::of_weights(const std::vector<const Weight*>& all) {
  ImageLayout l;
  l.hash = fnv1a(0xcbf29ce484222325ull, kImageLayoutVersion);
  l.host_lo = UINTPTR_MAX;
  for (const Weight* w : all) {
    if (l.by_data.count(w->data)) continue;
    l.by_data[w->data] = l.entries.size();
    l.entries.push_back({w, l.total});
    for (uint64_t v : {l.total, uint64_t(w->type), uint64_t(w->rows), uint64_t(w->cols)}) l.hash = fnv1a(l.hash, v);
    const uint64_t bytes = align256(device_weight_bytes(*w));
    l.total += bytes;
    if (repacked(w->type)) {
      l.max_q8_host = std::max(l.max_q8_host, host_bytes(*w));
      l.max_q8_elems = std::max<uint64_t>(l.max_q8_elems, uint64_t(w->rows * w->cols));
      l.q8_bytes += bytes;
    }
    l.host_lo = std::min(l.host_lo, reinterpret_cast<uintptr_t>(w->data));
    l.host_hi = std::max(l.host_hi, reinterpret_cast<uintptr_t>(w->data) + host_bytes(*w));
  }
  if (l.entries.empty()) l.host_lo = 0;
  return l;
}

const ImageLayout::Entry& ImageLayout::at(const Weight& w) const { return entries.at(by_data.at(w.data)); }

// The host range is pinned read-only for the copy so that it runs at full bus
// speed; where that is refused (a file mapping, a locked-memory limit), the
// copy goes through the driver's staging instead.
void fill_image(const ImageLayout& l, void* dst, cudaStream_t s) {
  DeviceBuffer stage(l.max_q8_host, "Q8_0 staging");
  std::optional<HostRegistration> pin;
  if (!std::getenv("DS4_CUDA_NO_PIN")) pin.emplace(l.host_lo, l.host_hi, cudaHostRegisterReadOnly);
  for (const auto& e : l.entries) upload_weight(*e.w, static_cast<uint8_t*>(dst) + e.offset, stage.as<void>(), s);
  DS4_CUDA_CHECK(cudaStreamSynchronize(s));
}

std::unique_ptr<WeightImage> copy_image(const ImageLayout& l, cudaStream_t s) {
  return std::make_unique<CopiedImage>(l, s);
}

std::unique_ptr<WeightImage> host_mapped_image(const ImageLayout& l, cudaStream_t s) {
  return std::make_unique<HostMappedImage>(l, s);
}

std::unique_ptr<WeightImage> imported_image(const ImageLayout& l, std::unique_ptr<VmmAllocation> a) {
  if (a->size() < l.total)
    throw Error("the holder's allocation (" + std::to_string(a->size()) + " bytes) is smaller than the weights (" +
                std::to_string(l.total) + " bytes)");
  return std::make_unique<ImportedImage>(l, std::move(a));
}

std::unique_ptr<VmmAllocation> VmmAllocation::create(int device, uint64_t bytes) {
  const Driver& d = driver();
  CUdevice dev = 0;
  check(d.device_get(&dev, device), "cuDeviceGet");
  int fd_ok = 0;
  check(d.device_get_attribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev),
        "cuDeviceGetAttribute");
  if (!fd_ok) throw Error("device cuda:" + std::to_string(device) + " cannot export memory as a file descriptor");
  const CUmemAllocationProp prop = device_prop(dev);
  size_t gran = 0;
  check(d.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  std::unique_ptr<VmmAllocation> a(new VmmAllocation);
  a->size_ = (std::max<uint64_t>(bytes, 1) + gran - 1) / gran * gran;
  check(d.create(&a->handle_, a->size_, &prop, 0), "cuMemCreate");
  a->map(device, false);
  return a;
}

std::unique_ptr<VmmAllocation> VmmAllocation::import(int device, int fd, uint64_t bytes) {
  std::unique_ptr<VmmAllocation> a(new VmmAllocation);
  const CUresult r = driver().import_handle(&a->handle_, reinterpret_cast<void*>(uintptr_t(fd)),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  ::close(fd);  // the handle keeps the memory
  check(r, "cuMemImportFromShareableHandle");
  a->size_ = bytes;
  a->map(device, true);
  return a;
}

// Maps the handle at a new address range, readable (read-only when the driver
// allows it for device memory, else read-write) from `device`.
void VmmAllocation::map(int device, bool read_only) {
  const Driver& d = driver();
  CUdevice dev = 0;
  check(d.device_get(&dev, device), "cuDeviceGet");
  check(d.reserve(&va_, size_, 0, 0, 0), "cuMemAddressReserve");
  check(d.map(va_, size_, 0, handle_, 0), "cuMemMap");
  mapped_ = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (d.set_access(va_, size_, &access, 1) != CUDA_SUCCESS) {
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(d.set_access(va_, size_, &access, 1), "cuMemSetAccess");
  }
}

VmmAllocation::~VmmAllocation() {
  const Driver& d = driver();
  if (mapped_) d.unmap(va_, size_);
  if (va_) d.address_free(va_, size_);
  if (handle_) d.release(handle_);
}

int VmmAllocation::export_fd() const {
  int fd = -1;
  check(driver().export_handle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle");
  return fd;
}

std::string device_uuid(int device) {
  cudaDeviceProp prop{};
  DS4_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::string out;
  char hex[3];
  for (unsigned char c : prop.uuid.bytes) {
    std::snprintf(hex, sizeof hex, "%02x", c);
    out += hex;
  }
  return out;
}

}  // namespace ds4::cuda

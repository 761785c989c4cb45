#pragma once
/// Anonymous memory that is allocated and touched at once, so that a worker
/// finds out at start, not mid-request, whether the memory is really there.

#include <sys/mman.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <utility>

#include "shared/error.h"

namespace ds4::cpu {

class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(size_t bytes, const std::string& what) : bytes_(bytes) {
    if (bytes == 0) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw Error("cannot allocate " + std::to_string(bytes >> 20) + " MiB for the " + what + ": " +
                  std::strerror(errno));
    // 2 MiB pages where the machine gives them on request (transparent huge
    // pages "madvise", Debian's default, or "always"): the KV cache is read
    // whole at every decode step, deep in a context mostly from memory.
    (void)madvise(p, bytes, MADV_HUGEPAGE);
    std::memset(p, 0, bytes);  // touch every page now
    ptr_ = p;
  }
  HostBuffer(HostBuffer&& o) noexcept { *this = std::move(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~HostBuffer() {
    if (ptr_) munmap(ptr_, bytes_);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace ds4::cpu

#include "shared/request_trace.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>

namespace ds4::trace {

namespace detail {
std::atomic<Record*> records{nullptr};
}

namespace {
constexpr size_t kFileBytes = 64u << 20;
constexpr size_t kHeaderBytes = 64;
std::atomic<uint64_t>* taken = nullptr;  // in the header
uint64_t room = 0;
std::once_flag opened;
}  // namespace

void open(const char* tag) {
  std::call_once(opened, [tag] {
    const char* prefix = std::getenv("DS4_TRACE");
    if (!prefix || !*prefix) return;
    const std::string path = std::string(prefix) + "." + tag;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    void* m = MAP_FAILED;
    if (fd >= 0 && ::ftruncate(fd, off_t(kFileBytes)) == 0)
      m = ::mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    if (fd >= 0) ::close(fd);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "ds4: DS4_TRACE: cannot write %s: %s; tracing stays off\n", path.c_str(), std::strerror(err));
      return;
    }
    taken = new (m) std::atomic<uint64_t>(0);
    room = (kFileBytes - kHeaderBytes) / sizeof(Record);
    detail::records.store(reinterpret_cast<Record*>(static_cast<char*>(m) + kHeaderBytes), std::memory_order_release);
  });
}

int64_t now_ns() {
  timespec t;
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void mark(Stage stage, int64_t id, int64_t ns, int32_t extra) {
  Record* r = detail::records.load(std::memory_order_acquire);
  if (!r) return;
  const uint64_t i = taken->fetch_add(1, std::memory_order_relaxed);
  if (i >= room) return;
  r[i] = {ns ? ns : now_ns(), id, int32_t(stage), extra};
}

}  // namespace ds4::trace

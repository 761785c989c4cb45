#include "supervisor/resident_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "shared/error.h"

namespace ds4::sup {

namespace {
const uint64_t kPage = uint64_t(::sysconf(_SC_PAGESIZE));
}

ResidentFile::ResidentFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("model.keep_resident: cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    throw Error("model.keep_resident: " + path + " is empty or cannot be read");
  }
  size_ = uint64_t(st.st_size);
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw Error("model.keep_resident: cannot map " + path + ": " + std::strerror(err));
  }
  thread_ = std::thread([this] { hold(); });
}

ResidentFile::~ResidentFile() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (map_) ::munmap(map_, size_);
}

void ResidentFile::hold() {
  ::madvise(map_, size_, MADV_WILLNEED);  // read ahead while the lock below faults the pages in
  if (::mlock(map_, size_) == 0) {
    mode_ = Mode::locked;
    return;
  }
  const int err = errno;
  rlimit lim{};
  ::getrlimit(RLIMIT_MEMLOCK, &lim);
  lock_error_ = std::string("mlock: ") + std::strerror(err) + " (LimitMEMLOCK= / RLIMIT_MEMLOCK is " +
                (lim.rlim_cur == RLIM_INFINITY ? std::string("infinity") : std::to_string(lim.rlim_cur) + " bytes") +
                ", the file " + std::to_string(size_) + " bytes)";
  touch();
  mode_ = Mode::touched;
}

uint64_t ResidentFile::resident_bytes() const {
  std::vector<unsigned char> v((size_ + kPage - 1) / kPage);
  if (::mincore(map_, size_, v.data()) != 0) return 0;
  uint64_t n = 0;
  for (unsigned char c : v) n += c & 1;
  return std::min(n * kPage, size_);
}

uint64_t ResidentFile::touch() {
  std::vector<unsigned char> v((size_ + kPage - 1) / kPage);
  if (::mincore(map_, size_, v.data()) != 0) return 0;
  const volatile unsigned char* p = static_cast<const unsigned char*>(map_);
  uint64_t back = 0;
  unsigned sum = 0;
  for (size_t i = 0; i < v.size() && !stop_; ++i)
    if (!(v[i] & 1)) {
      sum += p[i * kPage];
      back += kPage;
    }
  (void)sum;
  return back;
}

const char* ResidentFile::mode_name(Mode m) {
  switch (m) {
    case Mode::loading: return "loading";
    case Mode::locked: return "mlock";
    case Mode::touched: return "touch";
  }
  return "?";
}

}  // namespace ds4::sup

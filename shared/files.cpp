#include "shared/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace ds4 {

std::optional<std::string> read_whole_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) text.append(buf, size_t(n));
  }
  const int err = errno;
  ::close(fd);
  if (n < 0) {
    errno = err;
    return std::nullopt;
  }
  return text;
}

std::string ds4_runtime_dir() {
  const char* x = std::getenv("XDG_RUNTIME_DIR");
  if (x && *x) return std::string(x) + "/ds4";
  return "/tmp/ds4-" + std::to_string(::getuid());
}

}  // namespace ds4

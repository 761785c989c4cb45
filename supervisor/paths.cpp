#include "supervisor/paths.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "shared/error.h"
#include "shared/files.h"

namespace ds4::sup {

std::string runtime_dir() { return ds4_runtime_dir(); }

void ensure_private_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error("cannot create " + dir + ": " + ec.message());
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw Error("cannot stat " + dir + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) throw Error(dir + " is not a directory");
  if (st.st_uid != getuid()) throw Error(dir + " belongs to uid " + std::to_string(st.st_uid) + ", not to us");
  if (::chmod(dir.c_str(), 0700) != 0) throw Error("cannot chmod 0700 " + dir + ": " + std::strerror(errno));
}

RuntimeDirLock::RuntimeDirLock(const std::string& dir) {
  const std::string path = dir + "/supervisor.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd_ < 0) throw Error("cannot open " + path + ": " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char pid[32] = {};
    const ssize_t n = ::pread(fd_, pid, sizeof pid - 1, 0);
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK) throw Error("cannot lock " + path + ": " + std::strerror(err));
    std::string who = n > 0 ? std::string(pid, size_t(n)) : "";
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    throw Error("another ds4-supervisor" + (who.empty() ? std::string() : " (pid " + who + ")") + " runs on " + dir +
                ": stop it first, or start this one with its own XDG_RUNTIME_DIR");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != ssize_t(pid.size())) {
    // The lock holds without the pid; only the message of a second supervisor loses it.
  }
}

RuntimeDirLock& RuntimeDirLock::operator=(RuntimeDirLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

RuntimeDirLock::~RuntimeDirLock() {
  if (fd_ >= 0) ::close(fd_);
}

std::string admin_socket_path() { return runtime_dir() + "/admin.sock"; }

std::string self_dir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
}

}  // namespace ds4::sup

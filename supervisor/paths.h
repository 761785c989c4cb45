#pragma once
/// Where the supervisor keeps its sockets and per-worker files.

#include <string>

namespace ds4::sup {

/// $XDG_RUNTIME_DIR/ds4, or /tmp/ds4-$UID when XDG_RUNTIME_DIR is unset.
std::string runtime_dir();
/// Creates `dir` (and its parents) and makes it 0700, owned by us. Throws
/// ds4::Error when it cannot, or when it belongs to someone else.
void ensure_private_dir(const std::string& dir);
/// Holds `dir`/supervisor.lock (flock) for the process's life, so that a
/// second supervisor on the same runtime folder stops before it touches the
/// first one's sockets and control block. Throws ds4::Error naming the holder's
/// pid when another process has it. The descriptor is close-on-exec: workers
/// do not inherit the lock.
class RuntimeDirLock {
 public:
  RuntimeDirLock() = default;
  explicit RuntimeDirLock(const std::string& dir);
  RuntimeDirLock(RuntimeDirLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  RuntimeDirLock& operator=(RuntimeDirLock&& o) noexcept;
  ~RuntimeDirLock();

 private:
  int fd_ = -1;
};

/// runtime_dir()/admin.sock.
std::string admin_socket_path();
/// The folder of the running executable (/proc/self/exe).
std::string self_dir();

}  // namespace ds4::sup

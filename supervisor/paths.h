#pragma once
/// Where the supervisor keeps its sockets and per-worker files.

#include <string>

namespace ds4::sup {

/// $XDG_RUNTIME_DIR/ds4, or /tmp/ds4-$UID when XDG_RUNTIME_DIR is unset.
std::string runtime_dir();
/// Creates `dir` (and its parents) and makes it 0700, owned by us. Throws
/// ds4::Error when it cannot, or when it belongs to someone else.
void ensure_private_dir(const std::string& dir);
/// runtime_dir()/admin.sock.
std::string admin_socket_path();
/// The folder of the running executable (/proc/self/exe).
std::string self_dir();

}  // namespace ds4::sup

#pragma once
/// Whole small files (/proc and /sys entries, the workers' env files).

#include <optional>
#include <string>

namespace ds4 {

/// The whole of `path`; nullopt when it cannot be opened or read, with errno
/// telling why (ENOENT: not there, EACCES: not ours to read).
std::optional<std::string> read_whole_file(const std::string& path);

/// Where ds4's daemons keep their sockets: $XDG_RUNTIME_DIR/ds4, or
/// /tmp/ds4-$UID when XDG_RUNTIME_DIR is unset.
std::string ds4_runtime_dir();

}  // namespace ds4

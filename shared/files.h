#pragma once
/// Whole small files (/proc and /sys entries, the workers' env files).

#include <optional>
#include <string>

namespace ds4 {

/// The whole of `path`; nullopt when it cannot be opened or read, with errno
/// telling why (ENOENT: not there, EACCES: not ours to read).
std::optional<std::string> read_whole_file(const std::string& path);

}  // namespace ds4

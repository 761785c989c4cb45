#pragma once
/// Byte counts for people: log lines, error messages, ds4ctl status.

#include <cstdint>
#include <string>

namespace ds4 {

/// "812 bytes", "1.5 KiB", "1.2 MiB", "74.51 GiB": binary units, the largest
/// that is at most `bytes`; GiB with two decimals (a model or a GPU's memory,
/// where a tenth of a GiB is still hundreds of MiB), the others with one.
/// For messages only: a size a user writes in the config reads back with
/// format_size (shared/config.h), which parse_size takes.
std::string format_bytes(uint64_t bytes);

}  // namespace ds4

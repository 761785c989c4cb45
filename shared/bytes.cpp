#include "shared/bytes.h"

#include <cstdio>

namespace ds4 {

std::string format_bytes(uint64_t b) {
  constexpr uint64_t kKiB = uint64_t(1) << 10, kMiB = uint64_t(1) << 20, kGiB = uint64_t(1) << 30;
  char buf[48];
  if (b >= kGiB) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(kGiB));
  else if (b >= kMiB) std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(kMiB));
  else if (b >= kKiB) std::snprintf(buf, sizeof buf, "%.1f KiB", double(b) / double(kKiB));
  else std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(b));
  return buf;
}

}  // namespace ds4

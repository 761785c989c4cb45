#include "shared/meminfo.h"

#include <algorithm>
#include <charconv>

#include "shared/bytes.h"
#include "shared/files.h"

namespace ds4::mem {

namespace {

// The unsigned number at the start of `s` after blanks; nullopt when none.
std::optional<uint64_t> leading_number(std::string_view s) {
  const size_t at = s.find_first_not_of(" \t");
  if (at == std::string_view::npos) return std::nullopt;
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data() + at, s.data() + s.size(), v);
  if (ec != std::errc()) return std::nullopt;
  return v;
}

// The rest of the line that starts with `key` followed by `sep`; nullopt when none does.
std::optional<std::string_view> field(std::string_view text, std::string_view key, char sep) {
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(at, end - at);
    at = end + 1;
    if (line.size() > key.size() && line.starts_with(key) && line[key.size()] == sep) return line.substr(key.size() + 1);
  }
  return std::nullopt;
}

}  // namespace

std::optional<uint64_t> meminfo_bytes(std::string_view meminfo, std::string_view key) {
  const std::optional<std::string_view> rest = field(meminfo, key, ':');
  if (!rest) return std::nullopt;
  const std::optional<uint64_t> kib = leading_number(*rest);
  if (!kib) return std::nullopt;
  return *kib * 1024;  // the kernel's "kB" are KiB
}

std::optional<uint64_t> memory_stat_field(std::string_view stat, std::string_view key) {
  const std::optional<std::string_view> rest = field(stat, key, ' ');
  return rest ? leading_number(*rest) : std::nullopt;
}

std::optional<uint64_t> cgroup_room(const std::optional<std::string>& memory_max,
                                    const std::optional<std::string>& memory_current,
                                    const std::optional<std::string>& memory_stat) {
  if (!memory_max || !memory_current) return std::nullopt;
  const std::optional<uint64_t> max = leading_number(*memory_max);  // "max" has no number: no limit
  const std::optional<uint64_t> current = leading_number(*memory_current);
  if (!max || !current) return std::nullopt;
  uint64_t reclaimable = 0;
  if (memory_stat) {
    reclaimable = memory_stat_field(*memory_stat, "active_file").value_or(0) +
                  memory_stat_field(*memory_stat, "inactive_file").value_or(0);
  }
  const uint64_t used = *current - std::min(*current, reclaimable);
  return *max > used ? *max - used : 0;
}

uint64_t MemoryRoom::usable() const {
  const uint64_t host = host_available.value_or(UINT64_MAX);
  return cgroup_room ? std::min(host, *cgroup_room) : host;
}

std::string MemoryRoom::describe() const {
  std::string s = host_available ? format_bytes(*host_available) + " available on the host"
                                 : std::string("no MemAvailable in /proc/meminfo");
  if (cgroup_room) s += ", " + format_bytes(*cgroup_room) + " left under the cgroup's memory.max";
  return s;
}

std::optional<uint64_t> read_host_available(const ReadFn& read, const std::string& meminfo) {
  const std::optional<std::string> text = read(meminfo);
  return text ? meminfo_bytes(*text, "MemAvailable") : std::nullopt;
}

MemoryRoom read_memory_room(const ReadFn& read) {
  MemoryRoom r;
  r.host_available = read_host_available(read);
  // cgroup v2: the line "0::/user.slice/.../ds4-worker@0.service".
  const std::optional<std::string> cgroup = read("/proc/self/cgroup");
  if (!cgroup) return r;
  const std::optional<std::string_view> rel = field(*cgroup, "0:", ':');
  if (!rel || !rel->starts_with('/')) return r;
  std::string dir(*rel);
  while (!dir.empty() && (dir.back() == '\n' || dir.back() == '/')) dir.pop_back();
  // This cgroup, then each parent up to the root (whose files hold no limit).
  for (;;) {
    const std::string at = "/sys/fs/cgroup" + dir;
    if (const std::optional<uint64_t> room =
            cgroup_room(read(at + "/memory.max"), read(at + "/memory.current"), read(at + "/memory.stat")))
      r.cgroup_room = std::min(r.cgroup_room.value_or(UINT64_MAX), *room);
    if (dir.empty()) break;
    dir.resize(dir.rfind('/'));
  }
  return r;
}

MemoryRoom read_memory_room() {
  return read_memory_room(read_whole_file);
}

}  // namespace ds4::mem

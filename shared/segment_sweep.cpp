#include "shared/segment_sweep.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "shared/files.h"
#include "shared/model_store_internal.h"

namespace ds4::store {

namespace {

// Which kShmDir files the processes map, from one pass over /proc.
struct MapScan {
  std::set<std::pair<dev_t, ino_t>> mapped;  // device and inode of each mapped file
  bool ds4_unreadable = false;               // a ds4 process whose maps cannot be read
};

// A maps line: "start-end perms offset major:minor inode   path"; a memfd's
// path is "/memfd:<name> (deleted)".
void add_mappings(const std::string& maps, MapScan& scan) {
  const std::string dir = std::string(kShmDir) + "/";
  constexpr std::string_view kMemfdPath = "/memfd:";
  size_t at = 0;
  while (at < maps.size()) {
    size_t end = maps.find('\n', at);
    if (end == std::string::npos) end = maps.size();
    const std::string_view line(maps.data() + at, end - at);
    at = end + 1;
    size_t path = line.find(dir);
    if (path == std::string_view::npos) path = line.find(kMemfdPath);
    if (path == std::string_view::npos) continue;
    unsigned major_no = 0, minor_no = 0;
    unsigned long long inode = 0;
    if (std::sscanf(std::string(line.substr(0, path)).c_str(), "%*s %*s %*s %x:%x %llu", &major_no, &minor_no,
                    &inode) != 3) {
      continue;
    }
    scan.mapped.emplace(makedev(major_no, minor_no), ino_t(inode));
  }
}

// Whether a /proc/<pid>/cmdline runs a ds4 program (ds4-worker, ds4-supervisor).
bool runs_ds4(const std::string& cmdline) {
  const std::string argv0 = cmdline.substr(0, cmdline.find('\0'));
  const size_t slash = argv0.rfind('/');
  return argv0.compare(slash == std::string::npos ? 0 : slash + 1, 4, "ds4-") == 0;
}

MapScan scan_processes(const std::string& proc_dir) {
  MapScan scan;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(proc_dir, ec)) {
    const std::string pid = entry.path().filename().string();
    if (pid.empty() || !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (const std::optional<std::string> maps = read_whole_file(proc_dir + "/" + pid + "/maps")) {
      add_mappings(*maps, scan);
    } else if (errno == EACCES || errno == EPERM) {
      // Not ours to read (a non-dumpable process, another user's, or one in
      // another user namespace): only a ds4 program would map a segment.
      if (const std::optional<std::string> cmdline = read_whole_file(proc_dir + "/" + pid + "/cmdline"))
        scan.ds4_unreadable = scan.ds4_unreadable || runs_ds4(*cmdline);
    }
    // Anything else: the process is gone.
  }
  return scan;
}

bool changed_within(const struct stat& st, std::chrono::milliseconds age) {
  const int64_t ctime_ns = int64_t(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  const int64_t mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return realtime_ns() - std::max(ctime_ns, mtime_ns) < int64_t(age.count()) * 1000000;
}

enum class Swept { removed, kept, gone };

Swept sweep_one(const std::string& name, const InUseFn& in_use, const SweepOptions& opts, uint64_t& freed) {
  const std::string path = std::string(kShmDir) + "/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return errno == ENOENT ? Swept::gone : Swept::kept;
  struct stat st {};
  const bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  const uid_t me = ::geteuid();
  // A loader holds the lock from right after creating the segment until it is
  // ready, and maps it only once the pages are reserved.
  // Another user's segment is never ours to remove, root's sweeps included.
  const bool keep = !ok || st.st_uid != me || loader_lock_held(fd) || changed_within(st, opts.min_age);
  ::close(fd);
  if (keep || in_use(name)) return Swept::kept;
  struct stat now {};
  if (::stat(path.c_str(), &now) != 0) return Swept::gone;
  if (now.st_ino != st.st_ino || now.st_dev != st.st_dev) return Swept::kept;  // replaced since: look next time
  if (::unlink(path.c_str()) != 0) return errno == ENOENT ? Swept::gone : Swept::kept;
  freed = uint64_t(st.st_blocks) * 512;
  return Swept::removed;
}

}  // namespace

InUseFn mapped_by_some_process(std::string proc_dir) {
  auto scan = std::make_shared<std::optional<MapScan>>();
  return [scan, proc_dir = std::move(proc_dir)](const std::string& name) {
    struct stat st {};
    if (::stat((std::string(kShmDir) + "/" + name).c_str(), &st) != 0) return false;
    if (!*scan) *scan = scan_processes(proc_dir);
    const MapScan& s = **scan;
    return s.ds4_unreadable || s.mapped.count({st.st_dev, st.st_ino}) > 0;
  };
}

FdInUseFn fd_mapped_by_some_process(std::string proc_dir) {
  auto scan = std::make_shared<std::optional<MapScan>>();
  return [scan, proc_dir = std::move(proc_dir)](int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return false;
    if (!*scan) *scan = scan_processes(proc_dir);
    const MapScan& s = **scan;
    return s.ds4_unreadable || s.mapped.count({st.st_dev, st.st_ino}) > 0;
  };
}

SweepResult remove_unused_segments(std::string_view keep, const InUseFn& in_use, const SweepOptions& opts) {
  SweepResult r;
  for (const std::string& name : list_segments(opts.prefix)) {
    if (name == keep) continue;
    uint64_t freed = 0;
    switch (sweep_one(name, in_use, opts, freed)) {
      case Swept::removed:
        r.removed.push_back({name, freed});
        break;
      case Swept::kept:
        r.kept.push_back(name);
        break;
      case Swept::gone:
        break;
    }
  }
  return r;
}

}  // namespace ds4::store

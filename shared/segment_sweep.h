#pragma once
/// Removing old model segments: named ones in kShmDir that no process maps
/// any more (a supervisor restarted on another file or layout leaves them),
/// found with one pass over /proc/<pid>/maps. The supervisor's
/// SegmentSweeper (supervisor/segment_sweeper.h) runs it; memfd segments
/// are asked about through a descriptor (fd_mapped_by_some_process).

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/model_store.h"

namespace ds4::store {

/// Whether kShmDir/<name> may be in use by some process: true keeps it.
using InUseFn = std::function<bool(const std::string& name)>;

/// The real InUseFn: every /proc/<pid>/maps, read once at the first call (a
/// sweep with nothing to remove reads none) and not again. A segment is in use
/// when a mapping names its file (same inode: not an older file of that name).
/// Some maps cannot be read, even by root: another user's processes, non-
/// dumpable ones (ssh-agent, gpg-agent, setuid programs), a container's init.
/// Such a process is not asked about unless it runs a ds4 program (argv[0]
/// `ds4-*`): then nothing can be known, and every segment counts as in use.
/// ds4's own processes (workers, holders, supervisors) run as the user who
/// owns the segment and are dumpable, so their maps can be read; and removing
/// a segment never takes a mapping away from anyone, it only stops new ones.
InUseFn mapped_by_some_process(std::string proc_dir = "/proc");

/// Whether the memfd segment behind a descriptor is mapped by some process
/// (a mapping names "/memfd:<name>" with its inode): true keeps it.
using FdInUseFn = std::function<bool(int fd)>;

/// The real FdInUseFn: the same one-time scan of every /proc/<pid>/maps as
/// mapped_by_some_process, with the same caution about unreadable ds4 processes.
FdInUseFn fd_mapped_by_some_process(std::string proc_dir = "/proc");

struct SweepOptions {
  std::string prefix = "ds4-model-";  // which names in kShmDir are looked at (tests use their own)
  /// A segment changed more recently than this is kept: a loader may be
  /// between creating it and taking its lock.
  std::chrono::milliseconds min_age = std::chrono::seconds(5);
};

/// One segment a sweep removed.
struct RemovedSegment {
  std::string name;
  uint64_t bytes = 0;  // the memory its pages held, now freed
};

struct SweepResult {
  std::vector<RemovedSegment> removed;
  std::vector<std::string> kept;  // in use, being loaded, too young, or not ours to remove
};

/// Removes every segment in kShmDir named `prefix`..., other than `keep`, that
/// nobody uses: no live loader writes it (its lock is free), it is older than
/// `min_age`, and `in_use` says no. A caller that is not root leaves other
/// users' segments alone (it could not remove them). Never throws for one segment: one that cannot be
/// looked at or removed is kept.
SweepResult remove_unused_segments(std::string_view keep, const InUseFn& in_use, const SweepOptions& opts = {});

}  // namespace ds4::store

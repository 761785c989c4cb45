#pragma once
/// How much memory a new allocation can get: one reading for every part of
/// ds4 that asks (the model store before it makes a memfd segment, a worker
/// before it reserves its KV cache, the supervisor's headroom watch).
///
/// "Available" is /proc/meminfo's MemAvailable, lowered by what the cgroup
/// limits leave. Why these and no other figure:
///
/// - MemAvailable is the kernel's own estimate of what can be allocated
///   without swapping: MemFree less the reserved watermarks, plus the page
///   cache on the file LRU lists (Active(file) + Inactive(file)) and
///   reclaimable slab, each less what reclaim cannot free. Page cache is
///   counted already: subtracting it again (or adding Cached) is wrong.
/// - Shared memory (tmpfs, /dev/shm, memfd) shows in "Cached" and "Shmem" but
///   lives on the anon LRU lists and cannot be dropped, only swapped: it is
///   NOT in MemAvailable. This matters for ds4 above all: the model segment
///   is shared memory. On a 119 GiB DGX Spark holding an 81 GiB model,
///   /proc/meminfo reads for example "Cached: 84 GiB, Shmem: 81 GiB,
///   MemAvailable: 30 GiB": MemFree + Cached would promise the segment's
///   81 GiB a second time.
/// - A cgroup v2 memory.max (a unit's MemoryMax=, or a slice's above it)
///   caps what this process may take whatever the host has. Its room is
///   memory.max − (memory.current − the file LRU pages charged there,
///   memory.stat active_file + inactive_file), the same rule as
///   MemAvailable's: page cache is reclaimed when the cgroup needs room,
///   shared memory is not. memory.stat's "file" must not be used: it counts
///   shmem too, so a supervisor whose cgroup holds one memfd segment would
///   count that segment's pages as free when it loads the next one.
///   Every cgroup from this process's own up to the root is looked at and the
///   tightest one wins. cgroup v1 limits are not read.
///
/// Swap is not counted: a worker whose KV cache is swapped is as good as dead.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace ds4::mem {

/// Reads a whole file by path; nullopt when it cannot be read. The real one
/// is read_whole_file (shared/files.h); tests give an in-memory map.
using ReadFn = std::function<std::optional<std::string>(const std::string& path)>;

/// The field "<key>: <n> kB" of a /proc/meminfo text, in bytes; nullopt when
/// absent. meminfo_bytes(text, "MemAvailable").
std::optional<uint64_t> meminfo_bytes(std::string_view meminfo, std::string_view key);

/// The field "<key> <n>" of a cgroup v2 memory.stat text; nullopt when absent.
std::optional<uint64_t> memory_stat_field(std::string_view stat, std::string_view key);

/// The room one cgroup leaves: memory.max − (memory.current − its file LRU
/// pages); nullopt when it has no limit ("max", or files that cannot be read:
/// the root cgroup has none).
std::optional<uint64_t> cgroup_room(const std::optional<std::string>& memory_max,
                                    const std::optional<std::string>& memory_current,
                                    const std::optional<std::string>& memory_stat);

/// What a new allocation of this process can get.
struct MemoryRoom {
  std::optional<uint64_t> host_available;  // MemAvailable; nullopt when /proc/meminfo has none
  std::optional<uint64_t> cgroup_room;     // the tightest cgroup_room() of this process's cgroups
  /// The smaller of the two; UINT64_MAX when neither is known.
  uint64_t usable() const;
  /// "30.00 GiB available on the host, 4.00 GiB left under the cgroup's memory.max".
  std::string describe() const;
};

/// Reads /proc/meminfo, /proc/self/cgroup and each of this process's cgroup
/// directories under /sys/fs/cgroup through `read`. Never throws.
MemoryRoom read_memory_room(const ReadFn& read);
/// The same from the real files.
MemoryRoom read_memory_room();

/// MemAvailable from /proc/meminfo through `read`; nullopt when absent.
std::optional<uint64_t> read_host_available(const ReadFn& read, const std::string& meminfo = "/proc/meminfo");

}  // namespace ds4::mem

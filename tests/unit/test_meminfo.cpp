// What a new allocation can get (shared/meminfo.h), from files given in memory;
// and format_bytes (shared/bytes.h), which its messages use.
#include <doctest/doctest.h>

#include <map>
#include <string>

#include "shared/bytes.h"
#include "shared/meminfo.h"

using namespace ds4::mem;

namespace {

constexpr uint64_t KiB = 1024, MiB = KiB << 10, GiB = MiB << 10;

// A machine of 119 GiB holding an 81 GiB model in shared memory: Cached and
// Shmem count the segment, MemAvailable does not.
const std::string kMeminfo =
    "MemTotal:       124780544 kB\n"
    "MemFree:         28311552 kB\n"
    "MemAvailable:    31457280 kB\n"
    "Cached:          88080384 kB\n"
    "Shmem:           84934656 kB\n"
    "Active(file):     2097152 kB\n"
    "Inactive(file):   1048576 kB\n";

// A fake filesystem: paths not in the map cannot be read.
ReadFn files(std::map<std::string, std::string> m) {
  return [m = std::move(m)](const std::string& path) -> std::optional<std::string> {
    const auto it = m.find(path);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}

std::string stat_text(uint64_t file, uint64_t shmem, uint64_t active_file, uint64_t inactive_file) {
  return "anon 1000\nfile " + std::to_string(file) + "\nkernel 5\nshmem " + std::to_string(shmem) +
         "\ninactive_anon 7\nactive_anon 8\ninactive_file " + std::to_string(inactive_file) + "\nactive_file " +
         std::to_string(active_file) + "\nunevictable 0\n";
}

}  // namespace

TEST_CASE("meminfo: fields of /proc/meminfo in bytes; MemAvailable, never MemFree + Cached") {
  CHECK(meminfo_bytes(kMeminfo, "MemAvailable") == 30 * GiB);
  CHECK(meminfo_bytes(kMeminfo, "Shmem") == 81 * GiB);
  CHECK(meminfo_bytes(kMeminfo, "Active(file)") == 2 * GiB);
  CHECK_FALSE(meminfo_bytes(kMeminfo, "Mem"));        // a prefix of a key is not the key
  CHECK_FALSE(meminfo_bytes("MemTotal: 5 kB\n", "MemAvailable"));
  CHECK_FALSE(meminfo_bytes("MemAvailable: lots\n", "MemAvailable"));
  CHECK(meminfo_bytes("MemAvailable:42 kB", "MemAvailable") == 42 * KiB);  // no blank, no newline

  const MemoryRoom r = read_memory_room(files({{"/proc/meminfo", kMeminfo}}));
  CHECK(r.host_available == 30 * GiB);
  CHECK_FALSE(r.cgroup_room);  // no /proc/self/cgroup: no limit known
  CHECK(r.usable() == 30 * GiB);
  CHECK(r.describe() == "30.00 GiB available on the host");
}

TEST_CASE("meminfo: a cgroup's room counts its page cache as free, its shared memory as used") {
  // 10 GiB limit, 9 GiB charged: 1 GiB of page cache (file LRU) and a 6 GiB
  // memfd segment (shmem: in "file" too, but on the anon LRU).
  const std::string stat = stat_text(7 * GiB, 6 * GiB, 512 * MiB, 512 * MiB);
  CHECK(cgroup_room(std::string("10737418240\n"), std::string("9663676416\n"), stat) == 2 * GiB);
  CHECK(memory_stat_field(stat, "file") == 7 * GiB);
  CHECK(memory_stat_field(stat, "shmem") == 6 * GiB);
  CHECK_FALSE(memory_stat_field(stat, "fil"));
  // Without memory.stat nothing counts as reclaimable.
  CHECK(cgroup_room(std::string("10737418240"), std::string("9663676416"), std::nullopt) == 1 * GiB);
  // Over the limit: no room, not a wrapped-around figure.
  CHECK(cgroup_room(std::string("100"), std::string("200"), std::nullopt) == 0u);
  // No limit.
  CHECK_FALSE(cgroup_room(std::string("max\n"), std::string("9663676416\n"), stat));
  CHECK_FALSE(cgroup_room(std::nullopt, std::string("1"), std::nullopt));
}

TEST_CASE("meminfo: the tightest of this process's cgroup and its parents wins, and the host's figure") {
  const std::string unit = "/sys/fs/cgroup/user.slice/user-1000.slice/ds4-worker@0.service";
  const std::string slice = "/sys/fs/cgroup/user.slice";
  std::map<std::string, std::string> m = {
      {"/proc/meminfo", kMeminfo},
      {"/proc/self/cgroup", "0::/user.slice/user-1000.slice/ds4-worker@0.service\n"},
      {unit + "/memory.max", "8589934592\n"},  // MemoryMax=8G, 1 GiB used: 7 GiB
      {unit + "/memory.current", "1073741824\n"},
      {unit + "/memory.stat", stat_text(0, 0, 0, 0)},
      {"/sys/fs/cgroup/user.slice/user-1000.slice/memory.max", "max\n"},
      {"/sys/fs/cgroup/user.slice/user-1000.slice/memory.current", "5\n"},
      {slice + "/memory.max", "21474836480\n"},  // 20 GiB for the slice, 16 GiB used: 4 GiB
      {slice + "/memory.current", "17179869184\n"},
      {slice + "/memory.stat", stat_text(0, 0, 0, 0)},
  };
  MemoryRoom r = read_memory_room(files(m));
  CHECK(r.host_available == 30 * GiB);
  CHECK(r.cgroup_room == 4 * GiB);
  CHECK(r.usable() == 4 * GiB);
  CHECK(r.describe() == "30.00 GiB available on the host, 4.00 GiB left under the cgroup's memory.max");
  // The slice's page cache is reclaimed for us: then the unit's own limit is the tighter.
  m[slice + "/memory.stat"] = stat_text(12 * GiB, 0, 10 * GiB, 2 * GiB);
  CHECK(read_memory_room(files(m)).cgroup_room == 7 * GiB);
  // The host below both.
  m["/proc/meminfo"] = "MemAvailable: 1048576 kB\n";
  CHECK(read_memory_room(files(m)).usable() == 1 * GiB);
  // cgroup v1 only ("<n>:memory:/..."): no v2 line, no limit read.
  m["/proc/self/cgroup"] = "4:memory:/user.slice\n";
  CHECK_FALSE(read_memory_room(files(m)).cgroup_room);
}

TEST_CASE("meminfo: nothing readable is no limit known, not zero") {
  const MemoryRoom r = read_memory_room(files({}));
  CHECK_FALSE(r.host_available);
  CHECK_FALSE(r.cgroup_room);
  CHECK(r.usable() == UINT64_MAX);
  CHECK(r.describe() == "no MemAvailable in /proc/meminfo");
}

TEST_CASE("meminfo: this machine's reading") {
  const MemoryRoom r = read_memory_room();
  REQUIRE(r.host_available);
  CHECK(*r.host_available > 0);
  CHECK(r.usable() <= *r.host_available);
}

TEST_CASE("format_bytes: bytes, then KiB and MiB with one decimal, GiB with two") {
  using ds4::format_bytes;
  CHECK(format_bytes(0) == "0 bytes");
  CHECK(format_bytes(1000) == "1000 bytes");
  CHECK(format_bytes(1023) == "1023 bytes");
  CHECK(format_bytes(1024) == "1.0 KiB");
  CHECK(format_bytes(1536) == "1.5 KiB");
  CHECK(format_bytes(MiB - 1) == "1024.0 KiB");
  CHECK(format_bytes(MiB) == "1.0 MiB");
  CHECK(format_bytes(1258291) == "1.2 MiB");
  CHECK(format_bytes(150 * MiB) == "150.0 MiB");
  CHECK(format_bytes(GiB) == "1.00 GiB");
  CHECK(format_bytes(80000000000ull) == "74.51 GiB");
  CHECK(format_bytes(UINT64_MAX) == "17179869184.00 GiB");
}

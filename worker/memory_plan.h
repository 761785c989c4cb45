#pragma once
/// Checks a worker's memory plan against what the machine and its cgroup can
/// give before anything is allocated, so a plan that cannot fit fails at start
/// with a message instead of an OOM kill later.

#include <cstdint>
#include <optional>
#include <string>

#include "worker/backend.h"

namespace ds4 {

/// Memory a new allocation can get: MemAvailable, lowered by the cgroup's
/// memory.max − memory.current when the process runs under a limit.
struct MemoryRoom {
  uint64_t host_available = 0;          // /proc/meminfo MemAvailable
  std::optional<uint64_t> cgroup_room;  // memory.max - memory.current
  uint64_t usable() const;
  std::string describe() const;
};
MemoryRoom read_memory_room();

std::string format_bytes(uint64_t bytes);
std::string describe_plan(const MemoryPlan& p, const EngineShape& s);

/// Throws ds4::Error naming every figure when plan.own() does not fit `room`.
void check_plan_fits(const MemoryPlan& p, const EngineShape& s, const MemoryRoom& room);

}  // namespace ds4

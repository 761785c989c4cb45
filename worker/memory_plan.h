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

/// Throws ds4::Error when plan.own() does not fit the device memory free.
void check_plan_fits_device(const MemoryPlan& p, const EngineShape& s, const DeviceRoom& room);

/// The check for where `backend` allocates: its device's free memory when
/// memory_on_device(), else the host's (read_memory_room()).
void check_backend_plan_fits(const Backend& backend, const MemoryPlan& p, const EngineShape& s);

}  // namespace ds4

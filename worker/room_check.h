#pragma once
/// The room check: a worker's memory plan (computed by model/memory_plan.h)
/// against what the machine and its cgroup can give (shared/meminfo.h) or
/// its device has free, before anything is allocated, so a plan that cannot
/// fit fails at start with a message instead of an OOM kill later.

#include <cstdint>
#include <string>

#include "shared/meminfo.h"
#include "worker/backend.h"

namespace ds4 {

std::string describe_plan(const MemoryPlan& p, const EngineShape& s);

/// Throws ds4::Error naming every figure when plan.own() does not fit `room`
/// (what this process can allocate: shared/meminfo.h).
void check_plan_fits(const MemoryPlan& p, const EngineShape& s, const mem::MemoryRoom& room);

/// Throws ds4::Error when plan.own() does not fit the device memory free.
void check_plan_fits_device(const MemoryPlan& p, const EngineShape& s, const DeviceRoom& room);

/// The check for where `backend` allocates: its device's free memory when
/// memory_on_device(), else the host's (mem::read_memory_room()).
void check_backend_plan_fits(const Backend& backend, const MemoryPlan& p, const EngineShape& s);

}  // namespace ds4

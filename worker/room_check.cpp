#include "worker/room_check.h"

#include <sstream>

#include "shared/bytes.h"
#include "shared/error.h"

namespace ds4 {

std::string describe_plan(const MemoryPlan& p, const EngineShape& s) {
  std::ostringstream o;
  o << "weights " << format_bytes(p.weights) << " (shared), KV cache " << format_bytes(p.kv) << " (context "
    << s.ctx << " x " << s.slots << " slots, " << kv_type_name(s.kv) << "), scratch " << format_bytes(p.scratch) << "; this worker needs "
    << format_bytes(p.own());
  return o.str();
}

void check_plan_fits(const MemoryPlan& p, const EngineShape& s, const mem::MemoryRoom& room) {
  if (p.own() <= room.usable()) return;
  throw DoesNotFit("memory plan does not fit: " + describe_plan(p, s) + ", but there is only " + room.describe() +
              ". Use a smaller context or fewer slots.");
}

void check_plan_fits_device(const MemoryPlan& p, const EngineShape& s, const DeviceRoom& room) {
  if (p.own() <= room.free) return;
  throw DoesNotFit("memory plan does not fit the device: " + describe_plan(p, s) + ", but the device has only " +
              format_bytes(room.free) + " free of " + format_bytes(room.total) +
              ". Use a smaller context or fewer slots.");
}

void check_backend_plan_fits(const Backend& backend, const MemoryPlan& p, const EngineShape& s) {
  if (!backend.memory_on_device()) return check_plan_fits(p, s, mem::read_memory_room());
  // KV cache and scratch live on the device; the host holds only a few
  // pinned step buffers, far below what the host check would compare.
  if (const auto room = backend.device_room()) check_plan_fits_device(p, s, *room);
}

}  // namespace ds4

#include "worker/memory_plan.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "shared/error.h"

namespace ds4 {

std::string format_bytes(uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(1ull << 30));
  else if (b >= (1ull << 20)) std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1ull << 20));
  else std::snprintf(buf, sizeof buf, "%.1f KiB", double(b) / 1024.0);
  return buf;
}

uint64_t MemoryRoom::usable() const {
  return cgroup_room ? std::min(host_available, *cgroup_room) : host_available;
}

std::string MemoryRoom::describe() const {
  std::string s = format_bytes(host_available) + " available on the host";
  if (cgroup_room) s += ", " + format_bytes(*cgroup_room) + " left under the cgroup's memory.max";
  return s;
}

static std::optional<uint64_t> read_u64(const std::string& path) {
  std::ifstream f(path);
  std::string v;
  if (!(f >> v) || v == "max") return std::nullopt;
  try {
    return std::stoull(v);
  } catch (...) {
    return std::nullopt;
  }
}

MemoryRoom read_memory_room() {
  MemoryRoom r;
  std::ifstream mi("/proc/meminfo");
  std::string key;
  uint64_t kb;
  std::string unit;
  while (mi >> key >> kb) {
    std::getline(mi, unit);
    if (key == "MemAvailable:") r.host_available = kb * 1024;
  }
  // cgroup v2: "0::/user.slice/.../ds4-worker@0.service"
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    if (line.rfind("0::", 0) != 0) continue;
    const std::string dir = "/sys/fs/cgroup" + line.substr(3);
    auto max = read_u64(dir + "/memory.max");
    auto cur = read_u64(dir + "/memory.current");
    if (max && cur) r.cgroup_room = *max > *cur ? *max - *cur : 0;
  }
  return r;
}

std::string describe_plan(const MemoryPlan& p, const EngineShape& s) {
  std::ostringstream o;
  o << "weights " << format_bytes(p.weights) << " (shared), KV cache " << format_bytes(p.kv) << " (context "
    << s.ctx << " x " << s.slots << " slots, " << kv_type_name(s.kv) << "), scratch " << format_bytes(p.scratch) << "; this worker needs "
    << format_bytes(p.own());
  return o.str();
}

void check_plan_fits(const MemoryPlan& p, const EngineShape& s, const MemoryRoom& room) {
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
  if (!backend.memory_on_device()) return check_plan_fits(p, s, read_memory_room());
  // KV cache and scratch live on the device; the host holds only a few
  // pinned step buffers, far below what the host check would compare.
  if (const auto room = backend.device_room()) check_plan_fits_device(p, s, *room);
}

}  // namespace ds4

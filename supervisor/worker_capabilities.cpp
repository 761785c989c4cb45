#include "supervisor/worker_capabilities.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "shared/error.h"
#include "shared/spawn.h"

namespace ds4::sup {

bool WorkerCapabilities::has_backend(const std::string& name) const {
  return std::find(backends.begin(), backends.end(), name) != backends.end();
}

namespace {

std::vector<std::string> strings(const nlohmann::json& j, const char* key, bool required) {
  std::vector<std::string> out;
  if (!j.contains(key)) {
    if (required) throw Error(std::string("ds4-worker capabilities: no \"") + key + "\" in its answer");
    return out;
  }
  const nlohmann::json& v = j[key];
  if (!v.is_array()) throw Error(std::string("ds4-worker capabilities: \"") + key + "\" is not a list");
  for (const auto& e : v) {
    if (!e.is_string()) throw Error(std::string("ds4-worker capabilities: \"") + key + "\" holds a non-string");
    out.push_back(e.get<std::string>());
  }
  return out;
}

}  // namespace

WorkerCapabilities parse_worker_capabilities(const std::string& json_line) {
  const nlohmann::json j = nlohmann::json::parse(json_line, nullptr, false);
  if (!j.is_object()) throw Error("ds4-worker capabilities: its answer is not a JSON object: '" + json_line.substr(0, 200) + "'");
  WorkerCapabilities c;
  c.backends = strings(j, "backends", true);
  c.weight_types = strings(j, "weight_types", false);
  c.kv_cache = strings(j, "kv_cache", false);
  return c;
}

std::optional<WorkerCapabilities> ask_worker_capabilities(const std::string& worker_binary, std::string* why,
                                                          std::chrono::milliseconds timeout) {
  auto fail = [&](std::string s) -> std::optional<WorkerCapabilities> {
    if (why) *why = std::move(s);
    return std::nullopt;
  };
  SpawnOptions o;
  o.argv = {worker_binary, "capabilities"};
  o.parent_death_signal = SIGKILL;
  Captured c;
  try {
    c = run_captured(o, timeout, 64 * 1024);
  } catch (const Error& e) {
    return fail(e.what());
  }
  if (c.timed_out) return fail(worker_binary + " capabilities did not answer within " + std::to_string(timeout.count()) + " ms");
  if (!c.status.success()) return fail(worker_binary + " capabilities " + c.status.describe());
  try {
    return parse_worker_capabilities(c.out.substr(0, c.out.find('\n')));
  } catch (const Error& e) {
    return fail(e.what());
  }
}

std::string device_refusal(const Device& device, const std::optional<WorkerCapabilities>& caps) {
  if (device.kind != Device::Kind::cuda || !caps || caps->has_backend("cuda")) return "";
  return "workers.device " + device.str() +
         ": this build has no CUDA backend (ds4-worker capabilities lists no cuda: configured with -DDS4_CUDA=OFF); "
         "use cpu or auto, or a CUDA build";
}

bool workers_on_gpu(const Device& device, const std::optional<WorkerCapabilities>& caps, bool nvidia_driver) {
  if (device.kind == Device::Kind::cuda) return true;
  return device.kind == Device::Kind::automatic && (!caps || caps->has_backend("cuda")) && nvidia_driver;
}

}  // namespace ds4::sup

#include "supervisor/status_history.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace ds4::sup {

namespace {

int64_t to_int(std::string_view s, int64_t fallback) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && end == s.data() + s.size() ? v : fallback;
}

const char* level_name(log::Level l) {
  switch (l) {
    case log::Level::error: return "error";
    case log::Level::warn: return "warning";
    case log::Level::info: return "info";
    case log::Level::debug: return "debug";
  }
  return "info";
}

}  // namespace

std::optional<StatusEvent> status_event(log::Level level, std::string_view message,
                                        std::span<const log::Field> fields, int64_t time_ms) {
  StatusEvent e;
  e.time_ms = time_ms;
  e.level = level_name(level);
  e.message = std::string(message.substr(0, 1000));
  for (const auto& [name, value] : fields) {
    if (name == "DS4_EVENT") e.event = std::string(value);
    else if (name == "DS4_WORKER") e.worker = int(to_int(value, -1));
    else if (name == "DS4_CONTEXT_FROM") e.context_from = to_int(value, 0);
    else if (name == "DS4_CONTEXT_TO") e.context_to = to_int(value, 0);
    else if (name == "DS4_HOST_EXPERTS_FROM") e.host_experts_from = to_int(value, -1);
    else if (name == "DS4_HOST_EXPERTS_TO") e.host_experts_to = to_int(value, -1);
    else if (name == "DS4_KV_CACHE_FROM") e.kv_cache_from = std::string(value.substr(0, 16));
    else if (name == "DS4_KV_CACHE_TO") e.kv_cache_to = std::string(value.substr(0, 16));
  }
  if (e.event.empty() || e.event == "refused") return std::nullopt;
  return e;
}

void EventRing::add(StatusEvent e) {
  std::lock_guard lock(mu_);
  events_.push_back(std::move(e));
  while (events_.size() > capacity_) events_.pop_front();
}

void EventRing::set_capacity(size_t capacity) {
  std::lock_guard lock(mu_);
  capacity_ = std::max<size_t>(capacity, 1);
  while (events_.size() > capacity_) events_.pop_front();
}

std::vector<StatusEvent> EventRing::since(int64_t from_ms) const {
  std::lock_guard lock(mu_);
  // Added in time order but for clock steps: filter, do not bisect.
  std::vector<StatusEvent> out;
  for (const auto& e : events_)
    if (e.time_ms >= from_ms) out.push_back(e);
  return out;
}

size_t EventRing::size() const {
  std::lock_guard lock(mu_);
  return events_.size();
}

nlohmann::json events_json(const std::vector<StatusEvent>& events) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& e : events) {
    nlohmann::json j = {{"time_ms", e.time_ms}, {"event", e.event}, {"level", e.level}, {"message", e.message}};
    j["worker"] = e.worker >= 0 ? nlohmann::json(e.worker) : nlohmann::json(nullptr);
    if (e.context_from) j["context_from"] = e.context_from;
    if (e.context_to) j["context_to"] = e.context_to;
    if (e.host_experts_from >= 0) j["host_experts_from"] = e.host_experts_from;
    if (e.host_experts_to >= 0) j["host_experts_to"] = e.host_experts_to;
    if (!e.kv_cache_from.empty()) j["kv_cache_from"] = e.kv_cache_from;
    if (!e.kv_cache_to.empty()) j["kv_cache_to"] = e.kv_cache_to;
    out.push_back(std::move(j));
  }
  return out;
}

void SampleRing::push(StatusSample s) {
  samples_.push_back(std::move(s));
  while (samples_.size() > capacity_) samples_.pop_front();
}

void SampleRing::set_capacity(size_t capacity) {
  capacity_ = std::max<size_t>(capacity, 1);
  while (samples_.size() > capacity_) samples_.pop_front();
}

nlohmann::json samples_json(const std::deque<StatusSample>& samples) {
  auto opt = [](const auto& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  nlohmann::json t = nlohmann::json::array(), host = nlohmann::json::array(), gpu = nlohmann::json::array(),
                 min = nlohmann::json::array(), waiting = nlohmann::json::array(), running = nlohmann::json::array(),
                 tps = nlohmann::json::array(), answered = nlohmann::json::array(), p50 = nlohmann::json::array(),
                 max = nlohmann::json::array();
  for (const auto& s : samples) {
    t.push_back(s.time_ms);
    host.push_back(s.host_available);
    gpu.push_back(opt(s.gpu_free));
    min.push_back(s.min_available);
    waiting.push_back(s.waiting);
    running.push_back(s.in_flight);
    tps.push_back(std::round(s.tokens_per_s * 100) / 100);
    answered.push_back(s.answered);
    p50.push_back(opt(s.latency_p50_s));
    max.push_back(opt(s.latency_max_s));
  }
  return {{"time_ms", t},          {"host_available", host}, {"gpu_free", gpu},
          {"min_available", min},  {"waiting", waiting},     {"in_flight", running},
          {"tokens_per_s", tps},   {"answered", answered},   {"latency_p50_s", p50},
          {"latency_max_s", max}};
}

ActivityDelta activity_delta(const ProxyActivity& before, const ProxyActivity& after, double seconds) {
  ActivityDelta d;
  if (seconds > 0) d.tokens_per_s = double(std::max<int64_t>(0, after.generated_tokens - before.generated_tokens)) / seconds;
  d.answered = std::max<int64_t>(0, after.answered - before.answered);
  // The newest `answered` latencies are this interval's (all that are kept
  // when more were answered than the ring holds).
  const size_t n = std::min<size_t>(size_t(d.answered), after.recent_latency_s.size());
  if (n == 0) return d;
  std::vector<double> l(after.recent_latency_s.end() - std::ptrdiff_t(n), after.recent_latency_s.end());
  std::sort(l.begin(), l.end());
  d.latency_p50_s = l[(l.size() - 1) / 2];
  d.latency_max_s = l.back();
  return d;
}

std::string status_metrics(const nlohmann::json& status) {
  std::string out = "# HELP ds4_headroom Memory headroom readings (bytes; psi in %).\n# TYPE ds4_headroom gauge\n";
  const nlohmann::json headroom = status.value("headroom", nlohmann::json::object());
  for (const auto& [key, value] : headroom.items())
    if (value.is_number()) out += "ds4_headroom{reading=\"" + key + "\"} " + value.dump() + "\n";
  out += "# HELP ds4_worker_uptime_seconds Seconds since each worker's current process became ready; 0 while it is not.\n"
         "# TYPE ds4_worker_uptime_seconds gauge\n";
  for (const auto& w : status.value("workers", nlohmann::json::array())) {
    const double up = w.contains("uptime_ms") && w["uptime_ms"].is_number() ? w["uptime_ms"].get<double>() / 1000 : 0;
    char v[32];
    std::snprintf(v, sizeof v, "%.3f", up);
    out += "ds4_worker_uptime_seconds{worker=\"" + std::to_string(w.value("id", 0)) + "\"} " + v + "\n";
  }
  if (status.contains("model") && status["model"].is_object())
    out += "# HELP ds4_model_bytes Size of the served model's weights segment.\n# TYPE ds4_model_bytes gauge\n"
           "ds4_model_bytes " + std::to_string(status["model"].value("bytes", uint64_t(0))) + "\n";
  return out;
}

nlohmann::json requests_json(const std::vector<RequestView>& requests) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : requests) {
    nlohmann::json j = {{"endpoint", r.endpoint},           {"state", r.running ? "running" : "waiting"},
                        {"age_ms", r.age_ms},               {"prompt_tokens", r.prompt_tokens},
                        {"generated", r.generated},         {"resumes", r.resumes}};
    j["worker"] = r.running ? nlohmann::json(r.worker) : nlohmann::json(nullptr);
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace ds4::sup

#pragma once
/// What the status page (GET /status, /status.json, `ds4ctl status`) shows
/// besides the current state: the decisions of the last day (an EventRing of
/// the journal's DS4_EVENT entries) and an hour of samples of headroom, queue
/// depth, tokens/s and request latency (a SampleRing, one sample every
/// status.sample_every). Both are bounded; both are plain data, built into
/// JSON by the functions below and tested without a supervisor.

#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "shared/log.h"
#include "shared/worker_registry.h"

namespace ds4::sup {

/// One DS4_EVENT journal entry, as the page's timeline shows it.
struct StatusEvent {
  int64_t time_ms = 0;      // CLOCK_REALTIME
  std::string event{};      // DS4_EVENT: oom, downgrade, upgrade, hang, backoff, restart, reload, ...
  int worker = -1;          // DS4_WORKER; -1 = not about one worker (reload, holder, segments)
  int64_t context_from = 0; // DS4_CONTEXT_FROM / DS4_CONTEXT_TO; 0 = not given
  int64_t context_to = 0;
  int64_t host_experts_from = -1;  // DS4_HOST_EXPERTS_FROM / _TO (expert rungs); -1 = not given
  int64_t host_experts_to = -1;
  std::string kv_cache_from{}, kv_cache_to{};  // DS4_KV_CACHE_FROM / _TO (KV rungs); empty = not given
  std::string level{};      // error, warning, info
  std::string message{};    // MESSAGE
};

/// The events of a journal entry's fields, or none when it carries no
/// DS4_EVENT or one the timeline leaves out (`refused`: one per refused
/// request, counted in /metrics instead).
std::optional<StatusEvent> status_event(log::Level level, std::string_view message,
                                        std::span<const log::Field> fields, int64_t time_ms);

/// The last `capacity` events. Thread-safe: the journal observer adds them
/// from whichever thread logged.
class EventRing {
 public:
  explicit EventRing(size_t capacity) : capacity_(capacity) {}
  void add(StatusEvent e);
  void set_capacity(size_t capacity);
  /// Those at or after `from_ms`, oldest first.
  std::vector<StatusEvent> since(int64_t from_ms) const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::deque<StatusEvent> events_;
  size_t capacity_;
};

nlohmann::json events_json(const std::vector<StatusEvent>& events);

/// One sample of the page's graphs.
struct StatusSample {
  int64_t time_ms = 0;                // CLOCK_REALTIME
  int64_t host_available = 0;         // MemAvailable, bytes
  std::optional<int64_t> gpu_free;    // the tightest GPU a worker reports; none without GPU workers
  int64_t min_available = 0;          // headroom.min_available
  int64_t waiting = 0;                // requests queued
  int64_t in_flight = 0;              // requests on a worker
  double tokens_per_s = 0;            // generated, over the interval
  int64_t answered = 0;               // requests answered in the interval
  std::optional<double> latency_p50_s, latency_max_s;  // of those; none when none was answered
};

/// The last `capacity` samples (status.history / status.sample_every).
class SampleRing {
 public:
  explicit SampleRing(size_t capacity) : capacity_(capacity) {}
  void push(StatusSample s);
  void set_capacity(size_t capacity);
  const std::deque<StatusSample>& samples() const { return samples_; }

 private:
  std::deque<StatusSample> samples_;
  size_t capacity_;
};

/// Columns, one array per figure, oldest first ({"time_ms":[…],
/// "host_available":[…],…}; null where a sample has no value): the page
/// draws each as a line.
nlohmann::json samples_json(const std::deque<StatusSample>& samples);

/// What happened between two readings of the proxy's counters, `seconds`
/// apart: tokens/s, and the requests answered with their median and longest
/// latency (from the latencies the later reading still keeps).
struct ActivityDelta {
  double tokens_per_s = 0;
  int64_t answered = 0;
  std::optional<double> latency_p50_s, latency_max_s;
};
ActivityDelta activity_delta(const ProxyActivity& before, const ProxyActivity& after, double seconds);

/// The Prometheus text /metrics adds from the supervisor's status JSON
/// (Supervisor::status_json(false)): ds4_headroom{reading} (each numeric
/// headroom figure), ds4_worker_uptime_seconds{worker} (0 while one is not
/// up) and ds4_model_bytes.
std::string status_metrics(const nlohmann::json& status);

/// The requests in flight as the page lists them.
nlohmann::json requests_json(const std::vector<RequestView>& requests);

}  // namespace ds4::sup

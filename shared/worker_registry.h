#pragma once
/// The seam between the supervisor's worker management and its proxy. The
/// supervisor owns the workers and implements WorkerRegistry; the proxy reads
/// it to dispatch requests and implements ProxyStatsSource for `ds4ctl status`
/// and /metrics. It lives here, below both, so that the proxy's library
/// includes nothing of the supervisor's and both name the states with one
/// state_name(). Everything here is used on the supervisor's one io_context
/// thread: no locking.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace ds4::sup {

/// DESIGN.md's worker states, as `ds4ctl status`, /status.json and /metrics show them.
enum class WorkerState { starting, ready, draining, restarting, backoff, stopped };
const char* state_name(WorkerState s);

struct WorkerInfo {
  int id = 0;
  WorkerState state = WorkerState::stopped;
  std::string socket_path;  // the worker's Unix socket (token protocol, shared/protocol.h); "" for exec engines
  int http_port = 0;        // workers.engine: exec — the engine's HTTP port on 127.0.0.1; 0 = native
  int64_t context = 0;      // tokens per slot
  int64_t host_experts = 0; // the expert rung: first layers whose experts the CPU computes
  std::string kv_cache = "f16";  // the KV cache rung
  int64_t slots = 0;
  int pid = 0;
  uint64_t generation = 0;  // +1 at every (re)start: a new process behind the same id
  int64_t restarts = 0;
  int64_t oom_kills = 0;
  std::map<std::string, int64_t> decisions = {};  // policy decisions taken, by event (kDecisionEvents)
};

/// Every event a policy decision can carry (supervisor/policy.h Decision).
inline constexpr const char* kDecisionEvents[] = {"start",   "oom",     "downgrade", "upgrade",
                                                  "restart", "backoff", "hang",      "stop"};

class WorkerRegistry {
 public:
  virtual ~WorkerRegistry() = default;
  virtual std::vector<WorkerInfo> workers() const = 0;
  /// `fn` runs after any worker's state changes (a worker became ready, went
  /// away, started draining). Several listeners may subscribe.
  virtual void on_change(std::function<void()> fn) = 0;
};

struct ProxyStats {
  int64_t waiting = 0;                     // queued, no worker yet
  int64_t in_flight = 0;                   // running on a worker
  std::map<int, int64_t> in_flight_by_worker;
};

/// A request the proxy holds, as the status page lists it.
struct RequestView {
  std::string endpoint;        // "POST /v1/chat/completions"
  bool running = false;        // on a worker; false = waiting in the queue
  int worker = -1;             // running: on which worker
  int64_t age_ms = 0;          // since the proxy had it
  int64_t prompt_tokens = 0;
  int64_t generated = 0;       // tokens so far
  int64_t resumes = 0;         // times it moved to another worker mid-answer
};

/// The proxy's running totals, read now and then by the status sampler.
struct ProxyActivity {
  int64_t generated_tokens = 0;  // since the proxy started
  int64_t answered = 0;          // generation requests answered, since the proxy started
  /// The latencies (seconds, request in to last byte out) of the last
  /// answered requests, newest last; at most kRecentLatencies of them.
  std::vector<double> recent_latency_s;
  std::vector<RequestView> requests;  // waiting and running, oldest first (at most kListedRequests)
  static constexpr size_t kRecentLatencies = 4096;
  static constexpr size_t kListedRequests = 100;
};

class ProxyStatsSource {
 public:
  virtual ~ProxyStatsSource() = default;
  virtual ProxyStats proxy_stats() const = 0;
  /// For the status page; a source that keeps none answers nothing.
  virtual ProxyActivity proxy_activity() const { return {}; }
};

}  // namespace ds4::sup

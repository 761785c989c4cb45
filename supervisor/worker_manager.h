#pragma once
/// The worker manager: one WorkerPolicy per worker, carried out through a
/// UnitBackend, fed with memory readings on a timer. Implements
/// WorkerRegistry for the proxy. Everything runs on one io_context thread.

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shared/worker_registry.h"
#include "supervisor/asio.h"
#include "supervisor/headroom.h"
#include "supervisor/policy.h"
#include "supervisor/unit_backend.h"
#include "supervisor/worker_health.h"

namespace ds4::sup {

/// What the manager needs besides the policy settings.
struct ManagerSettings {
  PolicyConfig policy;           // its ladder: every rung with its plan
  uint32_t holder_experts = 0;   // the last expert rung: what the GPU holder's image lacks
  uint32_t count = 1;
  uint32_t slots = 1;
  std::string device = "auto";
  bool gpu_workers = false;  // workers run on a GPU: their plans are checked against its free memory
  std::string gpu_weights = "auto";
  uint32_t threads = 0;
  uint32_t prefill_chunk = 256;  // workers.prefill_chunk: ds4-worker serve --batch
  std::chrono::microseconds busy_poll{0};  // workers.busy_poll, resolved
  Bytes memory_max = 0;
  std::string segment;
  std::string control;     // the control block's name, handed to workers
  std::string socket_dir;  // worker-N.sock go here
  // workers.engine: exec: workers are external servers (ds4-worker engine)
  // reached over HTTP on a port picked at each start; no socket probes.
  std::string exec_command;  // "" = native workers
  std::string model_path;    // {model}
  /// How often memory is read (also how often draining workers are checked).
  Duration sample_every = std::chrono::milliseconds(500);
  /// A draining worker still busy after this is stopped anyway (the proxy
  /// resumes its requests on another worker).
  Duration drain_deadline = std::chrono::seconds(30);
  size_t events_kept = 200;
};

/// One decision as `ds4ctl events` shows it.
struct EventRecord {
  int64_t time_ms = 0;  // CLOCK_REALTIME
  Decision decision;
};

class WorkerManager : public WorkerRegistry {
 public:
  WorkerManager(asio::io_context& io, UnitBackend& backend, MemorySource& memory, ManagerSettings settings);

  /// Adopts running workers the backend finds, starts the others.
  void start();
  /// Stops every worker (unless the backend keeps them), then calls `done`.
  void stop(std::function<void()> done);
  /// Applies new settings (reload): policies are reconfigured; workers whose
  /// launch settings changed are drained and restarted; the count grows or shrinks.
  void reconfigure(ManagerSettings settings, bool restart_all);

  // Admin. Throw ds4::Error on a bad worker id or context.
  void drain(int id);
  void restart(int id);
  void set_context(int id, uint32_t context);

  void set_proxy_stats(const ProxyStatsSource* stats) { stats_ = stats; }
  /// Heartbeats and socket probes (policy.hang_timeout > 0); null = none.
  /// Also the source of the GPU figures in last_readings(). Set before start().
  void set_health_source(HealthSource* health) { health_ = health; }
  /// Where a GPU worker's start finds the GPU's free memory when no worker
  /// reports it yet (the weights holder: supervisor/holder_keeper.h). Without
  /// one, or when it cannot say, such a start takes the largest rung.
  void set_gpu_memory_source(std::function<std::optional<GpuMemory>()> source) { gpu_memory_ = std::move(source); }
  const std::deque<EventRecord>& events() const { return events_; }
  /// The last memory reading, with the GPU figures of the workers' records now.
  Readings last_readings() const;
  const ManagerSettings& settings() const { return s_; }
  /// `ds4ctl status` for the workers (without /proc details); "rung" is an
  /// index into ladder_json().
  nlohmann::json status_json() const;
  /// The rungs the workers go by, most memory first: each one's context,
  /// kv_cache, host_experts and memory_plan (bytes).
  nlohmann::json ladder_json() const;

  // WorkerRegistry
  std::vector<WorkerInfo> workers() const override;
  void on_change(std::function<void()> fn) override { listeners_.push_back(std::move(fn)); }

  /// The clock (tests may replace it).
  std::function<TimePoint()> now = [] { return std::chrono::steady_clock::now(); };

 private:
  struct Slot {
    std::unique_ptr<WorkerPolicy> policy;
    int pid = 0;
    uint64_t generation = 0;
    bool running = false;  // a process exists (started, not yet exited)
    std::optional<TimePoint> drain_since;
    std::optional<TimePoint> down_since;  // when it last went away unexpectedly
    /// Start of the first of the socket probes that failed in a row (none
    /// answered since): the socket is mute since then.
    std::optional<TimePoint> probe_failed_since;
    bool probing = false;
    int64_t last_downtime_ms = -1;        // went away → ready again
    std::optional<TimePoint> ready_since; // the current process's READY=1
    std::map<std::string, int64_t> decisions;  // by event, since the supervisor started
    std::string last_exit;
    int port = 0;  // exec engines: the current process's HTTP port
    std::unique_ptr<asio::steady_timer> timer;
  };

  Slot& slot(int id);
  void start_worker(int id);
  /// Logs the decisions (journal, events, counters by event).
  void record(Slot& sl, const std::vector<Decision>& decisions);
  void apply(int id, Step step);
  void launch(int id, uint32_t context, uint32_t host_experts, const std::string& kv_cache);
  void arm_timer(int id);
  void on_ready(int id, int pid);
  void on_exit(int id, ExitKind kind, const std::string& message);
  void sample();
  void schedule_sample();
  void check_health();
  void schedule_health();
  /// The worker's own record, when its current process keeps one.
  std::optional<control::Snapshot> own_record(int id) const;
  /// Sets r.gpu_free/gpu_total: the device with the least free memory any
  /// worker reports; none when no worker is on a GPU.
  void add_gpu_figures(Readings& r) const;
  /// The host's reading with worker `id`'s own GPU figures: none when it is
  /// not on a GPU (its policy then goes by the host's memory).
  Readings readings_for(int id) const;
  bool idle(int id) const;
  void notify();
  void maybe_finish_stop();
  std::string socket_path(int id) const;

  asio::io_context& io_;
  UnitBackend& backend_;
  MemorySource& memory_;
  ManagerSettings s_;
  std::map<int, Slot> slots_;
  const ProxyStatsSource* stats_ = nullptr;
  std::vector<std::function<void()>> listeners_;
  std::deque<EventRecord> events_;
  asio::steady_timer sampler_;
  asio::steady_timer health_timer_;
  HealthSource* health_ = nullptr;
  std::function<std::optional<GpuMemory>()> gpu_memory_;
  Readings last_;
  bool stopping_ = false;
  std::function<void()> stopped_;
};

/// Logs a decision as one journal entry (DS4_EVENT, DS4_WORKER,
/// DS4_CONTEXT_FROM, DS4_CONTEXT_TO, DS4_REASON and its figures).
void log_decision(const Decision& d);

}  // namespace ds4::sup

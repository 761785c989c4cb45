#pragma once
/// The memory policy of one worker: a pure state machine (no I/O, no clock of
/// its own). The worker manager feeds it what happened (the worker became
/// ready, exited and why, memory readings, admin requests, timers) with the
/// current time, and carries out the actions it returns. Every decision comes
/// back as a Decision, which the manager logs as one structured journal entry
/// (DS4_EVENT=oom|downgrade|upgrade|restart|backoff) and keeps for
/// `ds4ctl events`.
///
/// Rules (DESIGN.md "Context ladder and memory policy"):
///   start     the largest rung whose own memory (KV + scratch; the weights are
///             already resident) fits available − reserve; the smallest when
///             none fits. "available" is MemAvailable, or for a worker on a
///             GPU that GPU's free memory (Readings).
///   OOM kill  restart at once, one rung lower.
///   headroom  available < min_available (or, for a host worker, PSI above its threshold)
///             continuously for `for`: drain, then restart one rung lower.
///   step up   headroom ample (the next rung up would still leave
///             max(min_available, reserve) free) continuously for
///             step_up_after, and the worker idle: drain, restart one rung up.
///   crashes   the first unexpected exit is retried at once; each further one
///             in a row waits backoff_initial, doubling, capped at
///             backoff_max (state backoff, `degraded`). A worker that
///             stayed ready for healthy_after and then died is no crash
///             loop: the count starts again and it is restarted at once.
///   hang      a worker not ready start_timeout after its start, or
///             a ready worker whose heartbeat is older than hang_timeout, or
///             whose socket has not answered for that long: killed
///             (SIGKILL), then restarted at the same rung; it counts as a
///             failure, so a worker that keeps hanging backs off like a crash.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shared/config.h"
#include "shared/worker_registry.h"
#include "supervisor/ladder.h"

namespace ds4::sup {

using TimePoint = std::chrono::steady_clock::time_point;

/// The settings the policy uses, taken from Config.
struct PolicyConfig {
  /// The rungs, from the most memory to the least, each with its plan
  /// (ladder.h). Never empty.
  std::vector<Rung> ladder;
  Bytes reserve = 0;
  Bytes min_available = 0;
  Duration low_for{0};
  Duration step_up_after{0};  // 0 = never
  double psi = 0;             // 0 = not used
  Duration backoff_initial{1000};
  Duration backoff_max{60000};
  Duration healthy_after{3000};  // ready this long, then died: restarted at once
  Duration hang_timeout{0};   // 0 = no hang detection
  Duration start_timeout{0};  // 0 = a start may take forever
  /// The settings of `c`; its ladder one rung per configured context, with
  /// no plan yet (the supervisor lays out the KV and expert rungs and plans
  /// each: supervisor/model_setup.h).
  static PolicyConfig from(const Config& c);
};

/// One memory reading: the host's, and a GPU's where a worker reports one.
/// The policy of a worker on a GPU goes by that GPU's free memory (the one its
/// KV cache and scratch live in), every other worker's by the host's.
struct Readings {
  Bytes available = 0;                // MemAvailable
  double psi_some_avg10 = 0;          // % of time some task stalled on memory
  std::optional<Bytes> gpu_free;      // the worker's GPU (its control block record, or
                                      // before its first start the weights holder's);
                                      // for status: the tightest GPU any worker reports
  std::optional<Bytes> gpu_total;     // that device's size
  bool on_gpu = false;                // the worker's plan lives on a GPU, even when
                                      // gpu_free is not known yet (its first start)
};

/// A GPU's memory, as one who has a context on it (its weights holder) sees it.
struct GpuMemory {
  Bytes free = 0;
  Bytes total = 0;
};

/// What the supervisor sees of a running worker's liveness.
struct Health {
  /// Age of the heartbeat in the worker's control block record; nullopt when
  /// the process keeps no record (then only the socket counts).
  std::optional<Duration> heartbeat_age;
  /// How long the worker's socket has been mute: since the start of the first
  /// of the probes (`info`) that failed in a row; 0 when the last one was answered.
  Duration unanswered{0};
};

/// Why a worker process went away, as the backends tell it apart.
enum class ExitKind {
  clean,      // exited 0 / stopped by us
  oom,        // killed by the kernel's OOM killer
  crash,      // non-zero exit or a fatal signal of its own (SEGV, ABRT)
  no_fit,     // exited with kExitDoesNotFit: its memory plan did not fit (host or GPU)
  killed,     // SIGKILL/SIGTERM from someone else (a person), no OOM evidence
};
const char* exit_kind_name(ExitKind k);

/// What the manager must do.
struct Action {
  enum class Kind { start, stop, drain, kill } kind = Kind::start;  // kill: SIGKILL, no drain
  uint32_t context = 0;  // start
  uint32_t host_experts = 0;  // start: the expert rung (first layers whose experts stay on the host)
  std::string kv_cache = "f16";  // start: the KV cache rung
};

/// One decision, for the journal and `ds4ctl events`.
struct Decision {
  std::string event;   // oom | downgrade | upgrade | restart | backoff | hang | start | stop
  int worker = 0;
  uint32_t context_from = 0;
  uint32_t context_to = 0;
  std::optional<uint32_t> host_experts_from, host_experts_to;  // set when the ladder has expert rungs
  std::optional<std::string> kv_cache_from, kv_cache_to;       // set when it has KV cache rungs
  std::string reason;  // a sentence saying why, with the figures
  std::vector<std::pair<std::string, std::string>> figures;  // DS4_* fields
};

struct Step {
  std::vector<Action> actions;
  std::vector<Decision> decisions;
};

class WorkerPolicy {
 public:
  /// Throws ds4::Error when the ladder is empty.
  WorkerPolicy(int id, PolicyConfig config);

  /// Starts the worker at the rung that fits `r.available`.
  Step start(TimePoint now, const Readings& r);
  /// The worker said READY=1.
  Step on_ready(TimePoint now, int pid);
  /// The worker process is gone. `message` is its last error line, if any.
  Step on_exit(TimePoint now, ExitKind kind, const std::string& message);
  /// A memory reading; `idle` = nothing in flight on this worker.
  Step on_readings(TimePoint now, const Readings& r, bool idle);
  /// Nothing is in flight any more on a draining worker (or its deadline passed).
  Step on_drained(TimePoint now);
  /// A liveness reading (heartbeat, socket probe). Acts only on a ready
  /// worker found hung: a `hang` decision and Action::kill; on_exit() then
  /// restarts it at the same rung.
  Step on_health(TimePoint now, const Health& h);
  /// A timer the manager armed for next_wakeup() fired.
  Step on_timer(TimePoint now);

  /// Admin: drain and keep stopped / restart at the current rung / a rung.
  /// A drain of a running worker is a `stop` decision, with `why`.
  Step request_drain(TimePoint now, const std::string& why = "drain requested by an administrator");
  Step request_restart(TimePoint now);
  /// Throws ds4::Error when `context` is not on the ladder.
  Step request_context(TimePoint now, uint32_t context);
  /// Supervisor stopping: stop the worker, no restart (a `stop` decision
  /// when it runs).
  Step request_stop(TimePoint now);
  /// A new config (reload). Returns the actions to apply it (drain+restart
  /// when the ladder changed such that the current context is gone).
  Step reconfigure(TimePoint now, PolicyConfig config);

  /// A running worker found at start (supervisor restart): take it as ready.
  void adopt(TimePoint now, uint32_t context, int pid, uint32_t host_experts = 0, const std::string& kv_cache = "f16");
  /// Another worker just stepped down: this one starts its low-headroom count anew.
  void reset_headroom_timers(TimePoint now);

  /// When on_timer() wants to be called (backoff end), if ever.
  std::optional<TimePoint> next_wakeup() const;

  WorkerState state() const { return state_; }
  /// The rung it runs at (or starts at, or will start at again).
  const Rung& current() const { return config_.ladder[rung_]; }
  uint32_t context() const { return current().context; }
  uint32_t host_experts() const { return current().host_experts; }
  const std::string& kv_cache() const { return current().kv_cache; }
  size_t rung() const { return rung_; }
  int id() const { return id_; }
  int64_t restarts() const { return restarts_; }
  int64_t oom_kills() const { return oom_kills_; }
  int64_t failures() const { return failures_; }
  bool degraded() const { return failures_ >= 2; }
  const std::string& last_error() const { return last_error_; }
  const PolicyConfig& config() const { return config_; }

 private:
  /// What to do once the current process is gone.
  enum class After { nothing, start_target, stay_stopped };

  Step start_at(size_t rung, const std::string& event, const std::string& reason, TimePoint now);
  Step drain_then(size_t target, TimePoint now);
  Decision decision(const std::string& event, size_t from, size_t to, std::string reason) const;
  bool low(const Readings& r) const;
  bool ample(const Readings& r) const;
  Duration backoff_delay() const;

  int id_;
  PolicyConfig config_;
  WorkerState state_ = WorkerState::stopped;
  size_t rung_ = 0;
  size_t target_ = 0;
  After after_ = After::nothing;
  bool stopping_ = false;  // we asked the process to stop: its exit is expected
  bool hung_ = false;      // ... and it was because it hung (a failure)
  int pid_ = 0;
  int64_t restarts_ = 0;
  int64_t oom_kills_ = 0;
  int64_t failures_ = 0;
  std::string last_error_;
  TimePoint started_at_{};  // the last start_at (start_timeout counts from it)
  std::optional<TimePoint> ready_since_;
  std::optional<TimePoint> low_since_;
  std::optional<TimePoint> ample_since_;
  std::optional<TimePoint> backoff_until_;
};

}  // namespace ds4::sup

#pragma once
/// How workers are run: as child processes (process_backend.h) or as systemd
/// user units ds4-worker@N.service (systemd_backend.h). The worker manager
/// starts and stops them through this interface and hears back, on the
/// io_context thread, when one became ready or went away and why.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shared/config.h"
#include "shared/worker_launch.h"
#include "supervisor/policy.h"

namespace ds4::sup {

/// Everything a worker is started with.
struct LaunchSpec {
  int id = 0;
  std::string segment;      // model segment name
  std::string socket_path;  // the worker's token-protocol socket
  uint32_t context = 0;
  uint32_t host_experts = 0;    // DS4_HOST_EXPERTS: the expert rung (first layers whose experts stay on the host)
  uint32_t holder_experts = 0;  // DS4_HOLDER_EXPERTS: those the GPU holder's image lacks (the last expert rung)
  std::string kv_cache = "f16"; // DS4_KV_CACHE: the KV cache rung (ds4-worker serve --kv-cache)
  uint32_t slots = 1;
  std::string device = "auto";
  std::string gpu_weights = "auto";  // DS4_GPU_WEIGHTS: auto (the holder's, else a copy) | host-mapped
  uint32_t threads = 0;
  uint32_t prefill_chunk = 256;  // workers.prefill_chunk: ds4-worker serve --batch
  std::chrono::microseconds busy_poll{0};  // workers.busy_poll, resolved
  Bytes memory_max = 0;     // 0 = no limit
  std::string control;      // the control block's name (DS4_CONTROL); "" = none
  // workers.engine: exec — the worker runs this server (ds4-worker engine).
  std::string exec_command; // the template; "" = the native engine (ds4-worker serve)
  int port = 0;             // where the server answers HTTP (127.0.0.1)
  std::string model_path;   // {model}
  std::chrono::milliseconds start_timeout{0};  // restart.start_timeout: how long the engine may take to answer; 0 = no limit
};

/// `ds4-worker engine --start-timeout`'s value for restart.start_timeout: 10 s
/// longer, so that the supervisor's own timeout decides (a hang at start,
/// started again at its context) rather than the engine's exit before it
/// answered (which walks the ladder down); its default of 5 minutes would cut
/// a longer start_timeout short. 0 (no limit): its largest, a day.
inline int64_t exec_start_timeout_ms(std::chrono::milliseconds t) {
  return t.count() == 0 ? 86400000 : std::min<int64_t>(t.count() + 10000, 86400000);
}

/// What worker `spec.id` is started with (shared/worker_launch.h), as both
/// backends write it; `segment_socket` is the supervisor's segment socket.
inline WorkerLaunch worker_launch(const LaunchSpec& spec, const std::string& segment_socket) {
  WorkerLaunch l;
  l.id = spec.id;
  l.segment = spec.segment;
  l.segment_socket = segment_socket;
  l.socket = spec.socket_path;
  l.context = spec.context;
  l.slots = spec.slots;
  l.device = spec.device;
  l.threads = spec.threads;
  l.prefill_chunk = spec.prefill_chunk;
  l.busy_poll_us = spec.busy_poll.count();
  l.control = spec.control;
  l.gpu_weights = spec.gpu_weights;
  l.host_experts = spec.host_experts;
  l.holder_experts = spec.holder_experts;
  l.kv_cache = spec.kv_cache;
  if (!spec.exec_command.empty()) {  // workers.engine: exec (worker/exec_engine.h)
    l.exec_command = spec.exec_command;
    l.port = spec.port;
    l.model = spec.model_path;
    l.start_timeout_ms = exec_start_timeout_ms(spec.start_timeout);
  }
  return l;
}

/// A worker that was already running when the supervisor started.
struct AdoptedWorker {
  int id = 0;
  int pid = 0;
  uint32_t context = 0;
  std::string socket_path;
  int port = 0;  // engine: exec
  uint32_t host_experts = 0;  // its expert rung (DS4_HOST_EXPERTS)
  std::string kv_cache = "f16";  // its KV cache rung (DS4_KV_CACHE)
};

struct BackendCallbacks {
  /// READY=1 from worker `id`'s process `pid`.
  std::function<void(int id, int pid)> ready;
  /// Worker `id`'s process is gone. `message` is its last error, if known.
  std::function<void(int id, ExitKind kind, const std::string& message)> exited;
};

class UnitBackend {
 public:
  virtual ~UnitBackend() = default;
  virtual std::string name() const = 0;  // "process" | "systemd"
  virtual void set_callbacks(BackendCallbacks cb) = 0;
  /// Starts worker `spec.id` (which must not be running). Failures to even
  /// start come back through exited(crash, message).
  virtual void start(const LaunchSpec& spec) = 0;
  /// Asks worker `id` to stop (SIGTERM); exited() follows.
  virtual void stop(int id) = 0;
  /// Kills worker `id` at once (SIGKILL: it hung); exited() follows, as an
  /// expected exit (clean), never as an OOM kill or a person's kill.
  virtual void kill(int id) = 0;
  /// The unit name status shows ("ds4-worker@0.service", or "process" for children).
  virtual std::string unit_name(int id) const = 0;
  /// Running workers of `segment` to take over (a supervisor restarted after
  /// a crash); empty for child processes, which die with their parent.
  virtual std::vector<AdoptedWorker> find_running(const std::string& segment) { return {}; }
};

}  // namespace ds4::sup

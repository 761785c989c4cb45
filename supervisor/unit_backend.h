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

/// Everything a worker is started with: its launch (shared/worker_launch.h),
/// which the worker manager fills but for segment_socket, the supervisor's
/// segment socket, which each backend sets as it writes the launch; and what
/// only the backend uses.
struct LaunchSpec {
  WorkerLaunch launch;
  Bytes memory_max = 0;  // workers.memory_max; 0 = no limit
};

/// `ds4-worker engine --start-timeout`'s value for restart.start_timeout: 10 s
/// longer, so that the supervisor's own timeout decides (a hang at start,
/// started again at its context) rather than the engine's exit before it
/// answered (which walks the ladder down); its default of 5 minutes would cut
/// a longer start_timeout short. 0 (no limit): its largest, a day.
inline int64_t exec_start_timeout_ms(std::chrono::milliseconds t) {
  return t.count() == 0 ? 86400000 : std::min<int64_t>(t.count() + 10000, 86400000);
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
  /// Starts worker `spec.launch.id` (which must not be running). Failures to even
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

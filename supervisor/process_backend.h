#pragma once
/// Workers as child processes of the supervisor (workers.backend: process, or
/// no user manager). Readiness comes the systemd way: each child gets
/// NOTIFY_SOCKET pointing at a datagram socket of ours and its sd_notify
/// READY=1 arrives there with its pid (SO_PASSCRED). Exits come from SIGCHLD.
///
/// workers.memory_max is enforced with a memory cgroup per worker, created
/// under the supervisor's own memory cgroup where that is writable (cgroup
/// v1: memory.limit_in_bytes; v2 only where the controller can be delegated).
/// An OOM kill is told from another SIGKILL by that cgroup's oom_kill counter
/// (memory.oom_control / memory.events), or without a cgroup by the kernel's
/// global counter in /proc/vmstat.

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "shared/notify_socket.h"
#include "supervisor/asio.h"
#include "supervisor/unit_backend.h"

namespace ds4::sup {

struct ProcessBackendOptions {
  std::string worker_binary;  // ds4-worker
  std::string runtime_dir;    // where notify.sock goes (exists, 0700)
  /// Where per-worker memory cgroups go; empty = beside ourselves (our own
  /// memory cgroup). Tests give a cgroup they made.
  std::string cgroup_parent;
  /// SIGKILL a worker that has not exited this long after SIGTERM.
  Duration stop_timeout = std::chrono::seconds(15);
  /// The supervisor's keeper (keeper.h), 0 when none. With one, workers
  /// outlive the supervisor (they die with the keeper instead) and a
  /// restarted supervisor adopts them: each start is recorded in
  /// runtime_dir/process-worker-N.env (pid, start time, what it serves).
  int keeper_pid = 0;
};

class ProcessBackend : public UnitBackend {
 public:
  /// Throws ds4::Error when the notify socket cannot be made.
  ProcessBackend(asio::io_context& io, ProcessBackendOptions options);
  ~ProcessBackend() override;

  std::string name() const override { return "process"; }
  void set_callbacks(BackendCallbacks cb) override { cb_ = std::move(cb); }
  void start(const LaunchSpec& spec) override;
  void stop(int id) override;
  void kill(int id) override;
  std::string unit_name(int id) const override { return "process"; }
  /// Under a keeper: the workers a killed supervisor left running.
  std::vector<AdoptedWorker> find_running(const std::string& segment) override;

  /// Where memory_max lands for worker `id` ("" when not enforced) and why not.
  std::string cgroup_of(int id) const;
  const std::string& cgroup_note() const { return cgroup_note_; }

 private:
  struct Child;
  void do_notify_read();
  void on_notify_datagram(int pid, const NotifyMessage& m);
  void do_wait_signal();
  void reap();
  void record_start(const Child& c) const;
  void watch_adopted(int id);
  void on_adopted_exit(int id);
  void gone(int id, Child& c, ExitKind kind, std::string msg);
  std::string prepare_cgroup(int id, Bytes memory_max);
  std::optional<uint64_t> oom_kills_in(const std::string& cgroup) const;

  asio::io_context& io_;
  ProcessBackendOptions opts_;
  BackendCallbacks cb_;
  std::unique_ptr<NotifySocket> notify_;
  std::unique_ptr<asio::posix::stream_descriptor> notify_wait_;  // readable when notify_ has a datagram
  asio::signal_set sigchld_;
  std::map<int, std::unique_ptr<Child>> children_;  // by worker id
  std::string cgroup_root_;  // where per-worker memory cgroups are made; "" = none
  bool cgroup_v2_ = false;
  std::string cgroup_note_;
};

/// The global OOM-kill counter (/proc/vmstat oom_kill); 0 when unknown.
uint64_t read_vmstat_oom_kills();

/// The memory cgroup directory of process `pid` ("self" allowed): cgroup v1's
/// memory hierarchy, or v2's unified one. Empty when not found.
std::string memory_cgroup_dir(const std::string& pid, bool* v2 = nullptr);

}  // namespace ds4::sup

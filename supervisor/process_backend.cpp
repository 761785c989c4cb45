#include "supervisor/process_backend.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "shared/error.h"
#include "shared/files.h"
#include "shared/log.h"
#include "shared/notify_socket.h"
#include "shared/spawn.h"
#include "shared/worker_launch.h"

namespace ds4::sup {

struct ProcessBackend::Child {
  LaunchSpec spec;
  int pid = 0;
  bool stop_requested = false;
  bool killed_by_us = false;  // kill(): a SIGKILL of ours, not the OOM killer's
  bool ready = false;
  std::string status;   // last STATUS= it sent
  std::string cgroup;   // its memory cgroup, "" when none
  std::optional<uint64_t> cgroup_ooms_at_start;
  uint64_t vmstat_ooms_at_start = 0;
  std::unique_ptr<asio::steady_timer> kill_timer;
  bool adopted = false;  // left running by a supervisor before this one: not our child
  std::unique_ptr<asio::posix::stream_descriptor> pidfd;  // adopted: readable when it exits
};

namespace {

// Field 22 of /proc/PID/stat: when the process started (clock ticks since
// boot), which tells a recorded pid from a reused one. 0 when it is gone.
uint64_t start_time_of(int pid) {
  const std::string stat = read_whole_file("/proc/" + std::to_string(pid) + "/stat").value_or("");
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream in(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && in >> field; ++i)
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  return 0;
}

std::string record_path(const std::string& dir, int id) { return dir + "/process-worker-" + std::to_string(id) + ".env"; }

bool write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.flush();
  return bool(f);
}

/// "key value" lines: the value of `key`.
std::optional<uint64_t> keyed_value(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string k;
  unsigned long long v;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream l(line);
    if (l >> k >> v && k == key) return v;
  }
  return std::nullopt;
}

}  // namespace

uint64_t read_vmstat_oom_kills() {
  return keyed_value(read_whole_file("/proc/vmstat").value_or(""), "oom_kill").value_or(0);
}

std::string memory_cgroup_dir(const std::string& pid, bool* v2) {
  std::istringstream in(read_whole_file("/proc/" + pid + "/cgroup").value_or(""));
  std::string line, unified;
  while (std::getline(in, line)) {
    // "4:memory:/a/b" (v1) or "0::/a/b" (v2)
    const auto c1 = line.find(':');
    const auto c2 = line.find(':', c1 + 1);
    if (c1 == std::string::npos || c2 == std::string::npos) continue;
    const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1);
    const std::string path = line.substr(c2 + 1);
    std::istringstream cs(controllers);
    std::string c;
    while (std::getline(cs, c, ','))
      if (c == "memory") {
        if (v2) *v2 = false;
        return "/sys/fs/cgroup/memory" + path;
      }
    if (controllers.empty()) unified = path;
  }
  if (!unified.empty() && access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0) {
    if (v2) *v2 = true;
    return "/sys/fs/cgroup" + unified;
  }
  return "";
}

ProcessBackend::ProcessBackend(asio::io_context& io, ProcessBackendOptions options)
    : io_(io), opts_(std::move(options)), sigchld_(io, SIGCHLD) {
  notify_ = std::make_unique<NotifySocket>(opts_.runtime_dir + "/notify.sock");
  // Asio waits on a copy; the datagrams are read from the socket's own.
  const int wait_fd = ::fcntl(notify_->fd(), F_DUPFD_CLOEXEC, 3);
  if (wait_fd < 0) throw Error(std::string("cannot watch the workers' notify socket: ") + std::strerror(errno));
  notify_wait_ = std::make_unique<asio::posix::stream_descriptor>(io_, wait_fd);
  do_notify_read();
  do_wait_signal();

  // Memory cgroups for workers.memory_max.
  std::string parent = opts_.cgroup_parent;
  bool v2 = false;
  if (parent.empty()) parent = memory_cgroup_dir("self", &v2);
  else v2 = access((parent + "/memory.max").c_str(), F_OK) == 0 || access((parent + "/cgroup.controllers").c_str(), F_OK) == 0;
  if (parent.empty()) {
    cgroup_note_ = "no memory cgroup found";
  } else if (access(parent.c_str(), W_OK) != 0) {
    cgroup_note_ = parent + " is not writable";
  } else if (v2 && opts_.cgroup_parent.empty()) {
    // v2 forbids processes in a cgroup whose children have controllers: our
    // own cgroup cannot hold worker cgroups while we live in it.
    cgroup_note_ = "cgroup v2: the supervisor's own cgroup " + parent + " cannot get worker sub-cgroups";
  } else {
    cgroup_root_ = parent;
    cgroup_v2_ = v2;
  }
}

ProcessBackend::~ProcessBackend() {
  for (auto& [id, c] : children_) {
    if (c->pid > 0) {
      ::kill(c->pid, SIGKILL);
      if (!c->adopted) ::waitpid(c->pid, nullptr, 0);
      if (opts_.keeper_pid > 0) ::unlink(record_path(opts_.runtime_dir, id).c_str());
    }
    if (!c->cgroup.empty()) ::rmdir(c->cgroup.c_str());
  }
}

std::string ProcessBackend::cgroup_of(int id) const {
  auto it = children_.find(id);
  return it == children_.end() ? "" : it->second->cgroup;
}

std::string ProcessBackend::prepare_cgroup(int id, Bytes memory_max) {
  if (memory_max == 0 || cgroup_root_.empty()) return "";
  const std::string dir = cgroup_root_ + "/ds4-worker-" + std::to_string(id);
  ::mkdir(dir.c_str(), 0755);
  const std::string limit = std::to_string(memory_max);
  const bool ok = cgroup_v2_ ? write_text(dir + "/memory.max", limit)
                             : write_text(dir + "/memory.limit_in_bytes", limit);
  if (!ok) {
    log::warn("cannot set the memory limit of worker " + std::to_string(id) + " in " + dir + ", ignoring");
    return "";
  }
  if (cgroup_v2_) write_text(dir + "/memory.swap.max", "0");
  else write_text(dir + "/memory.swappiness", "0");
  return dir;
}

std::optional<uint64_t> ProcessBackend::oom_kills_in(const std::string& cgroup) const {
  if (cgroup.empty()) return std::nullopt;
  if (cgroup_v2_) return keyed_value(read_whole_file(cgroup + "/memory.events").value_or(""), "oom_kill");
  return keyed_value(read_whole_file(cgroup + "/memory.oom_control").value_or(""), "oom_kill");
}

void ProcessBackend::start(const LaunchSpec& spec) {
  const int id = int(spec.launch.id);
  auto c = std::make_unique<Child>();
  c->spec = spec;
  c->spec.launch.segment_socket = opts_.runtime_dir + "/segments.sock";
  c->cgroup = prepare_cgroup(id, spec.memory_max);
  if (!c->cgroup.empty() && ::access((c->cgroup + "/cgroup.procs").c_str(), W_OK) != 0) {
    log::warn("cannot move worker " + std::to_string(id) + " into " + c->cgroup + ": " + std::strerror(errno) +
              "; it runs without its memory limit, ignoring");
    c->cgroup.clear();
  }
  c->cgroup_ooms_at_start = oom_kills_in(c->cgroup);
  c->vmstat_ooms_at_start = read_vmstat_oom_kills();

  // Under a keeper the worker outlives us (a restarted supervisor adopts it)
  // and dies with the keeper instead (ds4-worker watches that pid).
  // (Exec engines die with us, as before: their servers are not adopted.)
  const bool outlive = opts_.keeper_pid > 0 && spec.launch.exec_command.empty();
  WorkerLaunch launch = c->spec.launch;
  if (outlive) launch.dies_with = opts_.keeper_pid;
  SpawnOptions o;
  o.argv = {opts_.worker_binary, launch.subcommand()};
  for (std::string& a : launch.to_args()) o.argv.push_back(std::move(a));
  // The launch in its environment, as a unit's environment file gives it
  // (ours of the same names do not reach it), and on its command line, where
  // ps shows it.
  std::vector<std::string> drop = worker_launch_env_names();
  drop.insert(drop.end(), {"NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID"});
  o.env = environment_without(drop);
  for (std::string& e : launch.to_env()) o.env->push_back(std::move(e));
  o.env->push_back("NOTIFY_SOCKET=" + notify_->address());
  // Own process group: a Ctrl-C meant for the supervisor does not reach it
  // (the supervisor stops it); dies with the supervisor.
  o.new_process_group = true;
  o.parent_death_signal = outlive ? 0 : SIGTERM;
  o.cgroup = c->cgroup;
  // As the unit's OOMScoreAdjust=1000: when memory runs out, the kernel
  // kills a worker (restarted in milliseconds), never the supervisor.
  o.oom_score_adj = 1000;
  pid_t pid = -1;
  try {
    pid = spawn(o);
  } catch (const Error& e) {
    const std::string msg = e.what();
    asio::post(io_, [this, id, msg] { if (cb_.exited) cb_.exited(id, ExitKind::crash, msg); });
    return;
  }
  c->pid = pid;
  log::info("started worker " + std::to_string(id) + " (pid " + std::to_string(pid) + ", context " +
                std::to_string(launch.context) + " x " + std::to_string(launch.slots) + " slots" +
                (launch.kv_cache != "f16" ? ", a " + launch.kv_cache + " KV cache" : "") +
                (launch.host_experts
                     ? ", the experts of " + std::to_string(launch.host_experts) + " layers on the host"
                     : "") +
                (c->cgroup.empty() ? "" : ", memory cgroup " + c->cgroup) + ")",
            {{"DS4_WORKER", std::to_string(id)}, {"DS4_PID", std::to_string(pid)}});
  if (outlive) record_start(*c);
  children_[id] = std::move(c);
}

void ProcessBackend::record_start(const Child& c) const {
  // Who it is (pid and start time: a reused pid is told apart), its cgroup,
  // then its launch as a unit's environment file holds it.
  write_text(record_path(opts_.runtime_dir, int(c.spec.launch.id)),
             "DS4_PID=" + std::to_string(c.pid) + "\nDS4_START_TIME=" + std::to_string(start_time_of(c.pid)) +
                 "\nDS4_CGROUP=" + c.cgroup + "\n" + c.spec.launch.to_env_file());
}

std::vector<AdoptedWorker> ProcessBackend::find_running(const std::string& segment) {
  std::vector<AdoptedWorker> out;
  if (opts_.keeper_pid <= 0) return out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(opts_.runtime_dir, ec)) {
    const std::string name = e.path().filename().string();
    int id = -1;
    if (std::sscanf(name.c_str(), "process-worker-%d.env", &id) != 1 || id < 0) continue;
    const std::string env = read_whole_file(e.path().string()).value_or("");
    auto value = [&](const std::string& key) {
      const auto p = env.find(key + "=");
      if (p == std::string::npos) return std::string();
      return env.substr(p + key.size() + 1, env.find('\n', p) - p - key.size() - 1);
    };
    const int pid = std::atoi(value("DS4_PID").c_str());
    const uint64_t started = std::strtoull(value("DS4_START_TIME").c_str(), nullptr, 10);
    if (pid <= 0 || started == 0 || start_time_of(pid) != started) {  // gone (or the pid is another's now)
      ::unlink(e.path().c_str());
      continue;
    }
    WorkerLaunch launch;
    try {
      launch = parse_worker_launch({}, decode_env_file(env));
    } catch (const Error& err) {
      log::warn(name + " does not read (" + err.what() + ")");
      launch.segment.clear();  // stopped below
    }
    if (launch.segment != segment || children_.count(id)) {
      log::info("worker " + std::to_string(id) + " (pid " + std::to_string(pid) + ") runs another model segment (" +
                launch.segment + "); stopping it");
      ::kill(pid, SIGTERM);
      ::unlink(e.path().c_str());
      continue;
    }
    auto c = std::make_unique<Child>();
    c->adopted = true;
    c->pid = pid;
    c->ready = true;
    c->spec.launch = launch;
    c->spec.launch.id = id;  // the record's name gives it
    c->cgroup = value("DS4_CGROUP");
    c->cgroup_ooms_at_start = oom_kills_in(c->cgroup);
    c->vmstat_ooms_at_start = read_vmstat_oom_kills();
    AdoptedWorker a;
    a.id = id;
    a.pid = pid;
    a.context = uint32_t(launch.context);
    a.socket_path = launch.socket;
    a.port = int(launch.port);
    a.host_experts = uint32_t(launch.host_experts);
    a.kv_cache = launch.kv_cache;
    children_[id] = std::move(c);
    watch_adopted(id);
    out.push_back(a);
  }
  return out;
}

// An adopted worker is the keeper's child, not ours: its end comes as its
// pidfd turning readable, without an exit status.
void ProcessBackend::watch_adopted(int id) {
  Child& c = *children_.at(id);
  const int fd = int(::syscall(SYS_pidfd_open, c.pid, 0));
  if (fd < 0) {  // already gone
    asio::post(io_, [this, id] { on_adopted_exit(id); });
    return;
  }
  c.pidfd = std::make_unique<asio::posix::stream_descriptor>(io_, fd);
  c.pidfd->async_wait(asio::posix::stream_descriptor::wait_read, [this, id](boost::system::error_code ec) {
    if (!ec) on_adopted_exit(id);
  });
}

void ProcessBackend::on_adopted_exit(int id) {
  auto it = children_.find(id);
  if (it == children_.end() || !it->second->adopted || it->second->pid <= 0) return;
  Child& c = *it->second;
  ExitKind kind = ExitKind::killed;
  std::string msg = "exited (an adopted process: its status went to the keeper)";
  const auto now_ooms = oom_kills_in(c.cgroup);
  const bool oom = c.cgroup_ooms_at_start && now_ooms ? *now_ooms > *c.cgroup_ooms_at_start
                                                      : read_vmstat_oom_kills() > c.vmstat_ooms_at_start;
  if (c.killed_by_us || c.stop_requested) {
    kind = ExitKind::clean;
  } else if (oom) {
    kind = ExitKind::oom;
    msg = "OOM-killed" + std::string(c.cgroup.empty() ? "" : " in " + c.cgroup);
  }
  gone(id, c, kind, msg);
  if (cb_.exited) cb_.exited(id, kind, msg);
}

void ProcessBackend::gone(int id, Child& c, ExitKind kind, std::string msg) {
  log::info("worker " + std::to_string(id) + " (pid " + std::to_string(c.pid) + ") exited: " + exit_kind_name(kind) +
                (msg.empty() ? "" : ", " + msg),
            {{"DS4_WORKER", std::to_string(id)}, {"DS4_EXIT", exit_kind_name(kind)}});
  if (opts_.keeper_pid > 0) {
    // Only this run's record: a worker started since has its own.
    const std::string env = read_whole_file(record_path(opts_.runtime_dir, id)).value_or("");
    if (env.starts_with("DS4_PID=" + std::to_string(c.pid) + "\n")) ::unlink(record_path(opts_.runtime_dir, id).c_str());
  }
  c.pid = 0;
  c.pidfd.reset();
  if (c.kill_timer) c.kill_timer->cancel();
}

void ProcessBackend::stop(int id) {
  auto it = children_.find(id);
  if (it == children_.end() || it->second->pid <= 0) return;
  Child& c = *it->second;
  c.stop_requested = true;
  ::kill(c.pid, SIGTERM);
  c.kill_timer = std::make_unique<asio::steady_timer>(io_, opts_.stop_timeout);
  const int pid = c.pid;
  c.kill_timer->async_wait([pid, id](boost::system::error_code ec) {
    if (ec) return;
    log::warn("worker " + std::to_string(id) + " did not stop in time; killing it");
    ::kill(pid, SIGKILL);
  });
}

void ProcessBackend::kill(int id) {
  auto it = children_.find(id);
  if (it == children_.end() || it->second->pid <= 0) return;
  Child& c = *it->second;
  c.stop_requested = true;
  c.killed_by_us = true;
  ::kill(c.pid, SIGKILL);
}

void ProcessBackend::do_notify_read() {
  notify_wait_->async_wait(asio::posix::stream_descriptor::wait_read, [this](boost::system::error_code ec) {
    if (ec) return;
    while (std::optional<NotifyMessage> m = notify_->receive()) {
      for (int fd : m->fds) ::close(fd);  // workers store nothing with us
      if (m->pid > 0) on_notify_datagram(m->pid, *m);
    }
    do_notify_read();
  });
}

void ProcessBackend::on_notify_datagram(int pid, const NotifyMessage& m) {
  for (auto& [id, c] : children_) {
    if (c->pid != pid) continue;
    if (auto status = m.value("STATUS")) c->status = *status;
    if (m.has("READY=1") && !c->ready) {
      c->ready = true;
      if (cb_.ready) cb_.ready(id, pid);
    }
    return;
  }
}

void ProcessBackend::do_wait_signal() {
  sigchld_.async_wait([this](boost::system::error_code ec, int) {
    if (ec) return;
    reap();
    do_wait_signal();
  });
}

void ProcessBackend::reap() {
  std::vector<std::pair<int, std::pair<ExitKind, std::string>>> ended;
  for (auto& [id, c] : children_) {
    if (c->pid <= 0 || c->adopted) continue;
    const std::optional<ExitStatus> st = try_wait(c->pid);
    if (!st) continue;
    ExitKind kind = ExitKind::crash;
    std::string msg;
    if (st->exited()) {
      const int code = st->code;
      kind = code == 0 || c->stop_requested ? ExitKind::clean
             : code == kExitDoesNotFit    ? ExitKind::no_fit
                                          : ExitKind::crash;
      if (code != 0) msg = st->describe();
    } else if (st->signalled()) {
      const int sig = st->signal;
      msg = st->describe();
      if (sig == SIGKILL && c->killed_by_us) {
        kind = ExitKind::clean;
        msg = "killed by the supervisor (SIGKILL)";
      } else if (sig == SIGKILL) {
        const auto now_ooms = oom_kills_in(c->cgroup);
        bool oom;
        if (c->cgroup_ooms_at_start && now_ooms) oom = *now_ooms > *c->cgroup_ooms_at_start;
        else oom = read_vmstat_oom_kills() > c->vmstat_ooms_at_start;
        kind = oom ? ExitKind::oom : c->stop_requested ? ExitKind::clean : ExitKind::killed;
        if (oom) msg = "OOM-killed" + std::string(c->cgroup.empty() ? "" : " in " + c->cgroup);
      } else if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) {
        kind = c->stop_requested ? ExitKind::clean : ExitKind::killed;
      } else {
        kind = ExitKind::crash;
      }
    }
    if (c->status.rfind("error: ", 0) == 0) msg = c->status.substr(7) + (msg.empty() ? "" : " (" + msg + ")");
    gone(id, *c, kind, msg);
    ended.push_back({id, {kind, msg}});
  }
  for (auto& [id, km] : ended)
    if (cb_.exited) cb_.exited(id, km.first, km.second);
}

}  // namespace ds4::sup

#include "supervisor/process_backend.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "shared/child_signals.h"
#include "shared/error.h"
#include "shared/files.h"
#include "shared/log.h"

extern char** environ;

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
};

namespace {

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
  notify_path_ = opts_.runtime_dir + "/notify.sock";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (notify_path_.size() >= sizeof addr.sun_path) throw Error("notify socket path too long: " + notify_path_);
  std::memcpy(addr.sun_path, notify_path_.c_str(), notify_path_.size() + 1);
  notify_fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (notify_fd_ < 0) throw Error(std::string("cannot create the workers' notify socket: ") + std::strerror(errno));
  ::unlink(notify_path_.c_str());
  const int one = 1;
  if (::bind(notify_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::setsockopt(notify_fd_, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0) {
    const int e = errno;
    ::close(notify_fd_);
    throw Error("cannot bind the workers' notify socket " + notify_path_ + ": " + std::strerror(e));
  }
  notify_ = std::make_unique<asio::posix::stream_descriptor>(io_, notify_fd_);
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
      ::waitpid(c->pid, nullptr, 0);
    }
    if (!c->cgroup.empty()) ::rmdir(c->cgroup.c_str());
  }
  ::unlink(notify_path_.c_str());
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
  auto c = std::make_unique<Child>();
  c->spec = spec;
  c->cgroup = prepare_cgroup(spec.id, spec.memory_max);
  c->cgroup_ooms_at_start = oom_kills_in(c->cgroup);
  c->vmstat_ooms_at_start = read_vmstat_oom_kills();

  std::vector<std::string> args = {opts_.worker_binary, "serve", "--id", std::to_string(spec.id),
                                   "--segment", spec.segment, "--socket", spec.socket_path,
                                   "--context", std::to_string(spec.context), "--slots", std::to_string(spec.slots),
                                   "--device", spec.device, "--threads", std::to_string(spec.threads),
                                   "--busy-poll-us", std::to_string(spec.busy_poll.count()),
                                   "--batch", std::to_string(spec.prefill_chunk)};
  if (!spec.exec_command.empty())  // workers.engine: exec: the external server as the worker
    args = {opts_.worker_binary, "engine", "--id", std::to_string(spec.id), "--port", std::to_string(spec.port),
            "--context", std::to_string(spec.context), "--slots", std::to_string(spec.slots),
            "--threads", std::to_string(spec.threads), "--model", spec.model_path, "--command", spec.exec_command,
            "--start-timeout", std::to_string(exec_start_timeout_ms(spec.start_timeout))};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string_view v(*e);
    if (v.starts_with("NOTIFY_SOCKET=") || v.starts_with("LISTEN_FDS=") || v.starts_with("LISTEN_PID=") ||
        v.starts_with("DS4_CONTROL=") || v.starts_with("DS4_GPU_WEIGHTS=") || v.starts_with("DS4_SEGMENT_SOCKET=") ||
        v.starts_with("DS4_EXEC_COMMAND=") || v.starts_with("DS4_HOST_EXPERTS=") || v.starts_with("DS4_HOLDER_EXPERTS="))
      continue;
    env.emplace_back(v);
  }
  env.push_back("NOTIFY_SOCKET=" + notify_path_);
  if (!spec.control.empty()) env.push_back("DS4_CONTROL=" + spec.control);
  env.push_back("DS4_GPU_WEIGHTS=" + spec.gpu_weights);
  env.push_back("DS4_HOST_EXPERTS=" + std::to_string(spec.host_experts));
  env.push_back("DS4_HOLDER_EXPERTS=" + std::to_string(spec.holder_experts));
  env.push_back("DS4_SEGMENT_SOCKET=" + opts_.runtime_dir + "/segments.sock");
  // Everything the child needs is prepared before fork (only async-signal-safe calls after).
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  int procs_fd = -1;
  if (!c->cgroup.empty()) procs_fd = ::open((c->cgroup + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
  const pid_t parent = ::getpid();

  ChildSignals signals;  // a stop right after the start must not run our handlers in the child
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    if (procs_fd >= 0) ::close(procs_fd);
    const std::string msg = std::string("fork failed: ") + std::strerror(e);
    asio::post(io_, [this, id = spec.id, msg] { if (cb_.exited) cb_.exited(id, ExitKind::crash, msg); });
    return;
  }
  if (pid == 0) {
    // Child. Own process group: a Ctrl-C meant for the supervisor does not
    // reach it (the supervisor stops it); dies with the supervisor.
    ChildSignals::reset_in_child();
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);
    if (procs_fd >= 0) {
      if (::write(procs_fd, "0", 1) != 1) ::_exit(126);
      ::close(procs_fd);
    }
    // As the unit's OOMScoreAdjust=1000: when memory runs out, the kernel
    // kills a worker (restarted in milliseconds), never the supervisor.
    if (const int fd = ::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC); fd >= 0) {
      [[maybe_unused]] const ssize_t n = ::write(fd, "1000", 4);
      ::close(fd);
    }
    ChildSignals::unblock_all_in_child();
    close_on_exec_in_child();
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  if (procs_fd >= 0) ::close(procs_fd);
  c->pid = pid;
  log::info("started worker " + std::to_string(spec.id) + " (pid " + std::to_string(pid) + ", context " +
                std::to_string(spec.context) + " x " + std::to_string(spec.slots) + " slots" +
                (spec.host_experts ? ", the experts of " + std::to_string(spec.host_experts) + " layers on the host" : "") +
                (c->cgroup.empty() ? "" : ", memory cgroup " + c->cgroup) + ")",
            {{"DS4_WORKER", std::to_string(spec.id)}, {"DS4_PID", std::to_string(pid)}});
  children_[spec.id] = std::move(c);
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
  notify_->async_wait(asio::posix::stream_descriptor::wait_read, [this](boost::system::error_code ec) {
    if (ec) return;
    for (;;) {
      char buf[4096];
      alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(ucred))];
      iovec iov{buf, sizeof buf - 1};
      msghdr mh{};
      mh.msg_iov = &iov;
      mh.msg_iovlen = 1;
      mh.msg_control = ctl;
      mh.msg_controllen = sizeof ctl;
      const ssize_t n = ::recvmsg(notify_fd_, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (n < 0) break;
      int pid = 0;
      for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_CREDENTIALS) {
          ucred cr;
          std::memcpy(&cr, CMSG_DATA(cm), sizeof cr);
          pid = cr.pid;
        }
      if (pid > 0) on_notify_datagram(pid, std::string(buf, size_t(n)));
    }
    do_notify_read();
  });
}

void ProcessBackend::on_notify_datagram(int pid, const std::string& text) {
  for (auto& [id, c] : children_) {
    if (c->pid != pid) continue;
    std::istringstream in(text);
    std::string line;
    bool ready = false;
    while (std::getline(in, line)) {
      if (line == "READY=1") ready = true;
      else if (line.rfind("STATUS=", 0) == 0) c->status = line.substr(7);
    }
    if (ready && !c->ready) {
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
  std::vector<std::pair<int, std::pair<ExitKind, std::string>>> gone;
  for (auto& [id, c] : children_) {
    if (c->pid <= 0) continue;
    int st = 0;
    if (::waitpid(c->pid, &st, WNOHANG) != c->pid) continue;
    ExitKind kind = ExitKind::crash;
    std::string msg;
    if (WIFEXITED(st)) {
      const int code = WEXITSTATUS(st);
      kind = code == 0 || c->stop_requested ? ExitKind::clean
             : code == kExitDoesNotFit    ? ExitKind::no_fit
                                          : ExitKind::crash;
      if (code != 0) msg = "exited with status " + std::to_string(code);
    } else if (WIFSIGNALED(st)) {
      const int sig = WTERMSIG(st);
      msg = std::string("killed by signal ") + sigabbrev_np(sig);
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
    log::info("worker " + std::to_string(id) + " (pid " + std::to_string(c->pid) + ") exited: " +
                  exit_kind_name(kind) + (msg.empty() ? "" : ", " + msg),
              {{"DS4_WORKER", std::to_string(id)}, {"DS4_EXIT", exit_kind_name(kind)}});
    c->pid = 0;
    if (c->kill_timer) c->kill_timer->cancel();
    gone.push_back({id, {kind, msg}});
  }
  for (auto& [id, km] : gone)
    if (cb_.exited) cb_.exited(id, km.first, km.second);
}

}  // namespace ds4::sup

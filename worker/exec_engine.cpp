#include "worker/exec_engine.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>

#include "shared/control_block.h"
#include "shared/error.h"
#include "shared/log.h"
#include "shared/spawn.h"
#include "shared/worker_launch.h"

namespace ds4 {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

int ms_left(Clock::time_point deadline) {
  const auto d = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  return d < 0 ? 0 : int(d);
}

bool wait_fd(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int r = ::poll(&p, 1, ms_left(deadline));
    if (r > 0) return true;
    if (r == 0 || errno != EINTR) return false;
  }
}

std::unique_ptr<control::Writer> open_record(const ExecEngineOptions& o) {
  if (o.control.empty()) return nullptr;
  try {
    return std::make_unique<control::Writer>(control::Block::attach(o.control), o.id, int(::getpid()));
  } catch (const Error& e) {
    log::warn(std::string(e.what()) + "; no heartbeat for the supervisor, ignoring");
    return nullptr;
  }
}

pid_t start_server(const std::vector<std::string>& args, const sigset_t& old_mask) {
  SpawnOptions o;
  o.argv = args;
  o.search_path = true;
  // What the supervisor told us is ours: the server must not answer systemd
  // for us (NOTIFY_SOCKET), claim our record (DS4_CONTROL) or, being a ds4
  // worker itself, take itself for an exec engine (DS4_EXEC_COMMAND).
  std::vector<std::string> drop = worker_launch_env_names();
  drop.insert(drop.end(), {"NOTIFY_SOCKET", "LISTEN_*", "WATCHDOG_USEC"});
  o.env = environment_without(drop);
  // The server must not outlive this process (a SIGKILL from the supervisor
  // for a hang reaches only us under the process backend).
  o.parent_death_signal = SIGKILL;
  o.signal_mask = old_mask;
  return spawn(o);
}

/// The status for main(), or raises the server's fatal signal on ourselves.
int end_like(const ExitStatus& status, bool stopping, bool ready) {
  if (status.exited()) {
    const int code = status.code;
    if (stopping) return code;
    // A server that fails before it ever answered most often could not get
    // the memory for its context (its plan is unknown to us): the supervisor
    // goes one rung down. Not for a command that could not run at all.
    if (!ready && code != 0 && code != 126 && code != 127) return kExitDoesNotFit;
    // A server that ends on its own with 0 did not do what it was started for.
    return code == 0 ? 1 : code;
  }
  const int sig = status.signalled() ? status.signal : SIGKILL;
  if (stopping && (sig == SIGTERM || sig == SIGINT)) return 0;
  ::signal(sig, SIG_DFL);
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, sig);
  ::sigprocmask(SIG_UNBLOCK, &s, nullptr);
  ::raise(sig);
  return 128 + sig;  // not reached for a fatal signal
}

}  // namespace

int http_get_status(int port, const std::string& path, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return 0;
  struct Closer { int fd; ~Closer() { ::close(fd); } } closer{fd};
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    if (errno != EINPROGRESS || !wait_fd(fd, POLLOUT, deadline)) return 0;
    int err = 0;
    socklen_t len = sizeof err;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) return 0;
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != ssize_t(req.size())) return 0;
  std::string head;
  char buf[512];
  while (head.find("\r\n") == std::string::npos && head.size() < 4096) {
    if (!wait_fd(fd, POLLIN, deadline)) return 0;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return 0;
    head.append(buf, size_t(n));
  }
  // "HTTP/1.1 200 OK"
  if (head.rfind("HTTP/1.", 0) != 0 || head.size() < 12) return 0;
  return std::atoi(head.c_str() + 9);
}

namespace {

/// The server and what this process says about it: its record, READY=1,
/// STOPPING=1. One thread; the loop in run_exec_engine drives it.
class EngineProcess {
 public:
  EngineProcess(const ExecEngineOptions& o, const sigset_t& child_mask) : o_(o), record_(open_record(o)) {
    if (record_) record_->set_plan(o.context, o.slots, 0, 0, 0);
    std::string shown;
    for (const auto& a : o.argv) shown += (shown.empty() ? "" : " ") + a;
    child_ = start_server(o.argv, child_mask);
    started_ = Clock::now();
    log::info("engine: started " + shown + " (pid " + std::to_string(child_) + ", port " + std::to_string(o.port) + ")",
              {{"DS4_WORKER", std::to_string(o.id)}, {"DS4_ENGINE_PID", std::to_string(child_)}});
    sd_notify(0, ("STATUS=starting the engine on port " + std::to_string(o.port)).c_str());
  }

  /// The server's wait status once it has ended.
  std::optional<ExitStatus> ended() {
    const std::optional<ExitStatus> status = try_wait(child_);
    if (!status) return std::nullopt;
    log::info("engine: the server (pid " + std::to_string(child_) + ") " + status->describe(),
              {{"DS4_WORKER", std::to_string(o_.id)}});
    if (record_) record_->set_state(control::RecordState::stopping);
    if (!stopping_ && !ready_ && status->exited())
      sd_notify(0, ("STATUS=error: the engine exited with status " + std::to_string(status->code) +
                    " before it answered on port " + std::to_string(o_.port) + " at context " +
                    std::to_string(o_.context))
                       .c_str());
    return status;
  }

  /// Asks the server whether it answers: a beat when it does; READY=1 the
  /// first time. False when it never answered within the start timeout.
  bool check_health() {
    const milliseconds timeout = ready_ ? std::max(o_.poll_every * 2, milliseconds(1000)) : milliseconds(1000);
    int code = http_get_status(o_.port, health_path_, timeout);
    if (code == 404 && health_path_ == "/health") {  // a server without /health: its model list
      health_path_ = "/v1/models";
      code = http_get_status(o_.port, health_path_, timeout);
    }
    if (code == 200) {
      if (record_) record_->beat();
      if (!ready_) become_ready();
    } else if (!ready_ && Clock::now() - started_ > o_.start_timeout) {
      sd_notify(0, ("STATUS=error: the engine did not answer GET " + health_path_ + " on port " +
                    std::to_string(o_.port) + " within the start timeout")
                       .c_str());
      return false;
    }
    next_check_ = Clock::now() + (ready_ ? o_.poll_every : milliseconds(100));
    return true;
  }

  /// SIGTERM to the server; SIGKILL after the stop timeout (kill_if_late).
  void stop() {
    if (stopping_) return;
    stopping_ = true;
    sd_notify(0, "STOPPING=1");
    if (record_) record_->set_state(control::RecordState::stopping);
    ::kill(child_, SIGTERM);
    kill_at_ = Clock::now() + o_.stop_timeout;
  }

  void kill_if_late() {
    if (!stopping_ || Clock::now() < kill_at_) return;
    ::kill(child_, SIGKILL);
    kill_at_ = Clock::time_point::max();
  }

  /// Kills the server at once and waits for it.
  void kill_now() {
    ::kill(child_, SIGKILL);
    wait_for(child_);
  }

  bool stopping() const { return stopping_; }
  bool ready() const { return ready_; }
  bool check_due() const { return !stopping_ && Clock::now() >= next_check_; }
  /// When the loop must look again (a health check, or the stop deadline).
  Clock::time_point next_wake() const {
    return stopping_ ? std::min(kill_at_, Clock::now() + milliseconds(100)) : next_check_;
  }

 private:
  void become_ready() {
    ready_ = true;
    if (record_) record_->set_state(control::RecordState::ready);
    sd_notify(0, ("READY=1\nSTATUS=engine answering on 127.0.0.1:" + std::to_string(o_.port)).c_str());
    log::info("engine: ready on port " + std::to_string(o_.port), {{"DS4_WORKER", std::to_string(o_.id)}});
  }

  const ExecEngineOptions& o_;
  std::unique_ptr<control::Writer> record_;
  pid_t child_ = -1;
  Clock::time_point started_, next_check_ = Clock::now(), kill_at_ = Clock::time_point::max();
  bool ready_ = false, stopping_ = false;
  std::string health_path_ = "/health";
};

}  // namespace

int run_exec_engine(const ExecEngineOptions& o) {
  // Signals are read synchronously (sigtimedwait) in the loop below; the
  // server gets the mask we started with.
  sigset_t wanted, old_mask;
  sigemptyset(&wanted);
  sigaddset(&wanted, SIGTERM);
  sigaddset(&wanted, SIGINT);
  sigaddset(&wanted, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &wanted, &old_mask);

  EngineProcess engine(o, old_mask);
  for (;;) {
    if (std::optional<ExitStatus> status = engine.ended()) return end_like(*status, engine.stopping(), engine.ready());
    engine.kill_if_late();
    if (engine.check_due() && !engine.check_health()) {
      engine.kill_now();
      return 1;
    }
    const int wait_ms = std::max(1, ms_left(engine.next_wake()));
    timespec ts{wait_ms / 1000, long(wait_ms % 1000) * 1000000L};
    const int sig = ::sigtimedwait(&wanted, nullptr, &ts);
    if (sig == SIGTERM || sig == SIGINT) engine.stop();
  }
}

}  // namespace ds4

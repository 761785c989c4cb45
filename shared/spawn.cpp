#include "shared/spawn.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shared/child_signals.h"
#include "shared/error.h"

extern char** environ;

namespace ds4 {

ExitStatus ExitStatus::from_wait_status(int status) {
  ExitStatus s;
  if (WIFEXITED(status)) {
    s.kind = Kind::exited;
    s.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    s.kind = Kind::signalled;
    s.signal = WTERMSIG(status);
  }
  return s;
}

std::string ExitStatus::describe() const {
  if (exited()) return "exited with status " + std::to_string(code);
  if (signalled()) {
    const char* name = sigabbrev_np(signal);
    return std::string("killed by signal ") + (name ? std::string(name) : std::to_string(signal));
  }
  return "still running";
}

namespace {

/// All of `s` to `fd`, in the child (async-signal-safe).
void say(int fd, const char* s) {
  for (size_t n = std::strlen(s); n > 0;) {
    const ssize_t w = ::write(fd, s, n);
    if (w <= 0) return;
    s += w;
    n -= size_t(w);
  }
}

/// A decimal number into `out` (async-signal-safe); returns the end.
char* put_number(char* out, long v) {
  char digits[24];
  int n = 0;
  do {
    digits[n++] = char('0' + v % 10);
    v /= 10;
  } while (v > 0);
  while (n > 0) *out++ = digits[--n];
  *out = '\0';
  return out;
}

/// The child's side of spawn(): never returns.
/// `kept` has room for o.keep_fds' copies (no allocation after the fork).
[[noreturn]] void become_child(const SpawnOptions& o, pid_t parent, char* const* argv, char** envp, char* listen_pid,
                               int procs_fd, const char* oom_text, const char* cannot_run, int* kept) {
  ChildSignals::reset_in_child();
  if (o.new_session) ::setsid();
  else if (o.new_process_group) ::setpgid(0, 0);
  if (o.parent_death_signal != 0) {
    ::prctl(PR_SET_PDEATHSIG, o.parent_death_signal);
    if (::getppid() != parent) ::_exit(127);  // the parent went before the prctl took
  }
  if (procs_fd >= 0 && ::write(procs_fd, "0", 1) != 1) ::_exit(126);
  if (oom_text[0]) {
    if (const int fd = ::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC); fd >= 0) {
      [[maybe_unused]] const ssize_t n = ::write(fd, oom_text, std::strlen(oom_text));
      ::close(fd);
    }
  }
  // Every descriptor the child gets, first above the range it will occupy,
  // then down into place (dup2 clears close-on-exec on the copy).
  const int top = 3 + int(o.keep_fds.size());
  int std_fds[3] = {o.stdin_fd, o.stdout_fd, o.stderr_fd};
  for (int& fd : std_fds)
    if (fd >= 0 && (fd = ::fcntl(fd, F_DUPFD_CLOEXEC, top)) < 0) ::_exit(126);
  const size_t n_kept = o.keep_fds.size();
  for (size_t i = 0; i < n_kept; ++i)
    if ((kept[i] = ::fcntl(o.keep_fds[i], F_DUPFD_CLOEXEC, top)) < 0) ::_exit(126);
  for (int i = 0; i < 3; ++i)
    if (std_fds[i] >= 0 && ::dup2(std_fds[i], i) < 0) ::_exit(126);
  for (size_t i = 0; i < n_kept; ++i)
    if (::dup2(kept[i], 3 + int(i)) < 0) ::_exit(126);
  close_on_exec_in_child(top);
  if (!o.cwd.empty() && ::chdir(o.cwd.c_str()) != 0) ::_exit(126);
  if (listen_pid) put_number(listen_pid + std::strlen("LISTEN_PID="), long(::getpid()));
  if (o.signal_mask) {
    ::sigprocmask(SIG_SETMASK, &*o.signal_mask, nullptr);
  } else {
    ChildSignals::unblock_all_in_child();
  }
  if (o.search_path) ::execvpe(argv[0], argv, envp);
  else ::execve(argv[0], argv, envp);
  const int e = errno;
  say(2, cannot_run);
  say(2, strerrordesc_np(e) ? strerrordesc_np(e) : "error");
  say(2, "\n");
  ::_exit(127);
}

}  // namespace

pid_t spawn(const SpawnOptions& o) {
  if (o.argv.empty()) throw Error("cannot start a program: no program named");
  // Everything the child needs, prepared before the fork.
  std::vector<std::string> env = o.env ? *o.env : environment_without({});
  char listen_text[48] = "LISTEN_PID=";
  if (o.set_listen_pid) std::erase_if(env, [](const std::string& e) { return e.starts_with("LISTEN_PID="); });
  std::vector<char*> argv, envp;
  for (const std::string& a : o.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  if (o.set_listen_pid) envp.push_back(listen_text);
  envp.push_back(nullptr);
  const std::string oom_text = o.oom_score_adj ? std::to_string(*o.oom_score_adj) : "";
  const std::string cannot_run = "cannot run " + o.argv[0] + ": ";
  int procs_fd = -1;
  if (!o.cgroup.empty()) {
    procs_fd = ::open((o.cgroup + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
    if (procs_fd < 0) throw Error("cannot start " + o.argv[0] + " in cgroup " + o.cgroup + ": " + std::strerror(errno));
  }
  std::vector<int> kept(o.keep_fds.size());
  const pid_t parent = ::getpid();
  pid_t pid;
  {
    ChildSignals signals;  // a signal before the exec must not run our handlers in the child
    pid = ::fork();
    if (pid == 0)
      become_child(o, parent, argv.data(), envp.data(), o.set_listen_pid ? listen_text : nullptr, procs_fd, oom_text.c_str(),
                   cannot_run.c_str(), kept.data());
  }
  const int e = errno;
  if (procs_fd >= 0) ::close(procs_fd);
  if (pid < 0) throw Error("cannot start " + o.argv[0] + ": fork: " + std::strerror(e));
  return pid;
}

std::vector<std::string> environment_without(const std::vector<std::string>& drop) {
  std::vector<std::string> out;
  for (char** e = environ; *e; ++e) {
    const std::string_view v(*e);
    const size_t eq = v.find('=');
    const std::string_view name = v.substr(0, eq);
    bool dropped = false;
    for (const std::string& d : drop)
      dropped = dropped || (d.ends_with('*') ? name.starts_with(std::string_view(d).substr(0, d.size() - 1)) : name == d);
    if (!dropped) out.emplace_back(v);
  }
  return out;
}

std::optional<ExitStatus> wait_for(pid_t pid) {
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, 0);
    if (r == pid) return ExitStatus::from_wait_status(status);
    if (r < 0 && errno == EINTR) continue;
    return std::nullopt;
  }
}

std::optional<ExitStatus> try_wait(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, WNOHANG) != pid) return std::nullopt;
  return ExitStatus::from_wait_status(status);
}

Captured run_captured(SpawnOptions options, std::chrono::milliseconds timeout, size_t max_out) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw Error(std::string("cannot start " + options.argv.at(0) + ": pipe: ") + std::strerror(errno));
  options.stdout_fd = p[1];
  pid_t pid;
  try {
    pid = spawn(options);
  } catch (...) {
    ::close(p[0]);
    ::close(p[1]);
    throw;
  }
  ::close(p[1]);
  Captured c;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd pf{p[0], POLLIN, 0};
    const int r = left.count() > 0 ? ::poll(&pf, 1, int(left.count())) : 0;
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      c.timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    char buf[4096];
    const ssize_t n = ::read(p[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (c.out.size() < max_out) c.out.append(buf, std::min(size_t(n), max_out - c.out.size()));
  }
  ::close(p[0]);
  // Its stdout closed: it should end now; the timeout still holds.
  while (!c.timed_out) {
    if (auto s = try_wait(pid)) {
      c.status = *s;
      return c;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      c.timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    ::usleep(2000);
  }
  c.status = wait_for(pid).value_or(ExitStatus{});
  return c;
}

}  // namespace ds4

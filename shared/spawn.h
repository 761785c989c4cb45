#pragma once
/// The one place ds4 starts another program (fork + exec), and the one place
/// that says how a child ended.
///
/// spawn() does, in the child and in this order: every signal handler back
/// to its default (shared/child_signals.h: a signal between the fork and the
/// exec must not run the parent's handlers), a new process group or session,
/// the parent-death signal (and an exit when the parent is already gone), the
/// cgroup, the OOM score, the kept descriptors moved to 3, 4, ... in order,
/// stdin/stdout/stderr redirected, every other descriptor closed at the exec,
/// the working directory, the signal mask, and the exec. What the child needs
/// is prepared before the fork: after it, only async-signal-safe calls.
/// A child that cannot get that far exits 126 (its setup failed) or 127 (the
/// program cannot run, said on its stderr), as a shell's do.

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ds4 {

/// How a child ended: from a wait status (as ninja's ExitStatus).
struct ExitStatus {
  enum class Kind { exited, signalled, running };
  Kind kind = Kind::running;
  int code = 0;    // exited: the exit status
  int signal = 0;  // signalled: the signal

  static ExitStatus from_wait_status(int status);
  bool exited() const { return kind == Kind::exited; }
  bool signalled() const { return kind == Kind::signalled; }
  /// Exited with status 0.
  bool success() const { return exited() && code == 0; }
  /// "exited with status 3", "killed by signal KILL" (the workers' exits say it so).
  std::string describe() const;
};

struct SpawnOptions {
  /// The program and its arguments; argv[0] is the file run.
  std::vector<std::string> argv;
  /// Look argv[0] up in PATH when it has no slash (execvpe).
  bool search_path = false;
  /// The child's whole environment ("NAME=value"); nullopt: this process's.
  std::optional<std::vector<std::string>> env;
  /// Set LISTEN_PID=<the child's pid> in its environment (sd_listen_fds()
  /// checks it), for a child that gets descriptors in keep_fds.
  bool set_listen_pid = false;
  /// The child's working directory; "" = ours.
  std::string cwd;
  /// Sent to the child when the thread that started it ends (PR_SET_PDEATHSIG);
  /// 0 = none: the child outlives us.
  int parent_death_signal = 0;
  /// Its own process group: a terminal's Ctrl-C meant for us does not reach it.
  bool new_process_group = false;
  /// Its own session (and process group), with no controlling terminal.
  bool new_session = false;
  /// Descriptors the child keeps, as 3, 4, ... in this order; every other one
  /// above stderr closes at the exec.
  std::vector<int> keep_fds;
  /// Descriptors that become the child's stdin, stdout, stderr; -1 = ours.
  int stdin_fd = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
  /// A cgroup directory the child joins before it execs (its memory counts
  /// there from the start); "" = ours. Opened before the fork: a cgroup that
  /// cannot be joined fails the start (exit 126).
  std::string cgroup;
  /// /proc/self/oom_score_adj for the child (1000: the kernel's first victim).
  std::optional<int> oom_score_adj;
  /// The child's signal mask; nullopt = no signal blocked.
  std::optional<sigset_t> signal_mask;
};

/// Starts the program; returns its pid. Throws ds4::Error naming the program
/// when it cannot fork (or open the cgroup). That the program ran at all
/// shows as its end: status 127 when it could not be run.
pid_t spawn(const SpawnOptions& options);

/// This process's environment without the variables named in `drop` (each a
/// name, or a prefix when it ends in '*': "LISTEN_*").
std::vector<std::string> environment_without(const std::vector<std::string>& drop);

/// Waits for child `pid` (retrying on EINTR); nullopt when it is not our child.
std::optional<ExitStatus> wait_for(pid_t pid);
/// Its end if it has ended, without waiting; nullopt while it runs (or is not ours).
std::optional<ExitStatus> try_wait(pid_t pid);

/// What run_captured() saw.
struct Captured {
  ExitStatus status;
  std::string out;       // its stdout, up to the limit
  bool timed_out = false;  // killed (SIGKILL) after the timeout
};

/// Runs the program to its end and returns its stdout (at most `max_out`
/// bytes are kept), killing it after `timeout`. options.stdout_fd is set by
/// this call. Throws ds4::Error when it cannot be started.
Captured run_captured(SpawnOptions options, std::chrono::milliseconds timeout, size_t max_out = 1 << 20);

}  // namespace ds4

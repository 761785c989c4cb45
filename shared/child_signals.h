#pragma once
/// Signals around fork() + exec. A child inherits its parent's signal
/// handlers until it execs: a SIGTERM that reaches it in between (a stop just
/// after a start) would run the parent's handler in the child. Asio's writes
/// the signal to a pipe the parent shares, so the parent would take it for
/// its own SIGTERM and stop. spawn() (shared/spawn.h) does this for every
/// program ds4 starts:
///
///   ChildSignals guard;              // every signal blocked on this thread
///   const pid_t pid = ::fork();
///   if (pid == 0) {
///     guard.reset_in_child();        // handlers back to default, still blocked
///     ...                            // setup
///     guard.unblock_in_child();      // the mask the parent's thread had, or
///     // ChildSignals::unblock_all_in_child() for a child that starts with none
///     close_on_exec_in_child();      // and none of the parent's descriptors
///     ::execve(...);
///   }
///   // the guard's end: this thread's mask as it was

#include <signal.h>

namespace ds4 {

class ChildSignals {
 public:
  ChildSignals();
  ~ChildSignals();
  ChildSignals(const ChildSignals&) = delete;
  ChildSignals& operator=(const ChildSignals&) = delete;

  /// In the child: every handler back to SIG_DFL (ignored signals too).
  /// Async-signal-safe.
  static void reset_in_child();
  /// In the child: the mask the parent's thread had before the guard.
  void unblock_in_child() const;
  /// In the child: no signal blocked.
  static void unblock_all_in_child();

 private:
  sigset_t old_;
};

/// In the child: every descriptor from `from` up (above stderr) closes at the exec. Asio and
/// others open theirs without O_CLOEXEC, so a worker would otherwise keep the
/// proxy's listening socket (still taking connections in its backlog after
/// the supervisor closed it, and holding the port against a new supervisor),
/// clients' connections and the parent's pipes. Async-signal-safe.
void close_on_exec_in_child(int from = 3);

}  // namespace ds4

// SIGTERM and SIGINT during the supervisor's start (the model load) request a
// stop instead of ending the process, and stay pending for the handler that
// run() installs; SIGHUP waits for it too. Each case runs in a forked child:
// the signal goes to a whole process, which here has only that one thread.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "supervisor/start_signals.h"

namespace {

volatile sig_atomic_t g_handled = 0;
void on_signal(int sig) { g_handled = sig; }

// Bits of the child's exit status: what went wrong.
enum : int { kStoppedTooSoon = 1, kStopWrong = 2, kNotPending = 4, kNotHandled = 8 };

// Sends `sig` to the process while a StartSignals lives, waits up to 1 s for
// the stop, then installs a handler and unblocks, as run() does. Returns the
// child's exit status: 0, or the bits above.
int signal_during_start(int sig, bool expect_stop) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    {
      ds4::sup::StartSignals signals;
      if (signals.token().stop_requested()) code |= kStoppedTooSoon;
      ::kill(::getpid(), sig);  // the default action would end the child here
      for (int i = 0; i < 1000 && !signals.token().stop_requested(); ++i) ::usleep(1000);
      if (signals.token().stop_requested() != expect_stop) code |= kStopWrong;
    }
    sigset_t pending;
    sigpending(&pending);
    if (!sigismember(&pending, sig)) code |= kNotPending;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, nullptr);
    ds4::sup::StartSignals::unblock();
    if (g_handled != sig) code |= kNotHandled;
    ::_exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));  // not killed by the signal
  return WEXITSTATUS(status);
}

}  // namespace

TEST_CASE("start signals: SIGTERM and SIGINT request the stop, and reach the handler installed after") {
  CHECK(signal_during_start(SIGTERM, true) == 0);
  CHECK(signal_during_start(SIGINT, true) == 0);
}

TEST_CASE("start signals: SIGHUP waits for the handler, and stops nothing") {
  CHECK(signal_during_start(SIGHUP, false) == 0);
}

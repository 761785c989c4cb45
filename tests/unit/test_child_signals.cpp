// A signal that reaches a forked child before its exec runs the default
// action there, never the parent's handler (which, for Asio's, would tell the
// parent it got the signal itself); and the exec'd child keeps none of the
// parent's descriptors.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <optional>
#include <string>

#include "shared/child_signals.h"

namespace {

int g_pipe = -1;
void parent_handler(int) { (void)!::write(g_pipe, "P", 1); }

// Forks with (or without) the guard; the child signals it is up, waits to be
// told to go on, then unblocks and exits 0. The parent sends SIGTERM in
// between. Returns the child's wait status; `ran_handler` says whether the
// parent's handler ran in the child.
int term_before_exec(bool guarded, bool& ran_handler) {
  int handler_pipe[2], ready[2], go[2];
  REQUIRE(::pipe(handler_pipe) == 0);
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(go) == 0);
  g_pipe = handler_pipe[1];
  struct sigaction sa {}, old {};
  sa.sa_handler = parent_handler;
  sigemptyset(&sa.sa_mask);
  REQUIRE(::sigaction(SIGTERM, &sa, &old) == 0);
  pid_t pid = -1;
  {
    std::optional<ds4::ChildSignals> guard;
    if (guarded) guard.emplace();
    pid = ::fork();
    if (pid == 0) {
      if (guarded) ds4::ChildSignals::reset_in_child();
      char c = 0;
      (void)!::write(ready[1], "r", 1);
      (void)!::read(go[0], &c, 1);
      ds4::ChildSignals::unblock_all_in_child();
      ::_exit(0);  // as an execve would end the child's share of our code
    }
  }
  REQUIRE(pid > 0);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  REQUIRE(::kill(pid, SIGTERM) == 0);
  if (!guarded) ::usleep(50 * 1000);  // unguarded, it is delivered at once
  (void)!::write(go[1], "g", 1);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  ::sigaction(SIGTERM, &old, nullptr);
  ::close(handler_pipe[1]);
  ran_handler = ::read(handler_pipe[0], &c, 1) == 1;
  for (int fd : {handler_pipe[0], ready[0], ready[1], go[0], go[1]}) ::close(fd);
  return status;
}

}  // namespace

TEST_CASE("child signals: a SIGTERM before the exec kills the child, and never runs the parent's handler there") {
  bool ran = false;
  const int status = term_before_exec(true, ran);
  CHECK_FALSE(ran);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGTERM);

  // Without the guard (how it was): the parent's handler runs in the child,
  // which then goes on as if nothing happened.
  const int unguarded = term_before_exec(false, ran);
  CHECK(ran);
  CHECK(WIFEXITED(unguarded));
}

TEST_CASE("child signals: the guard restores the parent thread's mask") {
  sigset_t before, after;
  ::pthread_sigmask(SIG_SETMASK, nullptr, &before);
  { ds4::ChildSignals guard; }
  ::pthread_sigmask(SIG_SETMASK, nullptr, &after);
  CHECK(sigismember(&before, SIGTERM) == sigismember(&after, SIGTERM));
  CHECK(sigismember(&before, SIGUSR1) == sigismember(&after, SIGUSR1));
}

// The exec'd child sees none of the parent's descriptors above stderr (a
// listening socket, a pipe), only what it opens itself; without the call it
// would see them.
TEST_CASE("child: close_on_exec_in_child leaves the exec'd program no inherited descriptor") {
  for (const bool closing : {false, true}) {
    CAPTURE(closing);
    int p[2];
    REQUIRE(::pipe(p) == 0);  // no O_CLOEXEC, as Asio's descriptors
    const std::string test = "test -e /proc/self/fd/" + std::to_string(p[0]);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      if (closing) ds4::close_on_exec_in_child();
      ::execl("/bin/sh", "sh", "-c", test.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == (closing ? 1 : 0));  // test -e: 0 = the descriptor is there
    ::close(p[0]);
    ::close(p[1]);
    // The parent's descriptors are untouched.
    CHECK(::fcntl(STDERR_FILENO, F_GETFD) >= 0);
  }
}

#include "shared/child_signals.h"

#include <fcntl.h>
#include <linux/close_range.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

namespace ds4 {

ChildSignals::ChildSignals() {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old_);
}

ChildSignals::~ChildSignals() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }

void ChildSignals::reset_in_child() {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (int sig = 1; sig < NSIG; ++sig)
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);  // fails harmlessly for reserved ones
}

void ChildSignals::unblock_in_child() const { sigprocmask(SIG_SETMASK, &old_, nullptr); }

void ChildSignals::unblock_all_in_child() {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
}

void close_on_exec_in_child(int from) {
  if (::close_range(unsigned(from), ~0U, CLOSE_RANGE_CLOEXEC) == 0) return;
  // A kernel before 5.11: one by one, up to the descriptor limit.
  struct rlimit limit {};
  const rlim_t top = ::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < (rlim_t(1) << 20) ? limit.rlim_cur
                                                                                                   : rlim_t(1) << 20;
  for (int fd = from; rlim_t(fd) < top; ++fd)
    if (const int flags = ::fcntl(fd, F_GETFD); flags >= 0 && !(flags & FD_CLOEXEC)) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

}  // namespace ds4

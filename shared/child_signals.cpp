#include "shared/child_signals.h"

#include <pthread.h>

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

}  // namespace ds4

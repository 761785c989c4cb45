#include "supervisor/start_signals.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

#include "shared/error.h"

namespace ds4::sup {

namespace {

sigset_t set_of(std::initializer_list<int> signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : signals) sigaddset(&set, sig);
  return set;
}

sigset_t blocked_signals() { return set_of({SIGTERM, SIGINT, SIGHUP}); }

}  // namespace

StartSignals::StartSignals() {
  const sigset_t blocked = blocked_signals();
  pthread_sigmask(SIG_BLOCK, &blocked, nullptr);
  const sigset_t stopping = set_of({SIGTERM, SIGINT});
  signals_ = store::UniqueFd(::signalfd(-1, &stopping, SFD_CLOEXEC));
  if (!signals_) throw Error(std::string("cannot watch for SIGTERM during the start: signalfd: ") + std::strerror(errno));
  wake_ = store::UniqueFd(::eventfd(0, EFD_CLOEXEC));
  if (!wake_) throw Error(std::string("cannot watch for SIGTERM during the start: eventfd: ") + std::strerror(errno));
  watcher_ = std::thread([this] { watch(); });  // it inherits the blocked signals
}

StartSignals::~StartSignals() {
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  watcher_.join();
}

void StartSignals::watch() {
  pollfd fds[2] = {{signals_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
  while (::poll(fds, 2, -1) < 0 && errno == EINTR) {}
  // Not read: the signal stays pending for the signal_set that unblock() lets it through to.
  if (fds[0].revents & POLLIN) stop_.request_stop();
}

void StartSignals::unblock() {
  const sigset_t blocked = blocked_signals();
  pthread_sigmask(SIG_UNBLOCK, &blocked, nullptr);
}

}  // namespace ds4::sup

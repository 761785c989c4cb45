#pragma once
/// SIGTERM and SIGINT while the supervisor starts (Supervisor::prepare():
/// loading an 80 GB model takes minutes), before run() has the signal_set
/// that handles them. Their default action would end the process in the
/// middle of the load and leave the half-written segment in /dev/shm. While a
/// StartSignals lives they are blocked instead, in the thread that made it
/// and in every thread started from it, and the first one requests a stop on
/// token(): a load given that token ends at its next chunk and removes what
/// it wrote (store::LoadCancelled). SIGHUP is blocked as well: a reload asked
/// for during the start is done once the supervisor runs.
///
/// The signal is left pending, not taken: once the signal_set is there,
/// unblock() lets it through to it, so a stop that comes after the load (the
/// workers' plans being computed) still reaches the usual shutdown.
///
///   StartSignals signals;             // before any other thread starts
///   store::load(path, {.stop = signals.token()});
///   ...                               // install the handlers (asio::signal_set)
///   StartSignals::unblock();          // on the thread that made the StartSignals

#include <stop_token>
#include <thread>

#include "shared/model_store.h"

namespace ds4::sup {

class StartSignals {
 public:
  /// Blocks SIGTERM, SIGINT and SIGHUP on this thread and watches for the
  /// first two. Throws ds4::Error when it cannot watch (no descriptors left).
  StartSignals();
  /// Stops watching. The signals stay blocked, and a pending one pending, until unblock().
  ~StartSignals();
  StartSignals(const StartSignals&) = delete;
  StartSignals& operator=(const StartSignals&) = delete;

  /// Stop requested once SIGTERM or SIGINT came.
  std::stop_token token() const { return stop_.get_token(); }

  /// Unblocks SIGTERM, SIGINT and SIGHUP on this thread; one pending is delivered now.
  static void unblock();

 private:
  void watch();

  std::stop_source stop_;
  store::UniqueFd signals_;  // signalfd of SIGTERM and SIGINT, never read
  store::UniqueFd wake_;     // eventfd: the destructor ends the watch
  std::thread watcher_;
};

}  // namespace ds4::sup

#pragma once
/// A busy poll of an io_context: the proxy's loop and an idle worker's poll
/// what becomes ready for a short while before they sleep, so that an event
/// that comes meanwhile skips the wake-up of a sleeping thread (about 10 us
/// on an idle core). proxy.busy_poll and workers.busy_poll say how long.
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <functional>

namespace ds4 {

/// Runs the first handler that becomes ready on `io` within `spin`, polling
/// without sleeping; true when one ran (at once when one was ready).
inline bool poll_busily(boost::asio::io_context& io, std::chrono::microseconds spin) {
  if (spin.count() <= 0) return false;
  const auto until = std::chrono::steady_clock::now() + spin;
  do {
    if (io.poll_one() > 0) return true;
  } while (!io.stopped() && std::chrono::steady_clock::now() < until);
  return false;
}

/// Runs `io` until it stops, as io.run() does, except that once no handler
/// is ready it keeps polling for busy_poll() (asked each time: a reload may
/// change it) before it sleeps.
inline void run_busy_polling(boost::asio::io_context& io, const std::function<std::chrono::microseconds()>& busy_poll) {
  while (!io.stopped())
    if (!poll_busily(io, busy_poll())) io.run_one();
}

}  // namespace ds4

#pragma once
/// Boost.Asio for the supervisor, included in one place.
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <chrono>
#include <functional>

namespace ds4::sup {
namespace asio = boost::asio;

/// Runs `io` until it stops, as io.run() does, except that once no handler
/// is ready it keeps polling for busy_poll() (asked each time: a reload may
/// change it) before it sleeps. An answer that comes meanwhile is handled
/// without the wake-up of a sleeping thread (about 10 us on an idle core).
inline void run_busy_polling(asio::io_context& io, const std::function<std::chrono::microseconds()>& busy_poll) {
  using Clock = std::chrono::steady_clock;
  while (!io.stopped()) {
    const std::chrono::microseconds spin = busy_poll();
    if (spin.count() > 0) {
      const auto until = Clock::now() + spin;
      bool ran = false;
      while (!ran && !io.stopped() && Clock::now() < until) ran = io.poll_one() > 0;
      if (ran) continue;
    }
    io.run_one();
  }
}

}  // namespace ds4::sup

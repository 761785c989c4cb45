#pragma once
/// Boost.Asio for the supervisor, included in one place.
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <chrono>
#include <functional>

#include "shared/busy_poll.h"

namespace ds4::sup {
namespace asio = boost::asio;

/// Runs `io` until it stops, as io.run() does, except that once no handler
/// is ready it keeps polling for busy_poll() (asked each time: a reload may
/// change it) before it sleeps (shared/busy_poll.h).
inline void run_busy_polling(asio::io_context& io, const std::function<std::chrono::microseconds()>& busy_poll) {
  while (!io.stopped())
    if (!poll_busily(io, busy_poll())) io.run_one();
}

}  // namespace ds4::sup

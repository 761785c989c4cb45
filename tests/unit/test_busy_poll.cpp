// The proxy's run loop with a busy poll (shared/busy_poll.h).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>

#include "shared/busy_poll.h"

using namespace std::chrono_literals;
namespace asio = boost::asio;

TEST_CASE("busy poll: every handler runs, and the loop ends when the work does, as io.run()") {
  for (const auto spin : {0us, 200us}) {
    CAPTURE(spin.count());
    asio::io_context io(1);
    int ran = 0;
    asio::steady_timer timer(io);
    timer.expires_after(5ms);
    timer.async_wait([&](boost::system::error_code ec) {
      CHECK_FALSE(ec);
      ++ran;
      asio::post(io, [&] { ++ran; });
    });
    asio::post(io, [&] { ++ran; });
    int asked = 0;
    ds4::run_busy_polling(io, [&] {
      ++asked;
      return spin;
    });
    CHECK(ran == 3);
    CHECK(asked >= 1);  // asked each round: a reload can change it
    CHECK(io.stopped());
  }
}

TEST_CASE("busy poll: io.stop() from a handler ends it") {
  asio::io_context io(1);
  auto guard = asio::make_work_guard(io);  // never out of work
  asio::steady_timer timer(io);
  timer.expires_after(2ms);
  timer.async_wait([&](boost::system::error_code) { io.stop(); });
  ds4::run_busy_polling(io, [] { return 100us; });
  CHECK(io.stopped());
}

TEST_CASE("busy poll: work posted from another thread while it polls or sleeps is run") {
  for (const std::chrono::microseconds spin : {0us, 10000us}) {
    CAPTURE(spin.count());
    asio::io_context io(1);
    auto guard = asio::make_work_guard(io);
    std::atomic<int> ran = 0;
    std::jthread other([&] {
      for (int i = 0; i < 20; ++i) {
        std::this_thread::sleep_for(1ms);
        asio::post(io, [&] { ++ran; });
      }
      asio::post(io, [&] { guard.reset(); });
    });
    ds4::run_busy_polling(io, [&] { return spin; });
    CHECK(ran == 20);
  }
}

#pragma once
/// Boost.Asio for the supervisor, included in one place.
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>

namespace ds4::sup {
namespace asio = boost::asio;
}  // namespace ds4::sup

#include "supervisor/worker_health.h"

#include <chrono>

namespace ds4::sup {

namespace {

using local = asio::local::stream_protocol;

/// One probe: connect, send the info request, read one line, all within a
/// deadline. Exactly one call of `done`.
class Probe : public std::enable_shared_from_this<Probe> {
 public:
  Probe(asio::io_context& io, std::function<void(bool)> done) : sock_(io), timer_(io), done_(std::move(done)) {}

  void run(const std::string& path, Duration timeout) {
    auto self = shared_from_this();
    timer_.expires_after(timeout);
    timer_.async_wait([this, self](boost::system::error_code ec) {
      if (ec) return;
      // An answer already waiting counts (we may be the ones who were late).
      boost::system::error_code e2;
      finish(sock_.is_open() && sock_.available(e2) > 0 && !e2);
    });
    sock_.async_connect(local::endpoint(path), [this, self](boost::system::error_code ec) {
      if (ec) return finish(false);
      asio::async_write(sock_, asio::buffer(kRequest, sizeof kRequest - 1),
                        [this, self](boost::system::error_code ec, size_t) {
                          if (ec) return finish(false);
                          asio::async_read_until(sock_, asio::dynamic_buffer(line_, 1 << 20), '\n',
                                                 [this, self](boost::system::error_code ec, size_t) {
                                                   finish(!ec && line_.find("\"info\"") != std::string::npos);
                                                 });
                        });
    });
  }

 private:
  static constexpr char kRequest[] = "{\"op\":\"info\"}\n";

  void finish(bool answered) {
    if (!done_) return;
    auto done = std::move(done_);
    done_ = nullptr;
    timer_.cancel();
    boost::system::error_code ignored;
    sock_.close(ignored);
    done(answered);
  }

  local::socket sock_;
  asio::steady_timer timer_;
  std::string line_;
  std::function<void(bool)> done_;
};

}  // namespace

WorkerHealth::WorkerHealth(asio::io_context& io, control::Block block) : io_(io), block_(std::move(block)) {}

std::optional<control::Snapshot> WorkerHealth::record(int id) const { return block_.read(id); }

void WorkerHealth::probe(const std::string& socket, Duration timeout, std::function<void(bool)> done) {
  auto p = std::make_shared<Probe>(io_, std::move(done));
  // Posted: done never runs inside probe(), even when connect fails at once.
  asio::post(io_, [p, socket, timeout] { p->run(socket, timeout); });
}

}  // namespace ds4::sup

#include "supervisor/segment_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <memory>

#include "shared/error.h"
#include "shared/log.h"
#include "shared/segment_socket.h"

namespace ds4::sup {

namespace {

using local = asio::local::stream_protocol;

/// One connection: a segment name in, its descriptor (or why not) out.
class SegmentSession : public std::enable_shared_from_this<SegmentSession> {
 public:
  SegmentSession(asio::io_context& io, local::socket s, const MemfdSegments& segments)
      : sock_(std::move(s)), timer_(io), segments_(segments) {}

  void start(Duration timeout) {
    auto self = shared_from_this();
    timer_.expires_after(timeout);
    timer_.async_wait([this, self](boost::system::error_code ec) {
      if (ec) return;
      boost::system::error_code ignored;
      sock_.close(ignored);  // a client that never finishes its request
    });
    asio::async_read_until(sock_, asio::dynamic_buffer(buf_, store::kMaxSegmentRequest), '\n',
                           [this, self](boost::system::error_code ec, size_t) { on_read(ec); });
  }

 private:
  void on_read(boost::system::error_code ec) {
    timer_.cancel();
    if (ec && ec != asio::error::not_found) return;
    const int s = sock_.native_handle();
    const std::string name = store::parse_segment_request(buf_);
    if (name.empty()) return store::send_segment_error(s, "bad request: expected a segment name and a newline");
    const std::shared_ptr<store::UniqueFd> fd = segments_.fd(name);
    if (!fd) {
      store::send_segment_error(s, "this supervisor keeps no memfd segment named " + name +
                                       " (the model changed or was reloaded; the worker is restarted on the current one)");
      return;
    }
    if (std::string err = store::send_segment_fd(s, fd->get()); !err.empty()) {
      log::warn("cannot pass memfd segment " + name + " to a client: " + err + ", ignoring",
                {{"DS4_SEGMENT", store::memfd_handle(name)}});
    }
  }

  local::socket sock_;
  asio::steady_timer timer_;
  const MemfdSegments& segments_;
  std::string buf_;
};

}  // namespace

SegmentServer::SegmentServer(asio::io_context& io, std::string path, const MemfdSegments& segments,
                             Duration request_timeout)
    : io_(io), listener_(io, std::move(path), "segment"), segments_(segments), request_timeout_(request_timeout) {
  do_accept();
}

SegmentServer::~SegmentServer() = default;

void SegmentServer::close() { listener_.close(); }

void SegmentServer::do_accept() {
  listener_.acceptor().async_accept([this](boost::system::error_code ec, local::socket s) {
    if (ec == asio::error::operation_aborted) return;
    if (!ec) std::make_shared<SegmentSession>(io_, std::move(s), segments_)->start(request_timeout_);
    if (listener_.is_open()) do_accept();
  });
}

}  // namespace ds4::sup

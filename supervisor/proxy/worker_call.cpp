#include "supervisor/proxy/worker_call.h"

#include "shared/error.h"

namespace ds4::proxy {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;

WorkerCall::WorkerCall(asio::io_context& io, std::string socket_path, std::string request_line, Handler h)
    : sock_(io), path_(std::move(socket_path)), request_(std::move(request_line)), h_(std::move(h)) {}

void WorkerCall::start() {
  sock_.async_connect(local::endpoint(path_),
                      [self = shared_from_this()](const boost::system::error_code& ec) { self->on_connect(ec); });
}

void WorkerCall::cancel() {
  finished_ = true;
  boost::system::error_code ignored;
  sock_.close(ignored);
}

void WorkerCall::on_connect(const boost::system::error_code& ec) {
  if (finished_) return;
  if (ec) return broken("cannot connect to " + path_ + ": " + ec.message());
  asio::async_write(sock_, asio::buffer(request_), [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
    if (self->finished_) return;
    if (ec) return self->broken("cannot send to " + self->path_ + ": " + ec.message());
  });
  do_read();
}

void WorkerCall::do_read() {
  asio::async_read_until(sock_, asio::dynamic_buffer(buf_, proto::kMaxLineBytes), '\n',
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t n) { self->on_read(ec, n); });
}

void WorkerCall::on_read(const boost::system::error_code& ec, size_t n) {
  if (finished_) return;
  if (ec) return broken(ec == asio::error::eof ? "the worker closed the connection" : ec.message());
  proto::Event e;
  try {
    e = proto::parse_event(std::string_view(buf_).substr(0, n - 1));
  } catch (const Error& err) {
    return broken(err.what());
  }
  buf_.erase(0, n);
  answered_ = true;
  const bool last = e.kind == proto::Event::Kind::done || e.kind == proto::Event::Kind::error;
  if (last) cancel();
  auto self = shared_from_this();  // the handler may drop the last other reference
  h_.on_event(std::move(e));
  if (!last && !finished_) do_read();
}

void WorkerCall::broken(const std::string& why) {
  const bool answered = answered_;
  cancel();
  auto self = shared_from_this();
  h_.on_broken(why, answered);
}

}  // namespace ds4::proxy

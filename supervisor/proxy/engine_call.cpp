#include "supervisor/proxy/engine_call.h"

#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cstring>
#include <limits>

namespace ds4::proxy {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

struct EngineCall::Impl {
  Impl(asio::io_context& io, EngineLimits l, Handler h) : sock(io), limits(l), handler(std::move(h)) {}
  tcp::socket sock;
  EngineLimits limits;
  Handler handler;
  std::string request;
  beast::flat_buffer buf;
  http::response_parser<http::buffer_body> parser;
  char chunk[16384];
  std::string whole;        // a non-stream answer, until it ends
  bool streaming = false;
  bool head_seen = false;
  bool finished = false;    // done, broken or cancelled: no handler runs any more
  bool stream_wanted = false;
};

EngineCall::EngineCall(asio::io_context& io, EngineLimits limits, Handler h)
    : impl_(std::make_shared<Impl>(io, limits, std::move(h))) {}

// An operation still pending completes later, aborted, and finds no call:
// the Impl it holds (its buffers, its socket) goes with it.
EngineCall::~EngineCall() {
  impl_->finished = true;
  impl_->handler = {};
  boost::system::error_code ignored;
  impl_->sock.close(ignored);
}

std::string serialize_engine_request(const EngineRequest& r, int port) {
  std::string out = r.method + " " + (r.target.empty() ? "/" : r.target) + " HTTP/1.1\r\n";
  out += "Host: 127.0.0.1:" + std::to_string(port) + "\r\n";
  out += "Content-Type: " + (r.content_type.empty() ? std::string("application/json") : r.content_type) + "\r\n";
  out += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  if (r.stream) out += "Accept: text/event-stream\r\n";
  out += "Connection: close\r\n\r\n";
  out += r.body;
  return out;
}

void EngineCall::fail(const std::string& why, bool replay) {
  Impl& m = *impl_;
  if (m.finished) return;
  m.finished = true;
  boost::system::error_code ignored;
  m.sock.close(ignored);
  Handler h = std::move(m.handler);  // the handler may drop the last reference to us
  if (h.broken) h.broken(why, replay);
}

void EngineCall::cancel() {
  impl_->finished = true;
  boost::system::error_code ignored;
  impl_->sock.close(ignored);
}

std::shared_ptr<EngineCall> EngineCall::start(asio::io_context& io, int port, const EngineRequest& req,
                                              const EngineLimits& limits, Handler h) {
  auto call = std::make_shared<EngineCall>(io, limits, std::move(h));
  Impl& m = *call->impl_;
  m.request = serialize_engine_request(req, port);
  m.stream_wanted = req.stream;
  m.parser.header_limit(limits.max_header_bytes);
  // Streams may be long; whole answers are bounded in on_read. (Boost 1.74's
  // body_limit(boost::none) keeps a limit for Content-Length bodies.)
  m.parser.body_limit(std::numeric_limits<std::uint64_t>::max());
  const tcp::endpoint ep(asio::ip::address_v4::loopback(), uint16_t(port));
  std::weak_ptr<EngineCall> w = call;
  m.sock.async_connect(ep, [w, keep = call->impl_](const boost::system::error_code& ec) {
    auto self = w.lock();
    if (!self || self->impl_->finished) return;
    if (ec) return self->fail("cannot connect to the engine: " + ec.message());
    boost::system::error_code ignored;
    self->impl_->sock.set_option(tcp::no_delay(true), ignored);
    asio::async_write(self->impl_->sock, asio::buffer(self->impl_->request),
                      [w, keep](const boost::system::error_code& ec, size_t) {
                        (void)keep;
                        auto self = w.lock();
                        if (!self || self->impl_->finished) return;
                        if (ec) return self->fail("cannot send to the engine: " + ec.message());
                        self->read_more();
                      });
  });
  return call;
}

void EngineCall::read_more() {
  Impl& m = *impl_;
  m.parser.get().body().data = m.chunk;
  m.parser.get().body().size = sizeof m.chunk;
  std::weak_ptr<EngineCall> w = shared_from_this();
  http::async_read_some(m.sock, m.buf, m.parser, [w, keep = impl_](boost::system::error_code ec, size_t) {
    (void)keep;
    auto self = w.lock();
    if (!self || self->impl_->finished) return;
    self->on_read(ec);
  });
}

void EngineCall::on_read(boost::system::error_code ec) {
  Impl& m = *impl_;
  if (ec == http::error::need_buffer) ec = {};
  if (ec == asio::error::eof || ec == http::error::end_of_stream || ec == http::error::partial_message ||
      ec == asio::error::connection_reset)
    return fail("the engine closed the connection before the answer ended");
  if (ec == http::error::header_limit)
    return fail("the engine's answer headers are larger than " + std::to_string(m.limits.max_header_bytes) +
                    " bytes (proxy.limits.max_header_bytes)", false);
  if (std::strcmp(ec.category().name(), "beast.http") == 0)  // malformed: it would be again
    return fail("the engine's answer is not valid HTTP: " + ec.message(), false);
  if (ec) return fail("reading the engine's answer: " + ec.message());
  if (!m.head_seen && m.parser.is_header_done()) {
    m.head_seen = true;
    const int status = int(m.parser.get().result_int());
    if (status == 503) return fail("the engine answered 503 (not ready)");
    m.streaming = m.stream_wanted && status == 200;
    std::string ct(m.parser.get()[http::field::content_type]);
    if (m.handler.head && m.streaming) m.handler.head(status, ct, true);
    if (m.finished) return;
  }
  const size_t n = sizeof m.chunk - m.parser.get().body().size;
  if (n > 0) {
    if (m.streaming) {
      if (m.handler.data) m.handler.data(std::string_view(m.chunk, n));
      if (m.finished) return;
    } else {
      if (m.whole.size() + n > m.limits.max_body_bytes)
        return fail("the engine's answer is larger than " + std::to_string(m.limits.max_body_bytes) +
                    " bytes (proxy.limits.max_body_bytes)", false);
      m.whole.append(m.chunk, n);
    }
  }
  if (!m.parser.is_done()) return read_more();
  m.finished = true;
  boost::system::error_code ignored;
  m.sock.close(ignored);
  Handler h = std::move(m.handler);  // the handlers may drop the last reference to us
  if (!m.streaming) {
    std::string ct(m.parser.get()[http::field::content_type]);
    if (h.head) h.head(int(m.parser.get().result_int()), ct, false);
    if (h.data && !m.whole.empty()) h.data(m.whole);
  }
  if (h.done) h.done();
}

}  // namespace ds4::proxy

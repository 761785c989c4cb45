#pragma once
/// One generate request to one worker over its Unix socket (shared/protocol.h):
/// connect, send the request line, read event lines until done or error.
/// Closing the connection cancels the work on the worker. A connection that
/// fails or ends before done/error is reported as broken, with whether the
/// worker had answered at all (a refused connect is not a death mid-answer).

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <functional>
#include <memory>
#include <string>

#include "shared/protocol.h"

namespace ds4::proxy {

class WorkerCall : public std::enable_shared_from_this<WorkerCall> {
 public:
  struct Handler {
    std::function<void(proto::Event&&)> on_event;             // token, then done or error
    std::function<void(const std::string& why, bool answered)> on_broken;
  };

  WorkerCall(boost::asio::io_context& io, std::string socket_path, std::string request_line, Handler h);
  void start();
  /// Closes the connection; no callback runs after this.
  void cancel();

 private:
  void on_connect(const boost::system::error_code& ec);
  void do_read();
  void on_read(const boost::system::error_code& ec, size_t n);
  void broken(const std::string& why);

  boost::asio::local::stream_protocol::socket sock_;
  std::string path_;
  std::string request_;
  Handler h_;
  std::string buf_;
  bool answered_ = false;
  bool finished_ = false;
};

}  // namespace ds4::proxy

#pragma once
/// A Unix socket only its owner may connect to, for the supervisor's own
/// sockets (admin, memfd segments).
#include <string>

#include "supervisor/asio.h"

namespace ds4::sup {

class PrivateListener {
 public:
  /// Listens on `path` (a stale socket there is replaced), created with mode
  /// 0600 from the start: no window in which others could connect. `what`
  /// names it in the error. Throws ds4::Error.
  PrivateListener(asio::io_context& io, std::string path, const std::string& what);
  /// Closes it and removes the path.
  ~PrivateListener();
  PrivateListener(const PrivateListener&) = delete;
  PrivateListener& operator=(const PrivateListener&) = delete;

  /// Stops accepting (a pending accept ends with operation_aborted) and
  /// removes the path; again, nothing.
  void close();
  bool is_open() const { return acceptor_.is_open(); }
  asio::local::stream_protocol::acceptor& acceptor() { return acceptor_; }
  const std::string& path() const { return path_; }

 private:
  asio::local::stream_protocol::acceptor acceptor_;
  std::string path_;
};

}  // namespace ds4::sup

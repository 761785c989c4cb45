#pragma once
/// The supervisor's side of shared/segment_socket.h: serves the descriptors
/// of the memfd segments it keeps (MemfdSegments) to workers and holders on
/// $XDG_RUNTIME_DIR/ds4/segments.sock (mode 0600 in a 0700 folder), one
/// request per connection. A client that does not finish its request line
/// within `request_timeout` is dropped.

#include <string>

#include "supervisor/asio.h"
#include "supervisor/memfd_segments.h"
#include "supervisor/policy.h"
#include "supervisor/private_listener.h"

namespace ds4::sup {

class SegmentServer {
 public:
  /// Binds `path` (replacing a stale socket). Throws ds4::Error.
  SegmentServer(asio::io_context& io, std::string path, const MemfdSegments& segments,
                Duration request_timeout = std::chrono::seconds(5));
  ~SegmentServer();
  SegmentServer(const SegmentServer&) = delete;
  SegmentServer& operator=(const SegmentServer&) = delete;
  void close();
  const std::string& path() const { return listener_.path(); }

 private:
  void do_accept();
  asio::io_context& io_;
  PrivateListener listener_;
  const MemfdSegments& segments_;
  Duration request_timeout_;
};

}  // namespace ds4::sup

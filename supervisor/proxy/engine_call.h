#pragma once
/// One request forwarded as it came to an exec engine (workers.engine: exec)
/// over HTTP/1.1 on 127.0.0.1, its answer read back with limits. A stream
/// (the client asked for one and the engine answers 200) is handed on as its
/// body bytes come; any other answer is read whole first, so it can still be
/// replayed elsewhere if the engine dies before it ends. A 503 from the engine
/// (still loading, overloaded) counts as a refusal: nothing was answered.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp needs std::exchange

#include <boost/asio.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace ds4::proxy {

struct EngineRequest {
  std::string method = "POST";
  std::string target;        // path and query, as the client sent them
  std::string content_type;  // of the body
  std::string body;
  bool stream = false;       // the client asked for a stream
};

struct EngineLimits {
  uint32_t max_header_bytes = 64 * 1024;
  uint64_t max_body_bytes = 16u << 20;  // a whole (non-stream) answer
};

class EngineCall : public std::enable_shared_from_this<EngineCall> {
 public:
  struct Handler {
    /// The answer's status and content type; `streaming`: data follows as it comes.
    std::function<void(int status, const std::string& content_type, bool streaming)> head;
    std::function<void(std::string_view bytes)> data;
    std::function<void()> done;
    /// No complete answer. `replay`: refused, closed early, 503 — another
    /// try may succeed; else malformed or over a limit (it would again).
    std::function<void(const std::string& why, bool replay)> broken;
  };

  static std::shared_ptr<EngineCall> start(boost::asio::io_context& io, int port, const EngineRequest& req,
                                           const EngineLimits& limits, Handler h);
  /// Closes the connection; no handler runs after.
  void cancel();
  ~EngineCall();

  EngineCall(boost::asio::io_context& io, EngineLimits limits, Handler h);

 private:
  struct Impl;
  void read_more();
  void on_read(boost::system::error_code ec);
  void fail(const std::string& why, bool replay = true);
  // Shared with the socket's pending operations: a read in flight writes to
  // the buffers in here when it completes, even after this call is gone.
  std::shared_ptr<Impl> impl_;
};

/// The request's bytes as sent to the engine (HTTP/1.1, Connection: close).
std::string serialize_engine_request(const EngineRequest& r, int port);

}  // namespace ds4::proxy

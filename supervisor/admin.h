#pragma once
/// The admin endpoint `ds4ctl` talks to: a Unix stream socket (mode 0600 in a
/// 0700 folder), one JSON request line per connection, one JSON answer line:
///   {"cmd":"status"} {"cmd":"events"} {"cmd":"drain","worker":0}
///   {"cmd":"restart","worker":0} {"cmd":"context","worker":0,"size":2048}
///   {"cmd":"reload"}
/// Answers are {"ok":true,...} or {"ok":false,"error":"..."}. What a command
/// does is the handler's business (a plain function of the request).

#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "supervisor/asio.h"
#include "supervisor/private_listener.h"

namespace ds4::sup {

using AdminHandler = std::function<nlohmann::json(const nlohmann::json& request)>;

/// Longest request line accepted.
inline constexpr size_t kAdminMaxRequest = 64 * 1024;

class AdminServer {
 public:
  /// Binds `path` (replacing a stale socket) with mode 0600. Throws ds4::Error.
  AdminServer(asio::io_context& io, std::string path, AdminHandler handler);
  ~AdminServer();
  void close();

 private:
  void do_accept();
  PrivateListener listener_;
  AdminHandler handler_;
};

/// Client side (ds4ctl, tests): sends one request, returns the answer.
/// Throws ds4::Error when the supervisor cannot be reached.
nlohmann::json admin_call(const std::string& path, const nlohmann::json& request,
                          std::chrono::milliseconds timeout = std::chrono::seconds(30));

}  // namespace ds4::sup

#include "supervisor/admin.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shared/error.h"
#include "shared/log.h"

namespace ds4::sup {

namespace {

using local = asio::local::stream_protocol;

/// One admin connection: a request line in, an answer line out.
class AdminSession : public std::enable_shared_from_this<AdminSession> {
 public:
  AdminSession(local::socket s, AdminHandler& h) : sock_(std::move(s)), handler_(h) {}
  void start() {
    auto self = shared_from_this();
    asio::async_read_until(sock_, asio::dynamic_buffer(buf_, kAdminMaxRequest), '\n',
                           [this, self](boost::system::error_code ec, size_t n) { on_read(ec, n); });
  }

 private:
  void on_read(boost::system::error_code ec, size_t n) {
    if (ec == asio::error::not_found) return reply({{"ok", false}, {"error", "request too long"}});
    if (ec) return;
    nlohmann::json answer;
    try {
      answer = handler_(nlohmann::json::parse(buf_.substr(0, n)));
    } catch (const nlohmann::json::exception& e) {
      answer = {{"ok", false}, {"error", std::string("bad request: ") + e.what()}};
    } catch (const std::exception& e) {
      answer = {{"ok", false}, {"error", e.what()}};
    }
    reply(answer);
  }
  void reply(const nlohmann::json& j) {
    out_ = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    auto self = shared_from_this();
    asio::async_write(sock_, asio::buffer(out_), [this, self](boost::system::error_code, size_t) {
      boost::system::error_code ignored;
      sock_.shutdown(local::socket::shutdown_both, ignored);
    });
  }
  local::socket sock_;
  AdminHandler& handler_;
  std::string buf_, out_;
};

}  // namespace

AdminServer::AdminServer(asio::io_context& io, std::string path, AdminHandler handler)
    : listener_(io, std::move(path), "admin"), handler_(std::move(handler)) {
  do_accept();
}

AdminServer::~AdminServer() = default;

void AdminServer::close() { listener_.close(); }

void AdminServer::do_accept() {
  listener_.acceptor().async_accept([this](boost::system::error_code ec, local::socket s) {
    if (ec == asio::error::operation_aborted) return;
    if (!ec) std::make_shared<AdminSession>(std::move(s), handler_)->start();
    if (listener_.is_open()) do_accept();
  });
}

nlohmann::json admin_call(const std::string& path, const nlohmann::json& request, std::chrono::milliseconds timeout) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("socket: ") + std::strerror(errno));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    ::close(fd);
    throw Error("admin socket path too long: " + path);
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error("cannot reach the supervisor at " + path + ": " + std::strerror(e) +
                " (is ds4-supervisor running? it listens under $XDG_RUNTIME_DIR/ds4/)");
  }
  const std::string line = request.dump() + "\n";
  size_t off = 0;
  while (off < line.size()) {
    const ssize_t n = ::write(fd, line.data() + off, line.size() - off);
    if (n <= 0) {
      ::close(fd);
      throw Error("cannot send to " + path);
    }
    off += size_t(n);
  }
  std::string answer;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[65536];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, int(left.count())) <= 0) {
      ::close(fd);
      throw Error("no answer from the supervisor at " + path + " within " + std::to_string(timeout.count()) + " ms");
    }
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    answer.append(buf, size_t(n));
    if (answer.find('\n') != std::string::npos) break;
  }
  ::close(fd);
  if (answer.empty()) throw Error("the supervisor at " + path + " closed the connection without an answer");
  return nlohmann::json::parse(answer);
}

}  // namespace ds4::sup

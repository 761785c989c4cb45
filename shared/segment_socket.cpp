#include "shared/segment_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shared/error.h"
#include "shared/fd_passing.h"
#include "shared/files.h"

namespace ds4::store {

namespace {

constexpr std::string_view kOk = "OK\n";
constexpr std::string_view kErr = "ERR ";

// A segment name: what segment_name() and tests make, nothing that could
// travel further (no '/', no blanks, bounded).
bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > 200) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
           c == '.';
  });
}

void set_timeout(int sock, std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = time_t(t.count() / 1000);
  tv.tv_usec = suseconds_t(t.count() % 1000 * 1000);
  ::setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

bool timed_out(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINPROGRESS; }

}  // namespace

std::string default_segment_socket() { return ds4_runtime_dir() + "/segments.sock"; }

UniqueFd fetch_segment_fd(const std::string& socket_path, std::string_view handle,
                          std::chrono::milliseconds timeout) {
  const std::string name(handle_name(handle));
  const std::string what = "memfd segment '" + name + "': cannot get it from the supervisor's socket " + socket_path;
  if (!valid_name(name)) throw Error(what + ": '" + name + "' is not a segment name");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof addr.sun_path) throw Error(what + ": the path is too long for a Unix socket");
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock) throw Error(what + ": socket: " + std::strerror(errno));
  set_timeout(sock.get(), timeout);
  if (::connect(sock.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ECONNREFUSED)
      throw Error(what + ": " + std::strerror(err) + " (is ds4-supervisor running? it serves the model's memfd)");
    if (timed_out(err)) throw Error(what + ": no answer within " + std::to_string(timeout.count()) + " ms");
    throw Error(what + ": connect: " + std::strerror(err));
  }
  const std::string request = name + "\n";
  if (::send(sock.get(), request.data(), request.size(), MSG_NOSIGNAL) != ssize_t(request.size()))
    throw Error(what + ": send: " + std::strerror(errno));

  // The answer: one line, and with "OK" one descriptor.
  char buf[512];
  std::string line;
  int fd = -1;
  while (line.find('\n') == std::string::npos && line.size() < sizeof buf) {
    const ssize_t n = recv_with_fd(sock.get(), buf, sizeof buf, fd);
    if (n < 0) {
      const int err = errno;
      if (fd >= 0) ::close(fd);
      if (timed_out(err)) throw Error(what + ": no answer within " + std::to_string(timeout.count()) + " ms");
      throw Error(what + ": recvmsg: " + std::strerror(err));
    }
    if (n == 0) break;
    line.append(buf, size_t(n));
  }
  UniqueFd got(fd);
  line = line.substr(0, line.find('\n'));
  if (line.starts_with(kErr)) throw Error(what + ": " + line.substr(kErr.size()));
  if (line + "\n" != kOk || !got) {
    throw Error(what + ": unexpected answer '" + line.substr(0, 80) + "'" +
                (got ? "" : " without a descriptor"));
  }
  return got;
}

Segment open_segment(const std::string& handle, const std::string& socket_path, std::chrono::milliseconds timeout) {
  if (!is_memfd_handle(handle)) return Segment::attach(handle);
  const UniqueFd fd = fetch_segment_fd(socket_path, handle, timeout);
  return Segment::attach_fd(fd.get(), handle);
}

std::string parse_segment_request(std::string_view request) {
  const size_t nl = request.find('\n');
  const std::string_view name = request.substr(0, nl);
  return nl != std::string_view::npos && valid_name(name) ? std::string(name) : std::string();
}

std::string send_segment_fd(int sock, int fd) {
  // A descriptor opened read-only anew: a worker could not get write access
  // to the weights through it even if the seals were missing.
  const UniqueFd ro(::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC));
  if (!ro) return std::string("cannot reopen the segment read-only: ") + std::strerror(errno);
  const ssize_t n = send_with_fd(sock, kOk, ro.get(), MSG_DONTWAIT);
  if (n != ssize_t(kOk.size())) return std::string("sendmsg: ") + std::strerror(n < 0 ? errno : EPIPE);
  return {};
}

void send_segment_error(int sock, std::string_view why) {
  std::string line = std::string(kErr) + std::string(why.substr(0, 400));
  std::replace(line.begin(), line.end(), '\n', ' ');
  line += '\n';
  (void)!::send(sock, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace ds4::store

#include "shared/notify_socket.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "shared/error.h"

namespace ds4 {

bool NotifyMessage::has(std::string_view line) const {
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    if (std::string_view(text).substr(at, end - at) == line) return true;
    at = end + 1;
  }
  return false;
}

std::optional<std::string> NotifyMessage::value(std::string_view key) const {
  std::optional<std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string_view line = std::string_view(text).substr(at, end - at);
    if (line.size() > key.size() && line.starts_with(key) && line[key.size()] == '=')
      out = std::string(line.substr(key.size() + 1));
    at = end + 1;
  }
  return out;
}

NotifySocket::NotifySocket(std::string address, int receive_buffer) : address_(std::move(address)) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const bool abstract = address_.starts_with('@');
  if (address_.size() >= sizeof addr.sun_path) throw Error("notify socket address too long: " + address_);
  std::memcpy(addr.sun_path, address_.data(), address_.size());
  if (abstract) addr.sun_path[0] = '\0';
  const socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + address_.size() + (abstract ? 0 : 1));
  fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd_ < 0) throw Error("cannot create the notify socket " + address_ + ": " + std::strerror(errno));
  if (!abstract) ::unlink(address_.c_str());
  const int one = 1;
  if (receive_buffer > 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::setsockopt(fd_, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0) {
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    throw Error("cannot bind the notify socket " + address_ + ": " + std::strerror(e));
  }
}

NotifySocket::~NotifySocket() {
  if (fd_ < 0) return;
  ::close(fd_);
  if (!address_.starts_with('@')) ::unlink(address_.c_str());
}

std::optional<NotifyMessage> NotifySocket::receive() {
  char text[4096];
  // Credentials, and as many descriptors as one sendmsg carries (SCM_MAX_FD).
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred)) + CMSG_SPACE(sizeof(int) * 253)];
  iovec iov{text, sizeof text};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  const ssize_t n = ::recvmsg(fd_, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) return std::nullopt;
  NotifyMessage m;
  m.text.assign(text, size_t(n));
  for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
    if (cm->cmsg_level != SOL_SOCKET) continue;
    if (cm->cmsg_type == SCM_CREDENTIALS) {
      ucred c;
      std::memcpy(&c, CMSG_DATA(cm), sizeof c);
      m.pid = c.pid;
    } else if (cm->cmsg_type == SCM_RIGHTS) {
      const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
        m.fds.push_back(fd);
      }
    }
  }
  return m;
}

}  // namespace ds4

#include "supervisor/proxy/tcp_bytes.h"

// <linux/tcp.h> for tcp_info's byte counts (glibc's <netinet/tcp.h> lacks
// them); the two cannot meet in one file, hence this one.
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

namespace ds4::proxy {

namespace {
// The kernel's TCP states (include/net/tcp_states.h), which only glibc's header names.
enum : uint8_t { kCloseWait = 8, kLastAck = 9, kClosing = 11 };
}  // namespace

std::optional<TcpBytes> tcp_bytes(int fd) {
  tcp_info ti{};
  socklen_t len = sizeof ti;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 ||
      len < offsetof(tcp_info, tcpi_bytes_received) + sizeof ti.tcpi_bytes_received)
    return std::nullopt;
  int unread = 0, unacked = 0;
  if (::ioctl(fd, SIOCINQ, &unread) != 0 || ::ioctl(fd, SIOCOUTQ, &unacked) != 0) return std::nullopt;
  TcpBytes b;
  // bytes_received counts the client's FIN as one byte, which SIOCINQ leaves out.
  b.peer_closed = ti.tcpi_state == kCloseWait || ti.tcpi_state == kLastAck || ti.tcpi_state == kClosing;
  b.read = ti.tcpi_bytes_received - uint64_t(unread) - (b.peer_closed ? 1 : 0);
  b.written = ti.tcpi_bytes_acked + uint64_t(unacked);
  return b;
}

}  // namespace ds4::proxy

#pragma once
/// How many bytes a TCP connection has given to and taken from its owner so
/// far, from the kernel's own counts: what a restarted supervisor checks a
/// connection's journal against (conn_journal.h), and how it knows the next
/// byte the client is waiting for.

#include <cstdint>
#include <optional>

namespace ds4::proxy {

struct TcpBytes {
  uint64_t read = 0;     // taken out of the receive queue by whoever held the socket
  uint64_t written = 0;  // written into it (acknowledged by the client, or still queued)
  bool peer_closed = false;  // the client sent FIN (it may still read)
};

/// nullopt when `fd` is not a connected TCP socket.
std::optional<TcpBytes> tcp_bytes(int fd);

}  // namespace ds4::proxy

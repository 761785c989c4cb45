#pragma once
/// A file descriptor sent along with bytes on a Unix stream socket
/// (SCM_RIGHTS): the memfd segments' socket and the GPU weights holder's.
#include <sys/types.h>

#include <cstddef>
#include <string_view>

namespace ds4 {

/// sendmsg() of `bytes` with `fd` attached to them, retried on EINTR; `flags`
/// go to sendmsg (MSG_NOSIGNAL is always added). What sendmsg returns: the
/// bytes sent (the rest, if any, goes without the descriptor) or -1 (errno).
ssize_t send_with_fd(int sock, std::string_view bytes, int fd, int flags = 0);

/// recvmsg() of up to `n` bytes into `buf`, retried on EINTR. A descriptor
/// that comes with them (close-on-exec) is stored in `fd` when it is still
/// -1; any other is closed. What recvmsg returns: the bytes, 0 at EOF, or -1.
ssize_t recv_with_fd(int sock, char* buf, size_t n, int& fd);

}  // namespace ds4

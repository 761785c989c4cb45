#pragma once
/// The receiving end of sd_notify(3), as systemd's manager has it for its
/// services: a datagram socket whose address a child gets as NOTIFY_SOCKET.
/// Each datagram comes with its sender's pid (SO_PASSCRED) and, for
/// FDSTORE=1, descriptors (SCM_RIGHTS).

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ds4 {

/// One sd_notify datagram: "READY=1\nSTATUS=..." and what came with it.
struct NotifyMessage {
  int pid = 0;            // the sender's, from its credentials; 0 when none came
  std::string text;
  std::vector<int> fds;   // received descriptors (close-on-exec): the caller's to keep or close

  /// Whether one line is exactly `line` ("READY=1").
  bool has(std::string_view line) const;
  /// The value of the last "KEY=value" line for `key` ("STATUS").
  std::optional<std::string> value(std::string_view key) const;
};

class NotifySocket {
 public:
  /// Binds `address`: a path (a stale file there is removed first), or
  /// "@name" for an abstract socket (nothing to remove afterwards).
  /// `receive_buffer` > 0 raises SO_RCVBUF (a burst of FDSTORE=1 datagrams
  /// queues while the reader sleeps). Throws ds4::Error naming the address.
  explicit NotifySocket(std::string address, int receive_buffer = 0);
  ~NotifySocket();
  NotifySocket(const NotifySocket&) = delete;
  NotifySocket& operator=(const NotifySocket&) = delete;

  /// Readable when a datagram is queued (non-blocking, close-on-exec).
  int fd() const { return fd_; }
  /// What a child's NOTIFY_SOCKET= says.
  const std::string& address() const { return address_; }
  /// The next queued datagram, without waiting; nullopt when none is.
  std::optional<NotifyMessage> receive();

 private:
  std::string address_;
  int fd_ = -1;
};

}  // namespace ds4

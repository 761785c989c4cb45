#pragma once
/// How a worker gets a memfd segment (shared/model_store.h): the supervisor
/// keeps the descriptor and serves it on a Unix socket,
/// $XDG_RUNTIME_DIR/ds4/segments.sock, passing it with SCM_RIGHTS.
///
/// The exchange, one per connection:
///   client → "<name>\n"          (the segment's name, without "memfd:")
///   server → "OK\n" + descriptor  (read-only: opened O_RDONLY anew)
///          | "ERR <why>\n"        (no such segment, ...)
/// Every step of the client is bounded by its timeout: a worker started while
/// the supervisor is down fails at once with a clear message, and one whose
/// supervisor does not answer fails after the timeout, never hangs.

#include <chrono>
#include <string>
#include <string_view>

#include "shared/model_store.h"

namespace ds4::store {

/// How long a client waits for the supervisor's answer, by default.
inline constexpr std::chrono::milliseconds kSegmentFetchTimeout = std::chrono::seconds(10);
/// Longest request line a server reads (a segment name is far shorter).
inline constexpr size_t kMaxSegmentRequest = 256;

/// $XDG_RUNTIME_DIR/ds4/segments.sock ($XDG_RUNTIME_DIR unset: /tmp/ds4-$UID/segments.sock).
std::string default_segment_socket();

/// Asks the server on `socket_path` for memfd segment `handle` ("memfd:<name>"
/// or the bare name) and returns the descriptor it passes. Throws ds4::Error
/// naming the socket and what failed (no server: is ds4-supervisor running?;
/// timed out; refused, with the server's reason).
UniqueFd fetch_segment_fd(const std::string& socket_path, std::string_view handle,
                          std::chrono::milliseconds timeout = kSegmentFetchTimeout);

/// Attaches segment `handle`: a named one from kShmDir, a memfd one through
/// fetch_segment_fd(). The descriptor is closed once mapped.
Segment open_segment(const std::string& handle, const std::string& socket_path = default_segment_socket(),
                     std::chrono::milliseconds timeout = kSegmentFetchTimeout);

/// Server side: the name asked for in `request` (the bytes up to '\n'), or
/// empty when it is not a valid segment name.
std::string parse_segment_request(std::string_view request);
/// Server side: sends "OK\n" with `fd` (a read-only descriptor of the same
/// file, opened anew through /proc/self/fd) on the connected socket `sock`.
/// Returns an errno-style message on failure, empty on success.
std::string send_segment_fd(int sock, int fd);
/// Server side: sends "ERR <why>\n" on `sock` (best effort).
void send_segment_error(int sock, std::string_view why);

}  // namespace ds4::store

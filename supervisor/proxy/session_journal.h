#pragma once
/// What a session writes into its connection's journal (conn_journal.h) and
/// reads back after a supervisor restart, and the fd store that keeps each
/// connection and its journal across that restart.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/protocol.h"
#include "supervisor/proxy/scheduler.h"

namespace ds4::proxy {

/// The request step: what planning chose that a second planning would not
/// choose the same way (the answer's id and time, a random seed, the room
/// the context left).
struct JournalRequest {
  std::string id;
  int64_t created = 0;
  uint64_t seed = 0;
  int32_t max_tokens = 0;
  bool forward = false;  // an exec engine's request, forwarded as it came
  bool operator==(const JournalRequest&) const = default;
};

std::string encode_request(const JournalRequest& r);
std::optional<JournalRequest> decode_request(std::string_view s);
std::string encode_token(const proto::TokenEvent& e);
std::optional<proto::TokenEvent> decode_token(std::string_view s);
std::string encode_result(const JobResult& r);
std::optional<JobResult> decode_result(std::string_view s);

/// A connection the fd store gave back: its socket and its journal.
struct StoredConnection {
  std::string name;  // ds4-conn-N
  int socket = -1;
  int journal = -1;
};

/// Client connections in systemd's fd store (FDSTORE=1, two descriptors
/// under one FDNAME). `capacity` connections at most (0: off), so that the
/// store never drops one silently at its FileDescriptorStoreMax=.
class ConnStore {
 public:
  explicit ConnStore(size_t capacity = 0) : capacity_(capacity) {}
  size_t capacity() const { return capacity_; }
  size_t size() const { return stored_; }
  /// Stores both under a new name; "" when full or refused.
  std::string add(int socket, int journal);
  /// One given back at the start, already in the store.
  void adopt() { ++stored_; }
  void remove(const std::string& name);
  /// Names after the ones a previous run used.
  void skip_past(uint64_t n) { next_ = std::max(next_, n + 1); }

 private:
  size_t capacity_;
  size_t stored_ = 0;
  uint64_t next_ = 1;
};

/// "ds4-conn-N": N; nullopt for any other name.
std::optional<uint64_t> stored_connection_number(std::string_view name);

}  // namespace ds4::proxy

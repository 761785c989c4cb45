#pragma once
/// Client connections in the service manager's fd store (systemd's, or the
/// keeper's: supervisor/keeper.h), each with its journal (conn_journal.h), so
/// that a restarted supervisor takes them back (Proxy::adopt_connections).

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ds4::proxy {

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

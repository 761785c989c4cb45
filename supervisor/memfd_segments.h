#pragma once
/// The memfd segments the supervisor keeps (DESIGN.md, Shared memory: Size).
/// A memfd segment lives only as long as a descriptor or a mapping of it: the
/// supervisor holds the descriptor here, and under systemd also in the
/// service's fd store (FDSTORE=1, FDNAME=<segment name>), so that a restart of
/// the supervisor, a crash included, gets it back (recover()) instead of
/// loading the model again. Workers get it through the SegmentServer.
/// Thread-safe: a reload loads its new model on a thread of its own.

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shared/model_store.h"

namespace ds4::sup {

/// One kept segment.
struct KeptMemfd {
  std::string handle;  // "memfd:<name>"
  std::shared_ptr<store::UniqueFd> fd;
  store::Identity identity;
  uint64_t bytes = 0;
};

/// What the service manager passed at this start, besides the segments.
struct PassedFds {
  std::vector<int> listeners;  // the socket unit's listening sockets
  /// Client connections the proxy kept (ds4-conn-N: a socket and its journal), by name.
  std::map<std::string, std::vector<int>> connections;
};

/// Descriptors of the fd store that are not segments: the proxy's kept
/// client connections, two each. The shipped unit's FileDescriptorStoreMax=
/// leaves room for these after kMemfdStoreSlots segments.
inline constexpr uint32_t kMemfdStoreSlots = 4;

class MemfdSegments {
 public:
  /// With `fd_store`, each segment added is also stored in systemd's fd store.
  explicit MemfdSegments(bool fd_store);
  /// Whether a service manager keeps descriptors for us: $NOTIFY_SOCKET is
  /// set, and our unit's FileDescriptorStoreMax= is not 0 (asked over the
  /// user bus; when the bus cannot say, assumed). Logs why not when it is 0.
  /// `max`: the unit's FileDescriptorStoreMax= when it could be asked.
  static bool systemd_fd_store_available(std::optional<uint32_t>* max = nullptr);

  /// Takes the descriptors the service manager passed back at this start
  /// (sd_listen_fds_with_names; named by FDNAME): each one that holds a ready
  /// ds4 segment of this layout is kept; a listening stream socket (socket
  /// activation: ds4-supervisor.socket) and the proxy's connections
  /// (ds4-conn-N) are returned, untouched; every other one is closed and
  /// removed from the store (FDSTOREREMOVE=1). Logs one entry per segment.
  PassedFds recover();

  /// Keeps `fd` as segment `handle` (and stores it in the fd store).
  void add(const std::string& handle, std::shared_ptr<store::UniqueFd> fd);
  /// A kept segment loaded from the file of identity `id`.
  std::optional<KeptMemfd> find(const store::Identity& id) const;
  /// The descriptor of `handle` ("memfd:<name>" or the name); null when not kept.
  std::shared_ptr<store::UniqueFd> fd(const std::string& handle) const;
  /// Every kept segment's handle.
  std::vector<std::string> handles() const;
  /// Lets `handle` go: removed from the fd store and closed here (its pages
  /// are freed once no process maps it either). Returns its size, 0 when it
  /// was not kept.
  uint64_t release(const std::string& handle);
  /// Whether descriptors go to systemd's fd store too.
  bool fd_store() const { return fd_store_; }

 private:
  void store_in_systemd(const std::string& name, int fd) const;
  void remove_from_systemd(const std::string& name) const;

  mutable std::mutex mu_;
  std::map<std::string, KeptMemfd> kept_;  // by handle
  bool fd_store_;
};

}  // namespace ds4::sup

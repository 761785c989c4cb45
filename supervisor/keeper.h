#pragma once
/// What systemd gives the supervisor, for a supervisor started by hand: a
/// small parent process (the keeper) that outlives a crash of the supervisor.
/// It holds what systemd's units hold (DESIGN.md):
///   - the public port (as ds4-supervisor.socket): bound once, passed to each
///     run of the supervisor, so connections made during a restart wait in
///     the backlog;
///   - an fd store: the supervisor's sd_notify messages (NOTIFY_SOCKET points
///     at the keeper) with FDSTORE=1 / FDSTOREREMOVE=1 keep descriptors here
///     (model memfds, client connections and their journals), passed back at
///     the next run as systemd does (LISTEN_FDS, LISTEN_FDNAMES);
///   - Restart=: a supervisor killed by a signal is started again at once,
///     RestartSec-like (100 ms), at most 5 times in 10 s;
///   - the runtime folder's lock, so a second supervisor names the keeper's pid.
/// Signals (TERM, INT, HUP) go to the supervisor; its own exit (a stop, an
/// error) is the keeper's. The supervisor dies with the keeper (PDEATHSIG).

#include <string>
#include <vector>

namespace ds4::sup {

/// Set in the supervisor's environment: the keeper's pid (its runtime lock
/// is the keeper's).
inline constexpr const char* kKeeperEnv = "DS4_SUPERVISOR_KEEPER";
/// The fd store's size the keeper announces (as FileDescriptorStoreMax=).
inline constexpr const char* kFdStoreMaxEnv = "DS4_FDSTORE_MAX";

/// Whether this process runs under a keeper (its parent is the one named).
bool under_keeper();

/// Runs the keeper: `argv` is the supervisor's command line, run again as a
/// child; `config_path` is read for proxy.listen (a config that does not
/// load leaves the port to the supervisor, which says why). Returns the exit
/// status for main().
int run_keeper(const std::vector<std::string>& argv, const std::string& config_path, bool config_given);

}  // namespace ds4::sup

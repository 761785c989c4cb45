#pragma once
/// Workers as systemd user units ds4-worker@N.service, driven over sd-bus
/// (libsystemd; never systemctl). Per worker it writes
/// $XDG_RUNTIME_DIR/ds4/worker-N.env (the unit's EnvironmentFile=) and, for
/// workers.memory_max, a drop-in ds4-worker@N.service.d/50-ds4-memory.conf
/// under $XDG_RUNTIME_DIR/systemd/user/ (then Reload). When the user manager
/// does not know ds4-worker@.service it writes one there that runs its own
/// ds4-worker. Unit state changes come from PropertiesChanged signals and
/// JobRemoved; why a worker died comes from the journal (journal_watch.h):
/// the kernel's oom-kill line naming the unit's cgroup, systemd's "killed by
/// the OOM killer" entry or Result=oom-kill make it an OOM kill; any other
/// SIGKILL is a person's; SIGTERM we did not ask for likewise; other deaths
/// are crashes. Before every start it calls ResetFailedUnit, so a crash loop
/// never ends in start-limit-hit.

#include <memory>
#include <string>

#include "supervisor/asio.h"
#include "supervisor/unit_backend.h"

namespace ds4::sup {

struct SystemdBackendOptions {
  std::string worker_binary;  // for a unit template written by us
  std::string runtime_dir;    // $XDG_RUNTIME_DIR/ds4: env files
};

/// Connects to the user manager. Returns null and sets `why_not` when there is
/// none (no user bus, or nothing owns org.freedesktop.systemd1 on it).
std::unique_ptr<UnitBackend> make_systemd_backend(asio::io_context& io, const SystemdBackendOptions& options,
                                                  std::string* why_not);

}  // namespace ds4::sup

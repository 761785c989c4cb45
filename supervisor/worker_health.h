#pragma once
/// How the supervisor sees whether a running worker is alive, besides its
/// process state: the heartbeat in the worker's control block record
/// (shared/control_block.h) and a cheap probe of its socket (the protocol's
/// `info` op). The worker manager reads both through HealthSource; the real
/// one maps the control block and probes with Asio, tests script their own.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "shared/config.h"
#include "shared/control_block.h"
#include "supervisor/asio.h"

namespace ds4::sup {

class HealthSource {
 public:
  virtual ~HealthSource() = default;
  /// Worker `id`'s record, when it keeps one.
  virtual std::optional<control::Snapshot> record(int id) const = 0;
  /// CLOCK_MONOTONIC now, in nanoseconds (the clock of heartbeats).
  virtual int64_t now_ns() const = 0;
  /// Sends {"op":"info"} to the worker on `socket`; `done(true)` when an
  /// info line came back within `timeout`, `done(false)` otherwise. `done`
  /// runs on the io_context thread, never inside probe().
  virtual void probe(const std::string& socket, Duration timeout, std::function<void(bool answered)> done) = 0;
};

/// The real one: the supervisor's control block and Unix-socket probes.
class WorkerHealth : public HealthSource {
 public:
  WorkerHealth(asio::io_context& io, control::Block block);
  std::optional<control::Snapshot> record(int id) const override;
  int64_t now_ns() const override { return control::monotonic_ns(); }
  void probe(const std::string& socket, Duration timeout, std::function<void(bool answered)> done) override;
  const std::string& name() const { return block_.name(); }

 private:
  asio::io_context& io_;
  control::Block block_;
};

}  // namespace ds4::sup

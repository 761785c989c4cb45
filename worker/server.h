#pragma once
/// The worker daemon: serves the token-level protocol (shared/protocol.h) on a
/// Unix socket, requests with ids side by side on a connection. One thread
/// runs the engine's steps and, between them, the sockets. Tells systemd
/// READY=1 once it can serve and STOPPING=1 on SIGTERM/SIGINT, cancels what
/// is in flight (the proxy resumes it elsewhere) and returns. With a control
/// block it beats the heartbeat from that loop, between steps and at least
/// every 50 ms when idle, so a stuck engine stops beating.

#include <chrono>
#include <string>

#include "worker/backend.h"
#include "worker/runtime.h"

namespace ds4 {

struct ServeOptions {
  std::string socket_path;
  int id = 0;
  EngineShape shape;
  int threads = 0;
  std::string device = "cpu";
  /// How long the worker's thread keeps polling its sockets once it has
  /// nothing to do, before it sleeps: a request that comes meanwhile skips
  /// the wake-up of a sleeping thread (about 10 us on an idle core). 0 = none.
  std::chrono::microseconds busy_poll{0};
  /// The supervisor's control block (shared/control_block.h) to fill: record
  /// `id` gets the plan, state, heartbeat, counters and device memory. Empty =
  /// none (a worker run by hand).
  std::string control;
  /// A pid whose end stops the worker (the supervisor's keeper, which a
  /// process-backend worker outlives the supervisor for); 0 = none.
  int dies_with = 0;
};

/// Runs until a stop signal. Throws ds4::Error when it cannot start (plan does
/// not fit, socket cannot be bound).
void serve(const LoadedModel& lm, Backend& backend, const ServeOptions& opts);

}  // namespace ds4

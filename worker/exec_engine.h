#pragma once
/// `ds4-worker engine` (workers.engine: exec): the worker is an external
/// OpenAI-compatible server (llama-server, ds4-server) run as this process's
/// child, so it stays in the worker's cgroup (MemoryMax=, OOM kills) with its
/// OOM score. This process tells systemd (or the process backend) READY=1 once
/// the server answers HTTP, beats in the control block record while it goes on
/// answering (hang detection), forwards SIGTERM, and ends the way the server
/// ended: its exit status, or killed by the same signal (an OOM kill stays a
/// SIGKILL for the supervisor).

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ds4 {

struct ExecEngineOptions {
  int id = 0;
  std::vector<std::string> argv;  // the server's command line, filled in
  int port = 0;                   // where it answers HTTP (127.0.0.1)
  int64_t context = 0;
  int64_t slots = 1;
  std::string control;            // the control block's name; "" = none
  std::chrono::milliseconds start_timeout{std::chrono::minutes(5)};  // to answer /health at all
  std::chrono::milliseconds poll_every{std::chrono::seconds(1)};     // health checks once ready
  std::chrono::milliseconds stop_timeout{std::chrono::seconds(10)};  // SIGTERM → SIGKILL
};

/// Runs the server until it ends or SIGTERM/SIGINT stops it. Returns the exit
/// status for main() (a signal death of the server is raised again on this
/// process and does not return). Throws ds4::Error when it cannot start it.
int run_exec_engine(const ExecEngineOptions& o);

/// GET `path` on 127.0.0.1:`port`: the status code, or 0 when no answer came
/// within `timeout` (refused, closed, malformed).
int http_get_status(int port, const std::string& path, std::chrono::milliseconds timeout);

}  // namespace ds4

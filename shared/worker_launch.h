#pragma once
/// Everything a worker is started with, in one struct, and its one encoding.
///
/// The supervisor fills a WorkerLaunch; a unit backend writes it as the
/// environment file of ds4-worker@N.service (to_env_file(): systemd, whose
/// template also names a few of these variables on its ExecStart= line), or
/// as a child process's environment and command line (to_env(), to_args()),
/// so that the worker's environment holds the same variables under either. `ds4-worker serve`
/// and `ds4-worker engine` read it back with parse_worker_launch(): the
/// environment first, then the command line, which wins. No other code names
/// these flags or variables: worker_launch_settings() lists each setting with
/// its flag, its environment variable and its default.
///
/// Values are checked as they are read; a bad one throws ds4::Error naming
/// the setting and where it came from:
///   `--context: 'abc' is not an integer`
///   `DS4_KV_CACHE=q4 (--kv-cache): expected f16 or q8_0`

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ds4 {

struct WorkerLaunch {
  int64_t id = 0;                // --id: the worker's number (ds4-worker@N)
  std::string segment;           // --segment: the model segment (ds4-model-..., or memfd:<name>)
  std::string segment_socket;    // --segment-socket: where a memfd segment is asked for; "" = the default
  std::string model;             // --model: a GGUF file (a worker run by hand; {model} of an exec engine)
  std::string socket;            // --socket: the token-protocol socket the worker serves
  int64_t context = 4096;        // --context (alias --ctx): tokens per slot, the context rung
  int64_t slots = 1;             // --slots: concurrent sequences
  std::string device = "auto";   // --device: auto | cpu | cuda:N
  int64_t threads = 0;           // --threads: CPU threads; 0 = all cores
  int64_t prefill_chunk = 256;   // --batch: prompt tokens per engine step (workers.prefill_chunk)
  int64_t busy_poll_us = 0;      // --busy-poll-us: idle polling before sleeping (workers.busy_poll)
  std::string control;           // --control: the supervisor's control block; "" = none
  std::string gpu_weights = "auto";  // --gpu-weights: auto | holder | copy | host-mapped
  std::string holder_socket;     // --holder-socket: the GPU holder's socket; "" = the default
  int64_t host_experts = 0;      // --host-experts: the expert rung (first layers whose experts stay on the host)
  int64_t holder_experts = -1;   // --holder-experts: those the holder's image lacks; -1 = as host_experts
  std::string kv_cache = "f16";  // --kv-cache: f16 | q8_0, the KV rung
  int64_t dies_with = 0;         // --dies-with: a pid (the supervisor's keeper) whose end stops the worker; 0 = none
  // workers.engine: exec: the worker runs an external server.
  std::string exec_command;      // --command: its command template; "" = the native engine
  int64_t port = 0;              // --port: where it answers HTTP
  int64_t start_timeout_ms = 300000;  // --start-timeout: how long it may take to answer

  /// "engine" when exec_command is set, else "serve": the subcommand to_args() goes with.
  std::string subcommand() const { return exec_command.empty() ? "serve" : "engine"; }
  /// `--flag value` for every setting but the empty ones (after the
  /// subcommand): `ps` shows the whole launch.
  std::vector<std::string> to_args() const;
  /// `NAME=value` for every setting that has a variable (for a process's environment).
  std::vector<std::string> to_env() const;
  /// The same lines, quoted where the value needs it for a systemd
  /// EnvironmentFile= (see decode_env_file()).
  std::string to_env_file() const;

  bool operator==(const WorkerLaunch&) const = default;
};

/// One setting: its flag (without "--"), its environment variable ("" when it
/// has none: --id, which the unit's name gives), its default as text, and
/// what it is.
struct WorkerLaunchSetting {
  std::string flag;
  std::string env;
  std::string default_text;
  std::string what;
};
const std::vector<WorkerLaunchSetting>& worker_launch_settings();

/// The environment variables worker_launch_settings() names: a process that
/// starts a worker (or is one and starts another program) drops them from
/// what it passes on.
std::vector<std::string> worker_launch_env_names();

/// A WorkerLaunch from `env` ("NAME=value", as environ; unknown names are
/// ignored) and then `args` (the arguments after the subcommand; `--ctx` is
/// accepted for `--context`). Throws ds4::Error naming the setting.
WorkerLaunch parse_worker_launch(const std::vector<std::string>& args, const std::vector<std::string>& env);
/// As above, with this process's environment.
WorkerLaunch parse_worker_launch(const std::vector<std::string>& args);

/// This process's environment value of the setting with `flag`, if set and
/// not empty (for commands that take one of these settings by hand, as
/// `bench --segment-socket`).
std::optional<std::string> worker_launch_env(std::string_view flag);

/// The lines of an environment file (to_env_file()'s, or one systemd reads)
/// as `NAME=value`, quotes and escapes removed; comments and blank lines skipped.
std::vector<std::string> decode_env_file(std::string_view text);

}  // namespace ds4

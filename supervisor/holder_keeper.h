#pragma once
/// The GPU weights holder as a child of the supervisor.
///
/// `ds4-worker hold` copies the model's weights from the shared-memory segment
/// to one GPU once and hands them to workers over its socket; a worker that
/// finds it maps them instead of copying (issue 5, worker/cuda/NOTES.md). The
/// supervisor starts it before the first GPU worker, waits (bounded) until it
/// answers, restarts it with backoff when it dies, and replaces it when the
/// model segment changes (then without blocking: the proxy keeps serving while
/// the new holder copies the weights). Workers that already mapped the weights keep them
/// whatever happens to the holder; a worker started while there is none
/// copies the weights itself.

#include "shared/spawn.h"
#include "supervisor/asio.h"
#include "supervisor/policy.h"
#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace ds4::sup {

struct HolderSettings {
  std::string worker_binary;  // ds4-worker
  std::string segment;        // model segment to hold
  int device = 0;             // cuda:N
  std::string socket;         // where workers look: $XDG_RUNTIME_DIR/ds4/holder-cudaN.sock
  std::string segment_socket;  // where a memfd segment's descriptor is asked for; empty: the holder's default
  uint32_t host_experts = 0;   // a mixture of experts: the first layers whose experts it does not hold (the last expert rung)
  std::chrono::milliseconds ready_timeout{std::chrono::minutes(5)};
};

/// Whether this machine has an NVIDIA driver at all (for `device: auto`).
bool nvidia_driver_present();

/// Asks the holder on `socket` for its GPU's memory: its answer to any
/// client (worker/cuda/holder.cuh) carries `device_free` and `device_total`;
/// the weights' descriptor that comes with it is closed at once. nullopt when
/// nobody answers within `timeout`, or the answer has no such figures.
std::optional<GpuMemory> ask_holder_memory(const std::string& socket, std::chrono::milliseconds timeout);

class HolderKeeper {
 public:
  HolderKeeper(asio::io_context& io, HolderSettings settings);
  ~HolderKeeper();
  HolderKeeper(const HolderKeeper&) = delete;
  HolderKeeper& operator=(const HolderKeeper&) = delete;

  /// Starts the holder and waits until its socket answers (or it exits, or
  /// ready_timeout passes: then workers copy, and a warning says why).
  /// Blocks the io thread: for the supervisor's start, before it serves.
  void start();
  /// Starts the holder without blocking: `settled` runs on the io thread once
  /// its socket answers, it exits, or ready_timeout passes (a reload starts
  /// the workers that should map its weights then).
  void start_async(std::function<void()> settled);
  /// Holds `segment` instead (the model changed): a new holder replaces the
  /// old, as start_async(). The same segment: `settled` runs at once.
  void change_segment(const std::string& segment, std::function<void()> settled);
  /// Holds `segment` without the experts of its first `host_experts` layers
  /// (workers.moe_offload's last rung): replaced as change_segment() when
  /// either differs from what it holds.
  void change_image(const std::string& segment, uint32_t host_experts, std::function<void()> settled);
  uint32_t host_experts() const { return s_.host_experts; }
  /// SIGTERM, then SIGKILL after a grace period.
  void stop();
  nlohmann::json status() const;
  int device() const { return s_.device; }
  /// The free memory of the holder's GPU now, with the weights on it: what a
  /// GPU worker's first start goes by, before any worker reports a figure of
  /// its own. nullopt when the holder is not ready (or cannot say).
  std::optional<GpuMemory> device_memory() const;

 private:
  void spawn();
  bool wait_ready();
  void watch();
  void became_ready();
  void settle();
  void restart_later();
  void reap(const ExitStatus& status);

  asio::io_context& io_;
  HolderSettings s_;
  asio::steady_timer timer_;
  int pid_ = -1;
  bool ready_ = false;
  bool stopping_ = false;
  int restarts_ = 0;
  bool not_needed_ = false;  // the holder exited kExitNothingToHold: an integrated GPU
  std::chrono::milliseconds backoff_{std::chrono::seconds(1)};
  std::string last_exit_;
  std::function<void()> settled_;  // start_async()'s, until the holder settles
  std::chrono::steady_clock::time_point started_at_, settle_by_;
};

}  // namespace ds4::sup

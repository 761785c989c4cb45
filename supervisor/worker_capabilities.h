#pragma once
/// What the workers of this installation can run, asked of the worker binary
/// (`ds4-worker capabilities`) rather than known when the supervisor was
/// built: one supervisor serves CPU-only and GPU builds of ds4-worker.

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "shared/config.h"

namespace ds4::sup {

struct WorkerCapabilities {
  std::vector<std::string> backends;      // "cpu", "cuda"
  std::vector<std::string> weight_types;  // "F32", "Q8_0", ...
  std::vector<std::string> kv_cache;      // "f16", "q8_0"

  bool has_backend(const std::string& name) const;
};

/// `ds4-worker capabilities`' JSON line. Throws ds4::Error saying what is
/// missing or of the wrong type.
WorkerCapabilities parse_worker_capabilities(const std::string& json_line);

/// Runs `worker_binary capabilities` (through shared/spawn.h) and reads its
/// answer. nullopt, with `why` set, when it cannot run or does not answer
/// within `timeout` (an older ds4-worker, or none there).
std::optional<WorkerCapabilities> ask_worker_capabilities(const std::string& worker_binary, std::string* why,
                                                          std::chrono::milliseconds timeout = std::chrono::seconds(10));

/// Why workers on `device` cannot run with these workers ("" when they can):
/// a cuda device needs a worker built with the CUDA backend. Unknown
/// capabilities refuse nothing (the workers then say it themselves).
std::string device_refusal(const Device& device, const std::optional<WorkerCapabilities>& caps);

/// Whether workers on `device` run on a GPU: cuda:N, or auto where the
/// workers have the CUDA backend (or may have it: capabilities unknown) and
/// the machine an NVIDIA driver.
bool workers_on_gpu(const Device& device, const std::optional<WorkerCapabilities>& caps, bool nvidia_driver);

}  // namespace ds4::sup

#pragma once
/// What a device backend computes on the host's own cores, behind interfaces:
/// the CPU backend implements them (worker/cpu/cpu_backend.cpp) and whoever
/// builds a device backend hands them over (make_backend in
/// worker/commands.cpp), so worker/cuda/ needs nothing of worker/cpu/.

#include <cstdint>
#include <functional>
#include <memory>

#include "model/weights.h"
#include "worker/forward.h"

namespace ds4 {

/// A mixture of experts computed on the host for a device backend: the
/// experts of the model's first layers when they stay in host memory (the
/// expert rung of the ladder, `--host-experts`). It is the CPU backend's
/// moe_ffn (the reference), over rows the caller hands in, read from the
/// weights where they are (the shared segment: no copy).
class HostExperts {
 public:
  virtual ~HostExperts() = default;
  /// out[t] = the mixture of experts of `spec` over n[t], for T <= max_batch
  /// rows of hp.dim values (strides ldn, ldo); `router`, when given, gets
  /// each token's expert probabilities (n_expert values, stride ldr).
  virtual void run(const MoeSpec& spec, const float* n, int64_t ldn, int64_t T, float* out, int64_t ldo,
                   float* router, int64_t ldr) = 0;
  /// Host memory it holds (its scratch).
  virtual uint64_t bytes() const = 0;
};

/// The host's cores as a device backend uses them.
class HostCompute {
 public:
  virtual ~HostCompute() = default;
  /// Calls fn(i) for i in [0, n) on the host's threads, the calling thread
  /// among them; returns when all are done (Backend::host_parallel).
  virtual void parallel(int n, const std::function<void(int)>& fn) = 0;
  /// Host experts for steps of at most `max_batch` tokens.
  virtual std::unique_ptr<HostExperts> experts(int64_t max_batch) = 0;
};

/// The CPU backend's host experts on `threads` threads (<= 0: one per core)
/// for steps of at most `max_batch` tokens.
std::unique_ptr<HostExperts> make_host_experts(const Model& model, int threads, int64_t max_batch);

/// The CPU backend's HostCompute for a device backend running `model`:
/// experts() on `expert_threads` threads (<= 0: one per core), parallel() on
/// up to 8 of the cores (half of them) that the device leaves idle.
std::unique_ptr<HostCompute> make_host_compute(const Model& model, int expert_threads);

}  // namespace ds4

#pragma once
/// The one small interface every compute backend implements (worker/cpu/,
/// worker/cuda/). The engine hands it a batch of tokens from several slots;
/// the backend runs the forward pass for them (run_forward() of
/// worker/forward.h over its ForwardOps), keeps the KV cache, and returns
/// the logits of the tokens that need one. Its plan() is plan_memory() of
/// model/memory_plan.h for its kind, the figure the supervisor plans with.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "model/memory_plan.h"
#include "model/weights.h"
#include "worker/sampler.h"

namespace ds4 {

/// Memory of the accelerator a backend allocates on (cudaMemGetInfo).
struct DeviceRoom {
  uint64_t free = 0;
  uint64_t total = 0;
};

/// One token of a forward step.
struct BatchToken {
  int32_t token = 0;
  int32_t slot = 0;
  int32_t pos = 0;         // position in the slot's sequence
  int32_t logit_row = -1;  // where its logits go, or -1 when not needed
};

/// A row's best logits, best first, and the whole row's log-sum-exp.
struct RowBest {
  std::span<const LogitCandidate> best;
  double lse = 0;
};

/// Throws ds4::Error unless every entry of `adjust` names a row below `rows`
/// and a token below `n_vocab`.
void check_adjustments(std::span<const LogitAdjust> adjust, int64_t rows, int64_t n_vocab);

/// Intermediate values for tests: name ("attn_norm", "ffn_out", "l_out",
/// "result_norm"; "router", a mixture of experts' probabilities), layer (-1
/// outside layers), rows x cols floats (one row per token).
using TraceFn = std::function<void(std::string_view name, int layer, const float* data,
                                   int64_t rows, int64_t cols, int64_t stride)>;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  /// What reserve(shape) will allocate: plan_memory() for this backend's kind.
  virtual MemoryPlan plan(const EngineShape& shape) const = 0;
  /// Bytes of KV cache and scratch the last reserve() allocated (0: not
  /// reported); plan(shape).own() for the CPU backend.
  virtual uint64_t reserved_bytes() const { return 0; }
  /// Allocates and touches the KV cache and scratch: after this the backend
  /// allocates nothing more. Throws ds4::Error when memory is refused.
  virtual void reserve(const EngineShape& shape) = 0;
  /// Runs the forward pass for `batch` (at most shape.max_batch tokens, logit
  /// rows at most shape.slots + 1). Tokens must be valid ids, positions below ctx.
  /// `adjust` (logit_adjustments(), at most one entry a row and token) is
  /// added to the logits where they are, before greedy() picks: logits()
  /// and greedy() then give the adjusted rows.
  virtual void forward(std::span<const BatchToken> batch, std::span<const LogitAdjust> adjust = {}) = 0;
  /// Logits (n_vocab floats) of a row the last forward() produced. Safe to
  /// call from several threads for rows fetch_logits() named.
  virtual std::span<const float> logits(int32_t row) const = 0;
  /// Rows logits() will be asked for: a device backend brings them to the
  /// host together (one wait instead of one a row).
  virtual void fetch_logits(std::span<const int32_t> rows) const { (void)rows; }
  /// Calls fn(i) for i in [0, n) on the host threads this backend may use
  /// between steps (the CPU backend's own; a GPU backend's idle cores), the
  /// calling thread among them; returns when all are done.
  virtual void host_parallel(int n, const std::function<void(int)>& fn) {
    for (int i = 0; i < n; ++i) fn(i);
  }
  /// The greedy token of a row the last forward() produced (highest logit,
  /// ties to the lowest id, NaN never wins) and its log-softmax, computed
  /// where the logits are, so they need not travel; the same token as
  /// sample() at temperature 0. nullopt: the engine samples from logits().
  virtual std::optional<TokenLogprob> greedy(int32_t row) const { (void)row; return std::nullopt; }
  /// The best logits of a row the last forward() produced (ranked as
  /// sampler.h ranks them, its adjustments added) and log(sum(exp(logits)))
  /// of the whole row, kept where the logits are: a sampled token with top-k
  /// is then drawn from them (sample_best) and the row need not travel.
  /// nullopt: the engine samples from logits(). Not for several threads.
  virtual std::optional<RowBest> best_logits(int32_t row) const { (void)row; return std::nullopt; }
  virtual void set_trace(TraceFn fn) { (void)fn; }
  /// Runs on the thread that calls forward(), while the step computes:
  /// between layers (CPU, and CUDA steps launched kernel by kernel) and
  /// while waiting for the device (CUDA). The worker takes its socket's
  /// requests there, so their timings start on arrival.
  void set_during_step(std::function<void()> fn) { during_step_ = std::move(fn); }
  /// True when reserve() allocates the KV cache and scratch in an
  /// accelerator's own memory rather than the host's.
  virtual bool memory_on_device() const { return false; }
  /// That accelerator's memory now; nullopt for a host backend.
  virtual std::optional<DeviceRoom> device_room() const { return std::nullopt; }

 protected:
  /// Runs the during-step work; false when there is none.
  bool during_step() const {
    if (!during_step_) return false;
    during_step_();
    return true;
  }

 private:
  std::function<void()> during_step_;
};

/// The CPU backend; threads <= 0 means one per core.
std::unique_ptr<Backend> make_cpu_backend(const Model& model, int threads);

}  // namespace ds4

#pragma once
/// The forward pass, written once over a small table of backend operations.
///
/// run_forward() sequences the ops of one step for the model's architecture
/// (model/architecture.h: QKV bias, Q/K norm, RoPE pairing and frequency
/// factors, tied embeddings); a backend implements ForwardOps and calls
/// run_forward() from its Backend::forward(). The ops name activations by
/// handle (Act, model/memory_plan.h), never by pointer: each backend maps a
/// handle to its own memory (host floats, device buffers), so the engine's
/// sequence can be enqueued on a stream or captured in a CUDA graph as it is.
///
/// Rows: an op on a token activation (x, xb, q, k, v, att, hb, hb2) covers
/// the step's T tokens; one on xl or logits covers the step's logit rows
/// (1 + the highest BatchToken::logit_row; rows no token names are unused).
/// Row t of a token activation belongs to batch[t] of begin_step().
///
/// Fusions are the backend's: an op that a backend runs as one kernel (an
/// RMSNorm folded into the products that read it, gate+up+SwiGLU in one
/// launch, RoPE with the KV store, a product that adds into the residual) is
/// one op here, with a default body composed of the simpler ops, so a
/// backend may override only what it fuses. The CPU backend
/// (worker/cpu/cpu_backend.cpp) is the reference implementation of every op.
///
/// Weights are the Model's own Weight objects (model/weights.h), whose
/// addresses are stable while the model is bound: a device backend may key
/// its device copies by address (or by Weight::data). An absent optional
/// weight (a bias, a Q/K norm, the frequency factors) is passed as nullptr
/// or not at all: run_forward() issues no op for it.
///
/// Porting a backend: implement every pure op, override the fused ones it
/// has kernels for, carve its buffers by the plan of model/memory_plan.h for
/// its kind (the supervisor budgets that figure), and call run_forward()
/// from forward() (a CUDA backend: from the function it enqueues or
/// captures; begin_step() gets the host batch, the device copy is the
/// backend's).
///
/// Numerics the CPU reference keeps (and ggml does): RMSNorm sums squares in
/// double, y = (x * (1 / sqrt(mean + eps))) * g; a bias is added after the
/// product; RoPE angles are theta_i = ((pos * base^(-2i/n_rot)) / ff[i]) *
/// freq_scale, the power taken by repeated products as ggml does.

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "model/hparams.h"
#include "model/memory_plan.h"
#include "model/weights.h"
#include "worker/backend.h"

namespace ds4 {

/// An RMSNorm in front of products: they read rmsnorm(in) * g. `out` is
/// where a backend that does not fold it writes the normalised rows (and
/// where the trace reads them); a folding backend may leave `out` untouched.
struct NormSpec {
  const Weight* g = nullptr;
  float eps = 0;
  Act out = Act::xb;
};

/// One product of several that share an input: out = W . in (+ bias), or with
/// `accumulate` out += W . in (+ bias), the residual add folded in.
struct ProductSpec {
  const Weight* w = nullptr;
  Act out = Act::xb;
  const Weight* bias = nullptr;  // (w->rows) f32, or nullptr
  bool accumulate = false;
};

/// RoPE of a step: positions come from the batch.
struct RopeSpec {
  RopeType type = RopeType::normal;
  int64_t n_rot = 0;       // rotated values per head (even, <= head_dim)
  int64_t head_dim = 0;
  float base = 10000.0f;
  float freq_scale = 1.0f;
  const Weight* freq_factors = nullptr;  // (n_rot / 2) f32, or nullptr
};

/// Grouped-query attention over each token's own slot, positions 0..pos.
struct AttentionSpec {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;  // head h reads KV head h / (n_heads / n_kv_heads)
  int64_t head_dim = 0;
  float scale = 1.0f;      // 1 / sqrt(head_dim)
};

/// A mixture-of-experts feed-forward (qwen2moe, qwen3moe), as llama.cpp's
/// build_moe_ffn computes it: p = softmax(router . n) over the experts; the
/// n_used experts of highest p (ties to the lower id) each compute
/// down_e . (silu(gate_e . n) * (up_e . n)), weighted by their p (divided by
/// the chosen p's sum when `norm_weights`, the sum kept >= 2^-14), and
/// summed; a shared expert (when gate_inp_shexp is set) adds its SwiGLU
/// output times sigmoid(gate_inp_shexp . n).
struct MoeSpec {
  const Weight* router = nullptr;  // (n_expert, dim) f32
  std::span<const Weight> gate;    // each expert's matrix (LayerWeights::gate_mats, ...)
  std::span<const Weight> up;
  std::span<const Weight> down;
  int64_t n_expert = 0;
  int64_t n_used = 0;
  int64_t expert_ff = 0;
  bool norm_weights = false;
  const Weight* shared_gate_inp = nullptr;  // (dim) f32, or nullptr: no shared expert
  const Weight* shared_gate = nullptr;
  const Weight* shared_up = nullptr;
  const Weight* shared_down = nullptr;
  int64_t shared_ff = 0;
  int layer = -1;  // the layer it belongs to (a device backend may run some layers' experts on the host)
};

/// Points in a step where a backend may do other work (the worker reads its
/// socket there: Backend::during_step()).
enum class StepPoint : uint8_t { attention_done, layer_done };

class ForwardOps {
 public:
  virtual ~ForwardOps() = default;

  /// The step's tokens (host memory, valid until the step ends) and its
  /// number of logit rows (0: no logits this step).
  virtual void begin_step(std::span<const BatchToken> batch, int64_t logit_rows) = 0;
  /// out[t] = row batch[t].token of `table` (dequantised to f32).
  virtual void embed(const Weight& table, Act out) = 0;
  /// out = rmsnorm(in) * g, row by row (in == out allowed).
  virtual void rmsnorm(Act in, const Weight& g, float eps, Act out) = 0;
  /// The products of `ps`, all reading `in` (through `norm` when set). Default:
  /// rmsnorm(in -> norm->out), then products(norm->out, nullptr, ps).
  virtual void products(Act in, const NormSpec* norm, std::span<const ProductSpec> ps);
  /// g = silu(g) * u, elementwise over the first hp.ff values of each row.
  virtual void swiglu(Act g, Act u) = 0;
  /// h = silu(gate . n) * (up . n), n = in or rmsnorm(in) * norm->g; `h_up`
  /// is scratch of h's shape. Default: products into h and h_up, swiglu.
  virtual void ffn_swiglu(Act in, const NormSpec* norm, const Weight& gate, const Weight& up, Act h, Act h_up);
  /// out (+)= the mixture of experts of `spec` over n = in, or rmsnorm(in) *
  /// norm->g (written to norm->out), leaving each token's expert
  /// probabilities (the softmax) in Act::router: `accumulate` adds it into out (the
  /// residual), else out is overwritten (it may be n, not moe_in or moe_out). A backend that
  /// runs no mixture of experts refuses the model when it is built.
  virtual void moe_ffn(Act in, const NormSpec* norm, const MoeSpec& spec, Act out, bool accumulate) = 0;
  /// The head_dim values of each of `heads` heads of `qk`, normalised each
  /// (RMSNorm per head, gain g of head_dim values): Qwen3's Q/K norm.
  virtual void head_norm(Act qk, int64_t heads, const Weight& g, float eps) = 0;
  /// Rotates the first n_rot values of each of `heads` heads of `qk`.
  virtual void rope(Act qk, int64_t heads, const RopeSpec& r) = 0;
  /// Stores rows k and v at batch[t].slot, batch[t].pos of layer's KV cache.
  virtual void kv_store(int layer, Act k, Act v) = 0;
  /// rope(q), rope(k), kv_store(k, v): the default body.
  virtual void rope_kv_store(int layer, Act q, int64_t q_heads, Act k, int64_t kv_heads, Act v, const RopeSpec& r);
  /// out = attention of q over the layer's cache (including this step's rows).
  virtual void attention(int layer, Act q, Act out, const AttentionSpec& a) = 0;
  /// x += o, over the first hp.dim values of each row.
  virtual void add(Act x, Act o) = 0;
  /// xl[batch[t].logit_row] = x[t] for the tokens that have a logit row.
  virtual void gather_logit_rows(Act x, Act xl) = 0;
  /// Hands an activation to the trace (tests): `name` as TraceFn says,
  /// `cols` used values of each row.
  virtual void trace(std::string_view name, int layer, Act a, int64_t cols) = 0;
  /// Whether trace() is wanted: run_forward() then issues no fused op whose
  /// intermediate the trace reads (the norms, ffn_out before its add).
  virtual bool tracing() const = 0;
  virtual void step_point(StepPoint p, int layer) {}
};

/// Runs one step of `model` on `ops`: embed, every layer (attention block,
/// feed-forward block), then, for the rows that need them, the output norm
/// and the logits (Act::logits, n_vocab per row). The batch is the
/// caller's, already checked (Backend::forward's contract).
void run_forward(const Model& model, ForwardOps& ops, std::span<const BatchToken> batch);

/// Logit rows a step needs: 1 + the highest logit_row (0 when none).
int64_t logit_rows_of(std::span<const BatchToken> batch);

}  // namespace ds4

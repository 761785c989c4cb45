#pragma once
/// Each architecture ds4 runs, described once as data: the prefix of its
/// metadata keys, its variations (RoPE pairing, QKV bias, Q/K norm, rope
/// frequency factors) and the tensors a file of it holds, with their shapes
/// as functions of the hyper-parameters. The binder (model/weights.h), the
/// generator (ds4-mkmodel --arch) and the tests read the same rows; adding an
/// architecture is adding a row here and, if it has a new variation, the op
/// of model/../worker/forward.cpp that runs it.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "model/hparams.h"

namespace ds4 {

/// A size of a tensor's dimension, resolved from HParams by dim_size().
enum class Dim : uint8_t { one, dim, q_dim, kv_dim, ff, vocab, head_dim, rot_half, n_expert, expert_ff, shared_ff };
int64_t dim_size(Dim d, const HParams& hp);

/// When a tensor must be in the file.
enum class Need : uint8_t {
  always,
  optional,    // bound when present (output.weight: tied embeddings; rope_freqs.weight)
  qkv_bias,    // when the architecture has QKV bias (bound wherever present)
  qk_norm,     // when it has Q/K norm
  dense_ffn,   // the feed-forward of a dense model (ffn_gate, ffn_up, ffn_down)
  experts,     // a mixture of experts' router and expert tensors
  shared_expert,  // the shared expert of qwen2moe and its gate
};

/// Where a bound tensor goes: the role the forward pass reads it as.
enum class Role : uint8_t {
  token_embd, output_norm, output, rope_freqs,
  attn_norm, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, ffn_norm, w_gate, w_up, w_down,
  gate_inp, gate_exps, up_exps, down_exps, gate_inp_shexp, gate_shexp, up_shexp, down_shexp,
};

/// One tensor: `name` ("blk.%d." is prefixed for layer tensors), GGUF dims
/// {cols, rows} (rows Dim::one: a vector, which must be F32), or {cols, rows,
/// mats} for a stack of matrices (the experts of a layer).
struct TensorSpec {
  std::string_view name;
  Role role;
  Dim cols;
  Dim rows;
  Need need;
  bool per_layer;
  Dim mats = Dim::one;
};

/// What a layer's feed-forward block is.
enum class FfnKind : uint8_t {
  dense,           // SwiGLU: ffn_gate, ffn_up, ffn_down
  experts,         // routed experts: softmax router, top-k, SwiGLU experts (qwen3moe)
  experts_shared,  // the same plus a shared expert under a sigmoid gate (qwen2moe)
};

struct Architecture {
  std::string_view name;  // general.architecture and the key prefix
  RopeType rope;
  bool qkv_bias;
  bool qk_norm;
  bool rope_freqs;        // may carry rope_freqs.weight (Llama 3 frequency factors)
  FfnKind ffn = FfnKind::dense;
  bool expert_weights_norm = false;  // the chosen experts' weights renormalised to sum to 1
};

/// Every architecture ds4 runs.
std::span<const Architecture> architectures();
/// The row named `name`, or nullptr.
const Architecture* find_architecture(std::string_view name);
/// "llama, mistral, qwen2, qwen3, ...": for the error naming an unknown one.
std::string known_architectures();
/// The tensors of `arch`, global ones first, then those of one layer.
std::span<const TensorSpec> architecture_tensors();
/// Whether `spec` must be in a file of `arch` (optional ones: false).
bool tensor_required(const TensorSpec& spec, const Architecture& arch);
/// Whether `spec` is bound for `arch` when a file has it (Q/K norm is not
/// part of llama; QKV biases are bound for every architecture).
bool tensor_used(const TensorSpec& spec, const Architecture& arch);
/// The full name of `spec` in layer `layer` ("blk.3.attn_q.weight").
std::string tensor_name(const TensorSpec& spec, int64_t layer);

}  // namespace ds4

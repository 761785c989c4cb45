#include "model/architecture.h"

#include <array>

namespace ds4 {
namespace {

// Llama 3.x, Mistral and TinyStories write "llama"; llama.cpp also reads
// "mistral" as the same graph. Qwen2/2.5 add QKV bias, Qwen3 a per-head
// RMSNorm of Q and K (and a head size of its own); both pair RoPE NEOX-style.
constexpr std::array kArchitectures = {
    Architecture{"llama", RopeType::normal, false, false, true},
    Architecture{"mistral", RopeType::normal, false, false, true},
    Architecture{"qwen2", RopeType::neox, true, false, false},
    Architecture{"qwen3", RopeType::neox, false, true, false},
    // Qwen1.5-MoE and Qwen2-57B-A14B: qwen2's attention, routed experts
    // whose weights are not renormalised, and a shared expert.
    Architecture{"qwen2moe", RopeType::neox, true, false, false, FfnKind::experts_shared, false},
    // Qwen3-30B-A3B and Qwen3-235B-A22B: qwen3's attention, routed experts
    // whose chosen weights are renormalised.
    Architecture{"qwen3moe", RopeType::neox, false, true, false, FfnKind::experts, true},
};

constexpr std::array kTensors = {
    TensorSpec{"token_embd.weight", Role::token_embd, Dim::dim, Dim::vocab, Need::always, false},
    TensorSpec{"output_norm.weight", Role::output_norm, Dim::dim, Dim::one, Need::always, false},
    TensorSpec{"output.weight", Role::output, Dim::dim, Dim::vocab, Need::optional, false},
    TensorSpec{"rope_freqs.weight", Role::rope_freqs, Dim::rot_half, Dim::one, Need::optional, false},
    TensorSpec{"attn_norm.weight", Role::attn_norm, Dim::dim, Dim::one, Need::always, true},
    TensorSpec{"attn_q.weight", Role::wq, Dim::dim, Dim::q_dim, Need::always, true},
    TensorSpec{"attn_k.weight", Role::wk, Dim::dim, Dim::kv_dim, Need::always, true},
    TensorSpec{"attn_v.weight", Role::wv, Dim::dim, Dim::kv_dim, Need::always, true},
    TensorSpec{"attn_q.bias", Role::bq, Dim::q_dim, Dim::one, Need::qkv_bias, true},
    TensorSpec{"attn_k.bias", Role::bk, Dim::kv_dim, Dim::one, Need::qkv_bias, true},
    TensorSpec{"attn_v.bias", Role::bv, Dim::kv_dim, Dim::one, Need::qkv_bias, true},
    TensorSpec{"attn_q_norm.weight", Role::q_norm, Dim::head_dim, Dim::one, Need::qk_norm, true},
    TensorSpec{"attn_k_norm.weight", Role::k_norm, Dim::head_dim, Dim::one, Need::qk_norm, true},
    TensorSpec{"attn_output.weight", Role::wo, Dim::q_dim, Dim::dim, Need::always, true},
    TensorSpec{"ffn_norm.weight", Role::ffn_norm, Dim::dim, Dim::one, Need::always, true},
    TensorSpec{"ffn_gate.weight", Role::w_gate, Dim::dim, Dim::ff, Need::dense_ffn, true},
    TensorSpec{"ffn_up.weight", Role::w_up, Dim::dim, Dim::ff, Need::dense_ffn, true},
    TensorSpec{"ffn_down.weight", Role::w_down, Dim::ff, Dim::dim, Need::dense_ffn, true},
    // A mixture of experts: the router (F32 in every file llama.cpp writes)
    // and each layer's experts as one stack of n_expert matrices.
    TensorSpec{"ffn_gate_inp.weight", Role::gate_inp, Dim::dim, Dim::n_expert, Need::experts, true},
    TensorSpec{"ffn_gate_exps.weight", Role::gate_exps, Dim::dim, Dim::expert_ff, Need::experts, true, Dim::n_expert},
    TensorSpec{"ffn_up_exps.weight", Role::up_exps, Dim::dim, Dim::expert_ff, Need::experts, true, Dim::n_expert},
    TensorSpec{"ffn_down_exps.weight", Role::down_exps, Dim::expert_ff, Dim::dim, Need::experts, true, Dim::n_expert},
    TensorSpec{"ffn_gate_inp_shexp.weight", Role::gate_inp_shexp, Dim::dim, Dim::one, Need::shared_expert, true},
    TensorSpec{"ffn_gate_shexp.weight", Role::gate_shexp, Dim::dim, Dim::shared_ff, Need::shared_expert, true},
    TensorSpec{"ffn_up_shexp.weight", Role::up_shexp, Dim::dim, Dim::shared_ff, Need::shared_expert, true},
    TensorSpec{"ffn_down_shexp.weight", Role::down_shexp, Dim::shared_ff, Dim::dim, Need::shared_expert, true},
};

}  // namespace

int64_t dim_size(Dim d, const HParams& hp) {
  switch (d) {
    case Dim::one: return 1;
    case Dim::dim: return hp.dim;
    case Dim::q_dim: return hp.q_dim();
    case Dim::kv_dim: return hp.kv_dim();
    case Dim::ff: return hp.ff;
    case Dim::vocab: return hp.n_vocab;
    case Dim::head_dim: return hp.head_dim;
    case Dim::rot_half: return hp.n_rot / 2;
    case Dim::n_expert: return hp.n_expert;
    case Dim::expert_ff: return hp.expert_ff;
    case Dim::shared_ff: return hp.shared_ff;
  }
  return 0;
}

std::span<const Architecture> architectures() { return kArchitectures; }

const Architecture* find_architecture(std::string_view name) {
  for (const Architecture& a : kArchitectures)
    if (a.name == name) return &a;
  return nullptr;
}

std::string known_architectures() {
  std::string s;
  for (const Architecture& a : kArchitectures) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

std::span<const TensorSpec> architecture_tensors() { return kTensors; }

bool tensor_used(const TensorSpec& spec, const Architecture& arch) {
  if (spec.role == Role::rope_freqs) return arch.rope_freqs;
  // QKV biases are bound wherever a file has them (llama.cpp's llama graph
  // takes them too); Q/K norm only where the architecture applies it, and
  // each kind of feed-forward only in the architectures that have it.
  switch (spec.need) {
    case Need::qk_norm: return arch.qk_norm;
    case Need::dense_ffn: return arch.ffn == FfnKind::dense;
    case Need::experts: return arch.ffn != FfnKind::dense;
    case Need::shared_expert: return arch.ffn == FfnKind::experts_shared;
    default: return true;
  }
}

bool tensor_required(const TensorSpec& spec, const Architecture& arch) {
  switch (spec.need) {
    case Need::always: return true;
    case Need::optional: return false;
    case Need::qkv_bias: return arch.qkv_bias;
    case Need::qk_norm: return arch.qk_norm;
    case Need::dense_ffn:
    case Need::experts:
    case Need::shared_expert: return tensor_used(spec, arch);
  }
  return false;
}

std::string tensor_name(const TensorSpec& spec, int64_t layer) {
  if (!spec.per_layer) return std::string(spec.name);
  return "blk." + std::to_string(layer) + "." + std::string(spec.name);
}

}  // namespace ds4

#pragma once
/// The hyper-parameters of a model, read from its GGUF metadata by the row of
/// its architecture (model/architecture.h). Plain data: the engine, the
/// memory plan and the proxy read them; nothing here touches tensors.

#include <algorithm>
#include <cstdint>
#include <string>

#include "shared/gguf.h"

namespace ds4 {

/// How RoPE pairs the values of a head: `normal` rotates (x[2i], x[2i+1])
/// (llama, mistral); `neox` rotates (x[i], x[i + n_rot/2]) (qwen2, qwen3).
enum class RopeType : uint8_t { normal, neox };

struct Architecture;

struct HParams {
  std::string arch;         // general.architecture
  std::string name;         // general.name (may be empty)
  int64_t n_vocab = 0;
  int64_t dim = 0;          // embedding length
  int64_t n_layers = 0;
  int64_t ff = 0;           // feed-forward length
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;     // attention.key_length, else dim / n_heads
  int64_t n_rot = 0;        // rope dimension count (<= head_dim)
  int64_t train_ctx = 0;    // context_length
  float rope_base = 10000.0f;
  float norm_eps = 1e-5f;
  // The architecture's variations (from its row, and the scaling keys).
  RopeType rope_type = RopeType::normal;
  float rope_freq_scale = 1.0f;  // 1 / rope.scaling.factor for linear scaling
  bool qkv_bias = false;         // attn_{q,k,v}.bias
  bool qk_norm = false;          // attn_{q,k}_norm.weight: RMSNorm per head before RoPE
  // Mixture of experts (qwen2moe, qwen3moe); n_expert == 0 for a dense model.
  int64_t n_expert = 0;          // expert_count
  int64_t n_expert_used = 0;     // expert_used_count: experts each token goes through
  int64_t expert_ff = 0;         // expert_feed_forward_length
  int64_t shared_ff = 0;         // expert_shared_feed_forward_length (qwen2moe), else 0
  bool expert_weights_norm = false;  // the chosen experts' weights are renormalised to sum to 1

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  bool moe() const { return n_expert > 0; }
  /// Width of the feed-forward activations: ff for a dense model, the
  /// largest expert (routed or shared) for a mixture of experts.
  int64_t ffn_width() const { return moe() ? std::max(expert_ff, shared_ff) : ff; }
};

/// Reads hyper-parameters only (the proxy and the memory planner need them).
/// Throws ds4::Error naming the key: missing, out of range, or an
/// architecture ds4 does not know (listing the ones it knows).
HParams read_hparams(const gguf::File& meta);

}  // namespace ds4

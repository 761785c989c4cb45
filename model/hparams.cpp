#include "model/hparams.h"

#include <cmath>
#include <string>

#include "model/architecture.h"
#include "shared/error.h"

namespace ds4 {
namespace {

int64_t require_int(const gguf::File& m, const std::string& key) {
  auto v = m.get_int(key);
  if (!v) throw Error(m.source() + ": missing metadata key '" + key + "'");
  if (*v <= 0) throw Error(m.source() + ": metadata key '" + key + "' must be positive, got " + std::to_string(*v));
  return *v;
}

/// RoPE scaling as llama.cpp reads it: rope.scaling.type (absent: linear)
/// with rope.scaling.factor (absent or 0: none). YaRN and LongRoPE change
/// the angles in ways ds4 does not run: refused, naming the key.
void read_rope_scaling(const gguf::File& m, const std::string& a, HParams& hp) {
  const std::string type = m.get_string(a + "rope.scaling.type").value_or("linear");
  const double factor = m.get_float(a + "rope.scaling.factor").value_or(0.0);
  if (type == "none") return;
  if (type != "linear")
    throw Error(m.source() + ": " + a + "rope.scaling.type is '" + type + "'; ds4 runs 'none' and 'linear'");
  if (!std::isfinite(factor) || factor < 0)
    throw Error(m.source() + ": " + a + "rope.scaling.factor = " + std::to_string(factor) + " must be positive");
  if (factor > 0) hp.rope_freq_scale = float(1.0 / factor);
}

/// The mixture of experts' sizes, as llama.cpp reads them: the expert
/// count, how many each token uses, an expert's hidden size and (qwen2moe)
/// the shared expert's, which defaults to feed_forward_length.
void read_experts(const gguf::File& m, const std::string& a, const Architecture& arch, HParams& hp) {
  hp.n_expert = require_int(m, a + "expert_count");
  hp.n_expert_used = require_int(m, a + "expert_used_count");
  if (hp.n_expert_used > hp.n_expert)
    throw Error(m.source() + ": " + a + "expert_used_count = " + std::to_string(hp.n_expert_used) +
                " exceeds expert_count = " + std::to_string(hp.n_expert));
  if (hp.n_expert > 4096) throw Error(m.source() + ": " + a + "expert_count = " + std::to_string(hp.n_expert) + " is beyond 4096");
  hp.expert_ff = require_int(m, a + "expert_feed_forward_length");
  if (arch.ffn == FfnKind::experts_shared) {
    hp.shared_ff = m.get_int(a + "expert_shared_feed_forward_length").value_or(hp.ff);
    if (hp.shared_ff <= 0)
      throw Error(m.source() + ": " + a + "expert_shared_feed_forward_length = " + std::to_string(hp.shared_ff) +
                  " must be positive");
  }
  hp.expert_weights_norm = arch.expert_weights_norm;
}

}  // namespace

HParams read_hparams(const gguf::File& m) {
  HParams hp;
  hp.arch = m.get_string("general.architecture").value_or("");
  const Architecture* arch = find_architecture(hp.arch);
  if (!arch)
    throw Error(m.source() + ": general.architecture is '" + hp.arch + "'; ds4 runs " + known_architectures());
  hp.rope_type = arch->rope;
  hp.qkv_bias = arch->qkv_bias;
  hp.qk_norm = arch->qk_norm;
  hp.name = m.get_string("general.name").value_or("");
  const std::string a = hp.arch + ".";
  hp.dim = require_int(m, a + "embedding_length");
  hp.n_layers = require_int(m, a + "block_count");
  hp.ff = require_int(m, a + "feed_forward_length");
  hp.n_heads = require_int(m, a + "attention.head_count");
  hp.n_kv_heads = m.get_int(a + "attention.head_count_kv").value_or(hp.n_heads);
  if (hp.n_kv_heads <= 0 || hp.n_heads % hp.n_kv_heads != 0)
    throw Error(m.source() + ": " + a + "attention.head_count_kv = " + std::to_string(hp.n_kv_heads) +
                " must divide head_count = " + std::to_string(hp.n_heads));
  if (const auto k = m.get_int(a + "attention.key_length")) {
    // Qwen3 (and others) give the head size: it need not be dim / heads.
    if (*k <= 0) throw Error(m.source() + ": " + a + "attention.key_length = " + std::to_string(*k) + " must be positive");
    const int64_t v = m.get_int(a + "attention.value_length").value_or(*k);
    if (v != *k)
      throw Error(m.source() + ": " + a + "attention.value_length = " + std::to_string(v) +
                  " differs from key_length = " + std::to_string(*k) + "; ds4 runs equal K and V head sizes");
    hp.head_dim = *k;
  } else {
    if (hp.dim % hp.n_heads != 0)
      throw Error(m.source() + ": embedding_length " + std::to_string(hp.dim) +
                  " is not a multiple of head_count " + std::to_string(hp.n_heads) + " (and no " + a +
                  "attention.key_length gives the head size)");
    hp.head_dim = hp.dim / hp.n_heads;
  }
  hp.n_rot = m.get_int(a + "rope.dimension_count").value_or(hp.head_dim);
  if (hp.n_rot <= 0 || hp.n_rot > hp.head_dim || hp.n_rot % 2)
    throw Error(m.source() + ": " + a + "rope.dimension_count = " + std::to_string(hp.n_rot) +
                " must be even and at most the head size " + std::to_string(hp.head_dim));
  hp.train_ctx = m.get_int(a + "context_length").value_or(2048);
  hp.rope_base = float(m.get_float(a + "rope.freq_base").value_or(10000.0));
  hp.norm_eps = float(m.get_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5));
  // NaN or a negative value passed, and every answer was <unk>.
  if (!(hp.norm_eps > 0) || !std::isfinite(hp.norm_eps))
    throw Error(m.source() + ": " + a + "attention.layer_norm_rms_epsilon = " + std::to_string(hp.norm_eps) +
                " must be a small positive number (1e-5, 1e-6)");
  if (!(hp.rope_base > 0) || !std::isfinite(hp.rope_base))
    throw Error(m.source() + ": " + a + "rope.freq_base = " + std::to_string(hp.rope_base) + " must be positive");
  read_rope_scaling(m, a, hp);
  if (arch->ffn != FfnKind::dense) read_experts(m, a, *arch, hp);
  if (auto toks = m.find("tokenizer.ggml.tokens"); toks && toks->type == gguf::ValueType::ARRAY)
    hp.n_vocab = int64_t(toks->array.size());
  if (hp.n_vocab <= 0) throw Error(m.source() + ": missing metadata key 'tokenizer.ggml.tokens'");
  return hp;
}

}  // namespace ds4

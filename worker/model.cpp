#include "worker/model.h"

#include <cmath>
#include <string>

#include "shared/error.h"

namespace ds4 {
namespace {

int64_t require_int(const gguf::File& m, const std::string& key) {
  auto v = m.get_int(key);
  if (!v) throw Error(m.source() + ": missing metadata key '" + key + "'");
  if (*v <= 0) throw Error(m.source() + ": metadata key '" + key + "' must be positive, got " + std::to_string(*v));
  return *v;
}

Weight bind_tensor(const gguf::File& m, const TensorLookup& lookup, const std::string& name,
                   int64_t cols, int64_t rows, uint64_t& total) {
  TensorView t;
  if (!lookup(name, t)) throw Error(m.source() + ": missing tensor '" + name + "'");
  const bool vector = rows == 0;
  const uint64_t want1 = vector ? 1 : uint64_t(rows);
  if (t.dims[0] != uint64_t(cols) || t.dims[1] != want1 || t.dims[2] != 1 || t.dims[3] != 1) {
    std::string got = std::to_string(t.dims[0]);
    for (uint32_t i = 1; i < t.n_dims; ++i) got += " x " + std::to_string(t.dims[i]);
    throw Error(m.source() + ": tensor '" + name + "' has shape [" + got + "], expected [" +
                std::to_string(cols) + (vector ? "" : " x " + std::to_string(rows)) + "]");
  }
  if (!type_supported(t.type)) {
    auto tr = type_traits(uint32_t(t.type));
    throw Error(m.source() + ": tensor '" + name + "' has type " + std::string(tr ? tr->name : "?") +
                ", which ds4 does not run (" + std::string(supported_types()) + ")");
  }
  if (vector && t.type != GgmlType::F32)
    throw Error(m.source() + ": norm tensor '" + name + "' must be F32");
  if (const auto tr = type_traits(uint32_t(t.type)); tr && cols % tr->block_elems != 0)
    throw Error(m.source() + ": tensor '" + name + "' is " + std::string(tr->name) + " with a row length " +
                std::to_string(cols) + ", not a multiple of its block of " + std::to_string(tr->block_elems));
  total += t.n_bytes;
  return Weight{t.type, t.data, cols, vector ? 1 : rows};
}

}  // namespace

HParams read_hparams(const gguf::File& m) {
  HParams hp;
  hp.arch = m.get_string("general.architecture").value_or("");
  if (hp.arch != "llama" && hp.arch != "mistral")
    throw Error(m.source() + ": general.architecture is '" + hp.arch +
                "'; ds4 runs llama-family models (llama, mistral)");
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
  if (hp.dim % hp.n_heads != 0)
    throw Error(m.source() + ": embedding_length " + std::to_string(hp.dim) +
                " is not a multiple of head_count " + std::to_string(hp.n_heads));
  hp.head_dim = hp.dim / hp.n_heads;
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
  if (auto toks = m.find("tokenizer.ggml.tokens"); toks && toks->type == gguf::ValueType::ARRAY)
    hp.n_vocab = int64_t(toks->array.size());
  if (hp.n_vocab <= 0) throw Error(m.source() + ": missing metadata key 'tokenizer.ggml.tokens'");
  return hp;
}

TensorView tensor_view(const gguf::File& file, const gguf::TensorInfo& t) {
  TensorView v;
  v.type = t.type;
  v.n_dims = uint32_t(t.dims.size());
  for (size_t i = 0; i < 4; ++i) v.dims[i] = i < t.dims.size() ? t.dims[i] : 1;
  v.data = file.tensor_data(t).data();
  v.n_bytes = t.n_bytes;
  return v;
}

Model Model::bind_file(const gguf::File& file) {
  return bind(file, [&file](std::string_view name, TensorView& out) {
    const gguf::TensorInfo* t = file.find_tensor(name);
    if (t) out = tensor_view(file, *t);
    return t != nullptr;
  });
}

Model Model::bind(const gguf::File& m, const TensorLookup& lookup) {
  Model model;
  HParams& hp = model.hp_ = read_hparams(m);
  ModelWeights& w = model.w_;
  uint64_t& total = w.bytes;
  // The embedding's vocabulary is authoritative when it differs from the token list.
  TensorView embd;
  if (!lookup("token_embd.weight", embd)) throw Error(m.source() + ": missing tensor 'token_embd.weight'");
  if (int64_t(embd.dims[1]) != hp.n_vocab)
    throw Error(m.source() + ": token_embd.weight has " + std::to_string(embd.dims[1]) +
                " rows but the vocabulary has " + std::to_string(hp.n_vocab) + " tokens");
  w.token_embd = bind_tensor(m, lookup, "token_embd.weight", hp.dim, hp.n_vocab, total);
  w.output_norm = bind_tensor(m, lookup, "output_norm.weight", hp.dim, 0, total);
  TensorView out;
  if (lookup("output.weight", out)) w.output = bind_tensor(m, lookup, "output.weight", hp.dim, hp.n_vocab, total);
  else w.output = w.token_embd;  // tied embeddings
  for (int64_t l = 0; l < hp.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights L;
    L.attn_norm = bind_tensor(m, lookup, p + "attn_norm.weight", hp.dim, 0, total);
    L.wq = bind_tensor(m, lookup, p + "attn_q.weight", hp.dim, hp.q_dim(), total);
    L.wk = bind_tensor(m, lookup, p + "attn_k.weight", hp.dim, hp.kv_dim(), total);
    L.wv = bind_tensor(m, lookup, p + "attn_v.weight", hp.dim, hp.kv_dim(), total);
    L.wo = bind_tensor(m, lookup, p + "attn_output.weight", hp.q_dim(), hp.dim, total);
    L.ffn_norm = bind_tensor(m, lookup, p + "ffn_norm.weight", hp.dim, 0, total);
    L.w_gate = bind_tensor(m, lookup, p + "ffn_gate.weight", hp.dim, hp.ff, total);
    L.w_up = bind_tensor(m, lookup, p + "ffn_up.weight", hp.dim, hp.ff, total);
    L.w_down = bind_tensor(m, lookup, p + "ffn_down.weight", hp.ff, hp.dim, total);
    w.layers.push_back(L);
  }
  return model;
}

}  // namespace ds4

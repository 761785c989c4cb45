#include "model/weights.h"

#include <string>

#include "model/architecture.h"
#include "shared/error.h"
#include "shared/model_store.h"

namespace ds4 {
namespace {

Weight bind_tensor(const gguf::File& m, const TensorView& t, const std::string& name, int64_t cols, int64_t rows,
                   int64_t mats, uint64_t& total) {
  const bool vector = rows == 0;
  const uint64_t want1 = vector ? 1 : uint64_t(rows);
  if (t.dims[0] != uint64_t(cols) || t.dims[1] != want1 || t.dims[2] != uint64_t(mats) || t.dims[3] != 1) {
    std::string got = std::to_string(t.dims[0]);
    for (uint32_t i = 1; i < t.n_dims; ++i) got += " x " + std::to_string(t.dims[i]);
    throw Error(m.source() + ": tensor '" + name + "' has shape [" + got + "], expected [" +
                std::to_string(cols) + (vector ? "" : " x " + std::to_string(rows)) +
                (mats > 1 ? " x " + std::to_string(mats) : "") + "]");
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
  return Weight{t.type, t.data, cols, vector ? 1 : rows, mats};
}

Weight* slot_of(Role role, ModelWeights& w, LayerWeights* L) {
  switch (role) {
    case Role::token_embd: return &w.token_embd;
    case Role::output_norm: return &w.output_norm;
    case Role::output: return &w.output;
    case Role::rope_freqs: return &w.rope_freqs;
    case Role::attn_norm: return &L->attn_norm;
    case Role::wq: return &L->wq;
    case Role::wk: return &L->wk;
    case Role::wv: return &L->wv;
    case Role::wo: return &L->wo;
    case Role::bq: return &L->bq;
    case Role::bk: return &L->bk;
    case Role::bv: return &L->bv;
    case Role::q_norm: return &L->q_norm;
    case Role::k_norm: return &L->k_norm;
    case Role::ffn_norm: return &L->ffn_norm;
    case Role::w_gate: return &L->w_gate;
    case Role::w_up: return &L->w_up;
    case Role::w_down: return &L->w_down;
    case Role::gate_inp: return &L->gate_inp;
    case Role::gate_exps: return &L->gate_exps;
    case Role::up_exps: return &L->up_exps;
    case Role::down_exps: return &L->down_exps;
    case Role::gate_inp_shexp: return &L->gate_inp_shexp;
    case Role::gate_shexp: return &L->gate_shexp;
    case Role::up_shexp: return &L->up_shexp;
    case Role::down_shexp: return &L->down_shexp;
  }
  return nullptr;
}

}  // namespace

uint64_t Weight::row_bytes() const {
  return type_bytes(type, uint64_t(cols));
}

Weight Weight::mat(int64_t e) const {
  Weight w = *this;
  w.mats = 1;
  w.data = static_cast<const uint8_t*>(data) + uint64_t(e) * uint64_t(rows) * row_bytes();
  return w;
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

TensorLookup segment_tensors(const store::Segment& segment) {
  const store::Segment* s = &segment;
  return [s](std::string_view name, TensorView& out) {
    const store::TensorRef* t = s->find_tensor(name);
    if (!t) return false;
    out.type = t->type;
    out.n_dims = t->n_dims;
    for (int i = 0; i < 4; ++i) out.dims[i] = t->dims[i];
    out.data = t->data;
    out.n_bytes = t->n_bytes;
    return true;
  };
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
  const Architecture& arch = *find_architecture(hp.arch);
  ModelWeights& w = model.w_;
  // The embedding's vocabulary is authoritative when it differs from the token list.
  TensorView embd;
  if (!lookup("token_embd.weight", embd)) throw Error(m.source() + ": missing tensor 'token_embd.weight'");
  if (int64_t(embd.dims[1]) != hp.n_vocab)
    throw Error(m.source() + ": token_embd.weight has " + std::to_string(embd.dims[1]) +
                " rows but the vocabulary has " + std::to_string(hp.n_vocab) + " tokens");
  w.layers.resize(size_t(hp.n_layers));
  for (const TensorSpec& spec : architecture_tensors()) {
    if (!tensor_used(spec, arch)) continue;
    const int64_t layers = spec.per_layer ? hp.n_layers : 1;
    for (int64_t l = 0; l < layers; ++l) {
      const std::string name = tensor_name(spec, l);
      TensorView t;
      if (!lookup(name, t)) {
        if (!tensor_required(spec, arch)) continue;
        throw Error(m.source() + ": missing tensor '" + name + "' (" + hp.arch + " has it in every file)");
      }
      const int64_t rows = spec.rows == Dim::one ? 0 : dim_size(spec.rows, hp);
      *slot_of(spec.role, w, spec.per_layer ? &w.layers[size_t(l)] : nullptr) =
          bind_tensor(m, t, name, dim_size(spec.cols, hp), rows, dim_size(spec.mats, hp), w.bytes);
    }
  }
  for (LayerWeights& L : w.layers)
    for (int64_t e = 0; L.gate_exps && e < L.gate_exps.mats; ++e) {
      L.gate_mats.push_back(L.gate_exps.mat(e));
      L.up_mats.push_back(L.up_exps.mat(e));
      L.down_mats.push_back(L.down_exps.mat(e));
    }
  if (!w.output) {  // tied embeddings
    w.output = w.token_embd;
    w.tied = true;
  }
  return model;
}

}  // namespace ds4

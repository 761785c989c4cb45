#pragma once
/// A model as the engine sees it: hyper-parameters from GGUF metadata and
/// views of the weight tensors (in the shared-memory segment, or in a file
/// held in memory), bound by the rows of model/architecture.h. Nothing here
/// owns weight memory or computes: the supervisor checks a file with it
/// before loading, without linking the engine.

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "model/hparams.h"
#include "shared/ggml_types.h"
#include "shared/gguf.h"

namespace ds4 {

namespace store {
class Segment;
}

/// A weight matrix: `rows` rows of `cols` elements (GGUF dims {cols, rows}).
/// A vector (norm gains, biases, frequency factors) has rows = 1 and is F32.
/// A stack of `mats` matrices (a layer's experts, GGUF dims {cols, rows,
/// mats}) holds them one after the other; mat(e) is matrix e.
/// An absent optional tensor has data == nullptr.
struct Weight {
  GgmlType type = GgmlType::F32;
  const void* data = nullptr;
  int64_t cols = 0;
  int64_t rows = 0;
  int64_t mats = 1;
  explicit operator bool() const { return data != nullptr; }
  /// Bytes of one row (whole blocks of the type).
  uint64_t row_bytes() const;
  /// Matrix `e` of a stack (e < mats), as a weight of its own.
  Weight mat(int64_t e) const;
};

struct LayerWeights {
  Weight attn_norm;  // (dim) f32
  Weight wq;         // (q_dim, dim)
  Weight wk;         // (kv_dim, dim)
  Weight wv;         // (kv_dim, dim)
  Weight bq, bk, bv; // (q_dim), (kv_dim), (kv_dim) f32: QKV bias (qwen2), else absent
  Weight q_norm;     // (head_dim) f32: per-head RMSNorm of Q (qwen3), else absent
  Weight k_norm;     // (head_dim) f32: the same for K
  Weight wo;         // (dim, q_dim)
  Weight ffn_norm;   // (dim) f32
  Weight w_gate;     // (ff, dim)
  Weight w_up;       // (ff, dim)
  Weight w_down;     // (dim, ff)
  // A mixture of experts (qwen2moe, qwen3moe) instead of w_gate, w_up, w_down:
  Weight gate_inp;   // (n_expert, dim) f32: the router
  Weight gate_exps;  // n_expert x (expert_ff, dim)
  Weight up_exps;    // n_expert x (expert_ff, dim)
  Weight down_exps;  // n_expert x (dim, expert_ff)
  Weight gate_inp_shexp;  // (dim) f32: the shared expert's gate (qwen2moe), else absent
  Weight gate_shexp, up_shexp;  // (shared_ff, dim)
  Weight down_shexp;            // (dim, shared_ff)
  // Each expert's matrices of the stacks (gate_exps.mat(e), ...), as objects
  // of their own: a device backend lays out and keys its copies by them.
  std::vector<Weight> gate_mats, up_mats, down_mats;
};

struct ModelWeights {
  Weight token_embd;   // (n_vocab, dim)
  Weight output_norm;  // (dim) f32
  Weight output;       // (n_vocab, dim); token_embd when the file ties them
  Weight rope_freqs;   // (n_rot / 2) f32: RoPE frequency factors (Llama 3), else absent
  bool tied = false;   // no output.weight: the logits use token_embd
  std::vector<LayerWeights> layers;
  uint64_t bytes = 0;  // all tensors the model uses
};

/// Finds a tensor by name: type, dims (ne[0] first, unused dims 1) and data.
struct TensorView {
  GgmlType type = GgmlType::F32;
  uint64_t dims[4] = {1, 1, 1, 1};
  uint32_t n_dims = 0;
  const void* data = nullptr;
  uint64_t n_bytes = 0;
};
using TensorLookup = std::function<bool(std::string_view name, TensorView& out)>;

/// The view of tensor `t` of a GGUF file held in memory (its data in the file's bytes).
TensorView tensor_view(const gguf::File& file, const gguf::TensorInfo& t);

/// The tensors of a model segment (shared/model_store.h), by name.
TensorLookup segment_tensors(const store::Segment& segment);

class Model {
 public:
  /// Reads hyper-parameters and binds every tensor of the architecture's row.
  /// Throws ds4::Error naming the key or tensor: missing, a shape that
  /// disagrees with the hyper-parameters, an unsupported type, an unknown
  /// architecture (listing the known ones).
  static Model bind(const gguf::File& meta, const TensorLookup& lookup);
  /// Binds every tensor in place in `file` (no shared memory: tests and tools).
  static Model bind_file(const gguf::File& file);

  const HParams& hp() const { return hp_; }
  const ModelWeights& w() const { return w_; }

 private:
  HParams hp_;
  ModelWeights w_;
};

}  // namespace ds4

#pragma once
/// A llama-family model (Llama 2/3, Mistral, TinyStories) as the engine sees
/// it: hyper-parameters from GGUF metadata and views of the weight tensors in
/// the shared-memory segment. Nothing here owns weight memory.

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/ggml_types.h"
#include "shared/gguf.h"

namespace ds4 {

struct HParams {
  std::string arch;         // general.architecture
  std::string name;         // general.name (may be empty)
  int64_t n_vocab = 0;
  int64_t dim = 0;          // embedding length
  int64_t n_layers = 0;
  int64_t ff = 0;           // feed-forward length
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;     // dim / n_heads
  int64_t n_rot = 0;        // rope dimension count (<= head_dim)
  int64_t train_ctx = 0;    // context_length
  float rope_base = 10000.0f;
  float norm_eps = 1e-5f;

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
};

/// A weight matrix: `rows` rows of `cols` elements (GGUF dims {cols, rows}).
struct Weight {
  GgmlType type = GgmlType::F32;
  const void* data = nullptr;
  int64_t cols = 0;
  int64_t rows = 0;
};

struct LayerWeights {
  Weight attn_norm;  // (dim) f32
  Weight wq;         // (q_dim, dim)
  Weight wk;         // (kv_dim, dim)
  Weight wv;         // (kv_dim, dim)
  Weight wo;         // (dim, q_dim)
  Weight ffn_norm;   // (dim) f32
  Weight w_gate;     // (ff, dim)
  Weight w_up;       // (ff, dim)
  Weight w_down;     // (dim, ff)
};

struct ModelWeights {
  Weight token_embd;   // (n_vocab, dim)
  Weight output_norm;  // (dim) f32
  Weight output;       // (n_vocab, dim); token_embd when the file ties them
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

class Model {
 public:
  /// Reads hyper-parameters and binds every tensor. Throws ds4::Error naming the
  /// key or tensor: missing, wrong shape, unsupported type or architecture.
  static Model bind(const gguf::File& meta, const TensorLookup& lookup);
  /// Binds every tensor in place in `file` (no shared memory: tests and tools).
  static Model bind_file(const gguf::File& file);

  const HParams& hp() const { return hp_; }
  const ModelWeights& w() const { return w_; }

 private:
  HParams hp_;
  ModelWeights w_;
};

/// Reads hyper-parameters only (the proxy and the memory planner need them).
HParams read_hparams(const gguf::File& meta);

}  // namespace ds4

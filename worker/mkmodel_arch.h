#pragma once
/// ds4-mkmodel's architectures: the metadata keys and the tensors of a
/// synthetic model of any row of model/architecture.h, with the weights'
/// spreads. mkmodel_main.cpp parses the options and writes the file; this
/// says what goes in it.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shared/ggml_types.h"
#include "shared/gguf_writer.h"

namespace ds4::mkmodel {

struct ArchOptions {
  std::string arch = "llama";  // a row of model/architecture.h
  uint32_t dim = 0, layers = 0, ff = 0, heads = 0, kv_heads = 0, ctx = 4096;
  uint32_t head_dim = 0;       // 0: dim / heads (qwen3 writes attention.key_length)
  bool tied = false;           // no output.weight: the logits use token_embd
  bool rope_freqs = false;     // rope_freqs.weight (Llama 3 frequency factors; llama, mistral)
  float rope_scale = 0;        // rope.scaling.type linear with this factor (0: no scaling keys)
  float rope_base = 0;         // 0: llama 10000, mistral and qwen 1e6
  float eos_bias = 0;          // > 0: the end token's output row leans to a few tokens' embeddings
  int32_t eos_token = -1;      // tokenizer.ggml.eos_token_id of the vocabulary
  std::vector<uint64_t> quiet_rows;  // tokens whose output rows are zero (never a greedy winner)
  uint64_t n_vocab = 0;
  // A mixture of experts (qwen2moe, qwen3moe): experts per layer, how many a
  // token uses, an expert's hidden size, the shared expert's (qwen2moe; 0: ff).
  uint32_t experts = 0, experts_used = 0, expert_ff = 0, shared_ff = 0;
  uint32_t head_size() const { return head_dim ? head_dim : dim / heads; }
  /// general.architecture written: Mistral's GGUFs say "llama" (llama.cpp
  /// knows no "mistral" graph); the others their own name.
  std::string file_arch() const { return arch == "mistral" ? "llama" : arch; }
};

/// Throws ds4::Error naming the option when `o` cannot make a model of its
/// architecture: an unknown one (listing the known ones), a head size that
/// is odd or that the architecture cannot take.
void validate_arch(const ArchOptions& o);

/// Sets `{arch}.*` and general.architecture.
void write_arch_metadata(gguf::Writer& w, const ArchOptions& o);

/// Where the tensors go: a matrix of normal(0, stddev) weights of the file's
/// type, or an F32 vector whose element i is value(i).
struct TensorSink {
  std::function<void(const std::string& name, uint64_t cols, uint64_t rows, float stddev)> matrix;
  std::function<void(const std::string& name, uint64_t n, std::function<float(uint64_t)> value)> vector;
  /// A stack of `mats` matrices (a layer's experts), of the file's type.
  std::function<void(const std::string& name, uint64_t cols, uint64_t rows, uint64_t mats, float stddev)> stack;
  /// A matrix that stays F32 whatever the file's type (a router, as llama.cpp writes it).
  std::function<void(const std::string& name, uint64_t cols, uint64_t rows, float stddev)> matrix_f32;
  /// A matrix whose element i is adjust(i, its normal(0, stddev) value):
  /// the output rows of eos_bias and quiet_rows.
  std::function<void(const std::string& name, uint64_t cols, uint64_t rows, float stddev,
                     std::function<float(uint64_t, float)> adjust)> matrix_adjusted;
};

/// Adds every tensor of the architecture, in llama.cpp's order. `normal_at(key, i)`
/// is the generator's seeded normal(0, 1) value of element i of the tensor named key.
void add_arch_tensors(const ArchOptions& o, TensorSink& sink, const std::function<float(const std::string&, uint64_t)>& normal_at);

}  // namespace ds4::mkmodel

#include "worker/mkmodel_arch.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "model/architecture.h"
#include "model/hparams.h"
#include "shared/error.h"

namespace ds4::mkmodel {
namespace {

HParams hparams_of(const ArchOptions& o) {
  const Architecture* a = find_architecture(o.arch);
  HParams hp;
  hp.arch = o.arch;
  hp.n_vocab = int64_t(o.n_vocab);
  hp.dim = o.dim;
  hp.n_layers = o.layers;
  hp.ff = o.ff;
  hp.n_heads = o.heads;
  hp.n_kv_heads = o.kv_heads;
  hp.head_dim = o.head_size();
  hp.n_rot = hp.head_dim;
  hp.qkv_bias = a->qkv_bias;
  hp.qk_norm = a->qk_norm;
  hp.n_expert = o.experts;
  hp.n_expert_used = o.experts_used;
  hp.expert_ff = o.expert_ff;
  hp.shared_ff = a->ffn == FfnKind::experts_shared ? (o.shared_ff ? o.shared_ff : o.ff) : 0;
  return hp;
}

}  // namespace

void validate_arch(const ArchOptions& o) {
  const Architecture* a = find_architecture(o.arch);
  if (!a) throw Error("--arch: unknown architecture '" + o.arch + "' (expected " + known_architectures() + ")");
  if (o.head_dim == 0 && o.dim % o.heads != 0)
    throw Error("--dim " + std::to_string(o.dim) + " is not divisible by --heads " + std::to_string(o.heads) +
                " (or give --head-dim)");
  if (o.head_size() % 2 != 0)
    throw Error("head size " + std::to_string(o.head_size()) + " must be even (rotary embeddings rotate pairs)");
  if (o.rope_freqs && !a->rope_freqs)
    throw Error("--rope-freqs: " + o.arch + " files have no rope_freqs.weight (llama and mistral do)");
  if (o.rope_scale < 0) throw Error("--rope-scale must be positive");
  if (a->ffn == FfnKind::dense) {
    if (o.experts || o.experts_used || o.expert_ff || o.shared_ff)
      throw Error("--experts, --experts-used, --expert-ff and --shared-ff: " + o.arch +
                  " is a dense model (qwen2moe and qwen3moe have experts)");
    return;
  }
  if (o.experts < 2) throw Error("--experts: " + o.arch + " needs at least 2 experts per layer");
  if (o.experts_used < 1 || o.experts_used > o.experts)
    throw Error("--experts-used must be between 1 and --experts (" + std::to_string(o.experts) + ")");
  if (o.expert_ff == 0) throw Error("--expert-ff: " + o.arch + " needs the experts' hidden size");
  if (o.shared_ff && a->ffn != FfnKind::experts_shared)
    throw Error("--shared-ff: " + o.arch + " has no shared expert (qwen2moe has)");
}

void write_arch_metadata(gguf::Writer& w, const ArchOptions& o) {
  const std::string p = o.file_arch() + ".";
  w.set_string("general.architecture", o.file_arch());
  w.set_u32(p + "vocab_size", uint32_t(o.n_vocab));
  w.set_u32(p + "context_length", o.ctx);
  w.set_u32(p + "embedding_length", o.dim);
  w.set_u32(p + "block_count", o.layers);
  w.set_u32(p + "feed_forward_length", o.ff);
  w.set_u32(p + "attention.head_count", o.heads);
  w.set_u32(p + "attention.head_count_kv", o.kv_heads);
  if (o.head_dim) {
    w.set_u32(p + "attention.key_length", o.head_dim);
    w.set_u32(p + "attention.value_length", o.head_dim);
  }
  if (o.experts) {
    w.set_u32(p + "expert_count", o.experts);
    w.set_u32(p + "expert_used_count", o.experts_used);
    w.set_u32(p + "expert_feed_forward_length", o.expert_ff);
    if (o.shared_ff) w.set_u32(p + "expert_shared_feed_forward_length", o.shared_ff);
  }
  w.set_f32(p + "attention.layer_norm_rms_epsilon", o.file_arch() == "llama" ? 1e-5f : 1e-6f);
  w.set_u32(p + "rope.dimension_count", o.head_size());
  // Mistral 7B v0.2+ and Qwen take a RoPE base of 1e6 unless told otherwise.
  w.set_f32(p + "rope.freq_base", o.rope_base > 0 ? o.rope_base : o.arch == "llama" ? 10000.0f : 1000000.0f);
  if (o.rope_scale > 0) {
    w.set_string(p + "rope.scaling.type", "linear");
    w.set_f32(p + "rope.scaling.factor", o.rope_scale);
  }
}

void add_arch_tensors(const ArchOptions& o, TensorSink& sink,
                      const std::function<float(const std::string&, uint64_t)>& normal_at) {
  const Architecture& arch = *find_architecture(o.arch);
  const HParams hp = hparams_of(o);
  // Scales keep activations near unit size: a matrix with fan-in n gets
  // stddev 1/sqrt(n); the output projection a larger one so that logits have a
  // clear argmax (std ~3), which makes greedy comparisons between engines robust.
  const float in_dim = 1.0f / std::sqrt(float(hp.dim));
  const float in_q = 1.0f / std::sqrt(float(hp.q_dim()));
  const float in_ff = 1.0f / std::sqrt(float(hp.ff));
  auto spread = [&](Role r) {
    switch (r) {
      case Role::token_embd: return 1.0f;
      case Role::output: return 3.0f * in_dim;
      case Role::wo: return in_q;
      case Role::w_down: return in_ff;
      case Role::down_exps: return 1.0f / std::sqrt(float(hp.expert_ff));
      case Role::down_shexp: return 1.0f / std::sqrt(float(hp.shared_ff));
      // Router scores of about 2 standard deviations: the experts' choice
      // is clear for most tokens, so two engines rarely part on it.
      case Role::gate_inp: return 2.0f * in_dim;
      default: return in_dim;
    }
  };
  const int64_t n_rot_half = hp.n_rot / 2;
  // The global tensors, then layer by layer.
  std::vector<std::pair<const TensorSpec*, int64_t>> order;
  for (const TensorSpec& spec : architecture_tensors())
    if (!spec.per_layer) order.push_back({&spec, 0});
  for (int64_t l = 0; l < hp.n_layers; ++l)
    for (const TensorSpec& spec : architecture_tensors())
      if (spec.per_layer) order.push_back({&spec, l});
  for (const auto& [spec_p, l] : order) {
    const TensorSpec& spec = *spec_p;
    if (!tensor_required(spec, arch)) {
      const bool wanted = (spec.role == Role::output && !o.tied) || (spec.role == Role::rope_freqs && o.rope_freqs);
      if (!wanted) continue;
    }
    {
      const std::string name = tensor_name(spec, l);
      const uint64_t cols = uint64_t(dim_size(spec.cols, hp));
      if (spec.mats != Dim::one) {
        sink.stack(name, cols, uint64_t(dim_size(spec.rows, hp)), uint64_t(dim_size(spec.mats, hp)), spread(spec.role));
        continue;
      }
      if (spec.role == Role::gate_inp) {
        sink.matrix_f32(name, cols, uint64_t(dim_size(spec.rows, hp)), spread(spec.role));
        continue;
      }
      if (spec.rows != Dim::one) {
        const uint64_t rows = uint64_t(dim_size(spec.rows, hp));
        const bool logits = spec.role == Role::output || (o.tied && spec.role == Role::token_embd);
        const bool eos = o.eos_bias > 0 && o.eos_token >= 0 && uint64_t(o.eos_token) < rows;
        if (logits && (eos || !o.quiet_rows.empty())) {
          // The end token's row leans toward the embeddings of a few tokens
          // (ids n/8, n/8 + n/4, ...): after one of them the end is likely, so
          // answers end by themselves after some tokens. Quiet rows are zero.
          const float gain = o.eos_bias * spread(spec.role);
          std::vector<uint64_t> leaders;
          for (uint64_t k = 0; k < 4; ++k) leaders.push_back(std::min<uint64_t>(o.n_vocab - 1, o.n_vocab / 8 + k * o.n_vocab / 4));
          std::vector<bool> quiet(rows, false);
          for (uint64_t r : o.quiet_rows)
            if (r < rows) quiet[r] = true;
          const uint64_t eos_row = eos ? uint64_t(o.eos_token) : rows;
          auto adjust = [&normal_at, leaders, gain, cols, quiet, eos_row](uint64_t i, float v) {
            const uint64_t row = i / cols, col = i % cols;
            if (quiet[row]) return 0.0f;
            if (row != eos_row) return v;
            float s = 0;
            for (uint64_t t : leaders) s += normal_at("token_embd.weight", t * cols + col);
            return v + gain * s;
          };
          sink.matrix_adjusted(name, cols, rows, spread(spec.role), adjust);
        } else {
          sink.matrix(name, cols, rows, spread(spec.role));
        }
        continue;
      }
      switch (spec.role) {
        case Role::gate_inp_shexp:
          // The shared expert's gate: sigmoid of scores of about 1.
          sink.vector(name, cols, [&normal_at, name, in_dim](uint64_t i) { return in_dim * normal_at(name, i); });
          break;
        case Role::bq:
        case Role::bk:
        case Role::bv:
          // Biases big enough to matter (a missing one changes the answer).
          sink.vector(name, cols, [&normal_at, name](uint64_t i) { return 0.5f * normal_at(name, i); });
          break;
        case Role::q_norm:
        case Role::k_norm:
          // Gains near 1 but not 1 (a norm left out, or its gain, shows).
          sink.vector(name, cols, [&normal_at, name](uint64_t i) { return 1.0f + 0.25f * normal_at(name, i); });
          break;
        case Role::rope_freqs:
          // Llama 3's shape: the fast pairs keep their frequency, the slow
          // ones are divided by up to 8.
          sink.vector(name, cols, [n_rot_half](uint64_t i) {
            const double q = double(n_rot_half) / 4;
            return i < q ? 1.0f : float(1.0 + 7.0 * (double(i) - q) / std::max(1.0, double(n_rot_half) - q));
          });
          break;
        default:
          sink.vector(name, cols, [](uint64_t) { return 1.0f; });
      }
    }
  }
}

}  // namespace ds4::mkmodel

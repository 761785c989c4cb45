// The forward pass of every architecture, as a sequence of backend ops.
#include "worker/forward.h"

#include <algorithm>
#include <cmath>

#include "shared/error.h"

namespace ds4 {

void ForwardOps::products(Act in, const NormSpec* norm, std::span<const ProductSpec> ps) {
  if (!norm) throw Error("ForwardOps::products: a backend must implement products without a norm");
  rmsnorm(in, *norm->g, norm->eps, norm->out);
  products(norm->out, nullptr, ps);
}

void ForwardOps::ffn_swiglu(Act in, const NormSpec* norm, const Weight& gate, const Weight& up, Act h, Act h_up) {
  const ProductSpec ps[2] = {{&gate, h}, {&up, h_up}};
  products(in, norm, ps);
  swiglu(h, h_up);
}

void ForwardOps::rope_kv_store(int layer, Act q, int64_t q_heads, Act k, int64_t kv_heads, Act v,
                               const RopeSpec& r) {
  rope(q, q_heads, r);
  rope(k, kv_heads, r);
  kv_store(layer, k, v);
}

int64_t logit_rows_of(std::span<const BatchToken> batch) {
  int64_t rows = 0;
  for (const BatchToken& b : batch) rows = std::max<int64_t>(rows, int64_t(b.logit_row) + 1);
  return rows;
}

void check_adjustments(std::span<const LogitAdjust> adjust, int64_t rows, int64_t n_vocab) {
  for (const LogitAdjust& a : adjust)
    if (a.row < 0 || a.row >= rows || a.token < 0 || a.token >= n_vocab)
      throw Error("logit adjustment for row " + std::to_string(a.row) + ", token " + std::to_string(a.token) +
                  " is outside the step's " + std::to_string(rows) + " rows of " + std::to_string(n_vocab) + " logits");
}

void run_forward(const Model& model, ForwardOps& ops, std::span<const BatchToken> batch) {
  if (batch.empty()) return;
  const HParams& hp = model.hp();
  const ModelWeights& W = model.w();
  const bool tracing = ops.tracing();
  const int64_t rows = logit_rows_of(batch);
  const RopeSpec rope{hp.rope_type, hp.n_rot, hp.head_dim, hp.rope_base, hp.rope_freq_scale,
                      W.rope_freqs ? &W.rope_freqs : nullptr};
  const AttentionSpec attn{hp.n_heads, hp.n_kv_heads, hp.head_dim, 1.0f / std::sqrt(float(hp.head_dim))};

  ops.begin_step(batch, rows);
  ops.embed(W.token_embd, Act::x);
  for (int layer = 0; layer < int(hp.n_layers); ++layer) {
    const LayerWeights& L = W.layers[size_t(layer)];
    // Attention block: x += wo . attention(rope(norm(q)), rope(norm(k)), v).
    const NormSpec attn_norm{&L.attn_norm, hp.norm_eps, Act::xb};
    const ProductSpec qkv[3] = {{&L.wq, Act::q, L.bq ? &L.bq : nullptr},
                                {&L.wk, Act::k, L.bk ? &L.bk : nullptr},
                                {&L.wv, Act::v, L.bv ? &L.bv : nullptr}};
    if (tracing) {
      ops.rmsnorm(Act::x, L.attn_norm, hp.norm_eps, Act::xb);
      ops.trace("attn_norm", layer, Act::xb, hp.dim);
      ops.products(Act::xb, nullptr, qkv);
    } else {
      ops.products(Act::x, &attn_norm, qkv);
    }
    if (L.q_norm) ops.head_norm(Act::q, hp.n_heads, L.q_norm, hp.norm_eps);
    if (L.k_norm) ops.head_norm(Act::k, hp.n_kv_heads, L.k_norm, hp.norm_eps);
    ops.rope_kv_store(layer, Act::q, hp.n_heads, Act::k, hp.n_kv_heads, Act::v, rope);
    ops.attention(layer, Act::q, Act::att, attn);
    const ProductSpec wo{&L.wo, Act::x, nullptr, true};
    ops.products(Act::att, nullptr, {&wo, 1});
    ops.step_point(StepPoint::attention_done, layer);
    // Feed-forward block (SwiGLU): x += down . (silu(gate . n) * (up . n)), n = norm(x).
    const NormSpec ffn_norm{&L.ffn_norm, hp.norm_eps, Act::xb};
    if (hp.moe()) {
      // A mixture of experts: the same SwiGLU in each chosen expert.
      const MoeSpec moe{&L.gate_inp, L.gate_mats, L.up_mats, L.down_mats, hp.n_expert, hp.n_expert_used,
                        hp.expert_ff, hp.expert_weights_norm, L.gate_inp_shexp ? &L.gate_inp_shexp : nullptr,
                        &L.gate_shexp, &L.up_shexp, &L.down_shexp, hp.shared_ff, layer};
      if (tracing) {
        ops.moe_ffn(Act::x, &ffn_norm, moe, Act::xb, false);
        ops.trace("router", layer, Act::router, hp.n_expert);
        ops.trace("ffn_out", layer, Act::xb, hp.dim);
        ops.add(Act::x, Act::xb);
        ops.trace("l_out", layer, Act::x, hp.dim);
      } else {
        ops.moe_ffn(Act::x, &ffn_norm, moe, Act::x, true);
      }
      ops.step_point(StepPoint::layer_done, layer);
      continue;
    }
    ops.ffn_swiglu(Act::x, &ffn_norm, L.w_gate, L.w_up, Act::hb, Act::hb2);
    if (tracing) {
      const ProductSpec down{&L.w_down, Act::xb};
      ops.products(Act::hb, nullptr, {&down, 1});
      ops.trace("ffn_out", layer, Act::xb, hp.dim);
      ops.add(Act::x, Act::xb);
    } else {
      const ProductSpec down{&L.w_down, Act::x, nullptr, true};
      ops.products(Act::hb, nullptr, {&down, 1});
    }
    if (tracing) ops.trace("l_out", layer, Act::x, hp.dim);
    ops.step_point(StepPoint::layer_done, layer);
  }
  if (rows == 0) return;
  // Logits: the output norm (in place on the gathered rows) and the output matrix.
  ops.gather_logit_rows(Act::x, Act::xl);
  const NormSpec out_norm{&W.output_norm, hp.norm_eps, Act::xl};
  const ProductSpec out{&W.output, Act::logits};
  if (tracing) {
    ops.rmsnorm(Act::xl, W.output_norm, hp.norm_eps, Act::xl);
    ops.trace("result_norm", -1, Act::xl, hp.dim);
    ops.products(Act::xl, nullptr, {&out, 1});
  } else {
    ops.products(Act::xl, &out_norm, {&out, 1});
  }
}

}  // namespace ds4

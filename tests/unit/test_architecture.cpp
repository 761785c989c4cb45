// The architectures as data (model/architecture.h) and the binder that reads
// them (model/weights.h): each architecture's keys, tensor names and shapes
// as llama.cpp writes them, and bad files refused naming the key or tensor.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "model/architecture.h"
#include "model/weights.h"
#include "shared/error.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"
#include "worker/forward.h"

using namespace ds4;

namespace {

/// A small model file of `arch`, written by hand from GGUF's names (not from
/// the table under test): dim 32, 2 layers, ff 48, 4 heads, 2 KV heads.
struct FileSpec {
  std::string arch = "llama";
  uint32_t dim = 32, layers = 2, ff = 48, heads = 4, kv_heads = 2, vocab = 10;
  uint32_t head_dim = 0;  // key_length when set
  bool output = true, rope_freqs = false, qkv_bias = false, qk_norm = false;
  uint32_t experts = 0, experts_used = 0, expert_ff = 0;  // a mixture of experts when experts > 0
  bool shared_expert = false;                              // qwen2moe's (of size ff)
  std::string skip;                                  // a tensor left out
  std::string skip_key;                              // a metadata key left out
  std::map<std::string, std::vector<uint64_t>> reshape;  // a tensor's dims changed
  std::vector<std::pair<std::string, std::string>> strings;  // extra string keys
};

struct Built {
  std::vector<uint8_t> bytes;
  gguf::File file;
};

Built build(const FileSpec& s) {
  gguf::Writer w;
  const std::string p = s.arch + ".";
  w.set_string("general.architecture", s.arch);
  w.set_u32(p + "embedding_length", s.dim);
  w.set_u32(p + "block_count", s.layers);
  w.set_u32(p + "feed_forward_length", s.ff);
  w.set_u32(p + "attention.head_count", s.heads);
  w.set_u32(p + "attention.head_count_kv", s.kv_heads);
  if (s.head_dim) w.set_u32(p + "attention.key_length", s.head_dim);
  if (s.experts) {
    w.set_u32(p + "expert_count", s.experts);
    w.set_u32(p + "expert_used_count", s.experts_used);
    if (s.skip_key != "expert_feed_forward_length") w.set_u32(p + "expert_feed_forward_length", s.expert_ff);
  }
  for (const auto& [k, v] : s.strings) w.set_string(k, v);
  std::vector<std::string> toks;
  for (uint32_t i = 0; i < s.vocab; ++i) toks.push_back("t" + std::to_string(i));
  w.set_string_array("tokenizer.ggml.tokens", toks);
  const uint64_t hd = s.head_dim ? s.head_dim : s.dim / s.heads, q = s.heads * hd, kv = s.kv_heads * hd;
  auto add = [&](const std::string& name, std::vector<uint64_t> dims) {
    if (name == s.skip) return;
    if (auto it = s.reshape.find(name); it != s.reshape.end()) dims = it->second;
    uint64_t n = 1;
    for (uint64_t d : dims) n *= d;
    w.add_tensor(name, dims, GgmlType::F32, std::vector<uint8_t>(n * 4, 0));
  };
  add("token_embd.weight", {s.dim, s.vocab});
  add("output_norm.weight", {s.dim});
  if (s.output) add("output.weight", {s.dim, s.vocab});
  if (s.rope_freqs) add("rope_freqs.weight", {hd / 2});
  for (uint32_t l = 0; l < s.layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    add(b + "attn_norm.weight", {s.dim});
    add(b + "attn_q.weight", {s.dim, q});
    add(b + "attn_k.weight", {s.dim, kv});
    add(b + "attn_v.weight", {s.dim, kv});
    if (s.qkv_bias) {
      add(b + "attn_q.bias", {q});
      add(b + "attn_k.bias", {kv});
      add(b + "attn_v.bias", {kv});
    }
    if (s.qk_norm) {
      add(b + "attn_q_norm.weight", {hd});
      add(b + "attn_k_norm.weight", {hd});
    }
    add(b + "attn_output.weight", {q, s.dim});
    add(b + "ffn_norm.weight", {s.dim});
    if (s.experts) {
      add(b + "ffn_gate_inp.weight", {s.dim, s.experts});
      add(b + "ffn_gate_exps.weight", {s.dim, s.expert_ff, s.experts});
      add(b + "ffn_up_exps.weight", {s.dim, s.expert_ff, s.experts});
      add(b + "ffn_down_exps.weight", {s.expert_ff, s.dim, s.experts});
      if (s.shared_expert) {
        add(b + "ffn_gate_inp_shexp.weight", {s.dim});
        add(b + "ffn_gate_shexp.weight", {s.dim, s.ff});
        add(b + "ffn_up_shexp.weight", {s.dim, s.ff});
        add(b + "ffn_down_shexp.weight", {s.ff, s.dim});
      }
      continue;
    }
    add(b + "ffn_gate.weight", {s.dim, s.ff});
    add(b + "ffn_up.weight", {s.dim, s.ff});
    add(b + "ffn_down.weight", {s.ff, s.dim});
  }
  Built out{w.to_bytes(), {}};
  out.file = gguf::File::parse(out.bytes, "test.gguf");
  return out;
}

Model bind(const FileSpec& s, Built& keep) {
  keep = build(s);
  return Model::bind_file(keep.file);
}

std::string bind_error(const FileSpec& s) {
  Built keep;
  try {
    bind(s, keep);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("architecture: the table names llama, mistral, qwen2, qwen3 and their MoE kin with their variations") {
  std::set<std::string> names;
  for (const Architecture& a : architectures()) names.insert(std::string(a.name));
  CHECK(names == std::set<std::string>{"llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe"});
  const Architecture* q2m = find_architecture("qwen2moe");
  const Architecture* q3m = find_architecture("qwen3moe");
  REQUIRE(q2m);
  REQUIRE(q3m);
  CHECK(q2m->ffn == FfnKind::experts_shared);
  CHECK(q2m->qkv_bias);
  CHECK_FALSE(q2m->expert_weights_norm);
  CHECK(q3m->ffn == FfnKind::experts);
  CHECK(q3m->qk_norm);
  CHECK(q3m->expert_weights_norm);
  CHECK(find_architecture("llama")->ffn == FfnKind::dense);
  const Architecture* qwen2 = find_architecture("qwen2");
  const Architecture* qwen3 = find_architecture("qwen3");
  const Architecture* llama = find_architecture("llama");
  REQUIRE(qwen2);
  REQUIRE(qwen3);
  REQUIRE(llama);
  CHECK(qwen2->qkv_bias);
  CHECK_FALSE(qwen2->qk_norm);
  CHECK(qwen2->rope == RopeType::neox);
  CHECK(qwen3->qk_norm);
  CHECK_FALSE(qwen3->qkv_bias);
  CHECK(qwen3->rope == RopeType::neox);
  CHECK(llama->rope == RopeType::normal);
  CHECK(llama->rope_freqs);
  CHECK(find_architecture("gpt2") == nullptr);
}

TEST_CASE("architecture: llama binds every tensor with GQA shapes, rope_freqs and the scaling keys") {
  FileSpec s;
  s.rope_freqs = true;
  s.strings = {{"llama.rope.scaling.type", "linear"}};
  Built keep;
  const Model m = bind(s, keep);
  const HParams& hp = m.hp();
  CHECK(hp.arch == "llama");
  CHECK(hp.head_dim == 8);
  CHECK(hp.q_dim() == 32);
  CHECK(hp.kv_dim() == 16);
  CHECK(hp.rope_type == RopeType::normal);
  CHECK(hp.rope_freq_scale == 1.0f);  // linear without a factor: no scaling
  const ModelWeights& w = m.w();
  REQUIRE(w.layers.size() == 2);
  CHECK(w.layers[1].wk.rows == 16);
  CHECK(w.layers[1].wk.cols == 32);
  CHECK(w.layers[0].wo.cols == 32);
  CHECK(bool(w.rope_freqs));
  CHECK(w.rope_freqs.cols == 4);
  CHECK_FALSE(w.tied);
  CHECK_FALSE(bool(w.layers[0].bq));
  CHECK_FALSE(bool(w.layers[0].q_norm));
  // 2 layers x (2 norms 32 + q 32x32 + k,v 2 x 16x32 + o 32x32 + 3 x 48x32) + embd, out 2 x 32x10 + norm 32 + freqs 4.
  const uint64_t floats = 2 * (64 + 1024 + 1024 + 1024 + 3 * 1536) + 640 + 32 + 4;
  CHECK(w.bytes == floats * 4);
}

TEST_CASE("architecture: tied embeddings use token_embd for the logits") {
  FileSpec s;
  s.output = false;
  Built keep;
  const Model m = bind(s, keep);
  CHECK(m.w().tied);
  CHECK(m.w().output.data == m.w().token_embd.data);
}

TEST_CASE("architecture: qwen2 needs its QKV biases and pairs RoPE NEOX-style") {
  FileSpec s;
  s.arch = "qwen2";
  s.qkv_bias = true;
  Built keep;
  const Model m = bind(s, keep);
  CHECK(m.hp().rope_type == RopeType::neox);
  CHECK(m.w().layers[0].bq.cols == 32);
  CHECK(m.w().layers[0].bk.cols == 16);
  CHECK(m.w().layers[1].bv.cols == 16);
  s.skip = "blk.1.attn_v.bias";
  CHECK(bind_error(s) == "test.gguf: missing tensor 'blk.1.attn_v.bias' (qwen2 has it in every file)");
}

TEST_CASE("architecture: qwen3 takes its head size from key_length and needs Q/K norms of that size") {
  FileSpec s;
  s.arch = "qwen3";
  s.qk_norm = true;
  s.head_dim = 12;  // dim / heads would be 8
  Built keep;
  const Model m = bind(s, keep);
  CHECK(m.hp().head_dim == 12);
  CHECK(m.hp().q_dim() == 48);
  CHECK(m.hp().kv_dim() == 24);
  CHECK(m.hp().n_rot == 12);
  CHECK(m.w().layers[0].wq.rows == 48);
  CHECK(m.w().layers[0].wo.cols == 48);
  CHECK(m.w().layers[0].q_norm.cols == 12);
  CHECK(m.w().layers[1].k_norm.cols == 12);
  s.reshape = {{"blk.0.attn_k_norm.weight", {8}}};
  CHECK(bind_error(s) == "test.gguf: tensor 'blk.0.attn_k_norm.weight' has shape [8], expected [12]");
  s.reshape.clear();
  s.skip = "blk.0.attn_q_norm.weight";
  CHECK(bind_error(s).find("missing tensor 'blk.0.attn_q_norm.weight'") != std::string::npos);
}

TEST_CASE("architecture: bad files are refused naming the key or tensor") {
  FileSpec s;
  s.arch = "gpt2";
  CHECK(bind_error(s) == "test.gguf: general.architecture is 'gpt2'; ds4 runs llama, mistral, qwen2, qwen3, qwen2moe, qwen3moe");
  s = {};
  s.skip = "blk.1.ffn_up.weight";
  CHECK(bind_error(s) == "test.gguf: missing tensor 'blk.1.ffn_up.weight' (llama has it in every file)");
  s = {};
  s.reshape = {{"blk.0.attn_k.weight", {32, 32}}};  // MHA-sized K in a GQA file
  CHECK(bind_error(s) == "test.gguf: tensor 'blk.0.attn_k.weight' has shape [32 x 32], expected [32 x 16]");
  s = {};
  s.rope_freqs = true;
  s.reshape = {{"rope_freqs.weight", {8}}};
  CHECK(bind_error(s) == "test.gguf: tensor 'rope_freqs.weight' has shape [8], expected [4]");
  s = {};
  s.strings = {{"llama.rope.scaling.type", "yarn"}};
  CHECK(bind_error(s) == "test.gguf: llama.rope.scaling.type is 'yarn'; ds4 runs 'none' and 'linear'");
  s = {};
  s.dim = 30;  // not a multiple of 4 heads, and no key_length
  CHECK(bind_error(s).find("embedding_length 30 is not a multiple of head_count 4") != std::string::npos);
}

TEST_CASE("architecture: every required tensor of every architecture is named as llama.cpp names it") {
  // The GGUF names (llama.cpp's LLM_TENSOR_NAMES) of one layer.
  const std::set<std::string> gguf_names = {
      "token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight", "attn_norm.weight",
      "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
      "attn_q_norm.weight", "attn_k_norm.weight", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
      "ffn_up.weight", "ffn_down.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
      "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
      "ffn_down_shexp.weight"};
  for (const TensorSpec& t : architecture_tensors()) CHECK(gguf_names.count(std::string(t.name)) == 1);
  CHECK(tensor_name(architecture_tensors()[5], 7) == "blk.7." + std::string(architecture_tensors()[5].name));
}

/// A qwen3moe file: 4 experts of 24 values, 2 a token.
FileSpec qwen3moe_spec() {
  FileSpec s;
  s.arch = "qwen3moe";
  s.qk_norm = true;
  s.experts = 4;
  s.experts_used = 2;
  s.expert_ff = 24;
  return s;
}

TEST_CASE("architecture: qwen3moe binds its router and expert stacks, and matrix e of a stack") {
  FileSpec s = qwen3moe_spec();
  Built keep;
  const Model m = bind(s, keep);
  const HParams& hp = m.hp();
  CHECK(hp.moe());
  CHECK(hp.n_expert == 4);
  CHECK(hp.n_expert_used == 2);
  CHECK(hp.expert_ff == 24);
  CHECK(hp.shared_ff == 0);
  CHECK(hp.expert_weights_norm);
  CHECK(hp.ffn_width() == 24);  // not feed_forward_length: no dense feed-forward
  const LayerWeights& L = m.w().layers[1];
  CHECK_FALSE(bool(L.w_gate));
  CHECK(L.gate_inp.rows == 4);
  CHECK(L.gate_exps.mats == 4);
  CHECK(L.gate_exps.rows == 24);
  CHECK(L.down_exps.cols == 24);
  CHECK(L.down_exps.rows == 32);
  CHECK_FALSE(bool(L.gate_inp_shexp));
  // Matrix 3 starts 3 matrices of 24 rows of 32 F32 values in.
  const Weight e3 = L.up_exps.mat(3);
  CHECK(e3.mats == 1);
  CHECK(static_cast<const uint8_t*>(e3.data) - static_cast<const uint8_t*>(L.up_exps.data) == 3 * 24 * 32 * 4);

  s.reshape = {{"blk.0.ffn_down_exps.weight", {24, 32, 3}}};
  CHECK(bind_error(s) == "test.gguf: tensor 'blk.0.ffn_down_exps.weight' has shape [24 x 32 x 3], expected [24 x 32 x 4]");
  s.reshape.clear();
  s.skip = "blk.1.ffn_gate_inp.weight";
  CHECK(bind_error(s) == "test.gguf: missing tensor 'blk.1.ffn_gate_inp.weight' (qwen3moe has it in every file)");
  s.skip.clear();
  s.experts_used = 5;
  CHECK(bind_error(s) == "test.gguf: qwen3moe.expert_used_count = 5 exceeds expert_count = 4");
  s.experts_used = 2;
  s.skip_key = "expert_feed_forward_length";
  CHECK(bind_error(s) == "test.gguf: missing metadata key 'qwen3moe.expert_feed_forward_length'");
}

TEST_CASE("architecture: qwen2moe binds a shared expert of feed_forward_length and its gate") {
  FileSpec s;
  s.arch = "qwen2moe";
  s.qkv_bias = true;
  s.experts = 4;
  s.experts_used = 2;
  s.expert_ff = 16;
  s.shared_expert = true;
  Built keep;
  const Model m = bind(s, keep);
  CHECK(m.hp().shared_ff == 48);
  CHECK(m.hp().ffn_width() == 48);
  CHECK_FALSE(m.hp().expert_weights_norm);
  const LayerWeights& L = m.w().layers[0];
  CHECK(L.gate_inp_shexp.cols == 32);
  CHECK(L.gate_shexp.rows == 48);
  CHECK(L.down_shexp.cols == 48);
  s.skip = "blk.0.ffn_up_shexp.weight";
  CHECK(bind_error(s) == "test.gguf: missing tensor 'blk.0.ffn_up_shexp.weight' (qwen2moe has it in every file)");
}

// --- the forward pass as a sequence of ops ----------------------------------


namespace {

/// Records the ops run_forward() issues, with what they say about the architecture.
struct RecordingOps final : ForwardOps {
  std::vector<std::string> ops;
  std::vector<const Weight*> biases;
  int head_norms = 0;
  std::optional<RopeSpec> rope_spec;
  const Weight* logits_weight = nullptr;
  bool trace_on = false;
  void begin_step(std::span<const BatchToken>, int64_t rows) override { ops.push_back("begin " + std::to_string(rows)); }
  void embed(const Weight&, Act) override { ops.push_back("embed"); }
  void rmsnorm(Act, const Weight&, float, Act) override { ops.push_back("rmsnorm"); }
  void products(Act in, const NormSpec* norm, std::span<const ProductSpec> ps) override {
    ops.push_back(std::string("products") + (norm ? "+norm" : "") + " x" + std::to_string(ps.size()));
    for (const ProductSpec& p : ps) {
      if (p.bias) biases.push_back(p.bias);
      if (p.out == Act::logits) logits_weight = p.w;
    }
  }
  void swiglu(Act, Act) override { ops.push_back("swiglu"); }
  std::optional<MoeSpec> moe;
  void moe_ffn(Act, const NormSpec* norm, const MoeSpec& m, Act out, bool acc) override {
    moe = m;
    ops.push_back(std::string("moe") + (norm ? "+norm" : "") + (acc && out == Act::x ? " into x" : ""));
  }
  void head_norm(Act, int64_t, const Weight&, float) override { ++head_norms; ops.push_back("head_norm"); }
  void rope(Act, int64_t, const RopeSpec& r) override { rope_spec = r; ops.push_back("rope"); }
  void kv_store(int, Act, Act) override { ops.push_back("kv_store"); }
  void attention(int, Act, Act, const AttentionSpec&) override { ops.push_back("attention"); }
  void add(Act, Act) override { ops.push_back("add"); }
  void gather_logit_rows(Act, Act) override { ops.push_back("gather"); }
  void trace(std::string_view name, int, Act, int64_t) override { ops.push_back("trace " + std::string(name)); }
  bool tracing() const override { return trace_on; }
};

}  // namespace

TEST_CASE("forward: each architecture's variations become ops, the fused ones by default composition") {
  const BatchToken batch[2] = {{1, 0, 0, -1}, {2, 0, 1, 0}};
  SUBCASE("llama: no bias, no head norm, normal RoPE with the frequency factors") {
    FileSpec s;
    s.rope_freqs = true;
    Built keep;
    const Model m = bind(s, keep);
    RecordingOps ops;
    run_forward(m, ops, batch);
    CHECK(ops.biases.empty());
    CHECK(ops.head_norms == 0);
    REQUIRE(ops.rope_spec);
    CHECK(ops.rope_spec->type == RopeType::normal);
    CHECK(ops.rope_spec->freq_factors == &m.w().rope_freqs);
    CHECK(ops.logits_weight == &m.w().output);
    // One layer: the norm folded into the QKV products, RoPE + store (the
    // default body), attention, the output product adding into x, the FFN.
    const std::vector<std::string> layer = {"products+norm x3", "rope", "rope", "kv_store", "attention",
                                            "products x1", "products+norm x2", "swiglu", "products x1"};
    REQUIRE(ops.ops.size() == 2 + 2 * layer.size() + 2);
    CHECK(ops.ops[0] == "begin 1");
    CHECK(ops.ops[1] == "embed");
    CHECK(std::vector<std::string>(ops.ops.begin() + 2, ops.ops.begin() + 2 + long(layer.size())) == layer);
    CHECK(ops.ops[ops.ops.size() - 2] == "gather");
    CHECK(ops.ops.back() == "products+norm x1");
  }
  SUBCASE("qwen2: the three biases; qwen3: a head norm of Q and of K, NEOX RoPE") {
    FileSpec s;
    s.arch = "qwen2";
    s.qkv_bias = true;
    Built keep;
    Model m = bind(s, keep);
    RecordingOps ops;
    run_forward(m, ops, batch);
    CHECK(ops.biases.size() == 3 * 2);
    CHECK(ops.rope_spec->type == RopeType::neox);
    FileSpec q;
    q.arch = "qwen3";
    q.qk_norm = true;
    q.head_dim = 12;
    q.output = false;
    Built keep3;
    m = bind(q, keep3);
    RecordingOps ops3;
    run_forward(m, ops3, batch);
    CHECK(ops3.head_norms == 2 * 2);
    CHECK(ops3.rope_spec->head_dim == 12);
    CHECK(ops3.logits_weight == &m.w().output);
    CHECK(m.w().output.data == m.w().token_embd.data);  // tied
  }
  SUBCASE("qwen3moe: one mixture-of-experts op per layer, adding into x, with the file's sizes") {
    Built keep;
    const Model m = bind(qwen3moe_spec(), keep);
    RecordingOps ops;
    run_forward(m, ops, batch);
    CHECK(std::count(ops.ops.begin(), ops.ops.end(), "moe+norm into x") == 2);
    CHECK(std::count(ops.ops.begin(), ops.ops.end(), "swiglu") == 0);
    REQUIRE(ops.moe);
    CHECK(ops.moe->n_expert == 4);
    CHECK(ops.moe->n_used == 2);
    CHECK(ops.moe->expert_ff == 24);
    CHECK(ops.moe->norm_weights);
    CHECK(ops.moe->router == &m.w().layers[1].gate_inp);
    CHECK(ops.moe->down.data() == m.w().layers[1].down_mats.data());
    CHECK(ops.moe->down.size() == 4);
    CHECK(ops.moe->down[3].data == m.w().layers[1].down_exps.mat(3).data);
    CHECK(ops.moe->shared_gate_inp == nullptr);
    RecordingOps traced;
    traced.trace_on = true;
    run_forward(m, traced, batch);
    CHECK(std::count(traced.ops.begin(), traced.ops.end(), "trace router") == 2);
    CHECK(std::count(traced.ops.begin(), traced.ops.end(), "trace ffn_out") == 2);
  }
  SUBCASE("tracing: the norms and ffn_out are separate ops so the trace can read them") {
    FileSpec s;
    Built keep;
    const Model m = bind(s, keep);
    RecordingOps ops;
    ops.trace_on = true;
    run_forward(m, ops, batch);
    int traces = 0;
    for (const std::string& o : ops.ops) traces += o.rfind("trace", 0) == 0;
    CHECK(traces == 2 * 3 + 1);  // attn_norm, ffn_out, l_out per layer; result_norm
    for (const std::string& o : ops.ops) CHECK(o != "products+norm x3");
  }
}

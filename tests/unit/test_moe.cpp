// A mixture of experts on the CPU backend (qwen3moe, qwen2moe): each layer's
// feed-forward output against an independent double-precision computation
// from the layer's own input (router softmax, top-k, renormalised weights,
// SwiGLU experts, the shared expert under its sigmoid gate), and the same
// bits whether the tokens come in one batch (grouped by expert) or one by one.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "model/weights.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"
#include "model/memory_plan.h"
#include "shared/config.h"
#include "shared/error.h"
#include "shared/model_store.h"
#include "supervisor/model_setup.h"
#include "worker/backend.h"
#include "worker/forward.h"
#include "worker/host_compute.h"

using namespace ds4;

namespace {

constexpr uint32_t kDim = 64, kLayers = 2, kHeads = 4, kVocab = 40;

struct MoeFile {
  std::vector<uint8_t> bytes;
  gguf::File file;
  Model model;
};

/// A small F32 model of `arch` (qwen3moe or qwen2moe) with seeded random
/// weights: 6 experts of 40 values, 2 a token; qwen2moe's shared expert of 56.
std::unique_ptr<MoeFile> make_moe(const std::string& arch) {
  const bool q2 = arch == "qwen2moe";
  const uint32_t experts = 6, used = 2, eff = 40, ff = 56;
  gguf::Writer w;
  const std::string p = arch + ".";
  w.set_string("general.architecture", arch);
  w.set_u32(p + "embedding_length", kDim);
  w.set_u32(p + "block_count", kLayers);
  w.set_u32(p + "feed_forward_length", ff);
  w.set_u32(p + "attention.head_count", kHeads);
  w.set_u32(p + "attention.head_count_kv", 2);
  w.set_u32(p + "expert_count", experts);
  w.set_u32(p + "expert_used_count", used);
  w.set_u32(p + "expert_feed_forward_length", eff);
  w.set_f32(p + "attention.layer_norm_rms_epsilon", 1e-6f);
  std::vector<std::string> toks;
  for (uint32_t i = 0; i < kVocab; ++i) toks.push_back("t" + std::to_string(i));
  w.set_string_array("tokenizer.ggml.tokens", toks);
  std::mt19937 rng(7);
  auto add = [&](const std::string& name, std::vector<uint64_t> dims, float stddev, float mean = 0) {
    uint64_t n = 1;
    for (uint64_t d : dims) n *= d;
    std::normal_distribution<float> nd(mean, stddev);
    std::vector<uint8_t> data(n * 4);
    for (uint64_t i = 0; i < n; ++i) {
      const float v = stddev > 0 ? nd(rng) : mean;
      std::memcpy(data.data() + 4 * i, &v, 4);
    }
    w.add_tensor(name, dims, GgmlType::F32, std::move(data));
  };
  const float s = 1.0f / std::sqrt(float(kDim));
  const uint64_t hd = kDim / kHeads;
  add("token_embd.weight", {kDim, kVocab}, 1.0f);
  add("output_norm.weight", {kDim}, 0, 1.0f);
  add("output.weight", {kDim, kVocab}, 3 * s);
  for (uint32_t l = 0; l < kLayers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    add(b + "attn_norm.weight", {kDim}, 0, 1.0f);
    add(b + "attn_q.weight", {kDim, kDim}, s);
    add(b + "attn_k.weight", {kDim, kDim / 2}, s);
    add(b + "attn_v.weight", {kDim, kDim / 2}, s);
    if (q2) {
      add(b + "attn_q.bias", {kDim}, 0.5f);
      add(b + "attn_k.bias", {kDim / 2}, 0.5f);
      add(b + "attn_v.bias", {kDim / 2}, 0.5f);
    } else {
      add(b + "attn_q_norm.weight", {hd}, 0.25f, 1.0f);
      add(b + "attn_k_norm.weight", {hd}, 0.25f, 1.0f);
    }
    add(b + "attn_output.weight", {kDim, kDim}, s);
    add(b + "ffn_norm.weight", {kDim}, 0, 1.0f);
    add(b + "ffn_gate_inp.weight", {kDim, experts}, 2 * s);
    add(b + "ffn_gate_exps.weight", {kDim, eff, experts}, s);
    add(b + "ffn_up_exps.weight", {kDim, eff, experts}, s);
    add(b + "ffn_down_exps.weight", {eff, kDim, experts}, 1.0f / std::sqrt(float(eff)));
    if (q2) {
      add(b + "ffn_gate_inp_shexp.weight", {kDim}, s);
      add(b + "ffn_gate_shexp.weight", {kDim, ff}, s);
      add(b + "ffn_up_shexp.weight", {kDim, ff}, s);
      add(b + "ffn_down_shexp.weight", {ff, kDim}, 1.0f / std::sqrt(float(ff)));
    }
  }
  auto f = std::make_unique<MoeFile>();
  f->bytes = w.to_bytes();
  f->file = gguf::File::parse(f->bytes, arch + ".gguf");
  f->model = Model::bind_file(f->file);
  return f;
}

const float* f32(const Weight& w) { return static_cast<const float*>(w.data); }

/// row r of matrix `w` (F32, one matrix) . x, in double.
double dot_row(const Weight& w, int64_t r, const std::vector<double>& x) {
  double s = 0;
  for (int64_t i = 0; i < w.cols; ++i) s += double(f32(w)[r * w.cols + i]) * x[size_t(i)];
  return s;
}

/// down . (silu(gate . n) * (up . n)), in double.
std::vector<double> swiglu_ffn(const Weight& gate, const Weight& up, const Weight& down, const std::vector<double>& n) {
  std::vector<double> h(size_t(gate.rows));
  for (int64_t j = 0; j < gate.rows; ++j) {
    const double g = dot_row(gate, j, n), u = dot_row(up, j, n);
    h[size_t(j)] = g / (1 + std::exp(-g)) * u;
  }
  std::vector<double> y(size_t(down.rows));
  for (int64_t i = 0; i < down.rows; ++i) y[size_t(i)] = dot_row(down, i, h);
  return y;
}

/// A layer's mixture of experts over one normalised row n, in double: the
/// router's probabilities, the chosen experts and the output (near_tie: the
/// k-th and (k+1)-th probabilities are too close for the choice to be sure).
struct Reference {
  std::vector<double> p, y;
  std::vector<int> chosen;
  bool near_tie = false;
};

Reference reference_moe(const LayerWeights& L, const HParams& hp, const std::vector<double>& n) {
  Reference ref;
  std::vector<double>& p = ref.p;
  p.resize(size_t(hp.n_expert));
  double mx = -1e300, sum = 0;
  for (int64_t e = 0; e < hp.n_expert; ++e) mx = std::max(mx, p[size_t(e)] = dot_row(L.gate_inp, e, n));
  for (double& v : p) sum += v = std::exp(v - mx);
  for (double& v : p) v /= sum;
  std::vector<int> order(size_t(hp.n_expert));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return p[size_t(a)] > p[size_t(b)]; });
  const size_t K = size_t(hp.n_expert_used);
  ref.near_tie = p[size_t(order[K - 1])] - p[size_t(order[K])] < 1e-4;
  double wsum = 0;
  for (size_t k = 0; k < K; ++k) wsum += p[size_t(order[k])];
  ref.y.assign(n.size(), 0.0);
  for (size_t k = 0; k < K; ++k) {
    const int e = order[k];
    ref.chosen.push_back(e);
    const double wk = hp.expert_weights_norm ? p[size_t(e)] / wsum : p[size_t(e)];
    const auto y = swiglu_ffn(L.gate_exps.mat(e), L.up_exps.mat(e), L.down_exps.mat(e), n);
    for (size_t i = 0; i < n.size(); ++i) ref.y[i] += wk * y[i];
  }
  if (L.gate_inp_shexp) {
    double g = 0;
    for (size_t i = 0; i < n.size(); ++i) g += double(f32(L.gate_inp_shexp)[i]) * n[i];
    const auto y = swiglu_ffn(L.gate_shexp, L.up_shexp, L.down_shexp, n);
    for (size_t i = 0; i < n.size(); ++i) ref.y[i] += y[i] / (1 + std::exp(-g));
  }
  return ref;
}

struct Traced {
  std::map<std::pair<std::string, int>, std::vector<std::vector<float>>> rows;  // (name, layer) -> rows
};

Traced run_traced(const Model& m, const std::vector<int32_t>& toks, bool one_by_one) {
  auto backend = make_cpu_backend(m, 2);
  backend->reserve({64, 1, 16});
  Traced t;
  backend->set_trace([&](std::string_view name, int layer, const float* d, int64_t rows, int64_t cols, int64_t ld) {
    auto& v = t.rows[{std::string(name), layer}];
    for (int64_t r = 0; r < rows; ++r) v.emplace_back(d + r * ld, d + r * ld + cols);
  });
  std::vector<BatchToken> batch;
  for (size_t i = 0; i < toks.size(); ++i) batch.push_back({toks[i], 0, int32_t(i), -1});
  if (one_by_one)
    for (const BatchToken& b : batch) backend->forward({&b, 1});
  else
    backend->forward(batch);
  return t;
}

}  // namespace

TEST_CASE("moe: each layer's experts equal a double-precision reference, for qwen3moe and qwen2moe") {
  for (const std::string arch : {"qwen3moe", "qwen2moe"}) {
    CAPTURE(arch);
    const auto f = make_moe(arch);
    const HParams& hp = f->model.hp();
    const std::vector<int32_t> toks{1, 7, 3, 22, 39, 5, 11, 30, 2, 17};
    const Traced t = run_traced(f->model, toks, false);
    int checked = 0, experts_seen = 0;
    std::vector<int> uses(size_t(hp.n_expert), 0);
    for (int l = 0; l < int(hp.n_layers); ++l) {
      const LayerWeights& L = f->model.w().layers[size_t(l)];
      const auto& out = t.rows.at({"ffn_out", l});
      const auto& lout = t.rows.at({"l_out", l});
      const auto& probs = t.rows.at({"router", l});
      REQUIRE(out.size() == toks.size());
      for (size_t r = 0; r < toks.size(); ++r) {
        // The layer's feed-forward input: l_out - ffn_out, normalised.
        std::vector<double> x(kDim), n(kDim);
        double ss = 0;
        for (size_t i = 0; i < kDim; ++i) {
          x[i] = double(lout[r][i]) - double(out[r][i]);
          ss += x[i] * x[i];
        }
        const double scale = 1 / std::sqrt(ss / kDim + hp.norm_eps);
        for (size_t i = 0; i < kDim; ++i) n[i] = x[i] * scale * f32(L.ffn_norm)[i];
        const Reference ref = reference_moe(L, hp, n);
        for (int64_t e = 0; e < hp.n_expert; ++e) CHECK(std::fabs(probs[r][size_t(e)] - ref.p[size_t(e)]) < 1e-4);
        if (ref.near_tie) continue;  // either choice is right
        for (int e : ref.chosen) ++uses[size_t(e)];
        const std::vector<double>& want = ref.y;
        double err = 0, norm = 0;
        for (size_t i = 0; i < kDim; ++i) {
          err += std::pow(double(out[r][i]) - want[i], 2);
          norm += want[i] * want[i];
        }
        CAPTURE(l);
        CAPTURE(r);
        CHECK(std::sqrt(err / norm) < 1e-4);
        ++checked;
      }
    }
    for (int u : uses) experts_seen += u > 0;
    CHECK(checked >= 16);
    CHECK(experts_seen == hp.n_expert);  // the tokens spread over every expert
  }
}

TEST_CASE("moe: a batch grouped by expert gives the same bits as the tokens one by one") {
  for (const std::string arch : {"qwen3moe", "qwen2moe"}) {
    CAPTURE(arch);
    const auto f = make_moe(arch);
    const std::vector<int32_t> toks{3, 9, 27, 27, 14, 0, 33, 8, 21, 5, 16, 38};
    const Traced batched = run_traced(f->model, toks, false);
    const Traced single = run_traced(f->model, toks, true);
    for (int l = 0; l < int(kLayers); ++l) {
      CAPTURE(l);
      CHECK(batched.rows.at({"l_out", l}) == single.rows.at({"l_out", l}));
      CHECK(batched.rows.at({"router", l}) == single.rows.at({"router", l}));
    }
  }
}

TEST_CASE("moe: host experts (a GPU worker's expert rung) take rows of any stride and equal the reference") {
  for (const std::string arch : {"qwen3moe", "qwen2moe"}) {
    CAPTURE(arch);
    const auto f = make_moe(arch);
    const HParams& hp = f->model.hp();
    constexpr int64_t T = 5, ldn = kDim + 13, ldo = kDim + 3;
    auto host = make_host_experts(f->model, 2, 8);
    CHECK(host->bytes() > 0);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> n(size_t(T * ldn)), out(size_t(T * ldo), -7.0f), router(size_t(T * hp.n_expert));
    for (float& v : n) v = nd(rng);
    int checked = 0;
    for (int l = 0; l < int(hp.n_layers); ++l) {
      CAPTURE(l);
      const LayerWeights& L = f->model.w().layers[size_t(l)];
      const MoeSpec spec{&L.gate_inp, L.gate_mats, L.up_mats, L.down_mats, hp.n_expert, hp.n_expert_used,
                         hp.expert_ff, hp.expert_weights_norm, L.gate_inp_shexp ? &L.gate_inp_shexp : nullptr,
                         &L.gate_shexp, &L.up_shexp, &L.down_shexp, hp.shared_ff, l};
      host->run(spec, n.data(), ldn, T, out.data(), ldo, router.data(), hp.n_expert);
      for (int64_t t = 0; t < T; ++t) {
        CAPTURE(t);
        const std::vector<double> nt(n.begin() + t * ldn, n.begin() + t * ldn + kDim);
        const Reference ref = reference_moe(L, hp, nt);
        for (int64_t e = 0; e < hp.n_expert; ++e) CHECK(std::fabs(router[size_t(t * hp.n_expert + e)] - ref.p[size_t(e)]) < 1e-4);
        for (int64_t i = kDim; i < ldo; ++i) CHECK(out[size_t(t * ldo + i)] == -7.0f);  // nothing past the row
        if (ref.near_tie) continue;
        double err = 0, norm = 0;
        for (size_t i = 0; i < kDim; ++i) {
          err += std::pow(double(out[size_t(t * ldo) + i]) - ref.y[i], 2);
          norm += ref.y[i] * ref.y[i];
        }
        CHECK(std::sqrt(err / norm) < 1e-4);
        ++checked;
      }
    }
    CHECK(checked >= 4);
    std::string refused;
    try {
      const LayerWeights& L = f->model.w().layers[0];
      const MoeSpec spec{&L.gate_inp, L.gate_mats, L.up_mats, L.down_mats, hp.n_expert, hp.n_expert_used, hp.expert_ff};
      host->run(spec, n.data(), ldn, 9, out.data(), ldo, nullptr, 0);  // more rows than its max_batch of 8
    } catch (const Error& e) {
      refused = e.what();
    }
    CHECK(refused.find("exceeds max_batch") != std::string::npos);
  }
}

TEST_CASE("moe: the host's cores a device backend is handed: experts as make_host_experts's, parallel over every index once") {
  const auto f = make_moe("qwen3moe");
  const HParams& hp = f->model.hp();
  auto compute = make_host_compute(f->model, 2);
  auto experts = compute->experts(4);
  auto direct = make_host_experts(f->model, 2, 4);
  CHECK(experts->bytes() == direct->bytes());
  const LayerWeights& L = f->model.w().layers[0];
  const MoeSpec spec{&L.gate_inp, L.gate_mats, L.up_mats, L.down_mats, hp.n_expert, hp.n_expert_used, hp.expert_ff};
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> n(size_t(4 * kDim)), a(n.size()), b(n.size());
  for (float& v : n) v = nd(rng);
  experts->run(spec, n.data(), kDim, 4, a.data(), kDim, nullptr, 0);
  direct->run(spec, n.data(), kDim, 4, b.data(), kDim, nullptr, 0);
  CHECK(a == b);
  for (const int count : {0, 1, 7, 1000}) {
    CAPTURE(count);
    std::vector<std::atomic<int>> seen(static_cast<size_t>(count));
    compute->parallel(count, [&](int i) { seen[size_t(i)].fetch_add(1); });
    for (const auto& s : seen) CHECK(s.load() == 1);
  }
}

TEST_CASE("moe: the supervisor's expert rungs follow the model, and each rung's plan counts the experts it copies") {
  const auto f = make_moe("qwen3moe");
  const std::string path = "/tmp/ds4-test-" + std::to_string(::getpid()) + "-moe.gguf";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(f->bytes.data()), std::streamsize(f->bytes.size()));
  }
  const std::string name = "ds4-test-" + std::to_string(::getpid()) + "-moe";
  store::remove(name);
  store::LoadOptions opts;
  opts.name = name;
  store::load(path, opts);
  sup::ModelInfo info;
  info.segment = name;
  WorkersConfig w;
  w.moe_offload = {0, 1, 5};
  std::string note;
  // On a GPU: rungs past the model's layers are cut to its layer count.
  CHECK(sup::expert_rungs(info, w, true, &note) == std::vector<uint32_t>{0, 1, kLayers});
  CHECK(note.find("the model has 2 layers") != std::string::npos);
  // On the CPU every expert is on the host already; an exec engine places its own.
  note.clear();
  CHECK(sup::expert_rungs(info, w, false, &note) == std::vector<uint32_t>{0});
  CHECK(note.find("run on the CPU") != std::string::npos);
  WorkersConfig exec = w;
  exec.engine = WorkerEngine::exec;
  CHECK(sup::expert_rungs(info, exec, true) == std::vector<uint32_t>{0});

  // Rung i's plan: the CPU figure plus the experts of layers [host_experts[i], 2) the worker copies itself.
  const std::vector<sup::Rung> plans = sup::plan_ladder(info, sup::ladder_rungs({256}, {}, {0, 1, 2}), 1, 2, 64, 2);
  const std::vector<sup::Rung> bare = sup::plan_ladder(info, sup::ladder_rungs({256}), 1, 2, 64);
  REQUIRE(plans.size() == 3);
  uint64_t layer = 0;  // one layer's experts: 3 stacks of 6 F32 matrices of 40 x 64
  for (const Weight* s : {&f->model.w().layers[1].gate_exps, &f->model.w().layers[1].up_exps,
                          &f->model.w().layers[1].down_exps})
    layer += uint64_t(s->rows * s->cols * s->mats) * 4;
  CHECK(layer == 3 * 6 * 40 * 64 * 4);
  CHECK(expert_bytes(f->model.w(), 1, 2) == layer);
  CHECK(plans[2].own_bytes == bare[0].own_bytes);
  CHECK(plans[1].own_bytes == bare[0].own_bytes + layer);
  CHECK(plans[0].own_bytes == bare[0].own_bytes + 2 * layer);
  store::remove(name);
  std::remove(path.c_str());
}

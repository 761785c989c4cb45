#include "model/exec_plan.h"

#include <algorithm>

#include "shared/error.h"

namespace ds4 {

namespace {

// A key that may be one integer for every layer or an array of one per layer.
std::vector<int64_t> per_layer(const gguf::File& m, const std::string& key, int64_t layers) {
  const gguf::Value* v = m.find(key);
  if (!v) return {};
  if (v->type == gguf::ValueType::ARRAY) {
    std::vector<int64_t> a = *m.get_int_array(key);
    if (int64_t(a.size()) != layers)
      throw Error(m.source() + ": " + key + " has " + std::to_string(a.size()) + " entries for " + std::to_string(layers) +
                  " layers");
    return a;
  }
  return std::vector<int64_t>(size_t(layers), *m.get_int(key));
}

}  // namespace

ExecKvGeometry read_exec_kv_geometry(const gguf::File& m) {
  const std::string arch = m.get_string("general.architecture").value_or("");
  if (arch.empty()) throw Error(m.source() + ": no general.architecture");
  const std::string p = arch + ".";
  auto need = [&](const std::string& key) {
    std::optional<int64_t> v = m.get_int(key);
    if (!v || *v <= 0) throw Error(m.source() + ": " + key + " is missing or not positive (needed for the engine's memory plan)");
    return *v;
  };
  ExecKvGeometry g;
  g.n_layers = need(p + "block_count");
  std::vector<int64_t> heads = per_layer(m, p + "attention.head_count", g.n_layers);
  if (heads.empty()) throw Error(m.source() + ": " + p + "attention.head_count is missing (needed for the engine's memory plan)");
  g.kv_heads = per_layer(m, p + "attention.head_count_kv", g.n_layers);
  if (g.kv_heads.empty()) g.kv_heads = heads;
  const int64_t max_heads = *std::max_element(heads.begin(), heads.end());
  if (auto k = m.get_int(p + "attention.key_length")) g.key_length = *k;
  else g.key_length = need(p + "embedding_length") / std::max<int64_t>(max_heads, 1);
  g.value_length = m.get_int(p + "attention.value_length").value_or(g.key_length);
  g.sliding_window = m.get_int(p + "attention.sliding_window").value_or(0);
  g.swa.assign(size_t(g.n_layers), false);
  if (g.sliding_window > 0) {
    const std::string key = p + "attention.sliding_window_pattern";
    if (const gguf::Value* v = m.find(key)) {
      if (v->type == gguf::ValueType::ARRAY) {  // one flag per layer
        if (int64_t(v->array.size()) != g.n_layers) throw Error(m.source() + ": " + key + " has a wrong length");
        for (size_t i = 0; i < v->array.size(); ++i) g.swa[i] = v->array[i].u != 0;
      } else if (const int64_t n = *m.get_int(key); n > 0) {  // every n-th layer is full (llama.cpp's set_swa_pattern)
        for (int64_t i = 0; i < g.n_layers; ++i) g.swa[size_t(i)] = i % n < n - 1;
      }
    }
    // No pattern in the file: every layer counted whole (the larger figure).
  }
  return g;
}

std::optional<double> kv_cache_type_bytes(std::string_view t) {
  if (t == "f32") return 4.0;
  if (t == "f16" || t == "bf16") return 2.0;
  if (t == "q8_0") return 34.0 / 32;
  if (t == "q4_0" || t == "iq4_nl") return 18.0 / 32;
  if (t == "q4_1") return 20.0 / 32;
  if (t == "q5_0") return 22.0 / 32;
  if (t == "q5_1") return 24.0 / 32;
  return std::nullopt;
}

uint64_t exec_kv_bytes(const ExecKvGeometry& g, int64_t tokens, int64_t slots, double k_bytes, double v_bytes) {
  double total = 0;
  for (int64_t i = 0; i < g.n_layers; ++i) {
    int64_t held = tokens;
    if (g.swa[size_t(i)]) held = std::min(tokens, g.sliding_window * std::max<int64_t>(slots, 1) + 512);
    const double heads = double(g.kv_heads[size_t(i)]);
    total += double(held) * heads * (double(g.key_length) * k_bytes + double(g.value_length) * v_bytes);
  }
  return uint64_t(total);
}

ExecKvArgs read_exec_kv_args(const std::vector<std::string>& argv) {
  ExecKvArgs a;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& w = argv[i];
    // "-c N" or "--ctx-size=N"
    auto value = [&](std::initializer_list<std::string_view> names) -> std::optional<std::string> {
      for (std::string_view n : names) {
        if (w == n && i + 1 < argv.size()) return argv[i + 1];
        if (w.size() > n.size() && w.starts_with(n) && w[n.size()] == '=') return w.substr(n.size() + 1);
      }
      return std::nullopt;
    };
    if (auto v = value({"-c", "--ctx-size"})) {
      try {
        a.tokens = std::stoll(*v);
      } catch (const std::exception&) {
      }
    } else if (auto v = value({"-ctk", "--cache-type-k"})) {
      a.type_k = *v;
    } else if (auto v = value({"-ctv", "--cache-type-v"})) {
      a.type_v = *v;
    }
  }
  return a;
}

}  // namespace ds4

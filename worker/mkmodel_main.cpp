// ds4-mkmodel: writes a synthetic llama-architecture GGUF model with seeded
// random weights and a vocabulary copied from a real model, for benchmarks and
// tests at sizes no small real model has. llama.cpp loads the result too.
//
//   ds4-mkmodel --out FILE (--vocab-from GGUF | --vocab-hf DIR [--pre NAME]) [--preset NAME] [--dim D]
//               [--layers L] [--ff F] [--heads H] [--kv-heads K]
//               [--type f32|f16|bf16|q8_0] [--seed S] [--ctx C] [--name NAME]

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shared/error.h"
#include "shared/ggml_types.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"
#include "shared/progress.h"
#include "text/hf_vocab.h"
#include "text/tokenizer.h"

namespace ds4 {
namespace {

struct Shape {
  uint32_t dim = 0;      // embedding length
  uint32_t layers = 0;
  uint32_t ff = 0;       // feed-forward hidden size
  uint32_t heads = 0;
  uint32_t kv_heads = 0;
  uint32_t ctx = 4096;
};

struct Options {
  std::string out;
  std::string vocab_from;
  std::string vocab_hf;  // a Hugging Face tokenizer folder instead
  std::string pre;       // its pre-tokenizer, when not told from tokenizer.json
  std::string preset;
  Shape shape;
  GgmlType type = GgmlType::F16;
  uint64_t seed = 42;
  std::string name;
  bool help = false;
};

// Shapes of well-known sizes (with a 32K vocabulary these are close to the
// real models' parameter counts; with a small vocabulary a little less).
const std::map<std::string, Shape, std::less<>> kPresets = {
    {"stories-like", {64, 5, 172, 8, 4, 2048}},       // stories260K's own shape
    {"207m", {1024, 16, 2816, 16, 16, 4096}},
    {"1b", {2048, 22, 5632, 32, 4, 4096}},           // TinyLlama-1.1B's shape
    {"7b", {4096, 32, 11008, 32, 32, 4096}},         // Llama-2-7B's shape
};

struct TypeChoice {
  std::string_view name;
  GgmlType type;
  uint32_t file_type;  // general.file_type (llama_ftype)
};
constexpr TypeChoice kTypes[] = {
    {"f32", GgmlType::F32, 0},
    {"f16", GgmlType::F16, 1},
    {"q8_0", GgmlType::Q8_0, 7},
    {"bf16", GgmlType::BF16, 32},
};

constexpr const char* kUsage =
    "usage: ds4-mkmodel --out FILE (--vocab-from GGUF | --vocab-hf DIR [--pre NAME])\n"
    "                   [--preset stories-like|207m|1b|7b]\n"
    "                   [--dim D] [--layers L] [--ff F] [--heads H] [--kv-heads K]\n"
    "                   [--type f32|f16|bf16|q8_0] [--seed S] [--ctx C] [--name NAME]\n"
    "Writes a llama GGUF with seeded random weights and the vocabulary of --vocab-from\n"
    "(a GGUF) or --vocab-hf (a folder with tokenizer.json and tokenizer_config.json, whose\n"
    "pre-tokenizer is told from tokenizer.json or named by --pre: llama-bpe, qwen2, deepseek-v3, gpt-2).\n"
    "Explicit sizes override the preset's; --kv-heads defaults to --heads; --type to f16.\n";

uint64_t parse_number(std::string_view flag, std::string_view text, uint64_t max) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v > max) {
    throw Error(std::string(flag) + ": expected a whole number up to " + std::to_string(max) +
                ", got '" + std::string(text) + "'");
  }
  return v;
}

// A size of the model: 0 would mean "not given" (the preset's) without a word.
uint64_t parse_size(std::string_view flag, std::string_view text, uint64_t max) {
  const uint64_t v = parse_number(flag, text, max);
  if (v == 0) throw Error(std::string(flag) + ": must be at least 1");
  return v;
}

Options parse_args(int argc, char** argv) {
  Options o;
  Shape given;  // explicit sizes; 0 = not given
  bool ctx_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      o.help = true;
      return o;
    }
    static constexpr std::string_view kFlags[] = {"--out",    "--vocab-from", "--vocab-hf", "--pre", "--preset", "--name",  "--seed", "--dim",
                                                  "--layers", "--ff",         "--heads",  "--kv-heads", "--ctx", "--type"};
    if (std::find(std::begin(kFlags), std::end(kFlags), flag) == std::end(kFlags))
      throw Error("unknown option '" + std::string(flag) + "' (see --help)");
    if (i + 1 >= argc) throw Error(std::string(flag) + ": missing value (see --help)");
    const std::string_view value = argv[++i];
    if (flag == "--out") o.out = value;
    else if (flag == "--vocab-from") o.vocab_from = value;
    else if (flag == "--vocab-hf") o.vocab_hf = value;
    else if (flag == "--pre") o.pre = value;
    else if (flag == "--preset") o.preset = value;
    else if (flag == "--name") o.name = value;
    else if (flag == "--seed") o.seed = parse_number(flag, value, UINT64_MAX);
    else if (flag == "--dim") given.dim = uint32_t(parse_size(flag, value, 1u << 20));
    else if (flag == "--layers") given.layers = uint32_t(parse_size(flag, value, 4096));
    else if (flag == "--ff") given.ff = uint32_t(parse_size(flag, value, 1u << 22));
    else if (flag == "--heads") given.heads = uint32_t(parse_size(flag, value, 4096));
    else if (flag == "--kv-heads") given.kv_heads = uint32_t(parse_size(flag, value, 4096));
    else if (flag == "--ctx") {
      given.ctx = uint32_t(parse_number(flag, value, 1u << 24));
      ctx_given = true;
    } else if (flag == "--type") {
      const auto* t = std::find_if(std::begin(kTypes), std::end(kTypes),
                                   [&](const TypeChoice& c) { return c.name == value; });
      if (t == std::end(kTypes)) {
        throw Error("--type: unknown type '" + std::string(value) +
                    "' (expected f32, f16, bf16 or q8_0)");
      }
      o.type = t->type;
    } else {
      throw Error("unknown option '" + std::string(flag) + "' (see --help)");
    }
  }

  if (!o.preset.empty()) {
    const auto it = kPresets.find(o.preset);
    if (it == kPresets.end()) {
      throw Error("--preset: unknown preset '" + o.preset +
                  "' (expected stories-like, 207m, 1b or 7b)");
    }
    o.shape = it->second;
  }
  auto take = [](uint32_t& field, uint32_t v) { if (v) field = v; };
  take(o.shape.dim, given.dim);
  take(o.shape.layers, given.layers);
  take(o.shape.ff, given.ff);
  take(o.shape.heads, given.heads);
  take(o.shape.kv_heads, given.kv_heads);
  if (ctx_given) o.shape.ctx = given.ctx;
  if (given.heads && !given.kv_heads) o.shape.kv_heads = given.heads;
  return o;
}

void validate(const Options& o) {
  if (o.out.empty()) throw Error("--out is required (see --help)");
  if (o.vocab_from.empty() && o.vocab_hf.empty())
    throw Error("--vocab-from is required, or --vocab-hf (see --help)");
  if (!o.vocab_from.empty() && !o.vocab_hf.empty())
    throw Error("--vocab-from and --vocab-hf exclude each other (one vocabulary)");
  if (!o.pre.empty() && o.vocab_hf.empty()) throw Error("--pre goes with --vocab-hf");
  const Shape& s = o.shape;
  const std::pair<const char*, uint32_t> sizes[] = {
      {"--dim", s.dim}, {"--layers", s.layers}, {"--ff", s.ff}, {"--heads", s.heads},
      {"--kv-heads", s.kv_heads}, {"--ctx", s.ctx}};
  for (const auto& [flag, v] : sizes) {
    if (v == 0) throw Error(std::string(flag) + " must be given (or come from --preset) and be > 0");
  }
  if (s.dim % s.heads != 0) {
    throw Error("--dim " + std::to_string(s.dim) + " is not divisible by --heads " +
                std::to_string(s.heads));
  }
  if (s.heads % s.kv_heads != 0) {
    throw Error("--heads " + std::to_string(s.heads) + " is not divisible by --kv-heads " +
                std::to_string(s.kv_heads));
  }
  if ((s.dim / s.heads) % 2 != 0) {
    throw Error("head size --dim/--heads = " + std::to_string(s.dim / s.heads) +
                " must be even (rotary embeddings rotate pairs)");
  }
  if (o.type == GgmlType::Q8_0 && (s.dim % 32 != 0 || s.ff % 32 != 0)) {
    throw Error("--type q8_0 needs --dim and --ff to be multiples of 32 (the block size), got " +
                std::to_string(s.dim) + " and " + std::to_string(s.ff));
  }
}

// --- weights --------------------------------------------------------------

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ uint8_t(c)) * 0x100000001b3ull;
  return h;
}

/// Element `i` of a tensor keyed `key`: approximately normal(0, 1), from four
/// 16-bit uniforms of one hash (Irwin-Hall, rescaled). Depending only on
/// (key, i) makes the output independent of thread count and tensor order.
inline float normal_at(uint64_t key, uint64_t i) {
  const uint64_t r = splitmix64(key + i);
  const uint32_t sum = uint32_t(r & 0xffff) + uint32_t((r >> 16) & 0xffff) +
                       uint32_t((r >> 32) & 0xffff) + uint32_t(r >> 48);
  constexpr float kMean = 2.0f * 65535.0f;
  constexpr float kScale = 1.7320508f / 65535.0f;  // sqrt(3): the sum of 4 U(0,1) has variance 1/3
  return (float(sum) - kMean) * kScale;
}

/// Encodes elements [begin, end) of a normal(0, stddev) tensor into `out`
/// (the whole tensor's bytes). For Q8_0, begin and end are multiples of 32.
void fill_range(uint8_t* out, GgmlType type, uint64_t key, float stddev, uint64_t begin,
                uint64_t end) {
  switch (type) {
    case GgmlType::F32: {
      for (uint64_t i = begin; i < end; ++i) {
        const float v = normal_at(key, i) * stddev;
        std::memcpy(out + 4 * i, &v, 4);
      }
      break;
    }
    case GgmlType::F16:
    case GgmlType::BF16: {
      const bool f16 = type == GgmlType::F16;
      for (uint64_t i = begin; i < end; ++i) {
        const float v = normal_at(key, i) * stddev;
        const uint16_t h = f16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
        std::memcpy(out + 2 * i, &h, 2);
      }
      break;
    }
    case GgmlType::Q8_0: {
      for (uint64_t b = begin / 32; b < end / 32; ++b) {
        float x[32];
        float amax = 0;
        for (int j = 0; j < 32; ++j) {
          x[j] = normal_at(key, b * 32 + uint64_t(j)) * stddev;
          amax = std::max(amax, std::fabs(x[j]));
        }
        BlockQ8_0 blk;
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        blk.d = fp32_to_fp16(d);
        for (int j = 0; j < 32; ++j) blk.qs[j] = int8_t(std::lround(x[j] * id));
        std::memcpy(out + b * sizeof(BlockQ8_0), &blk, sizeof(BlockQ8_0));
      }
      break;
    }
    default:  // random_tensor accepts only the types above
      break;
  }
}

/// A generator for a random tensor: the work is split over the machine's cores
/// in block-aligned ranges.
gguf::TensorGenerator random_tensor(std::string_view name, uint64_t seed, GgmlType type,
                                    uint64_t n_elements, float stddev) {
  if (type != GgmlType::F32 && type != GgmlType::F16 && type != GgmlType::BF16 &&
      type != GgmlType::Q8_0) {
    throw Error("cannot generate tensors of ggml type " + std::to_string(uint32_t(type)));
  }
  const uint64_t key = splitmix64(seed ^ fnv1a(name));
  return [=](uint8_t* out, uint64_t) {
    const uint64_t n_threads = std::clamp<uint64_t>(std::thread::hardware_concurrency(), 1, 64);
    const uint64_t per = n_elements / 32 / n_threads;  // 32-element blocks per thread
    if (per < 1024) {  // small: not worth threads
      fill_range(out, type, key, stddev, 0, n_elements);
      return;
    }
    std::vector<std::thread> threads;
    for (uint64_t t = 0; t < n_threads; ++t) {
      const uint64_t begin = t * per * 32;
      const uint64_t end = t + 1 == n_threads ? n_elements : (t + 1) * per * 32;
      threads.emplace_back(fill_range, out, type, key, stddev, begin, end);
    }
    for (auto& th : threads) th.join();
  };
}

gguf::TensorGenerator ones(uint64_t n) {
  return [n](uint8_t* out, uint64_t) {
    const float one = 1.0f;
    for (uint64_t i = 0; i < n; ++i) std::memcpy(out + 4 * i, &one, 4);
  };
}

// --- the model file -------------------------------------------------------

void copy_vocabulary(const gguf::File& src, gguf::Writer& w) {
  for (const auto& [key, value] : src.metadata()) {
    if (key.starts_with("tokenizer.")) w.set(key, value);
  }
}

uint32_t file_type_of(GgmlType t) {
  for (const TypeChoice& c : kTypes) {
    if (c.type == t) return c.file_type;
  }
  return 0;
}

std::string_view type_name(GgmlType t) {
  for (const TypeChoice& c : kTypes) {
    if (c.type == t) return c.name;
  }
  return "?";
}

/// Counts generated bytes for the progress line.
struct Progress {
  store::ProgressFn report;
  uint64_t done = 0;
  uint64_t total = 0;

  gguf::TensorGenerator wrap(gguf::TensorGenerator gen) {
    return [this, gen = std::move(gen)](uint8_t* out, uint64_t n) {
      gen(out, n);
      done += n;
      if (report) report(done, total);
    };
  }
};

int run(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  if (o.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  validate(o);
  const Shape& s = o.shape;

  // The vocabulary must be one ds4 (and llama.cpp) can use.
  std::optional<gguf::File> vocab_src;
  std::optional<Tokenizer> tok;
  std::vector<uint8_t> hf_keys;  // --vocab-hf: its tokenizer keys as a GGUF of their own
  try {
    if (!o.vocab_hf.empty()) {
      gguf::Writer keys;
      write_hf_vocab(read_hf_vocab(o.vocab_hf, o.pre), keys);
      hf_keys = keys.to_bytes();
      vocab_src = gguf::File::parse(hf_keys, o.vocab_hf + "/tokenizer.json");
    } else {
      vocab_src = gguf::File::open(o.vocab_from);
    }
    tok = Tokenizer::from_gguf(*vocab_src);
  } catch (const Error& e) {
    throw Error(std::string(o.vocab_hf.empty() ? "--vocab-from: " : "--vocab-hf: ") + e.what());
  }
  const uint64_t n_vocab = uint64_t(tok->n_vocab());
  const uint32_t head_dim = s.dim / s.heads;
  const uint64_t kv_dim = uint64_t(s.kv_heads) * head_dim;

  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.set_string("general.name",
               o.name.empty() ? "ds4-synthetic-" + (o.preset.empty() ? std::to_string(s.dim) + "d" +
                                                                           std::to_string(s.layers) + "l"
                                                                     : o.preset)
                              : o.name);
  w.set_u32("general.file_type", file_type_of(o.type));
  w.set_u32("llama.vocab_size", uint32_t(n_vocab));
  w.set_u32("llama.context_length", s.ctx);
  w.set_u32("llama.embedding_length", s.dim);
  w.set_u32("llama.block_count", s.layers);
  w.set_u32("llama.feed_forward_length", s.ff);
  w.set_u32("llama.attention.head_count", s.heads);
  w.set_u32("llama.attention.head_count_kv", s.kv_heads);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.set_u32("llama.rope.dimension_count", head_dim);
  w.set_f32("llama.rope.freq_base", 10000.0f);
  copy_vocabulary(*vocab_src, w);

  // Scales keep activations near unit size: a matrix with fan-in n gets
  // stddev 1/sqrt(n); the output projection a larger one so that logits have a
  // clear argmax (std ~3), which makes greedy comparisons between engines robust.
  const float in_dim = 1.0f / std::sqrt(float(s.dim));
  const float in_ff = 1.0f / std::sqrt(float(s.ff));
  uint64_t n_params = 0;
  Progress progress;
  auto matrix = [&](const std::string& name, uint64_t ne0, uint64_t ne1, GgmlType type,
                    float stddev) {
    w.add_tensor_generated(name, {ne0, ne1}, type,
                           progress.wrap(random_tensor(name, o.seed, type, ne0 * ne1, stddev)));
    n_params += ne0 * ne1;
    progress.total += gguf::Writer::tensor_bytes({ne0, ne1}, type);
  };
  auto norm = [&](const std::string& name) {
    w.add_tensor_generated(name, {s.dim}, GgmlType::F32, progress.wrap(ones(s.dim)));
    n_params += s.dim;
    progress.total += uint64_t(s.dim) * 4;
  };

  matrix("token_embd.weight", s.dim, n_vocab, o.type, 1.0f);
  for (uint32_t l = 0; l < s.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    norm(p + "attn_norm.weight");
    matrix(p + "attn_q.weight", s.dim, s.dim, o.type, in_dim);
    matrix(p + "attn_k.weight", s.dim, kv_dim, o.type, in_dim);
    matrix(p + "attn_v.weight", s.dim, kv_dim, o.type, in_dim);
    matrix(p + "attn_output.weight", s.dim, s.dim, o.type, in_dim);
    norm(p + "ffn_norm.weight");
    matrix(p + "ffn_gate.weight", s.dim, s.ff, o.type, in_dim);
    matrix(p + "ffn_up.weight", s.dim, s.ff, o.type, in_dim);
    matrix(p + "ffn_down.weight", s.ff, s.dim, o.type, in_ff);
  }
  norm("output_norm.weight");
  matrix("output.weight", s.dim, n_vocab, o.type, 3.0f * in_dim);

  std::fprintf(stderr, "ds4-mkmodel: writing %s: %.1fM parameters, %s, dim %u, %u layers, ff %u, "
               "%u/%u heads, vocab %llu\n",
               o.out.c_str(), double(n_params) / 1e6, std::string(type_name(o.type)).c_str(), s.dim,
               s.layers, s.ff, s.heads, s.kv_heads, (unsigned long long)n_vocab);
  progress.report = store::make_progress_reporter("ds4-mkmodel: generating",
                                                  store::default_progress_sinks());
  const auto t0 = std::chrono::steady_clock::now();
  w.write(o.out);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "ds4-mkmodel: wrote %s (%.1f MB of tensors) in %.1f s\n", o.out.c_str(),
               double(progress.total) / 1e6, secs);
  return 0;
}

}  // namespace
}  // namespace ds4

int main(int argc, char** argv) {
  try {
    return ds4::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ds4-mkmodel: %s\n", e.what());
    return 1;
  }
}

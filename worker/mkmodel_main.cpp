// ds4-mkmodel: writes a synthetic GGUF model of any architecture ds4 runs
// (worker/mkmodel_arch.h) with seeded random weights and a vocabulary copied
// from a real model, for benchmarks and tests at sizes no small real model
// has. llama.cpp loads the result too.
//
//   ds4-mkmodel --out FILE (--vocab-from GGUF | --vocab-hf DIR [--pre NAME]) [--preset NAME]
//               [--arch A] [--dim D] [--layers L] [--ff F] [--heads H] [--kv-heads K] [--head-dim N]
//               [--tied] [--rope-freqs] [--rope-scale F] [--rope-base B] [--eos-bias B]
//               [--type f32|f16|bf16|q8_0|...] [--seed S] [--ctx C] [--name NAME]
//               [--experts E --experts-used K --expert-ff F [--shared-ff F]]

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
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
#include "worker/cpu/quant_types.h"
#include "worker/mkmodel_arch.h"

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
  mkmodel::ArchOptions arch;  // sizes are copied from `shape` at the end of parse_args
  bool no_byte_tokens = false;
  bool help = false;
};

// Shapes of well-known sizes (with a 32K vocabulary these are close to the
// real models' parameter counts; with a small vocabulary a little less).
const std::map<std::string, Shape, std::less<>> kPresets = {
    {"stories-like", {64, 5, 172, 8, 4, 2048}},       // stories260K's own shape
    {"207m", {1024, 16, 2816, 16, 16, 4096}},
    {"1b", {2048, 22, 5632, 32, 4, 4096}},           // TinyLlama-1.1B's shape
    {"7b", {4096, 32, 11008, 32, 32, 4096}},         // Llama-2-7B's shape
    {"llama3-1b", {2048, 16, 8192, 32, 8, 8192}},    // Llama 3.2 1B's shape (tied)
    {"llama3-8b", {4096, 32, 14336, 32, 8, 8192}},   // Llama 3.1 8B's shape
};

// What a Llama 3 preset has besides its sizes: RoPE base 500000 with
// frequency factors, and (1B) the output tied to the embeddings.
struct PresetArch {
  bool tied;
};
const std::map<std::string, PresetArch, std::less<>> kLlama3Presets = {{"llama3-1b", {true}}, {"llama3-8b", {false}}};

struct TypeChoice {
  std::string_view name;
  GgmlType type;
  uint32_t file_type;  // general.file_type (llama_ftype)
};
// The types with their own encoding here. Any other type whose CPU row has a
// quantization (from_float) is taken too, by its name in lower case, with
// no general.file_type (llama.cpp then guesses it from the tensors).
constexpr TypeChoice kTypes[] = {
    {"f32", GgmlType::F32, 0},
    {"f16", GgmlType::F16, 1},
    {"q8_0", GgmlType::Q8_0, 7},
    {"bf16", GgmlType::BF16, 32},
};

// A type's name as --type takes it.
std::string type_name(GgmlType t) {
  for (const TypeChoice& c : kTypes)
    if (c.type == t) return std::string(c.name);
  const TypeTraits* row = type_row(t);
  std::string lower(row ? row->name : "?");
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  return lower;
}

// A type the CPU backend can quantize floats into, by its lower-case name.
std::optional<GgmlType> quantizable_type(std::string_view name) {
  for (uint32_t n = 0; n < 64; ++n) {
    const TypeTraits* row = type_row(GgmlType(n));
    const cpu::QuantType* q = cpu::quant_type(GgmlType(n));
    if (!row || !q || !q->from_float) continue;
    if (type_name(GgmlType(n)) == name) return GgmlType(n);
  }
  return std::nullopt;
}

// "f32, f16, bf16, q8_0" and the quantizable types, for messages.
std::string type_names() {
  std::string s;
  for (const TypeChoice& c : kTypes) s += (s.empty() ? "" : ", ") + std::string(c.name);
  for (uint32_t n = 0; n < 64; ++n) {
    const cpu::QuantType* q = cpu::quant_type(GgmlType(n));
    if (!q || !q->from_float) continue;
    s += ", " + type_name(GgmlType(n));
  }
  return s;
}

constexpr const char* kUsage =
    "usage: ds4-mkmodel --out FILE (--vocab-from GGUF | --vocab-hf DIR [--pre NAME])\n"
    "                   [--preset stories-like|207m|1b|7b|llama3-1b|llama3-8b]\n"
    "                   [--arch llama|mistral|qwen2|qwen3|qwen2moe|qwen3moe] [--dim D] [--layers L] [--ff F]\n"
    "                   [--heads H] [--kv-heads K] [--head-dim N] [--tied] [--rope-freqs]\n"
    "                   [--rope-scale F] [--rope-base B] [--eos-bias B] [--no-byte-tokens]\n"
    "                   [--type f32|f16|bf16|q8_0|...] [--seed S] [--ctx C] [--name NAME]\n"
    "                   [--experts E --experts-used K --expert-ff F [--shared-ff F]]\n"
    "Writes a GGUF of the architecture (default llama) with seeded random weights and the\n"
    "vocabulary of --vocab-from (a GGUF) or --vocab-hf (a folder with tokenizer.json and\n"
    "tokenizer_config.json, whose pre-tokenizer is told from tokenizer.json or named by --pre:\n"
    "llama-bpe, qwen2, deepseek-v3, gpt-2). Explicit sizes override the preset's; --kv-heads defaults\n"
    "to --heads; --type to f16 (it also takes any type the CPU backend quantizes, by its lower-case\n"
    "name, written without general.file_type). --head-dim: a head size other than dim/heads (written as\n"
    "attention.key_length); --tied: no output.weight; --rope-freqs: rope_freqs.weight\n"
    "(Llama 3 frequency factors); --rope-scale F: linear RoPE scaling by F; --eos-bias B:\n"
    "the end token's output row leans to a few tokens, so greedy answers end by themselves\n"
    "(0.5: most answers of a small model end within 64 tokens); --no-byte-tokens: byte tokens (<0xNN>) get zero output\n"
    "rows (with a BPE vocabulary: the tokens that are not whole UTF-8), so greedy text is valid UTF-8\n"
    "(llama-server refuses stray bytes).\n"
    "qwen2moe and qwen3moe are mixtures of experts: --experts E per layer, --experts-used K\n"
    "of them per token, each of hidden size --expert-ff; qwen2moe's shared expert has\n"
    "--shared-ff (default --ff). The routers stay F32 whatever --type says.\n";

uint64_t parse_number(std::string_view flag, std::string_view text, uint64_t max) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v > max) {
    throw Error(std::string(flag) + ": expected a whole number up to " + std::to_string(max) +
                ", got '" + std::string(text) + "'");
  }
  return v;
}

float parse_float(std::string_view flag, std::string_view text) {
  const std::string t(text);
  char* end = nullptr;
  const float v = std::strtof(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size() || !std::isfinite(v) || v <= 0)
    throw Error(std::string(flag) + ": expected a positive number, got '" + t + "'");
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
    if (flag == "--tied" || flag == "--rope-freqs" || flag == "--no-byte-tokens") {
      (flag == "--tied" ? o.arch.tied : flag == "--rope-freqs" ? o.arch.rope_freqs : o.no_byte_tokens) = true;
      continue;
    }
    static constexpr std::string_view kFlags[] = {"--out",    "--vocab-from", "--vocab-hf", "--pre", "--preset", "--name",  "--seed", "--dim",
                                                  "--layers", "--ff",         "--heads",  "--kv-heads", "--ctx", "--type",
                                                  "--arch", "--head-dim", "--rope-scale", "--rope-base", "--eos-bias",
                                                  "--experts", "--experts-used", "--expert-ff", "--shared-ff"};
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
    else if (flag == "--arch") o.arch.arch = value;
    else if (flag == "--head-dim") o.arch.head_dim = uint32_t(parse_size(flag, value, 4096));
    else if (flag == "--rope-scale") o.arch.rope_scale = parse_float(flag, value);
    else if (flag == "--rope-base") o.arch.rope_base = parse_float(flag, value);
    else if (flag == "--eos-bias") o.arch.eos_bias = parse_float(flag, value);
    else if (flag == "--experts") o.arch.experts = uint32_t(parse_size(flag, value, 4096));
    else if (flag == "--experts-used") o.arch.experts_used = uint32_t(parse_size(flag, value, 4096));
    else if (flag == "--expert-ff") o.arch.expert_ff = uint32_t(parse_size(flag, value, 1u << 22));
    else if (flag == "--shared-ff") o.arch.shared_ff = uint32_t(parse_size(flag, value, 1u << 22));
    else if (flag == "--ctx") {
      given.ctx = uint32_t(parse_number(flag, value, 1u << 24));
      ctx_given = true;
    } else if (flag == "--type") {
      const auto* t = std::find_if(std::begin(kTypes), std::end(kTypes),
                                   [&](const TypeChoice& c) { return c.name == value; });
      if (t != std::end(kTypes)) {
        o.type = t->type;
      } else if (const auto q = quantizable_type(value)) {
        o.type = *q;
      } else {
        throw Error("--type: unknown type '" + std::string(value) + "' (expected one of " + type_names() + ")");
      }
    } else {
      throw Error("unknown option '" + std::string(flag) + "' (see --help)");
    }
  }

  if (!o.preset.empty()) {
    const auto it = kPresets.find(o.preset);
    if (it == kPresets.end()) {
      throw Error("--preset: unknown preset '" + o.preset +
                  "' (expected stories-like, 207m, 1b, 7b, llama3-1b or llama3-8b)");
    }
    o.shape = it->second;
    if (const auto l3 = kLlama3Presets.find(o.preset); l3 != kLlama3Presets.end()) {
      o.arch.tied = o.arch.tied || l3->second.tied;
      o.arch.rope_freqs = o.arch.arch == "llama" || o.arch.arch == "mistral";
      if (o.arch.rope_base == 0) o.arch.rope_base = 500000.0f;
    }
  }
  auto take = [](uint32_t& field, uint32_t v) { if (v) field = v; };
  take(o.shape.dim, given.dim);
  take(o.shape.layers, given.layers);
  take(o.shape.ff, given.ff);
  take(o.shape.heads, given.heads);
  take(o.shape.kv_heads, given.kv_heads);
  if (ctx_given) o.shape.ctx = given.ctx;
  if (given.heads && !given.kv_heads) o.shape.kv_heads = given.heads;
  o.arch.dim = o.shape.dim;
  o.arch.layers = o.shape.layers;
  o.arch.ff = o.shape.ff;
  o.arch.heads = o.shape.heads;
  o.arch.kv_heads = o.shape.kv_heads;
  o.arch.ctx = o.shape.ctx;
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
  if (s.heads % s.kv_heads != 0) {
    throw Error("--heads " + std::to_string(s.heads) + " is not divisible by --kv-heads " +
                std::to_string(s.kv_heads));
  }
  mkmodel::validate_arch(o.arch);
  const uint32_t q_dim = s.heads * o.arch.head_size();
  const uint32_t block = type_row(o.type)->block_elems;
  const std::string tname(type_name(o.type)), bs = std::to_string(block);
  if (block > 1 && (o.arch.expert_ff % block != 0 || o.arch.shared_ff % block != 0))
    throw Error("--type " + tname + " needs --expert-ff and --shared-ff to be multiples of " + bs + " (the block size)");
  if (block > 1 && (s.dim % block != 0 || s.ff % block != 0 || q_dim % block != 0)) {
    throw Error("--type " + tname + " needs --dim, --ff and heads x head size to be multiples of " + bs +
                " (the block size), got " + std::to_string(s.dim) + ", " + std::to_string(s.ff) + " and " +
                std::to_string(q_dim));
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
/// (the whole tensor's bytes). For Q8_0 and the quantized types, begin and
/// end are multiples of 32 (of the type's block).
void fill_range(uint8_t* out, GgmlType type, uint64_t key, float stddev, uint64_t begin,
                uint64_t end, const std::function<float(uint64_t, float)>* adjust) {
  auto value = [&](uint64_t i) {
    const float v = normal_at(key, i) * stddev;
    return adjust ? (*adjust)(i, v) : v;
  };
  switch (type) {
    case GgmlType::F32: {
      for (uint64_t i = begin; i < end; ++i) {
        const float v = value(i);
        std::memcpy(out + 4 * i, &v, 4);
      }
      break;
    }
    case GgmlType::F16:
    case GgmlType::BF16: {
      const bool f16 = type == GgmlType::F16;
      for (uint64_t i = begin; i < end; ++i) {
        const float v = value(i);
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
          x[j] = value(b * 32 + uint64_t(j));
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
    default: {  // a type the CPU row quantizes (random_tensor checks)
      const cpu::QuantType& q = *cpu::quant_type(type);
      std::vector<float> x(static_cast<size_t>(q.block_elems));
      for (uint64_t b = begin / uint64_t(q.block_elems); b < end / uint64_t(q.block_elems); ++b) {
        for (int64_t j = 0; j < q.block_elems; ++j) x[size_t(j)] = value(b * uint64_t(q.block_elems) + uint64_t(j));
        q.from_float(x.data(), q.block_elems, out + b * uint64_t(q.block_bytes));
      }
      break;
    }
  }
}

/// A generator for a random tensor: the work is split over the machine's cores
/// in block-aligned ranges.
gguf::TensorGenerator random_tensor(std::string_view name, uint64_t seed, GgmlType type,
                                    uint64_t n_elements, float stddev,
                                    std::function<float(uint64_t, float)> adjust = nullptr) {
  const cpu::QuantType* q = cpu::quant_type(type);
  if (type != GgmlType::F32 && type != GgmlType::F16 && type != GgmlType::BF16 && type != GgmlType::Q8_0 &&
      !(q && q->from_float && 32 % q->block_elems == 0)) {
    throw Error("cannot generate tensors of ggml type " + std::to_string(uint32_t(type)));
  }
  const uint64_t key = splitmix64(seed ^ fnv1a(name));
  return [=](uint8_t* out, uint64_t) {
    const std::function<float(uint64_t, float)>* x = adjust ? &adjust : nullptr;
    const uint64_t n_threads = std::clamp<uint64_t>(std::thread::hardware_concurrency(), 1, 64);
    const uint64_t per = n_elements / 32 / n_threads;  // 32-element blocks per thread
    if (per < 1024) {  // small: not worth threads
      fill_range(out, type, key, stddev, 0, n_elements, x);
      return;
    }
    std::vector<std::thread> threads;
    for (uint64_t t = 0; t < n_threads; ++t) {
      const uint64_t begin = t * per * 32;
      const uint64_t end = t + 1 == n_threads ? n_elements : (t + 1) * per * 32;
      threads.emplace_back(fill_range, out, type, key, stddev, begin, end, x);
    }
    for (auto& th : threads) th.join();
  };
}

// --- the model file -------------------------------------------------------

/// Whether `s` is whole, well-formed UTF-8 (no stray or missing continuation
/// bytes, no overlong forms, surrogates or code points above U+10FFFF).
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) n = 1, cp = c;
    else if ((c & 0xE0) == 0xC0) n = 2, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) n = 3, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) n = 4, cp = c & 0x07;
    else return false;
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

void copy_vocabulary(const gguf::File& src, gguf::Writer& w) {
  for (const auto& [key, value] : src.metadata()) {
    if (key.starts_with("tokenizer.")) w.set(key, value);
  }
}

std::optional<uint32_t> file_type_of(GgmlType t) {
  for (const TypeChoice& c : kTypes) {
    if (c.type == t) return c.file_type;
  }
  return std::nullopt;
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
  mkmodel::ArchOptions arch = o.arch;
  arch.n_vocab = n_vocab;
  arch.eos_token = int32_t(vocab_src->get_int("tokenizer.ggml.eos_token_id").value_or(-1));
  if (o.no_byte_tokens && tok->is_bpe()) {
    // Byte-level BPE has no byte tokens, but many tokens hold part of a
    // character (the first two bytes of a CJK one): those are quiet.
    for (int32_t i = 0; i < int32_t(n_vocab); ++i)
      if (!valid_utf8(tok->piece(i))) arch.quiet_rows.push_back(uint64_t(i));
  } else if (o.no_byte_tokens) {
    if (const gguf::Value* types = vocab_src->find("tokenizer.ggml.token_type"); types && types->type == gguf::ValueType::ARRAY)
      for (size_t i = 0; i < types->array.size(); ++i)
        if (types->array[i].as_int() == 6) arch.quiet_rows.push_back(uint64_t(i));  // a byte token
  }

  gguf::Writer w;
  w.set_string("general.name",
               o.name.empty() ? "ds4-synthetic-" + (o.preset.empty() ? std::to_string(s.dim) + "d" +
                                                                           std::to_string(s.layers) + "l"
                                                                     : o.preset)
                              : o.name);
  if (const auto ft = file_type_of(o.type)) w.set_u32("general.file_type", *ft);
  mkmodel::write_arch_metadata(w, arch);
  copy_vocabulary(*vocab_src, w);

  uint64_t n_params = 0;
  Progress progress;
  mkmodel::TensorSink sink;
  sink.matrix_adjusted = [&](const std::string& name, uint64_t ne0, uint64_t ne1, float stddev,
                             std::function<float(uint64_t, float)> adjust) {
    w.add_tensor_generated(name, {ne0, ne1}, o.type,
                           progress.wrap(random_tensor(name, o.seed, o.type, ne0 * ne1, stddev, adjust)));
    n_params += ne0 * ne1;
    progress.total += gguf::Writer::tensor_bytes({ne0, ne1}, o.type);
  };
  sink.matrix = [&](const std::string& name, uint64_t ne0, uint64_t ne1, float stddev) {
    w.add_tensor_generated(name, {ne0, ne1}, o.type,
                           progress.wrap(random_tensor(name, o.seed, o.type, ne0 * ne1, stddev)));
    n_params += ne0 * ne1;
    progress.total += gguf::Writer::tensor_bytes({ne0, ne1}, o.type);
  };
  sink.stack = [&](const std::string& name, uint64_t ne0, uint64_t ne1, uint64_t ne2, float stddev) {
    w.add_tensor_generated(name, {ne0, ne1, ne2}, o.type,
                           progress.wrap(random_tensor(name, o.seed, o.type, ne0 * ne1 * ne2, stddev)));
    n_params += ne0 * ne1 * ne2;
    progress.total += gguf::Writer::tensor_bytes({ne0, ne1, ne2}, o.type);
  };
  sink.matrix_f32 = [&](const std::string& name, uint64_t ne0, uint64_t ne1, float stddev) {
    w.add_tensor_generated(name, {ne0, ne1}, GgmlType::F32,
                           progress.wrap(random_tensor(name, o.seed, GgmlType::F32, ne0 * ne1, stddev)));
    n_params += ne0 * ne1;
    progress.total += ne0 * ne1 * 4;
  };
  sink.vector = [&](const std::string& name, uint64_t n, std::function<float(uint64_t)> value) {
    w.add_tensor_generated(name, {n}, GgmlType::F32, progress.wrap([n, value](uint8_t* out, uint64_t) {
      for (uint64_t i = 0; i < n; ++i) {
        const float v = value(i);
        std::memcpy(out + 4 * i, &v, 4);
      }
    }));
    n_params += n;
    progress.total += n * 4;
  };
  const uint64_t seed = o.seed;
  const std::function<float(const std::string&, uint64_t)> normal = [seed](const std::string& name, uint64_t i) {
    return normal_at(splitmix64(seed ^ fnv1a(name)), i);
  };
  mkmodel::add_arch_tensors(arch, sink, normal);

  std::fprintf(stderr, "ds4-mkmodel: writing %s: %s, %.1fM parameters, %s, dim %u, %u layers, ff %u, "
               "%u/%u heads, vocab %llu\n",
               o.out.c_str(), arch.arch.c_str(), double(n_params) / 1e6, type_name(o.type).c_str(), s.dim,
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

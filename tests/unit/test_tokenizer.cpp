// Tokenizer: stories260K's vocabulary against llama.cpp's own tokenization
// (tests/data/stories260K_refs.json, made by tests/tools/make_refs.mjs), the
// SPM merge order, byte fallback, user-defined tokens, and clear errors for
// vocabularies ds4 cannot use.
#include <doctest/doctest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shared/error.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"
#include "text/tokenizer.h"

using namespace ds4;
using Tokens = std::vector<int32_t>;

namespace {

const std::string kStories = DS4_SHARED_MODELS "/stories260K.gguf";
const std::string kRefs = DS4_SOURCE_DIR "/tests/data/stories260K_refs.json";

const Tokenizer& stories() {
  static const gguf::File file = gguf::File::open(kStories);
  static const Tokenizer tok = Tokenizer::from_gguf(file);
  return tok;
}

nlohmann::json load_refs() {
  std::ifstream in(kRefs);
  REQUIRE_MESSAGE(in.good(), "cannot read " << kRefs);
  return nlohmann::json::parse(in);
}

// A small vocabulary: kind of token → type (1 normal, 2 unknown, 3 control,
// 4 user-defined, 6 byte), plus the 256 byte tokens.
struct Vocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;

  int32_t add(std::string text, float score, int32_t type = 1) {
    tokens.push_back(std::move(text));
    scores.push_back(score);
    types.push_back(type);
    return int32_t(tokens.size()) - 1;
  }
};

Vocab base_vocab() {
  Vocab v;
  v.add("<unk>", 0, 2);
  v.add("<s>", 0, 3);
  v.add("</s>", 0, 3);
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) v.add({'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'}, 0, 6);
  return v;
}

// The bytes of a GGUF holding only `v` and the keys `extra` sets.
std::vector<uint8_t> vocab_file(const Vocab& v, const std::function<void(gguf::Writer&)>& extra = {}) {
  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", v.tokens);
  w.set_f32_array("tokenizer.ggml.scores", v.scores);
  w.set_i32_array("tokenizer.ggml.token_type", v.types);
  if (extra) extra(w);
  return w.to_bytes();
}

Tokenizer from_bytes(const std::vector<uint8_t>& bytes) {
  return Tokenizer::from_gguf(gguf::File::parse(bytes, "vocab.gguf"));
}

std::string load_error(const std::vector<uint8_t>& bytes) {
  try {
    from_bytes(bytes);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("tokenizer: stories260K vocabulary") {
  const Tokenizer& tok = stories();
  CHECK(tok.n_vocab() == 512);
  CHECK(tok.bos() == 1);
  CHECK(tok.eos() == 2);
  CHECK(tok.add_bos());
  CHECK(tok.is_eog(2));
  CHECK_FALSE(tok.is_eog(1));
  CHECK(tok.piece(0) == "<unk>");     // unknown: its text
  CHECK(tok.piece(1).empty());        // control: nothing
  CHECK(tok.piece(2).empty());
  CHECK(tok.piece(3) == std::string(1, '\0'));  // <0x00>
  CHECK(tok.piece(3 + 0xE4) == "\xe4");
  CHECK(tok.piece(403) == " Once");   // U+2581 → ' '
  CHECK_THROWS_AS(tok.piece(512), Error);
  CHECK_THROWS_AS(tok.piece(-1), Error);
}

TEST_CASE("tokenizer: Once upon a time") {
  const Tokenizer& tok = stories();
  CHECK(tok.encode("Once upon a time", false) == Tokens{403, 407, 261, 378});
  CHECK(tok.encode("Once upon a time", true) == Tokens{1, 403, 407, 261, 378});
  CHECK(tok.encode("", false).empty());
  CHECK(tok.encode("", true) == Tokens{1});
}

TEST_CASE("tokenizer: matches llama.cpp on every reference prompt") {
  const Tokenizer& tok = stories();
  const nlohmann::json refs = load_refs();
  REQUIRE(refs["cases"].size() >= 20);
  for (const auto& c : refs["cases"]) {
    const std::string prompt = c["prompt"];
    const Tokens expected = c["tokens"].get<Tokens>();
    CAPTURE(prompt);
    CHECK(tok.encode(prompt, false) == expected);
    Tokens with_bos = {refs["bos"].get<int32_t>()};
    with_bos.insert(with_bos.end(), expected.begin(), expected.end());
    CHECK(tok.encode(prompt, true) == with_bos);
    // llama.cpp drops the prefix space when detokenizing; decode keeps it.
    const std::string detok = c["detokenized"];
    CHECK(detok == prompt);
    CHECK(tok.decode(expected) == (prompt.empty() ? "" : " " + prompt));
    // The generated continuation decodes to what llama.cpp printed (which,
    // right after BOS, drops the first piece's leading space).
    const std::string generated = c["generated_text"];
    CHECK(tok.decode(c["generated"].get<Tokens>()) ==
          (prompt.empty() ? " " + generated : generated));
  }
}

TEST_CASE("tokenizer: parse_special makes control texts tokens; escape_special keeps them text") {
  const Tokenizer& tok = stories();
  const Tokens once = tok.encode("Once", false);
  Tokens special = {tok.bos()};
  special.insert(special.end(), once.begin(), once.end());  // after a special: the space prefix again
  CHECK(tok.encode("<s>Once", false, true) == special);
  CHECK(tok.encode("<s>Once", false, false) != special);
  CHECK(tok.encode(tok.escape_special("<s>Once"), false, true) == tok.encode("<s>Once", false, false));
}

TEST_CASE("tokenizer: characters absent from the vocabulary fall back to bytes") {
  const Tokenizer& tok = stories();
  // "中" is E4 B8 AD; none of it is a piece of the 512-token vocabulary.
  const Tokens t = tok.encode("中", false);
  REQUIRE(t.size() == 4);
  CHECK(tok.piece(t[0]) == " ");
  CHECK(t[1] == 3 + 0xE4);
  CHECK(t[2] == 3 + 0xB8);
  CHECK(t[3] == 3 + 0xAD);
  CHECK(tok.decode(t) == " 中");
}

TEST_CASE("tokenizer: invalid UTF-8 is handled byte by byte") {
  const Tokenizer& tok = stories();
  for (const std::string text : {"\xff", "a\x80z", "\xe4", "\xe4" "a", "ok\xf0\x9f", "\xc3"}) {
    CAPTURE(text);
    const Tokens t = tok.encode(text, false);
    CHECK(tok.decode(t) == " " + text);
  }
  // A lead byte takes its announced length (here two bytes: E4 'a') as one
  // symbol, as llama.cpp does; no piece matches it, so both become bytes.
  CHECK(tok.encode("\xe4" "a", false) == Tokens{tok.encode(" ", false)[0], 3 + 0xE4, 3 + 'a'});
}

TEST_CASE("tokenizer: round trip on varied text") {
  const Tokenizer& tok = stories();
  const std::string texts[] = {
      "The quick brown fox jumps over the lazy dog.",
      "  spaces  everywhere  ",
      "tab\tnew\nline\r\n",
      "Ünïcödé ✓ 🚀 日本",
      std::string(5000, 'x'),
  };
  for (const std::string& text : texts) {
    CHECK(tok.decode(tok.encode(text, false)) == " " + text);
  }
}

TEST_CASE("tokenizer: merges the best-scoring pair first, leftmost on ties") {
  Vocab v = base_vocab();
  const int32_t space = v.add("\xe2\x96\x81", -1);
  const int32_t a = v.add("a", -1);
  const int32_t b = v.add("b", -1);
  const int32_t aa = v.add("aa", -2);
  const int32_t ab = v.add("ab", -3);
  const int32_t sp_a = v.add("\xe2\x96\x81" "a", -5);
  const Tokenizer tok = from_bytes(vocab_file(v));
  // "▁aaa": pairs ▁a(-5) aa(-2) aa(-2): the leftmost aa wins, then ▁ and a stay.
  CHECK(tok.encode("aaa", false) == Tokens{space, aa, a});
  // "▁aab": aa(-2) beats ab(-3).
  CHECK(tok.encode("aab", false) == Tokens{space, aa, b});
  // "▁ab": ab(-3) beats ▁a(-5).
  CHECK(tok.encode("ab", false) == Tokens{space, ab});
  CHECK(tok.encode("a", false) == Tokens{sp_a});
  // 'c' is no token: byte fallback.
  CHECK(tok.encode("c", false) == Tokens{space, 3 + 'c'});
}

TEST_CASE("tokenizer: add_bos_token and add_space_prefix keys") {
  Vocab v = base_vocab();
  const int32_t space = v.add("\xe2\x96\x81", -1);
  const int32_t a = v.add("a", -1);
  const Tokenizer plain = from_bytes(vocab_file(v, [](gguf::Writer& w) {
    w.set_bool("tokenizer.ggml.add_bos_token", false);
    w.set_bool("tokenizer.ggml.add_space_prefix", false);
  }));
  CHECK_FALSE(plain.add_bos());
  CHECK(plain.encode("a", true) == Tokens{a});
  CHECK(plain.encode("a a", true) == Tokens{a, space, a});

  const Tokenizer ids = from_bytes(vocab_file(v, [](gguf::Writer& w) {
    w.set_u32("tokenizer.ggml.bos_token_id", 2);
    w.set_u32("tokenizer.ggml.eos_token_id", 1);
    w.set_u32("tokenizer.ggml.unknown_token_id", 0xffffffffu);  // out of range: default kept
  }));
  CHECK(ids.bos() == 2);
  CHECK(ids.eos() == 1);
  CHECK(ids.encode("a", true) == Tokens{2, space, a});
  CHECK(ids.is_eog(1));
}

TEST_CASE("tokenizer: user-defined tokens are matched in plain text") {
  Vocab v = base_vocab();
  const int32_t space = v.add("\xe2\x96\x81", -1);
  const int32_t a = v.add("a", -1);
  const int32_t marker = v.add("<|x|>", 0, 4);
  v.add("<|ctl|>", 0, 3);  // control: stays plain text
  const Tokenizer tok = from_bytes(vocab_file(v));
  // After a user-defined token the next fragment gets the space prefix again.
  CHECK(tok.encode("a<|x|>a", false) == Tokens{space, a, marker, space, a});
  CHECK(tok.encode("<|x|>", false) == Tokens{marker});
  CHECK(tok.piece(marker) == "<|x|>");
  const Tokens ctl = tok.encode("<|ctl|>", false);
  CHECK(ctl.size() == 8);  // ▁ and seven byte tokens
  CHECK(tok.decode(ctl) == " <|ctl|>");
}

TEST_CASE("tokenizer: clear errors for unusable vocabularies") {
  Vocab v = base_vocab();
  v.add("a", 0);

  gguf::Writer none;
  none.set_string("general.architecture", "llama");
  CHECK(load_error(none.to_bytes()).find("'tokenizer.ggml.model'") != std::string::npos);

  const std::string bert = load_error(
      vocab_file(v, [](gguf::Writer& w) { w.set_string("tokenizer.ggml.model", "bert"); }));
  CHECK(bert.find("'tokenizer.ggml.model'") != std::string::npos);
  CHECK(bert.find("bert") != std::string::npos);
  // gpt2 (byte-level BPE, tests/unit/test_bpe.cpp) needs its merges.
  const std::string gpt2 = load_error(
      vocab_file(v, [](gguf::Writer& w) { w.set_string("tokenizer.ggml.model", "gpt2"); }));
  CHECK(gpt2.find("'tokenizer.ggml.merges'") != std::string::npos);

  gguf::Writer no_tokens;
  no_tokens.set_string("tokenizer.ggml.model", "llama");
  CHECK(load_error(no_tokens.to_bytes()).find("'tokenizer.ggml.tokens'") != std::string::npos);

  Vocab short_scores = v;
  short_scores.scores.pop_back();
  CHECK(load_error(vocab_file(short_scores)).find("'tokenizer.ggml.scores'") != std::string::npos);

  Vocab short_types = v;
  short_types.types.pop_back();
  CHECK(load_error(vocab_file(short_types)).find("'tokenizer.ggml.token_type'") !=
        std::string::npos);
}

TEST_CASE("tokenizer: fast with a 128K vocabulary") {
  // Pieces of 1–4 letters over a 16-letter alphabet, scored so longer wins.
  Vocab v = base_vocab();
  v.add("\xe2\x96\x81", -1);
  const std::string letters = "etaoinshrdlucmfw";
  std::vector<std::string> level = {""};
  for (int len = 1; len <= 4 && v.tokens.size() < 131072; ++len) {
    std::vector<std::string> next;
    for (const std::string& prefix : level) {
      for (char c : letters) next.push_back(prefix + c);
    }
    for (const std::string& s : next) v.add(s, float(len));
    level = std::move(next);
  }
  while (v.tokens.size() < 131072) v.add("\xe2\x96\x81" "w" + std::to_string(v.tokens.size()), 0);

  const auto t0 = std::chrono::steady_clock::now();
  const Tokenizer tok = from_bytes(vocab_file(v));
  std::string text;
  while (text.size() < 200000) text += "the rain in spain stays mainly in the plain ";
  const Tokens t = tok.encode(text, false);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(tok.n_vocab() == 131072);
  CHECK(tok.decode(t) == " " + text);
  CHECK(secs < 5.0);  // ~0.7 s on a busy core in RelWithDebInfo
}

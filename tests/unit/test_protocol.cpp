// The worker protocol's lines (shared/protocol.h): the hand-written hot-path
// lines must read back exactly, and mean what nlohmann's JSON means.
#include <doctest/doctest.h>

#include <cmath>

#include "shared/error.h"
#include "shared/protocol.h"

using namespace ds4::proto;
using nlohmann::json;

TEST_CASE("protocol: a generate request line reads back as the same request") {
  GenerateRequest g;
  g.prompt = {1, 403, 407, 261, 378};
  g.generated = {432, 7};
  g.max_tokens = 48;
  g.sampling.temperature = 0.95f;
  g.sampling.top_k = 40;
  g.sampling.top_p = 0.9f;
  g.sampling.min_p = 0.05f;
  g.sampling.seed = 18446744073709551615ull;
  g.logprobs = 3;
  g.ignore_eos = true;
  const std::string line = to_line(g);
  CHECK(line.back() == '\n');
  CHECK_NOTHROW(json::parse(line));  // valid JSON
  const Request r = parse_request(line);
  REQUIRE(r.op == Request::Op::generate);
  CHECK(r.generate.prompt == g.prompt);
  CHECK(r.generate.generated == g.generated);
  CHECK(r.generate.max_tokens == 48);
  CHECK(r.generate.sampling.temperature == 0.95f);
  CHECK(r.generate.sampling.top_k == 40);
  CHECK(r.generate.sampling.top_p == 0.9f);
  CHECK(r.generate.sampling.min_p == 0.05f);
  CHECK(r.generate.sampling.seed == 18446744073709551615ull);
  CHECK(r.generate.logprobs == 3);
  CHECK(r.generate.ignore_eos);
}

TEST_CASE("protocol: penalties and logit_bias travel only when set, and read back") {
  GenerateRequest g;
  g.prompt = {1, 2};
  CHECK(to_line(g).find("penalty") == std::string::npos);  // the common line stays as it was
  CHECK(to_line(g).find("logit_bias") == std::string::npos);
  g.sampling.frequency_penalty = 0.5f;
  g.sampling.presence_penalty = -1.25f;
  g.sampling.logit_bias = {{13, -100.f}, {400, 2.5f}};
  const std::string line = to_line(g, 9);
  CHECK_NOTHROW(json::parse(line));
  const Request r = parse_request(line);
  CHECK(r.id == 9);
  CHECK(r.generate == g);
  auto bad = [&](const std::string& from, const std::string& to) {
    std::string l = line;
    REQUIRE(l.find(from) != std::string::npos);
    return l.replace(l.find(from), from.size(), to);
  };
  CHECK_THROWS_WITH_AS(parse_request(bad("0.5", "2.5")), doctest::Contains("frequency_penalty"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(bad("[13,-100]", "[13,-101]")), doctest::Contains("bias"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(bad("[13,-100]", "[-3,1]")), doctest::Contains("token"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(bad("[13,-100]", "[13]")), doctest::Contains("[token, bias] pair"), ds4::Error);
}

TEST_CASE("protocol: a lazy grammar's triggers travel with its grammar, and read back") {
  GenerateRequest g;
  g.prompt = {1, 2};
  g.grammar = R"(root ::= "<tool_call>" "x")";
  CHECK(to_line(g).find("grammar_triggers") == std::string::npos);
  g.grammar_triggers = {{"<tool_call>", false}, {"{", true}};
  const std::string line = to_line(g, 3);
  CHECK(parse_request(line).generate == g);
  auto bad = [&](const std::string& from, const std::string& to) {
    std::string l = line;
    REQUIRE(l.find(from) != std::string::npos);
    return l.replace(l.find(from), from.size(), to);
  };
  CHECK_THROWS_WITH_AS(parse_request(bad(R"("at_start":true)", R"("at_start":1)")), doctest::Contains("at_start"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(bad(R"({"at_start":true,"text":"{"})", R"("{")")), doctest::Contains("grammar_triggers"),
                       ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(bad(R"("text":"<tool_call>")", R"("text":"")")), doctest::Contains("1 to 256 bytes"), ds4::Error);
  GenerateRequest none;
  none.prompt = {1};
  none.grammar_triggers = {{"x", false}};
  CHECK_THROWS_WITH_AS(parse_request(to_line(none)), doctest::Contains("without a 'grammar'"), ds4::Error);
}

TEST_CASE("protocol: a request line in another form, or out of range, reads as the general parser says") {
  GenerateRequest g;
  g.prompt = {1, 2};
  g.max_tokens = 4;
  std::string line = to_line(g);
  // Spacing and key order are free.
  Request r = parse_request(R"({ "max_tokens": 4, "prompt": [1, 2], "op": "generate" })");
  CHECK(r.generate.prompt == g.prompt);
  CHECK(r.generate.max_tokens == 4);
  auto with = [&](const std::string& key, const std::string& value) {
    std::string l = line;
    const size_t at = l.find("\"" + key + "\":") + key.size() + 3;
    return l.replace(at, l.find_first_of(",}", at) - at, value);
  };
  // Every limit holds on the hand-written path as on the general one.
  CHECK_THROWS_WITH_AS(parse_request(with("max_tokens", "-1")), doctest::Contains("out of range"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(with("top_p", "1.0000001")), doctest::Contains("out of range"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(with("temperature", "null")), doctest::Contains("must be a number"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(with("logprobs", "21")), doctest::Contains("out of range"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(with("ignore_eos", "1")), doctest::Contains("true or false"), ds4::Error);
  std::string neg = line;
  neg.replace(neg.find("[1,2]"), 5, "[1,-2]");
  CHECK_THROWS_WITH_AS(parse_request(neg), doctest::Contains("not a token id"), ds4::Error);
  std::string big = line;
  big.replace(big.find("[1,2]"), 5, "[1,2147483648]");
  CHECK_THROWS_WITH_AS(parse_request(big), doctest::Contains("not a token id"), ds4::Error);
  CHECK(parse_request(with("seed", "18446744073709551615")).generate.sampling.seed == 18446744073709551615ull);
}

TEST_CASE("protocol: token and done lines read back exactly, with or without the fast path") {
  TokenEvent t{17, 432, -0.0123f, {}};
  Event e = parse_event(token_line(t));
  CHECK(e.kind == Event::Kind::token);
  CHECK(e.token.index == 17);
  CHECK(e.token.token == 432);
  CHECK(e.token.logprob == -0.0123f);
  // Plain JSON: the general parser reads the same event (lp as the same float).
  const json j = json::parse(token_line(t));
  CHECK(j.size() == 4);
  CHECK(j["ev"] == "token");
  CHECK(j["i"] == 17);
  CHECK(j["t"] == 432);
  CHECK(j["lp"].get<float>() == -0.0123f);

  t.top = {{432, -0.0123f}, {9, -4.5f}};
  e = parse_event(token_line(t));
  REQUIRE(e.token.top.size() == 2);
  CHECK(e.token.top[1] == std::pair<int32_t, float>{9, -4.5f});

  // Other key orders and spacing take the general parser.
  e = parse_event(R"({ "t": 5, "i": 2, "ev": "token", "lp": -1.5 })");
  CHECK(e.kind == Event::Kind::token);
  CHECK(e.token.token == 5);
  CHECK(e.token.index == 2);

  const Timings tm{5, 2, 1, 0.731, 1e-05};
  e = parse_event(done_line("length", tm));
  CHECK(e.kind == Event::Kind::done);
  CHECK(e.reason == "length");
  CHECK(e.timings.prompt_n == 5);
  CHECK(e.timings.cache_n == 2);
  CHECK(e.timings.predicted_n == 1);
  CHECK(e.timings.prompt_ms == 0.731);
  CHECK(e.timings.predicted_ms == 1e-05);
  CHECK(json::parse(done_line("length", tm))["timings"]["prompt_ms"] == 0.731);
  e = parse_event(done_line("odd \"reason\"", tm));  // escaped: the general writer and parser
  CHECK(e.reason == "odd \"reason\"");

  e = parse_event(error_line("worker is stopping"));
  CHECK(e.kind == Event::Kind::error);
  CHECK(e.message == "worker is stopping");
}

TEST_CASE("protocol: broken event lines are errors, never anything else") {
  for (const char* bad : {R"({"ev":"token","i":1,"lp":-0.5,"t":)", R"({"ev":"token","i":x,"lp":-0.5,"t":3})",
                          R"({"ev":"done","reason":"stop","timings":{"cache_n":0}})", "", "{}", "[1]",
                          R"({"ev":"token","i":1,"lp":null,"t":3})", R"({"ev":"nope"})",
                          // found by fuzz_worker_protocol: values no JSON reader takes, or no field can hold
                          R"({"ev":"token","i":1,"lp":nan,"t":3})", R"({"ev":"token","i":1,"lp":-inf,"t":3})",
                          R"({"ev":"token","i":1,"lp":-1e300,"t":3})", R"({"ev":"token","i":1,"lp":-0.5,"t":40000000000})",
                          R"({"ev":"token","i":1,"lp":-0.5,"t":4e50})", R"({"ev":"token","i":1,"lp":-0.5,"t":3,"top":[[4e50,-1]]})",
                          R"({"ev":"token","i":1,"lp":-0.5,"t":3,"top":[[1]]})",
                          R"({"ev":"done","reason":"stop","timings":{"cache_n":0,"predicted_ms":0,"predicted_n":1e30,"prompt_ms":0,"prompt_n":0}})",
                          "{\"ev\":\"done\",\"reason\":\"le\x8bgth\",\"timings\":{\"cache_n\":0,\"predicted_ms\":0,\"predicted_n\":0,\"prompt_ms\":0,\"prompt_n\":0}}"})
    CHECK_THROWS_AS(parse_event(bad), ds4::Error);
}

TEST_CASE("protocol: request ids travel on requests, cancels and every event, fast path or not") {
  GenerateRequest g;
  g.prompt = {1, 2};
  g.max_tokens = 4;
  const std::string line = to_line(g, 9007199254740993);
  CHECK(json::parse(line)["id"] == 9007199254740993);
  Request r = parse_request(line);
  CHECK(r.op == Request::Op::generate);
  CHECK(r.id == 9007199254740993);
  CHECK(r.generate.prompt == g.prompt);
  CHECK(parse_request(to_line(g)).id == 0);  // none
  CHECK(parse_request(R"({"prompt":[1],"id":4,"op":"generate"})").id == 4);
  CHECK_THROWS_WITH_AS(parse_request(R"({"op":"generate","id":0,"prompt":[1]})"), doctest::Contains("out of range"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(R"({"op":"generate","id":"7","prompt":[1]})"), doctest::Contains("must be a number"), ds4::Error);

  r = parse_request(cancel_line(12));
  CHECK(r.op == Request::Op::cancel);
  CHECK(r.id == 12);
  CHECK_THROWS_WITH_AS(parse_request(R"({"op":"cancel"})"), doctest::Contains("needs the 'id'"), ds4::Error);
  CHECK_THROWS_WITH_AS(parse_request(R"({"op":"stop","id":1})"), doctest::Contains("expected generate, cancel or info"), ds4::Error);

  Event e = parse_event(token_line({3, 432, -0.5f, {}}, 12));
  CHECK(e.kind == Event::Kind::token);
  CHECK(e.id == 12);
  CHECK(e.token.index == 3);
  CHECK(e.token.token == 432);
  CHECK(json::parse(token_line({3, 432, -0.5f, {{432, -0.5f}}}, 12))["id"] == 12);  // with alternatives: the general path
  CHECK(parse_event(token_line({3, 432, -0.5f, {{432, -0.5f}}}, 12)).id == 12);
  CHECK(parse_event(token_line({3, 432, -0.5f, {}})).id == 0);

  e = parse_event(done_line("length", {5, 2, 1, 0.5, 0.25}, 12));
  CHECK(e.kind == Event::Kind::done);
  CHECK(e.id == 12);
  CHECK(e.reason == "length");
  CHECK(e.timings.prompt_n == 5);
  CHECK(parse_event(done_line("odd \"reason\"", {}, 12)).id == 12);
  CHECK(parse_event(done_line("stop", {})).id == 0);

  e = parse_event(error_line("the prompt has 600 tokens", 12));
  CHECK(e.kind == Event::Kind::error);
  CHECK(e.id == 12);
  CHECK(parse_event(error_line("bad line")).id == 0);
  CHECK_THROWS_AS(parse_event(R"({"ev":"done","id":-1,"reason":"stop","timings":{}})"), ds4::Error);
  CHECK_THROWS_AS(parse_event(R"({"ev":"token","i":1,"id":"x","lp":-0.5,"t":3})"), ds4::Error);
}

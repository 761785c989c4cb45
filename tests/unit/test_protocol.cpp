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
  g.sampling = {0.95f, 40, 0.9f, 0.05f, 18446744073709551615ull};
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
                          R"({"ev":"token","i":1,"lp":null,"t":3})", R"({"ev":"nope"})"})
    CHECK_THROWS_AS(parse_event(bad), ds4::Error);
}

// Proxy APIs without sockets: routing, authentication, request validation
// with each protocol's error shape, and the answers' shapes (whole and SSE).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "shared/gguf.h"
#include "supervisor/proxy/api_response.h"
#include "supervisor/proxy/json_util.h"
#include "supervisor/proxy/router.h"

using namespace ds4::proxy;
using ds4::proxy::json;  // the proxy's (ordered) JSON
namespace http = boost::beast::http;

namespace {

const ModelText& stories() {
  static const ds4::gguf::File file = ds4::gguf::File::open(DS4_SHARED_MODELS "/stories260K.gguf");
  static const ModelText m = ModelText::from_gguf(file, "stories");
  return m;
}

HttpRequest post(const std::string& target, const std::string& body, const std::string& key = "") {
  HttpRequest r{http::verb::post, target, 11};
  r.body() = body;
  if (!key.empty()) r.set(http::field::authorization, "Bearer " + key);
  r.prepare_payload();
  return r;
}

struct Ctx {
  ApiKeys keys;
  std::vector<ds4::sup::WorkerInfo> workers;
  int64_t context = 512;
  RouteContext get() const {
    PlanLimits l;
    l.context = context;
    l.max_tokens_per_request = 4096;
    l.random_seed = 99;
    return RouteContext{stories(), keys, l, [this] { return workers; }, [] { return std::string("m 1\n"); }, false};
  }
};

json body_of(const Route& r) { return json::parse(r.response->body); }

}  // namespace

TEST_CASE("router: health, models, metrics, unknown paths") {
  Ctx c;
  HttpRequest get{http::verb::get, "/health", 11};
  Route r = route(get, c.get());
  CHECK(r.response->status == 503);  // no worker ready
  c.workers.push_back({});
  c.workers[0].state = ds4::sup::WorkerState::ready;
  r = route(get, c.get());
  CHECK(r.response->status == 200);
  CHECK(body_of(r)["workers_ready"] == 1);

  get.target("/v1/models");
  r = route(get, c.get());
  CHECK(body_of(r)["data"][0]["id"] == "stories");

  get.target("/metrics");
  r = route(get, c.get());
  CHECK(r.response->body == "m 1\n");

  get.target("/nope");
  r = route(get, c.get());
  CHECK(r.response->status == 404);
  CHECK(body_of(r)["error"]["type"] == "not_found_error");
}

TEST_CASE("router: a known path with another method is 405 with Allow; OPTIONS says what is allowed; HEAD's length") {
  Ctx c;
  c.workers.push_back({});
  c.workers[0].state = ds4::sup::WorkerState::ready;
  auto allow = [](const Response& r) {
    for (auto& [k, v] : r.headers)
      if (k == "Allow") return v;
    return std::string();
  };
  HttpRequest req{http::verb::put, "/v1/models", 11};
  Route r = route(req, c.get());
  CHECK(r.response->status == 405);
  CHECK(allow(*r.response) == "GET, HEAD, OPTIONS");
  CHECK(body_of(r)["error"]["message"] == "PUT /v1/models is not served: use GET");
  req = {http::verb::get, "/v1/chat/completions", 11};
  r = route(req, c.get());
  CHECK(r.response->status == 405);
  CHECK(allow(*r.response) == "POST, OPTIONS");
  req = {http::verb::delete_, "/v1/messages", 11};
  r = route(req, c.get());
  CHECK(r.response->status == 405);
  CHECK(body_of(r)["type"] == "error");  // Anthropic's shape on Anthropic's path
  req = {http::verb::post, "/health", 11};
  CHECK(route(req, c.get()).response->status == 405);

  req = {http::verb::options, "/v1/completions/", 11};
  r = route(req, c.get());
  CHECK(r.response->status == 204);
  CHECK(allow(*r.response) == "POST, OPTIONS");
  const std::string no_content = serialize(*r.response, true);
  CHECK(no_content.find("Content-Length") == std::string::npos);
  CHECK(no_content.ends_with("\r\n\r\n"));
  req = {http::verb::options, "/nope", 11};
  CHECK(route(req, c.get()).response->status == 404);

  // HEAD: GET's headers, Content-Length included, and no body.
  req = {http::verb::head, "/health", 11};
  r = route(req, c.get());
  REQUIRE(r.response->status == 200);
  Response head = *r.response;
  head.head_only = true;
  const std::string bytes = serialize(head, true);
  CHECK(bytes.find("Content-Length: " + std::to_string(r.response->body.size()) + "\r\n") != std::string::npos);
  CHECK(bytes.ends_with("\r\n\r\n"));

  // OpenAI's model retrieval; an absolute-form target (RFC 9112) routes by its path.
  req = {http::verb::get, "/v1/models/stories", 11};
  r = route(req, c.get());
  REQUIRE(r.response->status == 200);
  CHECK(body_of(r)["id"] == "stories");
  CHECK(body_of(r)["object"] == "model");
  req = {http::verb::get, "/v1/models/gpt-4", 11};
  r = route(req, c.get());
  CHECK(r.response->status == 404);
  CHECK(body_of(r)["error"]["message"] == "no model 'gpt-4' here; this server serves 'stories'");
  req = {http::verb::get, "http://127.0.0.1:8080/health?x=1", 11};
  CHECK(route(req, c.get()).response->status == 200);
  CHECK(api_of("HTTP://host/v1/messages") == Api::anthropic);
  CHECK(api_of("/v1/messages?beta=true") == Api::anthropic);
  CHECK(api_of("/v1/messages/") == Api::anthropic);
  CHECK(api_of("/v1/chat/completions") == Api::openai);
}

TEST_CASE("router: keys by Bearer or x-api-key; errors in each protocol's shape") {
  Ctx c;
  c.keys.set({"sk-good"});
  Route r = route(post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}]})", "sk-bad"), c.get());
  CHECK(r.response->status == 401);
  CHECK(body_of(r)["error"]["type"] == "authentication_error");

  r = route(post("/v1/messages", R"({"model":"x","max_tokens":4,"messages":[{"role":"user","content":"hi"}]})"), c.get());
  CHECK(r.response->status == 401);
  CHECK(body_of(r)["type"] == "error");
  CHECK(body_of(r)["error"]["type"] == "authentication_error");

  auto req = post("/v1/messages", R"({"model":"x","max_tokens":4,"messages":[{"role":"user","content":"hi"}]})");
  req.set("x-api-key", "sk-good");
  r = route(req, c.get());
  REQUIRE(r.plan);
  CHECK(r.plan->gen.max_tokens == 4);
}

TEST_CASE("requests: malformed and mistyped bodies are 400 naming the field") {
  Ctx c;
  auto err = [&](const std::string& target, const std::string& body) {
    Route r = route(post(target, body), c.get());
    REQUIRE(r.response);
    CHECK(r.response->status == 400);
    json b = body_of(r);
    return target == "/v1/messages" ? b["error"]["message"].get<std::string>() : b["error"]["message"].get<std::string>();
  };
  CHECK(err("/v1/chat/completions", "{not json").starts_with("the request body is not valid JSON: parse error at line 1, column 3: "));
  // Well-formed, but what nlohmann refuses: the reason, not a bare "not valid".
  CHECK(err("/v1/completions", R"({"prompt":"x","max_tokens":1e400})").find("number overflow parsing '1e400'") !=
        std::string::npos);
  CHECK(err("/v1/completions", R"({"prompt":"\ud800"})").find("surrogate") != std::string::npos);
  const std::string long_bad = "{\"prompt\":\"" + std::string(100000, 'a') + "\\x\"}";
  CHECK(err("/v1/completions", long_bad).size() < 300);  // the reason quotes the client's text: cut
  CHECK(err("/v1/chat/completions", "[1,2]").find("JSON object") != std::string::npos);
  CHECK(err("/v1/chat/completions", R"({"messages":"hi"})").find("'messages'") != std::string::npos);
  CHECK(err("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"temperature":"hot"})")
            .find("'temperature' must be a number") != std::string::npos);
  CHECK(err("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"n":2})").find("'n'") !=
        std::string::npos);
  CHECK(err("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":-1})")
            .find("'max_tokens'") != std::string::npos);
  CHECK(err("/v1/messages", R"({"messages":[{"role":"user","content":"hi"}]})").find("'max_tokens' is required") !=
        std::string::npos);
  CHECK(err("/v1/completions", R"({"prompt":{"a":1}})").find("'prompt'") != std::string::npos);
  std::string deep(10000, '[');
  deep += std::string(10000, ']');
  CHECK(err("/v1/completions", R"({"prompt":"a","x":)" + deep + "}").find("nests deeper") != std::string::npos);
}

TEST_CASE("requests: a prompt longer than the context is 400 naming both lengths") {
  Ctx c;
  c.context = 16;
  std::string text;
  for (int i = 0; i < 40; ++i) text += "Once upon a time ";
  Route r = route(post("/v1/completions", json{{"prompt", text}}.dump()), c.get());
  REQUIRE(r.response);
  CHECK(r.response->status == 400);
  const std::string m = body_of(r)["error"]["message"];
  CHECK(m.find("context is 16 tokens") != std::string::npos);
  CHECK(m.find("the prompt has ") != std::string::npos);
}

TEST_CASE("requests: a prompt too long by its length alone is refused without encoding it, with a bound") {
  const size_t per_token = stories().tokenizer().max_token_bytes();
  CHECK(per_token >= 4);
  // No token stands for more bytes than that: the bound holds for real text.
  const std::string sample = "Once upon a time there was a little girl named Lily. She liked to play <0x41> \xe2\x96\x81.";
  CHECK(stories().encode(sample, false).size() >= sample.size() / per_token);

  Ctx c;
  c.context = 256;
  for (const char* ep : {"/v1/completions", "/v1/chat/completions", "/v1/messages"}) {
    std::string text;
    while (text.size() < 256 * per_token + 100) text += "Once upon a time there was a cat. ";
    const std::string body = std::string(ep) == "/v1/completions"
                                 ? json{{"prompt", text}, {"max_tokens", 4}}.dump()
                                 : json{{"messages", {{{"role", "user"}, {"content", text}}}}, {"max_tokens", 4}}.dump();
    Route r = route(post(ep, body), c.get());
    REQUIRE(r.response);
    CHECK(r.response->status == 400);
    const std::string m = body_of(r)["error"]["message"];
    CHECK_MESSAGE(m.find("tokens or more but the context is 256 tokens") != std::string::npos, m);
  }
  // Under the bound, the exact count (the text is encoded).
  std::string text;
  while (text.size() < 2000) text += "Once upon a time there was a cat. ";
  REQUIRE(text.size() / per_token < 256);
  Route r = route(post("/v1/completions", json{{"prompt", text}}.dump()), c.get());
  REQUIRE(r.response);
  const std::string m = body_of(r)["error"]["message"];
  CHECK_MESSAGE(m.find(" tokens but the context is 256 tokens") != std::string::npos, m);
  CHECK(m.find("or more") == std::string::npos);
}

TEST_CASE("requests: sampling, limits, stops and seeds are carried into the plan") {
  Ctx c;
  Route r = route(post("/v1/chat/completions",
                       R"({"messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"hi"}]}],
                           "max_completion_tokens":7,"temperature":0,"top_k":5,"top_p":0.5,"min_p":0.1,"seed":3,
                           "stop":"\n","stream":true,"stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2})"),
                  c.get());
  REQUIRE(r.plan);
  const Plan& p = *r.plan;
  CHECK(p.stream);
  CHECK(p.include_usage);
  CHECK(p.gen.max_tokens == 7);
  CHECK(p.gen.sampling.temperature == 0.f);
  CHECK(p.gen.sampling.top_k == 5);
  CHECK(p.gen.sampling.seed == 3);
  CHECK(p.stop == std::vector<std::string>{"\n"});
  CHECK(p.gen.logprobs == 2);
  CHECK(p.gen.prompt.front() == stories().tokenizer().bos());
  // ChatML text around the messages (stories260K has no template).
  const std::string text = stories().tokenizer().decode(p.gen.prompt);
  CHECK(text.find("<|im_start|>system\nS<|im_end|>") != std::string::npos);

  // No seed: the proxy's random one, so that a resumed request draws the same.
  r = route(post("/v1/completions", R"({"prompt":"Once","max_tokens":100000})"), c.get());
  REQUIRE(r.plan);
  CHECK(r.plan->gen.sampling.seed == 99);
  CHECK(r.plan->gen.max_tokens == 512 - int(r.plan->gen.prompt.size()));  // clamped to the context
}

TEST_CASE("requests: OpenAI's penalties and logit_bias reach the plan; what cannot be honoured is refused by name") {
  Ctx c;
  Route r = route(post("/v1/completions", R"({"prompt":"Once","frequency_penalty":0.5,"presence_penalty":-1,
                                              "logit_bias":{"400":-100,"13":2.5}})"),
                  c.get());
  REQUIRE(r.plan);
  CHECK(r.plan->gen.sampling.frequency_penalty == 0.5f);
  CHECK(r.plan->gen.sampling.presence_penalty == -1.f);
  CHECK(r.plan->gen.sampling.logit_bias == std::vector<std::pair<int32_t, float>>{{13, 2.5f}, {400, -100.f}});
  auto err = [&](const std::string& target, const std::string& body) {
    Route e = route(post(target, body), c.get());
    REQUIRE(e.response);
    CHECK(e.response->status == 400);
    return body_of(e)["error"]["message"].get<std::string>();
  };
  const std::string chat = R"({"messages":[{"role":"user","content":"hi"}],)";
  const std::string msgs = R"({"max_tokens":4,"messages":[{"role":"user","content":"hi"}],)";
  CHECK(err("/v1/completions", R"({"prompt":"x","frequency_penalty":2.5})").find("'frequency_penalty'") != std::string::npos);
  CHECK(err("/v1/completions", R"({"prompt":"x","logit_bias":{"abc":1}})").find("'logit_bias' key 'abc' is not a token id") !=
        std::string::npos);
  CHECK(err("/v1/completions", R"({"prompt":"x","logit_bias":{"512":1}})").find("0 to 511") != std::string::npos);
  CHECK(err("/v1/completions", R"({"prompt":"x","logit_bias":{"5":101}})").find("-100 to 100") != std::string::npos);
  CHECK(err("/v1/completions", R"({"prompt":"x","logit_bias":[1]})").find("must be an object") != std::string::npos);
  CHECK(err("/v1/chat/completions", chat + R"("functions":[{"name":"f"}]})").find("'functions'") != std::string::npos);
  // The JSON answer formats are served under a grammar; another type, or a schema it cannot keep, is a 400.
  {
    Route j = route(post("/v1/chat/completions", chat + R"("response_format":{"type":"json_object"}})"), c.get());
    REQUIRE(j.plan);
    CHECK(j.plan->gen.grammar.find("root ::=") != std::string::npos);
    Route none = route(post("/v1/chat/completions", chat + R"("response_format":{"type":"text"}})"), c.get());
    REQUIRE(none.plan);
    CHECK(none.plan->gen.grammar.empty());
  }
  CHECK(err("/v1/chat/completions", chat + R"("response_format":{"type":"xml"}})").find("'response_format'") !=
        std::string::npos);
  CHECK(err("/v1/chat/completions", chat + R"("response_format":{"type":"json_schema","json_schema":{"name":"x",
        "schema":{"type":"strin"}}}})").find("'response_format.json_schema.schema'") != std::string::npos);
  CHECK(err("/v1/chat/completions", chat + R"("response_format":{"type":"json_schema"}})").find("schema' is required") !=
        std::string::npos);
  CHECK(err("/v1/chat/completions", chat + R"("repeat_penalty":1.1})").find("'repeat_penalty'") != std::string::npos);
  CHECK(err("/v1/completions", R"({"prompt":"x","best_of":3})").find("'best_of' must be 1") != std::string::npos);
  CHECK(err("/v1/completions", R"({"prompt":"x","suffix":"end"})").find("'suffix'") != std::string::npos);
  // Tools, tool_choice and thinking are served (test_proxy_agents.cpp); unknown values are not.
  CHECK(err("/v1/chat/completions", chat + R"("tool_choice":"sometimes"})").find("'tool_choice' must be") != std::string::npos);
  CHECK(err("/v1/messages", msgs + R"("thinking":{"type":"maybe"}})").find("'thinking.type'") != std::string::npos);
  CHECK(err("/v1/messages", msgs + R"("tool_choice":{"type":"any"}})").find("'tool_choice' is 'any' but 'tools' is empty") !=
        std::string::npos);
  // Their "off" values are served.
  for (const std::string& off : {std::string(R"("tools":[],"tool_choice":"none")"), std::string(R"("tool_choice":"auto")"),
                                 std::string(R"("response_format":{"type":"text"})"), std::string(R"("repeat_penalty":1)"),
                                 std::string(R"("functions":null,"function_call":"none")")}) {
    CAPTURE(off);
    CHECK(route(post("/v1/chat/completions", chat + off + "}"), c.get()).plan.has_value());
  }
  CHECK(route(post("/v1/completions", R"({"prompt":"x","best_of":1,"suffix":""})"), c.get()).plan.has_value());
  CHECK(route(post("/v1/messages", msgs + R"("thinking":{"type":"disabled"},"tool_choice":{"type":"auto"}})"), c.get())
            .plan.has_value());
}

namespace {

void check_same_plan(const Plan& a, const Plan& b) {
  CHECK(a.endpoint == b.endpoint);
  CHECK(a.stream == b.stream);
  CHECK(a.include_usage == b.include_usage);
  CHECK(a.logprobs == b.logprobs);
  CHECK(a.top_logprobs == b.top_logprobs);
  CHECK(a.stop == b.stop);
  CHECK(a.model == b.model);
  CHECK(a.gen.prompt == b.gen.prompt);
  CHECK(a.gen.generated == b.gen.generated);
  CHECK(a.gen.max_tokens == b.gen.max_tokens);
  CHECK(a.gen.logprobs == b.gen.logprobs);
  CHECK(a.gen.sampling.temperature == b.gen.sampling.temperature);
  CHECK(a.gen.sampling.top_k == b.gen.sampling.top_k);
  CHECK(a.gen.sampling.top_p == b.gen.sampling.top_p);
  CHECK(a.gen.sampling.min_p == b.gen.sampling.min_p);
  CHECK(a.gen.sampling.seed == b.gen.sampling.seed);
}

}  // namespace

TEST_CASE("requests: the common shape is read without a JSON tree, into the plan of the full parse") {
  PlanLimits limits;
  limits.context = 512;
  limits.max_tokens_per_request = 4096;
  limits.random_seed = 99;
  const std::vector<std::pair<Endpoint, std::string>> common = {
      {Endpoint::completion, R"({"model":"stories","prompt":"Once upon a time","max_tokens":1,"temperature":0})"},
      {Endpoint::completion,
       R"({"prompt":"Tab\there \"q\" caf\u00e9 \ud83d\ude00 \/ \\ \b\f\r\n\u0000end","max_tokens":5,"seed":-7,)"
       R"("top_k":3,"top_p":0.5,"min_p":1e-1,"stop":["\n","The"],"stream":true,"n":1})"},
      {Endpoint::completion, "{\"prompt\":\"caf\xC3\xA9 \xE2\x98\x95 \xF0\x9F\x98\x80\",\"seed\":-0,\"stop\":[]}"},
      {Endpoint::completion, " {\n\t\"prompt\" : \"Once\" ,\r\n \"max_tokens\" : 100000 , \"temperature\" : 2 } \n"},
      {Endpoint::chat,
       R"({"messages":[{"role":"system","content":"Be brief."},{"content":"Hi","role":"user"},)"
       R"({"role":"assistant","content":"Hello"},{"role":"developer","content":"x"}],)"
       R"("max_completion_tokens":7,"max_tokens":3,"stop":".","temperature":0.7})"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":""}],"model":"gpt-4o","stream":false})"},
      {Endpoint::messages,
       R"({"model":"claude","system":"Be kind","messages":[{"role":"user","content":"Hi"},)"
       R"({"role":"assistant","content":"Hey"}],"max_tokens":4,"temperature":1,"stop_sequences":["x"]})"},
  };
  for (const auto& [ep, body] : common) {
    CAPTURE(body);
    std::optional<Plan> fast = parse_common_request(ep, body, stories(), limits);
    REQUIRE(fast);
    // A field no parser reads sends the body the full way.
    auto full = parse_request(ep, "{\"x_unread\":null," + body.substr(body.find('{') + 1), stories(), limits);
    REQUIRE(std::holds_alternative<Plan>(full));
    check_same_plan(*fast, std::get<Plan>(full));
    auto answer = parse_request(ep, body, stories(), limits);
    REQUIRE(std::holds_alternative<Plan>(answer));
    check_same_plan(*fast, std::get<Plan>(answer));
  }

  // Anything else goes the full way, which words the errors.
  const std::vector<std::pair<Endpoint, std::string>> other = {
      {Endpoint::completion, R"({"prompt":"a","max_tokens":null})"},
      {Endpoint::completion, R"({"prompt":"a","prompt":"b"})"},
      {Endpoint::completion, R"({"prompt":[1,2,3]})"},
      {Endpoint::completion, R"({"prompt":"a","logprobs":2})"},
      {Endpoint::completion, R"({"prompt":"a","max_tokens":2.0})"},
      {Endpoint::completion, R"({"prompt":"a","max_tokens":01})"},
      {Endpoint::completion, R"({"prompt":"a","max_tokens":-1})"},
      {Endpoint::completion, R"({"prompt":"a","max_tokens":99999999999999999999})"},
      {Endpoint::completion, R"({"prompt":"a","temperature":2.5})"},
      {Endpoint::completion, R"({"prompt":"a","n":2})"},
      {Endpoint::completion, R"({"prompt":"a",})"},
      {Endpoint::completion, R"({"prompt":"a"} x)"},
      {Endpoint::completion, R"({"prompt":"\ud83d"})"},
      {Endpoint::completion, R"({"prompt":"\x"})"},
      {Endpoint::completion, "{\"prompt\":\"\xC3\x28\"}"},
      {Endpoint::completion, "{\"prompt\":\"a\tb\"}"},
      {Endpoint::completion, R"({"messages":[{"role":"user","content":"hi"}]})"},
      {Endpoint::chat, R"({"messages":[]})"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]})"},
      {Endpoint::chat, R"({"messages":[{"role":"user"}]})"},
      {Endpoint::chat, R"({"messages":[{"role":"critic","content":"hi"}]})"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"hi"}],"stream_options":{"include_usage":true}})"},
      {Endpoint::messages, R"({"messages":[{"role":"user","content":"hi"}]})"},
      {Endpoint::messages, R"({"messages":[{"role":"tool","content":"hi"}],"max_tokens":3})"},  // a system message anywhere is served; tool is not a role there
  };
  for (const auto& [ep, body] : other) {
    CAPTURE(body);
    CHECK_FALSE(parse_common_request(ep, body, stories(), limits));
  }
}

TEST_CASE("responses: OpenAI chat, whole and streamed") {
  Ctx c;
  Route r = route(post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"logprobs":true})"), c.get());
  REQUIRE(r.plan);
  auto resp = make_responder(*r.plan, stories().tokenizer(), "chatcmpl-1", 5);
  CHECK(resp->open().empty());
  CHECK(resp->text("Hel", {{100, -0.5f, {}}}).empty());
  CHECK(resp->text("lo", {{101, -0.25f, {}}}).empty());
  Finish f;
  f.reason = FinishReason::length;
  f.prompt_tokens = 9;
  f.completion_tokens = 2;
  f.timings.predicted_n = 2;
  f.timings.predicted_ms = 4;
  json b = json::parse(resp->finish(f));
  CHECK(b["object"] == "chat.completion");
  CHECK(b["choices"][0]["message"]["content"] == "Hello");
  CHECK(b["choices"][0]["finish_reason"] == "length");
  CHECK(b["choices"][0]["logprobs"]["content"].size() == 2);
  CHECK(b["usage"]["total_tokens"] == 11);
  CHECK(b["timings"]["predicted_per_second"] == 500.0);

  r.plan->stream = true;
  r.plan->include_usage = true;
  r.plan->logprobs = false;
  resp = make_responder(*r.plan, stories().tokenizer(), "chatcmpl-1", 5);
  std::string s = resp->open() + resp->text("Hi", {}) + resp->finish(f);
  CHECK(s.rfind("data: {", 0) == 0);
  CHECK(s.find("\"role\":\"assistant\"") != std::string::npos);
  CHECK(s.find("\"delta\":{\"content\":\"Hi\"}") != std::string::npos);
  CHECK(s.find("\"finish_reason\":\"length\"") != std::string::npos);
  CHECK(s.find("\"choices\":[],") != std::string::npos);  // the usage chunk
  CHECK(s.size() >= 14);
  CHECK(s.substr(s.size() - 14) == "data: [DONE]\n\n");
}

TEST_CASE("responses: Anthropic messages stream has the event sequence") {
  Ctx c;
  Route r = route(post("/v1/messages", R"({"model":"claude-x","max_tokens":8,"stream":true,"system":"S",
                                           "stop_sequences":["END"],"messages":[{"role":"user","content":"hi"}]})"),
                  c.get());
  REQUIRE(r.plan);
  auto resp = make_responder(*r.plan, stories().tokenizer(), "msg_1", 5);
  Finish f;
  f.reason = FinishReason::stop_sequence;
  f.stop_sequence = "END";
  f.completion_tokens = 3;
  std::string s = resp->open();  // in this order: the stream's state goes from one to the next
  s += resp->text("Hi", {});
  s += resp->finish(f);
  std::vector<std::string> events;
  for (size_t at = 0; (at = s.find("event: ", at)) != std::string::npos; at += 7)
    events.push_back(s.substr(at + 7, s.find('\n', at) - at - 7));
  CHECK(events == std::vector<std::string>{"message_start", "content_block_start", "ping", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop"});
  CHECK(s.find("\"stop_reason\":\"stop_sequence\"") != std::string::npos);
  CHECK(s.find("\"model\":\"claude-x\"") != std::string::npos);
  CHECK(waiting_comment(3) == ": waiting, position 3\n\n");
}

TEST_CASE("errors: shapes and statuses") {
  json o = json::parse(error_body(Api::openai, {ErrorKind::too_large, "big"}));
  CHECK(o["error"]["message"] == "big");
  CHECK(o["error"].contains("code"));
  json a = json::parse(error_body(Api::anthropic, {ErrorKind::unavailable, "full"}));
  CHECK(a["type"] == "error");
  CHECK(a["error"]["type"] == "overloaded_error");
  Response r = error_response(Api::openai, {ErrorKind::unavailable, "full", 2});
  CHECK(r.status == 503);
  CHECK(r.headers.at(0) == std::pair<std::string, std::string>{"Retry-After", "2"});
  CHECK(status_of(ErrorKind::timeout) == 504);
  const std::string raw = serialize(r, true);
  CHECK(raw.rfind("HTTP/1.1 503 Service Unavailable\r\n", 0) == 0);
  CHECK(raw.find("Retry-After: 2\r\n") != std::string::npos);
}

TEST_CASE("JsonWriter: the text dump() writes; invalid UTF-8 becomes U+FFFD") {
  const std::vector<std::string> texts = {"plain", "quote \" back \\ nl \n tab \t ctl \x01 del \x7f",
                                          "\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82", "bad \xff\xfe end",
                                          "surrogate \xed\xa0\x80 overlong \xc0\xaf"};
  for (const std::string& s : texts) {
    JsonWriter w;
    w.begin_object().key("a").begin_array().value(int64_t(-3)).value(500.0).value(1e-05).null().end_array();
    w.key("k").value(s).key("o").begin_object().end_object().end_object();
    const json j = {{"a", {-3, 500.0, 1e-05, nullptr}}, {"k", s}, {"o", json::object()}};
    CHECK(w.str() == dump(j));
  }
  std::string cut;
  put_json_string(cut, "cut \xe6\x97");
  CHECK(json::parse(cut).get<std::string>().rfind("cut \xef\xbf\xbd", 0) == 0);
}

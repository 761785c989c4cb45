// What agents send and get: tools, tool_choice, tool calls and results in the
// history, thinking controls, the Responses API, count_tokens, HEAD /, and
// the answers' shapes with reasoning and calls (whole and streamed).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "shared/error.h"
#include "shared/gguf.h"
#include "supervisor/proxy/answer.h"
#include "supervisor/proxy/api_response.h"
#include "supervisor/proxy/chat_input.h"
#include "supervisor/proxy/json_util.h"
#include "supervisor/proxy/router.h"
#include "supervisor/proxy/tool_grammar.h"
#include "text/grammar.h"

using namespace ds4::proxy;
using ds4::proxy::json;  // the proxy's (ordered) JSON
namespace http = boost::beast::http;

namespace {

const ModelText& stories() {
  static const ds4::gguf::File file = ds4::gguf::File::open(DS4_SHARED_MODELS "/stories260K.gguf");
  static const ModelText m = ModelText::from_gguf(file, "stories");
  return m;
}

HttpRequest request(http::verb verb, const std::string& target, const std::string& body = "") {
  HttpRequest r{verb, target, 11};
  r.body() = body;
  r.prepare_payload();
  return r;
}

struct Ctx {
  ApiKeys keys;
  ResponseStore store{4};
  RouteContext get() {
    PlanLimits l;
    l.context = 4096;
    l.max_tokens_per_request = 8192;
    l.responses = &store;
    return RouteContext{stories(), keys, l, [] { return std::vector<ds4::sup::WorkerInfo>{}; }, [] { return std::string(); }, false};
  }
};

Route post(Ctx& c, const std::string& target, const std::string& body) { return route(request(http::verb::post, target, body), c.get()); }

json error_of(const Route& r) {
  REQUIRE(r.response);
  CHECK(r.response->status == 400);
  return json::parse(r.response->body);
}

const std::string kWeatherTool =
    R"({"type":"function","function":{"name":"get_weather","description":"Weather of a city",
        "parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}})";

std::string prompt_text(const Plan& p) { return stories().tokenizer().decode(p.gen.prompt); }

}  // namespace

TEST_CASE("agents: OpenAI tools and tool_choice reach the plan; the tools are in the prompt") {
  Ctx c;
  const std::string base = R"({"messages":[{"role":"user","content":"Weather in Paris?"}],"tools":[)" + kWeatherTool + "]";
  Route r = post(c, "/v1/chat/completions", base + "}");
  REQUIRE(r.plan);
  CHECK(r.plan->tool_calls);
  CHECK(r.plan->read_answer);
  CHECK(r.plan->tool_syntax == ds4::tools::Syntax::hermes);  // stories has no template: ChatML, Hermes calls
  CHECK(r.plan->tool_choice.mode == ToolChoice::Mode::automatic);
  CHECK(prompt_text(*r.plan).find("get_weather") != std::string::npos);
  CHECK(prompt_text(*r.plan).find("<tool_call>") != std::string::npos);

  Route none = post(c, "/v1/chat/completions", base + R"(,"tool_choice":"none"})");
  REQUIRE(none.plan);
  CHECK_FALSE(none.plan->tool_calls);
  CHECK(prompt_text(*none.plan).find("get_weather") == std::string::npos);

  Route named = post(c, "/v1/chat/completions", base + R"(,"tool_choice":{"type":"function","function":{"name":"get_weather"}},"parallel_tool_calls":false})");
  REQUIRE(named.plan);
  CHECK(named.plan->tool_choice.mode == ToolChoice::Mode::named);
  CHECK(named.plan->tool_choice.name == "get_weather");
  CHECK_FALSE(named.plan->tool_choice.parallel);
  CHECK(post(c, "/v1/chat/completions", base + R"(,"tool_choice":"required"})").plan->tool_choice.mode ==
        ToolChoice::Mode::required);

  // Bad values: 400 naming the field, in message and param.
  json e = error_of(post(c, "/v1/chat/completions", base + R"(,"tool_choice":{"type":"function","function":{"name":"nope"}}})"));
  CHECK(e["error"]["message"].get<std::string>().find("'nope', which is not among 'tools'") != std::string::npos);
  CHECK(e["error"]["param"] == "tool_choice.function.name");
  e = error_of(post(c, "/v1/chat/completions", base + R"(,"tool_choice":"sometimes"})"));
  CHECK(e["error"]["param"] == "tool_choice");
  e = error_of(post(c, "/v1/chat/completions",
                    R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"retrieval"}]})"));
  CHECK(e["error"]["param"] == "tools[0].type");
  e = error_of(post(c, "/v1/chat/completions",
                    R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"description":"no name"}}]})"));
  CHECK(e["error"]["param"] == "tools[0].function.name");
  e = error_of(post(c, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"tools":[)" + kWeatherTool + "," +
                                                   kWeatherTool + "]}"));
  CHECK(e["error"]["message"].get<std::string>().find("repeats the name 'get_weather'") != std::string::npos);
}

TEST_CASE("agents: tools, their schemas and a call's arguments keep the client's key order in the prompt") {
  // transformers and llama.cpp render what the client sent, in its order; a
  // sorted object would put "function" before "type" and "alpha" before "zeta".
  json body = json::parse(R"({"messages":[
      {"role":"user","content":"Weather?"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
         "function":{"name":"f","arguments":"{\"zeta\":1,\"alpha\":2}"}}]},
      {"role":"tool","tool_call_id":"c1","content":"ok"}],
    "tools":[{"type":"function","function":{"name":"f","description":"d","parameters":
      {"type":"object","properties":{"zeta":{"type":"integer"},"alpha":{"type":"integer"}},"required":["zeta","alpha"]}}}]})");
  ToolChoice choice;
  ChatInput in = openai_chat_input(body, choice);
  const std::string p = render_prompt(stories(), in);
  CAPTURE(p);
  CHECK(p.find(R"({"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object","properties":{"zeta":)") !=
        std::string::npos);
  CHECK(p.find(R"("arguments":{"zeta":1,"alpha":2})") != std::string::npos);
  // A forced JSON answer follows the schema's property order too.
  const std::string g = ds4::grammar::schema_to_gbnf(in.tools[0]["function"]["parameters"]);
  auto matcher = ds4::grammar::Matcher(ds4::grammar::Grammar::parse(g));
  CHECK(matcher.accept(R"({"zeta":1,"alpha":2})"));
  auto sorted = ds4::grammar::Matcher(ds4::grammar::Grammar::parse(g));
  CHECK_FALSE(sorted.accept(R"({"alpha":2,"zeta":1})"));
}

TEST_CASE("agents: history with assistant tool_calls and role tool becomes the template's messages") {
  json body = json::parse(R"({"messages":[
      {"role":"system","content":"S"},
      {"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",
         "function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"call_1","content":"sunny"},
      {"role":"system","content":"late system"}]})");
  ToolChoice choice;
  ChatInput in = openai_chat_input(body, choice);
  REQUIRE(in.messages.size() == 5);
  CHECK(in.messages[2]["tool_calls"][0]["function"]["arguments"] == json{{"city", "Paris"}});  // an object, as transformers passes it
  CHECK(in.messages[3] == json{{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny"}, {"name", "get_weather"}});
  CHECK(in.messages[4]["role"] == "system");
  // The fallback writes the call and the result as Qwen's template does.
  const std::string p = render_prompt(stories(), in);
  CHECK(p.find("<|im_start|>assistant\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call><|im_end|>") !=
        std::string::npos);
  CHECK(p.find("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>") != std::string::npos);

  Ctx c;
  json bad = body;
  bad["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{not json";
  json e = error_of(post(c, "/v1/chat/completions", bad.dump()));
  CHECK(e["error"]["param"] == "messages[2].tool_calls[0].function.arguments");
  bad = body;
  bad["messages"][3]["content"] = json{{"result", 1}};  // a tool result that is not a string
  e = error_of(post(c, "/v1/chat/completions", bad.dump()));
  CHECK(e["error"]["param"] == "messages[3].content");
}

TEST_CASE("agents: Anthropic tools, tool_use and tool_result blocks, system anywhere, thinking and what Claude Code sends") {
  Ctx c;
  const std::string body = R"({"model":"claude-sonnet","max_tokens":64000,"stream":false,
      "system":[{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral"}}],
      "thinking":{"type":"adaptive"},"context_management":{"edits":[]},"output_config":{"effort":"high"},
      "metadata":{"user_id":"u"},"service_tier":"auto",
      "tools":[{"name":"Bash","description":"Run","input_schema":{"type":"object","properties":{"command":{"type":"string"}}}}],
      "tool_choice":{"type":"auto"},
      "messages":[{"role":"user","content":[{"type":"text","text":"list files"}]},
                  {"role":"system","content":"a system message in the middle"},
                  {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"x"},
                     {"type":"text","text":"Running ls."},{"type":"tool_use","id":"toolu_1","name":"Bash","input":{"command":"ls"}}]},
                  {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"a.txt"}]},
                     {"type":"text","text":"and now?"}]}]})";
  Route r = post(c, "/v1/messages", body);
  REQUIRE(r.plan);
  CHECK(r.plan->tool_calls);
  CHECK(r.plan->gen.max_tokens > 0);  // 64000 is cut to the context, not refused
  CHECK(r.plan->gen.max_tokens <= 4096);
  const std::string p = prompt_text(*r.plan);
  CHECK(p.find("a system message in the middle") != std::string::npos);
  CHECK(p.find("\"name\":\"Bash\"") != std::string::npos);
  CHECK(p.find("<tool_response>\na.txt\n</tool_response>") != std::string::npos);
  CHECK(p.find("and now?") != std::string::npos);

  ToolChoice choice;
  ChatInput in = anthropic_input(json::parse(body), choice);
  REQUIRE(in.messages.size() == 6);
  CHECK(in.messages[3]["tool_calls"][0] ==
        json{{"id", "toolu_1"}, {"type", "function"}, {"function", {{"name", "Bash"}, {"arguments", {{"command", "ls"}}}}}});
  CHECK(in.messages[4] == json{{"role", "tool"}, {"tool_call_id", "toolu_1"}, {"content", "a.txt"}, {"name", "Bash"}});

  for (const char* choice_json : {R"({"type":"any"})", R"({"type":"tool","name":"Bash"})", R"({"type":"none"})"}) {
    json b = json::parse(body);
    b["tool_choice"] = json::parse(choice_json);
    CHECK(post(c, "/v1/messages", b.dump()).plan.has_value());
  }
  json b = json::parse(body);
  b["tool_choice"] = {{"type", "sometimes"}};
  json e = json::parse(post(c, "/v1/messages", b.dump()).response->body);
  CHECK(e["type"] == "error");
  CHECK(e["error"]["message"].get<std::string>().find("'tool_choice'") == 0);
  b = json::parse(body);
  b["messages"][3]["content"][0]["content"] = 42;  // a tool result that is neither a string nor blocks
  CHECK(post(c, "/v1/messages", b.dump()).response->status == 400);
}

TEST_CASE("agents: the thinking controls reach the template as enable_thinking; Anthropic's budget is kept") {
  auto think = [](const std::string& body, bool anthropic) { return thinking_asked(json::parse(body), anthropic); };
  CHECK(think(R"({"reasoning_effort":"none"})", false) == false);
  CHECK(think(R"({"reasoning_effort":"minimal"})", false) == false);
  for (const char* e : {"low", "medium", "high", "max"})
    CHECK(think(std::string(R"({"reasoning_effort":")") + e + "\"}", false) == true);
  CHECK(think(R"({"chat_template_kwargs":{"enable_thinking":false},"reasoning_effort":"high"})", false) == false);
  CHECK(think(R"({"thinking":{"type":"disabled"}})", false) == false);  // DeepSeek's, on chat
  CHECK(think(R"({"thinking":{"type":"enabled","budget_tokens":2048}})", true) == true);
  CHECK(think(R"({"thinking":{"type":"adaptive"}})", true) == true);
  CHECK(think(R"({"reasoning":{"effort":"low"}})", false) == true);
  CHECK_FALSE(think(R"({})", false).has_value());
  CHECK_THROWS_WITH_AS(think(R"({"reasoning_effort":"extreme"})", false), doctest::Contains("'reasoning_effort' is 'extreme'"),
                       ds4::Error);

  Ctx c;
  Route r = post(c, "/v1/messages", R"({"max_tokens":100,"thinking":{"type":"enabled","budget_tokens":16},
                                         "messages":[{"role":"user","content":"hi"}]})");
  REQUIRE(r.plan);
  CHECK(r.plan->thinking_budget == 16);
}

TEST_CASE("agents: answers are read into thought, content and calls") {
  Plan p;
  p.read_answer = true;
  p.tool_calls = true;
  AnswerParser a(p);
  std::vector<AnswerEvent> all;
  const std::string text = "<think>plan</think>\n\nOK <tool_call>{\"name\":\"f\",\"arguments\":{\"x\":1}}</tool_call>";
  for (char ch : text)
    for (AnswerEvent& e : a.push(std::string(1, ch))) all.push_back(std::move(e));
  for (AnswerEvent& e : a.finish()) all.push_back(std::move(e));
  std::string reasoning, content;
  std::vector<ds4::tools::ToolCall> calls;
  for (auto& e : all) {
    if (e.kind == AnswerEvent::Kind::reasoning) reasoning += e.text;
    if (e.kind == AnswerEvent::Kind::content) content += e.text;
    if (e.kind == AnswerEvent::Kind::call) calls.push_back(e.call);
  }
  CHECK(reasoning == "plan");
  CHECK(content == "OK ");
  REQUIRE(calls.size() == 1);
  CHECK(calls[0] == ds4::tools::ToolCall{"f", R"({"x":1})"});
  CHECK(a.calls() == 1);

  Plan completion;  // completions read nothing out of the text
  AnswerParser plain(completion);
  auto ev = plain.push("<think>x</think>");
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].text == "<think>x</think>");
}

TEST_CASE("agents: OpenAI answers carry reasoning_content and tool_calls, whole and streamed as the SDK assembles them") {
  Ctx c;
  Route r = post(c, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"tools":[)" + kWeatherTool + "]}");
  REQUIRE(r.plan);
  Finish f;
  f.reason = FinishReason::tool_calls;
  auto resp = make_responder(*r.plan, stories().tokenizer(), "chatcmpl-1", 5);
  resp->reasoning("think");
  resp->tool_call("call_9", {"get_weather", R"({"city":"Oslo"})"});
  json b = json::parse(resp->finish(f));
  const json& m = b["choices"][0]["message"];
  CHECK(b["choices"][0]["finish_reason"] == "tool_calls");
  CHECK(m["content"].is_null());
  CHECK(m["reasoning_content"] == "think");
  CHECK(m["tool_calls"] == json::parse(R"([{"id":"call_9","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}}])"));

  r.plan->stream = true;
  resp = make_responder(*r.plan, stories().tokenizer(), "chatcmpl-1", 5);
  std::string s = resp->open();  // one after the other (the operands of + have no order)
  s += resp->reasoning("th");
  s += resp->text("Hi", {});
  s += resp->tool_call("call_9", {"get_weather", R"({"city":"Oslo"})"});
  s += resp->finish(f);
  std::vector<json> chunks;
  for (size_t at = 0; (at = s.find("data: {", at)) != std::string::npos; at += 6)
    chunks.push_back(json::parse(s.substr(at + 6, s.find("\n\n", at) - at - 6)));
  // Assemble as the openai SDK does: by index, id/type/name once, arguments appended.
  std::string reasoning, content, name, args, id, finish;
  for (const json& ch : chunks) {
    const json& d = ch["choices"][0]["delta"];
    if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("content")) content += d["content"].get<std::string>();
    if (d.contains("tool_calls")) {
      const json& t = d["tool_calls"][0];
      CHECK(t["index"] == 0);
      if (t.contains("id")) id = t["id"];
      if (t["function"].contains("name")) name += t["function"]["name"].get<std::string>();
      args += t["function"].value("arguments", "");
    }
    if (!ch["choices"][0]["finish_reason"].is_null()) finish = ch["choices"][0]["finish_reason"];
  }
  CHECK(reasoning == "th");
  CHECK(content == "Hi");
  CHECK(id == "call_9");
  CHECK(name == "get_weather");
  CHECK(json::parse(args) == json{{"city", "Oslo"}});
  CHECK(finish == "tool_calls");
}

TEST_CASE("agents: Anthropic answers have thinking, text and tool_use blocks; the stream has input_json_delta") {
  Ctx c;
  Route r = post(c, "/v1/messages", R"({"max_tokens":50,"messages":[{"role":"user","content":"x"}],
                                         "tools":[{"name":"Bash","input_schema":{"type":"object"}}]})");
  REQUIRE(r.plan);
  Finish f;
  f.reason = FinishReason::tool_calls;
  auto resp = make_responder(*r.plan, stories().tokenizer(), "msg_1", 5);
  resp->reasoning("hm");
  resp->text("Running.", {});
  resp->tool_call("toolu_1", {"Bash", R"({"command":"ls"})"});
  json b = json::parse(resp->finish(f));
  CHECK(b["stop_reason"] == "tool_use");
  REQUIRE(b["content"].size() == 3);
  CHECK(b["content"][0]["type"] == "thinking");
  CHECK(b["content"][0]["thinking"] == "hm");
  CHECK(b["content"][1] == json{{"type", "text"}, {"text", "Running."}});
  CHECK(b["content"][2] == json{{"type", "tool_use"}, {"id", "toolu_1"}, {"name", "Bash"}, {"input", {{"command", "ls"}}}});

  r.plan->stream = true;
  resp = make_responder(*r.plan, stories().tokenizer(), "msg_1", 5);
  std::string s = resp->open();
  s += resp->reasoning("hm");
  s += resp->text("Run", {});
  s += resp->text("ning.", {});
  s += resp->tool_call("toolu_1", {"Bash", R"({"command":"ls"})"});
  s += resp->finish(f);
  std::vector<std::string> events;
  std::vector<json> data;
  for (size_t at = 0; (at = s.find("event: ", at)) != std::string::npos; at += 7) {
    events.push_back(s.substr(at + 7, s.find('\n', at) - at - 7));
    const size_t d = s.find("data: ", at) + 6;
    data.push_back(json::parse(s.substr(d, s.find("\n\n", d) - d)));
  }
  CHECK(events == std::vector<std::string>{"message_start", "content_block_start", "ping", "content_block_delta",
                                           "content_block_stop", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "content_block_start",
                                           "content_block_delta", "content_block_stop", "message_delta", "message_stop"});
  CHECK(data[1]["content_block"]["type"] == "thinking");
  CHECK(data[3]["delta"]["type"] == "thinking_delta");
  CHECK(data[5]["index"] == 1);
  CHECK(data[9]["content_block"]["type"] == "tool_use");
  CHECK(data[9]["index"] == 2);
  CHECK(data[10]["delta"] == json{{"type", "input_json_delta"}, {"partial_json", R"({"command":"ls"})"}});
  CHECK(data[12]["delta"]["stop_reason"] == "tool_use");
}

TEST_CASE("agents: the Responses API: input items, function calls round-trip, previous_response_id, the stream's events") {
  Ctx c;
  const std::string body = R"({"model":"m","instructions":"Be brief.","store":true,"prompt_cache_key":"k",
      "reasoning":{"effort":"low","summary":"auto"},"include":["reasoning.encrypted_content"],
      "tools":[{"type":"function","name":"shell","description":"Run","parameters":{"type":"object","properties":{}}},
               {"type":"web_search"}],
      "input":[{"type":"message","role":"developer","content":[{"type":"input_text","text":"dev note"}]},
               {"type":"message","role":"user","content":[{"type":"input_text","text":"list"}]},
               {"type":"reasoning","id":"rs_1","summary":[]},
               {"type":"function_call","call_id":"call_1","name":"shell","arguments":"{\"cmd\":\"ls\"}"},
               {"type":"function_call_output","call_id":"call_1","output":"a.txt"}]})";
  Route r = post(c, "/v1/responses", body);
  REQUIRE(r.plan);
  CHECK(r.plan->endpoint == Endpoint::responses);
  CHECK(r.plan->tool_calls);
  const std::string p = prompt_text(*r.plan);
  CHECK(p.find("Be brief.") != std::string::npos);
  CHECK(p.find("\"name\":\"shell\"") != std::string::npos);
  CHECK(p.find("web_search") == std::string::npos);  // built-in tools are not offered
  CHECK(p.find("<tool_response>\na.txt\n</tool_response>") != std::string::npos);
  REQUIRE(r.plan->conversation.size() == 4);  // without the instructions
  CHECK(r.plan->conversation[2]["tool_calls"][0]["function"]["arguments"] == json{{"cmd", "ls"}});

  // The answer, whole: a function_call item.
  Finish f;
  f.reason = FinishReason::tool_calls;
  f.prompt_tokens = 10;
  f.completion_tokens = 3;
  auto resp = make_responder(*r.plan, stories().tokenizer(), "resp_abc", 7);
  resp->text("Listing.", {});
  resp->tool_call("call_2", {"shell", R"({"cmd":"ls -l"})"});
  json b = json::parse(resp->finish(f));
  CHECK(b["object"] == "response");
  CHECK(b["status"] == "completed");
  CHECK(b["instructions"] == "Be brief.");
  REQUIRE(b["output"].size() == 2);
  CHECK(b["output"][0]["type"] == "message");
  CHECK(b["output"][0]["content"][0]["text"] == "Listing.");
  CHECK(b["output"][1]["type"] == "function_call");
  CHECK(b["output"][1]["call_id"] == "call_2");
  CHECK(b["output"][1]["arguments"] == R"({"cmd":"ls -l"})");
  CHECK(b["usage"]["total_tokens"] == 13);

  // Streamed: the event types in order, sequence numbers counting up.
  r.plan->stream = true;
  resp = make_responder(*r.plan, stories().tokenizer(), "resp_abc", 7);
  std::string s = resp->open();
  s += resp->reasoning("hm");
  s += resp->text("Listing.", {});
  s += resp->tool_call("call_2", {"shell", R"({"cmd":"ls -l"})"});
  s += resp->finish(f);
  std::vector<std::string> events;
  int64_t seq = 0;
  for (size_t at = 0; (at = s.find("event: ", at)) != std::string::npos; at += 7) {
    events.push_back(s.substr(at + 7, s.find('\n', at) - at - 7));
    const size_t d = s.find("data: ", at) + 6;
    json j = json::parse(s.substr(d, s.find("\n\n", d) - d));
    CHECK(j["type"] == events.back());
    CHECK(j["sequence_number"] == seq++);
  }
  CHECK(events == std::vector<std::string>{
                      "response.created", "response.in_progress", "response.output_item.added", "response.reasoning_part.added",
                      "response.reasoning_text.delta", "response.reasoning_text.done", "response.reasoning_part.done",
                      "response.output_item.done", "response.output_item.added", "response.content_part.added",
                      "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                      "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
                      "response.function_call_arguments.done", "response.output_item.done", "response.completed"});

  // previous_response_id: the stored conversation comes first; an unknown id is a 400.
  c.store.put("resp_prev", json::parse(R"([{"role":"user","content":"first question"},{"role":"assistant","content":"first answer"}])"));
  Route next = post(c, "/v1/responses", R"({"previous_response_id":"resp_prev","input":"second question"})");
  REQUIRE(next.plan);
  CHECK(next.plan->conversation.size() == 3);
  CHECK(prompt_text(*next.plan).find("first answer") != std::string::npos);
  json e = error_of(post(c, "/v1/responses", R"({"previous_response_id":"resp_gone","input":"x"})"));
  CHECK(e["error"]["param"] == "previous_response_id");
  e = error_of(post(c, "/v1/responses", R"({"input":[{"type":"item_reference","id":"x"}]})"));
  CHECK(e["error"]["param"] == "input[0].type");
}

TEST_CASE("agents: the response store keeps the most recent, up to its size") {
  ResponseStore s(2);
  s.put("a", json::array());
  s.put("b", json::array());
  s.put("c", json::array());
  CHECK_FALSE(s.get("a"));
  CHECK(s.get("b"));
  CHECK(s.get("c"));
  s.set_capacity(0);
  CHECK(s.size() == 0);
}

TEST_CASE("agents: HEAD / and GET / answer 200; count_tokens counts the prompt") {
  Ctx c;
  Route h = route(request(http::verb::head, "/"), c.get());
  REQUIRE(h.response);
  CHECK(h.response->status == 200);
  CHECK(route(request(http::verb::get, "/"), c.get()).response->status == 200);
  const std::string msgs = R"({"model":"x","messages":[{"role":"user","content":"Tell me about a cat."}]})";
  Route n = post(c, "/v1/messages/count_tokens", msgs);
  REQUIRE(n.response);
  CHECK(n.response->status == 200);
  json body = json::parse(n.response->body);
  Route full = post(c, "/v1/messages", R"({"max_tokens":5,"messages":[{"role":"user","content":"Tell me about a cat."}]})");
  REQUIRE(full.plan);
  CHECK(body["input_tokens"] == full.plan->gen.prompt.size());
  CHECK(api_of("/v1/messages/count_tokens") == Api::anthropic);
}

TEST_CASE("agents: strict tools under tool_choice auto get a lazy grammar from the call's marker on") {
  Ctx c;
  const std::string strict_weather =
      R"({"type":"function","function":{"name":"get_weather","strict":true,
          "parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"],"additionalProperties":false}}})";
  const std::string loose = R"({"type":"function","function":{"name":"note","parameters":{"type":"object"}}})";
  const std::string msgs = R"({"messages":[{"role":"user","content":"Weather in Paris?"}],)";
  Route r = post(c, "/v1/chat/completions", msgs + R"("tools":[)" + strict_weather + "," + loose + "]}");
  REQUIRE(r.plan);
  REQUIRE_FALSE(r.plan->gen.grammar.empty());
  REQUIRE(r.plan->gen.grammar_triggers.size() == 1);
  CHECK(r.plan->gen.grammar_triggers[0].text == "<tool_call>");  // Hermes: the call's own marker
  CHECK_FALSE(r.plan->gen.grammar_triggers[0].at_start);
  auto g = ds4::grammar::Grammar::parse(r.plan->gen.grammar);
  auto takes = [&](const std::string& text) {
    ds4::grammar::Matcher m(g);
    return m.accept(text) && m.can_end();
  };
  // From the marker on: a call of a known tool; the strict one's arguments fit its schema.
  CHECK(takes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"));
  CHECK(takes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
              "<tool_call>\n{\"name\": \"note\", \"arguments\": {\"anything\": [1, 2]}}\n</tool_call>"));
  CHECK_FALSE(takes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Paris\"}}\n</tool_call>"));
  CHECK_FALSE(takes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"));
  CHECK_FALSE(takes("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"));
  // One call only when parallel calls are off.
  Route one = post(c, "/v1/chat/completions", msgs + R"("parallel_tool_calls":false,"tools":[)" + strict_weather + "]}");
  REQUIRE(one.plan);
  g = ds4::grammar::Grammar::parse(one.plan->gen.grammar);
  CHECK(takes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"));
  CHECK_FALSE(takes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"
                    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"));

  // No strict tool, or a choice that is not auto: no lazy grammar (forced calls have their own).
  Route plain = post(c, "/v1/chat/completions", msgs + R"("tools":[)" + kWeatherTool + "]}");
  REQUIRE(plain.plan);
  CHECK(plain.plan->gen.grammar.empty());
  Route forced = post(c, "/v1/chat/completions", msgs + R"("tool_choice":"required","tools":[)" + strict_weather + "]}");
  REQUIRE(forced.plan);
  CHECK_FALSE(forced.plan->gen.grammar.empty());
  CHECK(forced.plan->gen.grammar_triggers.empty());
  Route none = post(c, "/v1/chat/completions", msgs + R"("tool_choice":"none","tools":[)" + strict_weather + "]}");
  REQUIRE(none.plan);
  CHECK(none.plan->gen.grammar.empty());

  // Anthropic's and the Responses API's strict are at the tool's top level.
  Route a = post(c, "/v1/messages",
                 R"({"model":"m","max_tokens":64,"messages":[{"role":"user","content":"Weather?"}],
                     "tools":[{"name":"get_weather","strict":true,"input_schema":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}]})");
  REQUIRE(a.plan);
  CHECK(a.plan->gen.grammar_triggers.size() == 1);
  Route resp = post(c, "/v1/responses",
                    R"({"input":"Weather?","tools":[{"type":"function","name":"get_weather","strict":true,
                        "parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}]})");
  REQUIRE(resp.plan);
  CHECK(resp.plan->gen.grammar_triggers.size() == 1);

  // strict must be a boolean: a 400 naming it.
  json e = error_of(post(c, "/v1/chat/completions",
                         msgs + R"("tools":[{"type":"function","function":{"name":"f","strict":"yes"}}]})"));
  CHECK(e["error"]["param"] == "tools[0].function.strict");
}

TEST_CASE("agents: each call syntax's lazy grammar starts at that syntax's marker") {
  using ds4::tools::Syntax;
  const json tools = json::parse(
      R"([{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}}}])");
  ToolChoice choice;
  const std::vector<std::string> strict = {"f"};
  struct Case {
    Syntax syntax;
    std::string call;  // a call as the family writes it, from its trigger on
  };
  const std::string ds_begin = "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>";
  for (const Case& k : std::vector<Case>{
           {Syntax::hermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 3}}\n</tool_call>"},
           {Syntax::llama3, "{\"name\": \"f\", \"parameters\": {\"n\": 3}}"},
           {Syntax::llama3, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"n\": 3}}"},
           {Syntax::mistral, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"n\": 3}}]"},
           {Syntax::deepseek, ds_begin + "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>function"
                                         "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>f\n```json\n{\"n\": 3}\n```"
                                         "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"
                                         "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"},
       }) {
    CAPTURE(ds4::tools::syntax_name(k.syntax));
    const LazyGrammar lazy = strict_calls_grammar(k.syntax, tools, choice, strict);
    REQUIRE_FALSE(lazy.triggers.empty());
    // The call starts with one of the triggers, and the grammar takes it whole.
    bool starts = false;
    for (const auto& t : lazy.triggers) starts |= k.call.rfind(t.text, 0) == 0;
    CHECK(starts);
    auto g = ds4::grammar::Grammar::parse(lazy.grammar);
    ds4::grammar::Matcher m(g);
    CHECK(m.accept(k.call));
    CHECK(m.can_end());
    // The same call with an argument of the wrong type is refused.
    std::string bad = k.call;
    bad.replace(bad.find("3"), 1, "\"3\"");
    ds4::grammar::Matcher m2(g);
    CHECK_FALSE((m2.accept(bad) && m2.can_end()));
  }
  // Llama 3's bare JSON call is recognised only as the answer's start.
  const LazyGrammar l3 = strict_calls_grammar(Syntax::llama3, tools, choice, strict);
  bool at_start_brace = false;
  for (const auto& t : l3.triggers) at_start_brace |= t.text == "{" && t.at_start;
  CHECK(at_start_brace);
}

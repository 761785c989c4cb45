// Tool calls in each family's own syntax and thoughts apart from answers,
// fed whole and byte by byte (as a stream of one-byte tokens would).
#include <doctest/doctest.h>

#include "text/reasoning.h"
#include "text/tool_calls.h"

using namespace ds4::tools;
using ds4::ChatFamily;

namespace {

// Events with neighbouring content joined (how pieces are split is free).
std::vector<Event> joined(std::vector<Event> in) {
  std::vector<Event> out;
  for (Event& e : in) {
    if (e.kind == Event::Kind::content && e.text.empty()) continue;
    if (e.kind == Event::Kind::content && !out.empty() && out.back().kind == Event::Kind::content) out.back().text += e.text;
    else out.push_back(std::move(e));
  }
  return out;
}

std::vector<Event> bytewise(Syntax s, std::string_view text) {
  Parser p(s);
  std::vector<Event> all;
  for (char c : text)
    for (Event& e : p.push(std::string_view(&c, 1))) all.push_back(std::move(e));
  for (Event& e : p.finish()) all.push_back(std::move(e));
  return joined(std::move(all));
}

Event text(std::string t) { return {Event::Kind::content, std::move(t), {}}; }
Event call(std::string name, std::string args) { return {Event::Kind::call, {}, {std::move(name), std::move(args)}}; }

void check_both(Syntax s, std::string_view input, const std::vector<Event>& want) {
  CAPTURE(input);
  CHECK(joined(parse(s, input)) == want);
  CHECK(bytewise(s, input) == want);
}

const std::string kDsCallsBegin = "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>";
const std::string kDsCallsEnd = "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>";
const std::string kDsCallBegin = "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>";
const std::string kDsCallEnd = "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>";
const std::string kDsSep = "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>";

}  // namespace

TEST_CASE("tool calls: Hermes/Qwen <tool_call> blocks, text around them kept") {
  check_both(Syntax::hermes, "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
             {text("Let me look.\n"), call("get_weather", R"({"city":"Paris"})")});
  check_both(Syntax::hermes,
             "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n<tool_call>{\"name\":\"b\",\"arguments\":\"{\\\"x\\\": 1}\"}</tool_call> done",
             {call("a", "{}"), text("\n"), call("b", R"({"x":1})"), text(" done")});
  // Not a call: given back as written.
  check_both(Syntax::hermes, "a <tool_call>not json</tool_call> b", {text("a <tool_call>not json</tool_call> b")});
  check_both(Syntax::hermes, "x < y and <tool", {text("x < y and <tool")});
  check_both(Syntax::hermes, "plain answer", {text("plain answer")});
  // Unfinished at the end: content.
  check_both(Syntax::hermes, "<tool_call>{\"name\": \"f\"", {text("<tool_call>{\"name\": \"f\"")});
}

TEST_CASE("tool calls: content before a call is sent before the call is complete") {
  Parser p(Syntax::hermes);
  auto a = p.push("Sure, ");
  REQUIRE(a.size() == 1);
  CHECK(a[0].text == "Sure, ");
  CHECK(p.push("<tool_").empty());  // could be a call: held
  CHECK(p.push("call>{\"name\": \"f\", ").empty());
  auto b = p.push("\"arguments\": {\"q\": \"</\"}}</tool_call>");
  REQUIRE(b.size() == 1);
  CHECK(b[0] == call("f", R"({"q":"</"})"));
  CHECK(p.calls() == 1);
}

TEST_CASE("tool calls: Llama 3.x JSON calls, bare or after <|python_tag|>") {
  check_both(Syntax::llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
             {call("get_weather", R"({"city":"Oslo"})")});
  check_both(Syntax::llama3, "\n\n{\"type\": \"function\", \"name\": \"f\", \"parameters\": {\"a\": [1, {\"b\": \"}\"}]}}",
             {text("\n\n"), call("f", R"({"a":[1,{"b":"}"}]})")});
  check_both(Syntax::llama3, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}", {call("f", "{}")});
  check_both(Syntax::llama3, "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 2}}",
             {call("a", "{}"), call("b", R"({"x":2})")});
  // JSON that is not a call, and JSON inside prose, are content.
  check_both(Syntax::llama3, "{\"answer\": 42}", {text("{\"answer\": 42}")});
  check_both(Syntax::llama3, "The object {\"name\": \"f\"} is shown.", {text("The object {\"name\": \"f\"} is shown.")});
}

TEST_CASE("tool calls: Mistral [TOOL_CALLS], the list and the newer name[ARGS] form") {
  check_both(Syntax::mistral, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]",
             {call("a", R"({"x":1})"), call("b", "{}")});
  check_both(Syntax::mistral, "Checking. [TOOL_CALLS]get_time[ARGS]{\"tz\": \"UTC\"}",
             {text("Checking. "), call("get_time", R"({"tz":"UTC"})")});
  check_both(Syntax::mistral, "[TOOL_CALLS]f[CALL_ID]abc123[ARGS]{}[TOOL_CALLS]g[ARGS]{\"k\": \"v\"}",
             {call("f", "{}"), call("g", R"({"k":"v"})")});
  check_both(Syntax::mistral, "[TOOL_CALLS] nonsense", {text("[TOOL_CALLS] nonsense")});
}

TEST_CASE("tool calls: DeepSeek V3 and V3.1 markers") {
  const std::string v3 = "I will check." + kDsCallsBegin + kDsCallBegin + "function" + kDsSep +
                         "get_weather\n```json\n{\"city\": \"Rome\"}\n```" + kDsCallEnd + "\n" + kDsCallBegin + "function" +
                         kDsSep + "now\n```json\n{}\n```" + kDsCallEnd + kDsCallsEnd;
  check_both(Syntax::deepseek, v3, {text("I will check."), call("get_weather", R"({"city":"Rome"})"), call("now", "{}")});
  const std::string v31 = kDsCallsBegin + kDsCallBegin + "search" + kDsSep + "{\"q\": \"ds4\"}" + kDsCallEnd + kDsCallsEnd + " ok";
  check_both(Syntax::deepseek, v31, {call("search", R"({"q":"ds4"})"), text(" ok")});
}

TEST_CASE("tool calls: the syntax is chosen from the template, else from the family") {
  CHECK(detect_syntax("{% if tools %}<tool_call>{% endif %}<|im_start|>", ChatFamily::chatml) == Syntax::hermes);
  CHECK(detect_syntax("<|start_header_id|>ipython ... <|python_tag|>", ChatFamily::llama3) == Syntax::llama3);
  CHECK(detect_syntax("[AVAILABLE_TOOLS] [TOOL_CALLS]", ChatFamily::mistral) == Syntax::mistral);
  CHECK(detect_syntax(kDsCallsBegin, ChatFamily::deepseek) == Syntax::deepseek);
  CHECK(detect_syntax("", ChatFamily::chatml) == Syntax::hermes);
  CHECK(detect_syntax("", ChatFamily::llama3) == Syntax::llama3);
}

TEST_CASE("json_extent: the end of an object or array, strings and escapes respected") {
  bool bad = false;
  CHECK(json_extent(R"(  {"a": "}\"", "b": [1]} tail)", 0, bad) == 24);
  CHECK_FALSE(bad);
  CHECK(json_extent(R"({"a": [1, 2)", 0, bad) == std::string::npos);
  CHECK_FALSE(bad);
  CHECK(json_extent(R"({"a": ]})", 0, bad) == 7);  // just past the stray bracket
  CHECK(bad);
  CHECK(json_extent("42", 0, bad) == 1);
  CHECK(bad);
}

TEST_CASE("tool calls: a malformed call is given back as text and a good call after it is still a call, whole or in pieces") {
  // Found by fuzz_answer: the whole answer gave everything after the bad
  // bracket back as text, pieces of 29 bytes found the second call.
  const std::vector<std::pair<Syntax, std::string>> answers = {
      {Syntax::mistral, R"(x [TOOL_CALLS][{"name": "f", "arguments":+}}] y [TOOL_CALLS][{"name": "g", "arguments": {}}])"},
      {Syntax::mistral, R"([TOOL_CALLS]f[ARGS]}{ then [TOOL_CALLS]g[ARGS]{"a": 1})"},
      {Syntax::llama3, R"(<|python_tag|>]oops <|python_tag|>{"name": "g", "parameters": {"a": 1}})"},
  };
  for (const auto& [syntax, answer] : answers) {
    CAPTURE(answer);
    const std::vector<Event> whole = parse(syntax, answer);
    REQUIRE(!whole.empty());
    CHECK(whole.back().kind == Event::Kind::call);
    CHECK(whole.back().call.name == "g");
    for (size_t piece : {1, 3, 29}) {
      Parser p(syntax);
      std::vector<Event> got;
      for (size_t at = 0; at < answer.size(); at += piece)
        for (Event& e : p.push(std::string_view(answer).substr(at, piece))) got.push_back(std::move(e));
      for (Event& e : p.finish()) got.push_back(std::move(e));
      std::string text_whole, text_got;
      int calls_whole = 0, calls_got = 0;
      for (const Event& e : whole) e.kind == Event::Kind::call ? void(++calls_whole) : void(text_whole += e.text);
      for (const Event& e : got) e.kind == Event::Kind::call ? void(++calls_got) : void(text_got += e.text);
      CAPTURE(piece);
      CHECK(text_got == text_whole);
      CHECK(calls_got == calls_whole);
    }
  }
}

namespace {

std::pair<std::string, std::string> split_bytewise(bool in_thought, std::string_view text) {
  ds4::reasoning::Splitter s(in_thought);
  std::string r, c;
  for (char ch : text) {
    auto o = s.push(std::string_view(&ch, 1));
    r += o.reasoning;
    c += o.content;
  }
  auto o = s.finish();
  return {r + o.reasoning, c + o.content};
}

std::pair<std::string, std::string> split_whole(bool in_thought, std::string_view text) {
  ds4::reasoning::Splitter s(in_thought);
  auto a = s.push(text);
  auto b = s.finish();
  return {a.reasoning + b.reasoning, a.content + b.content};
}

}  // namespace

TEST_CASE("reasoning: <think>…</think> apart from the answer, whole and byte by byte") {
  using P = std::pair<std::string, std::string>;
  for (auto split : {split_whole, split_bytewise}) {
    CHECK(split(false, "<think>\nLet me add.\n</think>\n\nIt is 4.") == P{"\nLet me add.\n", "It is 4."});
    CHECK(split(false, "\n<think></think>Hi") == P{"", "Hi"});
    CHECK(split(false, "No thought <think> here") == P{"", "No thought <think> here"});
    CHECK(split(true, "The prompt opened it.</think>Answer") == P{"The prompt opened it.", "Answer"});
    CHECK(split(true, "cut off mid </thi") == P{"cut off mid </thi", ""});
    CHECK(split(false, "<thin") == P{"", "<thin"});
  }
  CHECK(ds4::reasoning::prompt_opens_thought("<|Assistant|><think>\n"));
  CHECK_FALSE(ds4::reasoning::prompt_opens_thought("<think>\n\n</think>\n\n"));
  CHECK_FALSE(ds4::reasoning::prompt_opens_thought("plain"));
}

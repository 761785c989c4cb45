#include "supervisor/proxy/tool_grammar.h"

#include <algorithm>

#include "shared/error.h"
#include "text/grammar.h"

namespace ds4::proxy {


namespace {

// A rule name from a tool's name: GBNF names are letters, digits and '-'.
std::string rule_base(const std::string& name) {
  std::string r = "args-";
  for (char c : name) r += (std::isalnum(static_cast<unsigned char>(c)) ? c : '-');
  return r;
}

// DeepSeek V3's call markers (fullwidth bars, lower one-eighth blocks).
constexpr const char* kDeepseekCallsBegin = "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>";
constexpr const char* kDeepseekCallsEnd = "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>";
constexpr const char* kDeepseekCallBegin = "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>";
constexpr const char* kDeepseekCallEnd = "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>";
constexpr const char* kDeepseekSep = "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>";

// One call of the tool `name` whose arguments are the rule `args`, in `syntax`.
std::string call_rule(tools::Syntax syntax, const std::string& name, const std::string& args) {
  const std::string quoted = json(name).dump();
  switch (syntax) {
    case tools::Syntax::hermes:
      return grammar::literal("<tool_call>\n{\"name\": " + quoted + ", \"arguments\": ") + " " + args + " " +
             grammar::literal("}\n</tool_call>");
    case tools::Syntax::llama3:
      return grammar::literal("{\"name\": " + quoted + ", \"parameters\": ") + " " + args + " " + grammar::literal("}");
    case tools::Syntax::mistral:
      return grammar::literal("[TOOL_CALLS][{\"name\": " + quoted + ", \"arguments\": ") + " " + args + " " +
             grammar::literal("}]");
    case tools::Syntax::deepseek:
      return grammar::literal(std::string(kDeepseekCallsBegin) + kDeepseekCallBegin + "function" + kDeepseekSep + name +
                              "\n```json\n") +
             " " + args + " " + grammar::literal(std::string("\n```") + kDeepseekCallEnd + kDeepseekCallsEnd);
  }
  return "";
}

// The rule of `tool`'s arguments: its schema, or (`any_object`) any JSON object.
std::string args_rule(grammar::GrammarBuilder& b, const json& tool, size_t i, bool any_object) {
  const json& f = tool["function"];
  json params = any_object ? json{{"type", "object"}}
                           : (f.contains("parameters") && !f["parameters"].is_null() ? f["parameters"] : json::object());
  try {
    return b.add_schema(params, rule_base(f.value("name", std::string())) + (any_object ? "-any" : ""));
  } catch (const Error& e) {
    throw Error("'tools[" + std::to_string(i) + "].function.parameters': " + e.what());
  }
}

}  // namespace

std::string forced_call_grammar(tools::Syntax syntax, const json& tools, const ToolChoice& choice) {
  if (choice.mode != ToolChoice::Mode::required && choice.mode != ToolChoice::Mode::named) return "";
  grammar::GrammarBuilder b;
  std::string alternatives;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string name = tools[i]["function"].value("name", std::string());
    if (choice.mode == ToolChoice::Mode::named && name != choice.name) continue;
    alternatives += (alternatives.empty() ? "" : " | ") + call_rule(syntax, name, args_rule(b, tools[i], i, false));
  }
  if (alternatives.empty()) throw Error("'tool_choice' names a function that is not in 'tools'");
  b.add_rule("root", alternatives);
  return b.text();
}

LazyGrammar strict_calls_grammar(tools::Syntax syntax, const json& tools, const ToolChoice& choice,
                                 const std::vector<std::string>& strict) {
  if (choice.mode != ToolChoice::Mode::automatic || strict.empty()) return {};
  grammar::GrammarBuilder b;
  std::string alternatives;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string name = tools[i]["function"].value("name", std::string());
    const bool is_strict = std::find(strict.begin(), strict.end(), name) != strict.end();
    alternatives += (alternatives.empty() ? "" : " | ") + call_rule(syntax, name, args_rule(b, tools[i], i, !is_strict));
  }
  LazyGrammar out;
  b.add_rule("tool-call", alternatives);
  switch (syntax) {
    case tools::Syntax::hermes:  // calls one a line, as Qwen's template writes them; the end right after
      b.add_rule("root", choice.parallel ? "tool-call (\"\\n\" tool-call)*" : "tool-call");
      out.triggers = {{"<tool_call>", false}};
      break;
    case tools::Syntax::llama3:  // the whole answer, or after <|python_tag|>
      b.add_rule("root", grammar::literal("<|python_tag|>") + "? tool-call");
      out.triggers = {{"<|python_tag|>", false}, {"{", true}};
      break;
    case tools::Syntax::mistral:
      b.add_rule("root", "tool-call");
      out.triggers = {{"[TOOL_CALLS]", false}};
      break;
    case tools::Syntax::deepseek:
      b.add_rule("root", "tool-call");
      out.triggers = {{kDeepseekCallsBegin, false}};
      break;
  }
  out.grammar = b.text();
  return out;
}

std::string json_answer_grammar(const json* schema, const std::string& field) {
  grammar::GrammarBuilder b;
  try {
    const std::string value = b.add_schema(schema ? *schema : json{{"type", "object"}}, "answer");
    b.add_rule("root", value);
    return b.text();
  } catch (const Error& e) {
    throw Error("'" + field + "': " + e.what());
  }
}

}  // namespace ds4::proxy

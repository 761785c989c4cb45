#include "supervisor/proxy/tool_grammar.h"

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

}  // namespace

std::string forced_call_grammar(tools::Syntax syntax, const json& tools, const ToolChoice& choice) {
  if (choice.mode != ToolChoice::Mode::required && choice.mode != ToolChoice::Mode::named) return "";
  grammar::GrammarBuilder b;
  std::string alternatives;
  for (size_t i = 0; i < tools.size(); ++i) {
    const json& f = tools[i]["function"];
    const std::string name = f.value("name", std::string());
    if (choice.mode == ToolChoice::Mode::named && name != choice.name) continue;
    json params = f.contains("parameters") && !f["parameters"].is_null() ? f["parameters"] : json::object();
    std::string args;
    try {
      args = b.add_schema(params, rule_base(name));
    } catch (const Error& e) {
      throw Error("'tools[" + std::to_string(i) + "].function.parameters': " + e.what());
    }
    const std::string quoted = json(name).dump();
    std::string alt;
    switch (syntax) {
      case tools::Syntax::hermes:
        alt = grammar::literal("<tool_call>\n{\"name\": " + quoted + ", \"arguments\": ") + " " + args + " " +
              grammar::literal("}\n</tool_call>");
        break;
      case tools::Syntax::llama3:
        alt = grammar::literal("{\"name\": " + quoted + ", \"parameters\": ") + " " + args + " " + grammar::literal("}");
        break;
      case tools::Syntax::mistral:
        alt = grammar::literal("[TOOL_CALLS][{\"name\": " + quoted + ", \"arguments\": ") + " " + args + " " +
              grammar::literal("}]");
        break;
      case tools::Syntax::deepseek:
        alt = grammar::literal("<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c><\xef\xbd\x9ctool\xe2\x96\x81"
                               "call\xe2\x96\x81" "begin\xef\xbd\x9c>function<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>" +
                               name + "\n```json\n") +
              " " + args + " " +
              grammar::literal("\n```<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c><\xef\xbd\x9ctool\xe2\x96\x81"
                               "calls\xe2\x96\x81" "end\xef\xbd\x9c>");
        break;
    }
    alternatives += (alternatives.empty() ? "" : " | ") + alt;
  }
  if (alternatives.empty()) throw Error("'tool_choice' names a function that is not in 'tools'");
  b.add_rule("root", alternatives);
  return b.text();
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

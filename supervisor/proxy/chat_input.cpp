#include "supervisor/proxy/chat_input.h"

#include <set>

#include "shared/error.h"
#include "supervisor/proxy/json_util.h"
#include "text/tool_calls.h"

namespace ds4::proxy {

namespace {

constexpr size_t kMaxTools = 1024;
constexpr size_t kMaxToolName = 256;

std::string field(const std::string& where, const char* key) { return where.empty() ? key : where + "." + key; }
std::string index(const std::string& where, size_t i) { return where + "[" + std::to_string(i) + "]"; }

// Text of a content field: a string, or an array of text parts (OpenAI's
// text/input_text/output_text, Anthropic's text blocks) joined.
std::string content_text(const json& c, const std::string& where) {
  if (c.is_null()) return {};
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) throw Error("'" + where + "' must be a string or an array of text parts");
  std::string out;
  size_t i = 0;
  for (const json& part : c) {
    const std::string at = index(where, i++);
    if (part.is_string()) {
      out += part.get<std::string>();
      continue;
    }
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      throw Error("'" + at + "' must be an object with a 'type'");
    const std::string type = part["type"];
    if (type != "text" && type != "input_text" && type != "output_text")
      throw Error("'" + at + ".type' is '" + type + "'; only text is supported");
    auto t = opt_string(part, "text");
    if (!t) throw Error("'" + at + ".text' is required");
    out += *t;
  }
  return out;
}

const json& required(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) throw Error("'" + field(where, key) + "' is required");
  return *it;
}

std::string required_string(const json& obj, const char* key, const std::string& where) {
  const json& v = required(obj, key, where);
  if (!v.is_string() || v.get_ref<const std::string&>().empty())
    throw Error("'" + field(where, key) + "' must be a non-empty string");
  return v.get<std::string>();
}

// A call's arguments as an object: JSON text (OpenAI) or an object.
json arguments_object(const json& a, const std::string& where) {
  if (a.is_object()) return a;
  if (a.is_string()) {
    json j = json::parse(a.get_ref<const std::string&>(), nullptr, false);
    if (!j.is_discarded() && j.is_object()) return j;
    if (a.get_ref<const std::string&>().empty()) return json::object();
  }
  throw Error("'" + where + "' must be a JSON object (or its text)");
}

json tool_call(std::string id, std::string name, json arguments) {
  return {{"id", std::move(id)}, {"type", "function"}, {"function", {{"name", std::move(name)}, {"arguments", std::move(arguments)}}}};
}

std::string tool_name(const json& obj, const char* key, const std::string& where) {
  std::string name = required_string(obj, key, where);
  if (name.size() > kMaxToolName) throw Error("'" + field(where, key) + "' is longer than " + std::to_string(kMaxToolName) + " bytes");
  return name;
}

json function_tool(std::string name, const json* description, const json* parameters, const std::string& where,
                   const char* params_key) {
  json f = {{"name", std::move(name)}};
  if (description && !description->is_null()) {
    if (!description->is_string()) throw Error("'" + field(where, "description") + "' must be a string");
    f["description"] = *description;
  }
  if (parameters && !parameters->is_null()) {
    if (!parameters->is_object()) throw Error("'" + field(where, params_key) + "' must be a JSON Schema object");
    f["parameters"] = *parameters;
  } else {
    f["parameters"] = {{"type", "object"}, {"properties", json::object()}};
  }
  return {{"type", "function"}, {"function", std::move(f)}};
}

const json* find(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

// The tools array, each turned into the chat shape by `one`; names unique.
// `strict`, when given, gets the names of the tools marked strict: true
// (OpenAI chat's function.strict, Responses' and Anthropic's strict).
template <class F>
json tools_of(const json& body, F one, std::vector<std::string>* strict = nullptr) {
  json out = json::array();
  const json* t = find(body, "tools");
  if (!t) return out;
  if (!t->is_array()) throw Error("'tools' must be an array");
  if (t->size() > kMaxTools) throw Error("'tools' has " + std::to_string(t->size()) + " tools, more than " + std::to_string(kMaxTools));
  std::set<std::string> names;
  for (size_t i = 0; i < t->size(); ++i) {
    const std::string where = index("tools", i);
    if (!(*t)[i].is_object()) throw Error("'" + where + "' must be an object");
    json tool = one((*t)[i], where);
    if (tool.is_null()) continue;  // a tool the server has no use for
    if (!names.insert(tool["function"]["name"].get<std::string>()).second)
      throw Error("'" + where + "' repeats the name '" + tool["function"]["name"].get<std::string>() + "'");
    if (strict) {
      const json& given = (*t)[i];
      const json* f = find(given, "function");
      const bool nested = f && f->is_object() && f->contains("strict");
      if (const json* s = nested ? find(*f, "strict") : find(given, "strict")) {
        if (!s->is_boolean()) throw Error("'" + where + (nested ? ".function" : "") + ".strict' must be true or false");
        if (s->get<bool>()) strict->push_back(tool["function"]["name"]);
      }
    }
    out.push_back(std::move(tool));
  }
  return out;
}

bool has_tool(const json& tools, const std::string& name) {
  for (const json& t : tools)
    if (t["function"]["name"] == name) return true;
  return false;
}

// OpenAI's (and Responses') tool_choice and parallel_tool_calls.
ToolChoice openai_choice(const json& body, const json& tools, bool responses) {
  ToolChoice c;
  if (auto p = opt_bool(body, "parallel_tool_calls")) c.parallel = *p;
  const json* t = find(body, "tool_choice");
  if (!t) return c;
  const char* expected = responses ? "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}"
                                   : "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}";
  if (t->is_string()) {
    const std::string& s = t->get_ref<const std::string&>();
    if (s == "none") c.mode = ToolChoice::Mode::none;
    else if (s == "auto") c.mode = ToolChoice::Mode::automatic;
    else if (s == "required") c.mode = ToolChoice::Mode::required;
    else throw Error(std::string(expected) + ", not '" + s + "'");
  } else if (t->is_object() && t->value("type", json()) == "function") {
    const json* f = find(*t, "function");
    const std::string where = f ? "tool_choice.function" : "tool_choice";
    if (f && !f->is_object()) throw Error("'tool_choice.function' must be an object");
    c.mode = ToolChoice::Mode::named;
    c.name = required_string(f ? *f : *t, "name", where);
    if (!has_tool(tools, c.name)) throw Error("'" + where + ".name' is '" + c.name + "', which is not among 'tools'");
  } else {
    throw Error(expected);
  }
  if (c.mode == ToolChoice::Mode::required && tools.empty()) throw Error("'tool_choice' is 'required' but 'tools' is empty");
  return c;
}

json openai_tools(const json& body, std::vector<std::string>* strict) {
  return tools_of(body, [](const json& t, const std::string& where) {
    const std::string type = t.value("type", std::string("function"));
    if (type != "function") throw Error("'" + where + ".type' is '" + type + "': only function tools are served");
    const json& f = required(t, "function", where);
    const std::string fw = where + ".function";
    if (!f.is_object()) throw Error("'" + fw + "' must be an object");
    return function_tool(tool_name(f, "name", fw), find(f, "description"), find(f, "parameters"), fw, "parameters");
  }, strict);
}

// The name of the call `id` among the messages so far (tool results may omit it).
std::string name_of_call(const json& messages, const std::string& id) {
  for (auto m = messages.rbegin(); m != messages.rend(); ++m)
    if (auto calls = m->find("tool_calls"); calls != m->end())
      for (const json& c : *calls)
        if (c["id"] == id) return c["function"]["name"];
  return {};
}

json tool_message(const json& messages, std::string id, std::string content, std::string name) {
  if (name.empty()) name = name_of_call(messages, id);
  json m = {{"role", "tool"}, {"tool_call_id", std::move(id)}, {"content", std::move(content)}};
  if (!name.empty()) m["name"] = std::move(name);
  return m;
}

json kwargs_of(const json& body) {
  const json* k = find(body, "chat_template_kwargs");
  if (!k) return json::object();
  if (!k->is_object()) throw Error("'chat_template_kwargs' must be an object");
  return *k;
}

void need_messages(const json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || !it->is_array()) throw Error(std::string("'") + key + "' must be an array of messages");
  if (it->empty()) throw Error(std::string("'") + key + "' must not be empty");
}

}  // namespace

ChatInput openai_chat_input(const json& body, ToolChoice& choice) {
  need_messages(body, "messages");
  ChatInput in;
  in.tools = openai_tools(body, &in.strict);
  choice = openai_choice(body, in.tools, false);
  in.kwargs = kwargs_of(body);
  size_t i = 0;
  for (const json& m : body["messages"]) {
    const std::string where = index("messages", i++);
    if (!m.is_object()) throw Error("'" + where + "' must be an object");
    auto role = opt_string(m, "role");
    if (!role) throw Error("'" + where + ".role' is required");
    const json* content = find(m, "content");
    const std::string text = content ? content_text(*content, where + ".content") : std::string();
    if (*role == "system" || *role == "developer" || *role == "user") {
      in.messages.push_back({{"role", *role == "user" ? "user" : "system"}, {"content", text}});
    } else if (*role == "assistant") {
      json a = {{"role", "assistant"}, {"content", text}};
      if (auto r = opt_string(m, "reasoning_content")) a["reasoning_content"] = *r;
      json calls = json::array();
      if (const json* tc = find(m, "tool_calls")) {
        if (!tc->is_array()) throw Error("'" + where + ".tool_calls' must be an array");
        for (size_t k = 0; k < tc->size(); ++k) {
          const std::string cw = index(where + ".tool_calls", k);
          const json& c = (*tc)[k];
          if (!c.is_object()) throw Error("'" + cw + "' must be an object");
          const json& f = required(c, "function", cw);
          if (!f.is_object()) throw Error("'" + cw + ".function' must be an object");
          std::string id = opt_string(c, "id").value_or("call_" + std::to_string(i) + "_" + std::to_string(k));
          const json* args = find(f, "arguments");
          calls.push_back(tool_call(std::move(id), tool_name(f, "name", cw + ".function"),
                                    args ? arguments_object(*args, cw + ".function.arguments") : json::object()));
        }
      } else if (const json* fc = find(m, "function_call")) {  // the legacy single call
        if (!fc->is_object()) throw Error("'" + where + ".function_call' must be an object");
        const json* args = find(*fc, "arguments");
        calls.push_back(tool_call("call_" + std::to_string(i), tool_name(*fc, "name", where + ".function_call"),
                                  args ? arguments_object(*args, where + ".function_call.arguments") : json::object()));
      }
      if (!calls.empty()) a["tool_calls"] = std::move(calls);
      in.messages.push_back(std::move(a));
    } else if (*role == "tool") {
      std::string id = opt_string(m, "tool_call_id").value_or("");
      in.messages.push_back(tool_message(in.messages, std::move(id), text, opt_string(m, "name").value_or("")));
    } else if (*role == "function") {
      in.messages.push_back(tool_message(in.messages, "", text, tool_name(m, "name", where)));
    } else {
      throw Error("'" + where + ".role' is '" + *role + "', not a role this endpoint accepts");
    }
  }
  return in;
}

ChatInput anthropic_input(const json& body, ToolChoice& choice) {
  need_messages(body, "messages");
  ChatInput in;
  in.tools = tools_of(body, [](const json& t, const std::string& where) {
    // Client tools: {name, description, input_schema}; Anthropic's own typed
    // tools (bash_…, text_editor_…) are client tools with a name too.
    return function_tool(tool_name(t, "name", where), find(t, "description"), find(t, "input_schema"), where, "input_schema");
  }, &in.strict);
  if (const json* t = find(body, "tool_choice")) {
    const char* expected = "'tool_choice' must be an object with 'type' auto, any, tool or none";
    if (!t->is_object() || !t->contains("type") || !(*t)["type"].is_string()) throw Error(expected);
    const std::string type = (*t)["type"];
    if (type == "auto") choice.mode = ToolChoice::Mode::automatic;
    else if (type == "any") choice.mode = ToolChoice::Mode::required;
    else if (type == "none") choice.mode = ToolChoice::Mode::none;
    else if (type == "tool") {
      choice.mode = ToolChoice::Mode::named;
      choice.name = required_string(*t, "name", "tool_choice");
      if (!has_tool(in.tools, choice.name))
        throw Error("'tool_choice.name' is '" + choice.name + "', which is not among 'tools'");
    } else {
      throw Error(std::string(expected) + ", not '" + type + "'");
    }
    if (auto d = opt_bool(*t, "disable_parallel_tool_use")) choice.parallel = !*d;
    if (choice.mode == ToolChoice::Mode::required && in.tools.empty())
      throw Error("'tool_choice' is 'any' but 'tools' is empty");
  }
  if (const json* s = find(body, "system")) in.messages.push_back({{"role", "system"}, {"content", content_text(*s, "system")}});
  size_t i = 0;
  for (const json& m : body["messages"]) {
    const std::string where = index("messages", i++);
    if (!m.is_object()) throw Error("'" + where + "' must be an object");
    auto role = opt_string(m, "role");
    if (!role) throw Error("'" + where + ".role' is required");
    if (*role != "user" && *role != "assistant" && *role != "system")
      throw Error("'" + where + ".role' is '" + *role + "', not a role this endpoint accepts");
    const json* content = find(m, "content");
    if (!content || content->is_string() || *role == "system") {
      in.messages.push_back({{"role", *role}, {"content", content ? content_text(*content, where + ".content") : ""}});
      continue;
    }
    if (!content->is_array()) throw Error("'" + where + ".content' must be a string or an array of content blocks");
    std::string text;
    json calls = json::array();
    for (size_t k = 0; k < content->size(); ++k) {
      const std::string bw = index(where + ".content", k);
      const json& b = (*content)[k];
      if (!b.is_object() || !b.contains("type") || !b["type"].is_string())
        throw Error("'" + bw + "' must be an object with a 'type'");
      const std::string type = b["type"];
      if (type == "text") {
        text += required_string(b, "text", bw);
      } else if (type == "thinking" || type == "redacted_thinking") {
        // a thought of an earlier turn: templates drop them
      } else if (type == "tool_use" && *role == "assistant") {
        const json* input = find(b, "input");
        calls.push_back(tool_call(required_string(b, "id", bw), tool_name(b, "name", bw),
                                  input ? arguments_object(*input, bw + ".input") : json::object()));
      } else if (type == "tool_result" && *role == "user") {
        const json* c = find(b, "content");
        std::string result = c ? content_text(*c, bw + ".content") : std::string();
        if (opt_bool(b, "is_error").value_or(false)) result = "Error: " + result;
        in.messages.push_back(tool_message(in.messages, required_string(b, "tool_use_id", bw), std::move(result), ""));
      } else {
        throw Error("'" + bw + ".type' is '" + type + "'; this server takes text, tool_use and tool_result blocks");
      }
    }
    if (*role == "assistant") {
      json a = {{"role", "assistant"}, {"content", text}};
      if (!calls.empty()) a["tool_calls"] = std::move(calls);
      in.messages.push_back(std::move(a));
    } else if (!text.empty() || in.messages.empty() || in.messages.back()["role"] != "tool") {
      in.messages.push_back({{"role", "user"}, {"content", text}});
    }
  }
  return in;
}

ChatInput responses_input(const json& body, const json* previous, ToolChoice& choice) {
  ChatInput in;
  in.tools = tools_of(body, [](const json& t, const std::string& where) -> json {
    const std::string type = t.value("type", std::string("function"));
    if (type != "function") return nullptr;  // built-in tools (web_search, …) run nowhere here: the model is not offered them
    return function_tool(tool_name(t, "name", where), find(t, "description"), find(t, "parameters"), where, "parameters");
  }, &in.strict);
  choice = openai_choice(body, in.tools, true);
  in.kwargs = kwargs_of(body);
  if (auto s = opt_string(body, "instructions")) in.messages.push_back({{"role", "system"}, {"content", *s}});
  if (previous)
    for (const json& m : *previous) in.messages.push_back(m);
  const json* input = find(body, "input");
  if (!input) throw Error("'input' is required");
  if (input->is_string()) {
    in.messages.push_back({{"role", "user"}, {"content", *input}});
    return in;
  }
  if (!input->is_array()) throw Error("'input' must be a string or an array of items");
  size_t i = 0;
  for (const json& item : *input) {
    const std::string where = index("input", i++);
    if (!item.is_object()) throw Error("'" + where + "' must be an object");
    const std::string type = item.value("type", std::string("message"));
    if (type == "message") {
      auto role = opt_string(item, "role");
      if (!role) throw Error("'" + where + ".role' is required");
      if (*role != "user" && *role != "assistant" && *role != "system" && *role != "developer")
        throw Error("'" + where + ".role' is '" + *role + "', not a role this endpoint accepts");
      const json* c = find(item, "content");
      in.messages.push_back({{"role", *role == "developer" ? "system" : *role},
                             {"content", c ? content_text(*c, where + ".content") : ""}});
    } else if (type == "function_call" || type == "custom_tool_call") {
      const bool custom = type == "custom_tool_call";
      const json* args = find(item, custom ? "input" : "arguments");
      json arguments = custom ? json{{"input", args ? *args : json("")}}
                              : (args ? arguments_object(*args, where + ".arguments") : json::object());
      json call = tool_call(required_string(item, "call_id", where), tool_name(item, "name", where), std::move(arguments));
      if (in.messages.empty() || in.messages.back()["role"] != "assistant")
        in.messages.push_back({{"role", "assistant"}, {"content", ""}});
      json& last = in.messages.back();
      if (!last.contains("tool_calls")) last["tool_calls"] = json::array();
      last["tool_calls"].push_back(std::move(call));
    } else if (type == "function_call_output" || type == "custom_tool_call_output") {
      const json& out = required(item, "output", where);
      in.messages.push_back(tool_message(in.messages, required_string(item, "call_id", where),
                                         content_text(out, where + ".output"), ""));
    } else if (type == "reasoning") {
      // an earlier turn's thought: templates drop them
    } else {
      throw Error("'" + where + ".type' is '" + type + "'; this server takes message, function_call, function_call_output and reasoning items");
    }
  }
  if (in.messages.empty()) throw Error("'input' must not be empty");
  return in;
}

std::optional<bool> thinking_asked(const json& body, bool anthropic) {
  if (const json* k = find(body, "chat_template_kwargs"); k && k->is_object())
    if (auto e = opt_bool(*k, "enable_thinking")) return e;
  auto effort = [](const json& v, const std::string& where) -> bool {
    if (!v.is_string()) throw Error("'" + where + "' must be a string");
    const std::string& s = v.get_ref<const std::string&>();
    if (s == "none" || s == "minimal") return false;
    if (s == "low" || s == "medium" || s == "high" || s == "max" || s == "xhigh") return true;
    throw Error("'" + where + "' is '" + s + "'; expected none, minimal, low, medium, high or max");
  };
  if (const json* e = find(body, "reasoning_effort")) return effort(*e, "reasoning_effort");
  if (const json* r = find(body, "reasoning")) {
    if (!r->is_object()) throw Error("'reasoning' must be an object");
    if (const json* e = find(*r, "effort")) return effort(*e, "reasoning.effort");
  }
  if (const json* t = find(body, "thinking")) {  // Anthropic's; DeepSeek's on OpenAI chat
    if (!t->is_object() || !t->contains("type") || !(*t)["type"].is_string())
      throw Error("'thinking' must be an object with a 'type'");
    const std::string type = (*t)["type"];
    if (type == "disabled") return false;
    if (type == "enabled" || type == "adaptive") return true;
    throw Error("'thinking.type' is '" + type + "'; expected enabled, adaptive or disabled");
  }
  (void)anthropic;
  return std::nullopt;
}

// ---- the prompt ----

namespace {

std::string tools_text(const json& tools) {
  std::string s;
  for (const json& t : tools) s += "\n" + dump(t);
  return s;
}

// What the fallback formats tell the model about its tools, in its syntax.
std::string tools_instructions(tools::Syntax syntax, const json& tools) {
  switch (syntax) {
    case tools::Syntax::hermes:
      return "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
             "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" +
             tools_text(tools) +
             "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
             "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
    case tools::Syntax::llama3:
      return "You have access to the following functions. To call a function, respond only with a JSON object of the form "
             "{\"name\": function name, \"parameters\": dictionary of argument name and its value}." +
             tools_text(tools);
    case tools::Syntax::mistral:
      return "You have access to the following tools:" + tools_text(tools) +
             "\n\nTo call tools, write [TOOL_CALLS] followed by a JSON list: [{\"name\": ..., \"arguments\": {...}}].";
    case tools::Syntax::deepseek:
      return "## Tools\nYou have access to the following tools:" + tools_text(tools) +
             "\n\nTo call a tool, write <\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c><\xef\xbd\x9ctool\xe2\x96\x81"
             "call\xe2\x96\x81" "begin\xef\xbd\x9c>function<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>NAME\n```json\nARGUMENTS\n```"
             "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c><\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81"
             "end\xef\xbd\x9c>";
  }
  return {};
}

// `v` with every string escaped for the tokenizer (Tokenizer::escape_special),
// roles and keys left as they are.
json escaped(const Tokenizer& tok, const json& v, std::string_view key = {}) {
  if (v.is_string()) return key == "role" ? v : json(tok.escape_special(v.get_ref<const std::string&>()));
  if (v.is_array()) {
    json out = json::array();
    for (const json& e : v) out.push_back(escaped(tok, e));
    return out;
  }
  if (v.is_object()) {
    json out = json::object();
    for (const auto& [k, e] : v.items()) out[k] = escaped(tok, e, k);
    return out;
  }
  return v;
}

// An assistant's calls as the model writes them.
std::string calls_text(tools::Syntax syntax, const json& calls) {
  std::string s;
  switch (syntax) {
    case tools::Syntax::hermes:
      for (const json& c : calls)
        s += "\n<tool_call>\n" + dump({{"name", c["function"]["name"]}, {"arguments", c["function"]["arguments"]}}) + "\n</tool_call>";
      return s;
    case tools::Syntax::llama3:
      for (const json& c : calls)
        s += (s.empty() ? "" : "; ") + dump({{"name", c["function"]["name"]}, {"parameters", c["function"]["arguments"]}});
      return s;
    case tools::Syntax::mistral: {
      json list = json::array();
      for (const json& c : calls) list.push_back({{"name", c["function"]["name"]}, {"arguments", c["function"]["arguments"]}});
      return "[TOOL_CALLS]" + dump(list);
    }
    case tools::Syntax::deepseek:
      s = "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>";
      for (const json& c : calls)
        s += "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>function<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>" +
             c["function"]["name"].get<std::string>() + "\n```json\n" + dump(c["function"]["arguments"]) + "\n```" +
             "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>";
      return s + "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>";
  }
  return s;
}

// The fallback formats' messages: tools described in the system text, calls
// written in the model's syntax, results as the family's tool turn.
std::vector<ChatMessage> fallback_messages(const ModelText& model, const ChatInput& in) {
  const tools::Syntax syntax = model.tool_syntax();
  std::vector<ChatMessage> out;
  for (const json& m : in.messages) {
    const std::string role = m["role"];
    std::string content = m.value("content", std::string());
    if (role == "assistant" && m.contains("tool_calls")) {
      std::string calls = calls_text(syntax, m["tool_calls"]);
      if (content.empty() && !calls.empty() && calls[0] == '\n') calls.erase(0, 1);
      content += calls;
    }
    if (role != "tool") {
      out.push_back({role, std::move(content)});
      continue;
    }
    if (syntax == tools::Syntax::llama3) {
      out.push_back({"ipython", std::move(content)});
    } else if (syntax == tools::Syntax::hermes) {
      std::string r = "<tool_response>\n" + content + "\n</tool_response>";
      if (!out.empty() && out.back().role == "user" && out.back().content.starts_with("<tool_response>"))
        out.back().content += "\n" + r;  // consecutive results share one turn, as Qwen's template has it
      else
        out.push_back({"user", std::move(r)});
    } else {
      out.push_back({"user", "Result of " + m.value("name", std::string("the tool")) + ":\n" + content});
    }
  }
  if (!in.tools.empty()) {
    std::string text = tools_instructions(syntax, in.tools);
    if (!out.empty() && out.front().role == "system") out.front().content += "\n\n" + text;
    else out.insert(out.begin(), {"system", std::move(text)});
  }
  return out;
}

}  // namespace

std::string render_prompt(const ModelText& model, const ChatInput& in) {
  const jinja::Template* t = model.jinja_template();
  if (!t) return render_chat(model.family(), fallback_messages(model, in));
  // A control token's text in what the client wrote stays text: only the
  // template's own markers become those tokens (ModelText::encode).
  ChatTemplateInput ti;
  ti.messages = escaped(model.tokenizer(), in.messages);
  if (!in.tools.empty()) ti.tools = escaped(model.tokenizer(), in.tools);
  ti.kwargs = in.kwargs;
  ti.add_generation_prompt = true;
  ti.bos_token = model.bos_text();
  ti.eos_token = model.eos_text();
  try {
    return apply_chat_template(*t, ti);
  } catch (const Error& e) {
    throw Error(std::string("the model's chat template: ") + e.what());
  }
}

}  // namespace ds4::proxy

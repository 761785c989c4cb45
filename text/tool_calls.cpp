#include "text/tool_calls.h"

#include <algorithm>
#include <optional>

#include <nlohmann/json.hpp>

namespace ds4::tools {

using json = nlohmann::ordered_json;  // the model's arguments keep its key order

namespace {

constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";
constexpr std::string_view kMistralCalls = "[TOOL_CALLS]";
constexpr std::string_view kMistralArgs = "[ARGS]";
constexpr std::string_view kMistralCallId = "[CALL_ID]";
// DeepSeek's markers: fullwidth bars (U+FF5C) and U+2581 for the spaces.
constexpr std::string_view kDsCallsBegin = "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>";
constexpr std::string_view kDsCallsEnd = "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>";
constexpr std::string_view kDsCallBegin = "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>";
constexpr std::string_view kDsCallEnd = "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>";
constexpr std::string_view kDsSep = "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>";

constexpr size_t kMaxMistralName = 256;  // [TOOL_CALLS]name[ARGS]: a longer name is not a call

bool blank(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && blank(s.back())) s.remove_suffix(1);
  return s;
}

// The start markers of a syntax in text outside calls.
std::vector<std::string_view> openers(Syntax s) {
  switch (s) {
    case Syntax::hermes: return {kHermesOpen};
    case Syntax::llama3: return {kPythonTag};
    case Syntax::mistral: return {kMistralCalls};
    case Syntax::deepseek: return {kDsCallsBegin, kDsCallBegin};
  }
  return {};
}

// The longest tail of `s` that is a proper prefix of one of `words`.
size_t partial_tail(std::string_view s, const std::vector<std::string_view>& words) {
  size_t hold = 0;
  for (std::string_view w : words)
    for (size_t k = std::min(w.size() - 1, s.size()); k > hold; --k)
      if (s.substr(s.size() - k) == w.substr(0, k)) {
        hold = k;
        break;
      }
  return hold;
}

std::optional<json> parse_json(std::string_view s) {
  json j = json::parse(s, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// Arguments as JSON text: an object as it is; a string holding JSON (some
// models write them so) as that JSON; nothing as {}.
std::optional<std::string> arguments_text(const json* args) {
  if (!args || args->is_null()) return "{}";
  if (args->is_object()) return args->dump();
  if (args->is_string()) {
    auto inner = parse_json(args->get_ref<const std::string&>());
    if (inner && inner->is_object()) return inner->dump();
  }
  return std::nullopt;
}

// {"name": ..., "arguments"|"parameters": {...}} as a call.
std::optional<ToolCall> call_of(const json& j) {
  if (!j.is_object()) return std::nullopt;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return std::nullopt;
  const json* args = nullptr;
  for (const char* key : {"arguments", "parameters"})
    if (auto it = j.find(key); it != j.end()) args = &*it;
  auto text = arguments_text(args);
  if (!text) return std::nullopt;
  return ToolCall{name->get<std::string>(), std::move(*text)};
}

}  // namespace

const char* syntax_name(Syntax s) {
  switch (s) {
    case Syntax::hermes: return "hermes";
    case Syntax::llama3: return "llama3";
    case Syntax::mistral: return "mistral";
    case Syntax::deepseek: return "deepseek";
  }
  return "hermes";
}

Syntax detect_syntax(std::string_view t, ChatFamily family) {
  auto has = [&](std::string_view s) { return t.find(s) != std::string_view::npos; };
  if (has(kDsCallsBegin) || has(kDsCallBegin)) return Syntax::deepseek;
  if (has(kHermesOpen)) return Syntax::hermes;
  if (has(kMistralCalls)) return Syntax::mistral;
  if (has(kPythonTag) || (has("<|start_header_id|>") && has("parameters"))) return Syntax::llama3;
  switch (family) {
    case ChatFamily::llama3: return Syntax::llama3;
    case ChatFamily::mistral: return Syntax::mistral;
    case ChatFamily::deepseek: return Syntax::deepseek;
    case ChatFamily::chatml:
    case ChatFamily::llama2: return Syntax::hermes;
  }
  return Syntax::hermes;
}

std::vector<std::string_view> markers(Syntax s) {
  switch (s) {
    case Syntax::hermes: return {kHermesOpen, kHermesClose};
    case Syntax::llama3: return {kPythonTag};
    case Syntax::mistral: return {kMistralCalls, kMistralArgs, kMistralCallId};
    case Syntax::deepseek: return {kDsCallsBegin, kDsCallsEnd, kDsCallBegin, kDsCallEnd, kDsSep};
  }
  return {};
}

size_t json_extent(std::string_view s, size_t from, bool& bad) {
  bad = false;
  size_t i = from;
  while (i < s.size() && blank(s[i])) ++i;
  if (i == s.size()) return std::string_view::npos;
  if (s[i] != '{' && s[i] != '[') {
    bad = true;
    return i + 1;
  }
  std::string stack;
  bool in_string = false, escaped = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '{') stack += '}';
    else if (c == '[') stack += ']';
    else if (c == '}' || c == ']') {
      if (stack.empty() || stack.back() != c) {
        bad = true;
        return i + 1;
      }
      stack.pop_back();
      if (stack.empty()) return i + 1;
    }
  }
  return std::string_view::npos;
}

void Parser::content(std::vector<Event>& out, std::string_view s) {
  if (s.empty()) return;
  if (!trim(s).empty()) answer_start_ = false;
  if (!out.empty() && out.back().kind == Event::Kind::content) out.back().text += s;
  else out.push_back({Event::Kind::content, std::string(s), {}});
}

void Parser::call(std::vector<Event>& out, ToolCall c) {
  ++calls_;
  out.push_back({Event::Kind::call, {}, std::move(c)});
}

std::vector<Event> Parser::push(std::string_view text) {
  buf_ += text;
  std::vector<Event> out;
  scan(out, false);
  return out;
}

std::vector<Event> Parser::finish() {
  std::vector<Event> out;
  scan(out, true);
  if (state_ == State::call) buf_.insert(0, opener_);  // an unfinished call: given back as it was written
  if (!buf_.empty()) content(out, buf_);
  buf_.clear();
  state_ = State::text;
  return out;
}

void Parser::scan(std::vector<Event>& out, bool at_end) {
  for (;;) {
    const bool more = state_ == State::text ? scan_text(out, at_end) : scan_call(out, at_end);
    if (!more) return;
  }
}

// Outside a call: content up to the next opener. Returns true when a call began.
bool Parser::scan_text(std::vector<Event>& out, bool at_end) {
  if (syntax_ == Syntax::llama3 && answer_start_) {
    size_t i = 0;
    while (i < buf_.size() && (blank(buf_[i]) || (calls_ > 0 && buf_[i] == ';'))) ++i;
    if (i == buf_.size() && !at_end) return false;  // only blanks yet: what follows decides
    if (i < buf_.size() && buf_[i] == '{') {
      if (calls_ == 0) content(out, std::string_view(buf_).substr(0, i));
      buf_.erase(0, i);
      opener_.clear();
      bare_ = true;
      state_ = State::call;
      return true;
    }
  }
  const auto words = openers(syntax_);
  size_t at = std::string::npos;
  std::string_view word;
  for (std::string_view w : words)
    if (size_t f = buf_.find(w); f < at) at = f, word = w;
  if (at != std::string::npos) {
    content(out, std::string_view(buf_).substr(0, at));
    const size_t kept = word == kDsCallBegin ? 0 : word.size();  // DeepSeek's single call marker stays
    opener_ = std::string(word.substr(0, kept));
    buf_.erase(0, at + kept);
    bare_ = false;
    state_ = State::call;
    return true;
  }
  const size_t hold = at_end ? 0 : partial_tail(buf_, words);
  content(out, std::string_view(buf_).substr(0, buf_.size() - hold));
  buf_.erase(0, buf_.size() - hold);
  return false;
}

// Inside a call (its opener consumed). Returns true when the call ended
// (recognised or given back as content) and scanning goes on.
bool Parser::scan_call(std::vector<Event>& out, bool at_end) {
  auto give_back = [&](std::string_view opener, size_t n) {
    state_ = State::text;
    std::string raw = std::string(opener) + buf_.substr(0, n);
    buf_.erase(0, n);
    content(out, raw);
    return true;
  };
  switch (syntax_) {
    case Syntax::hermes: {
      const size_t end = buf_.find(kHermesClose);
      if (end == std::string::npos) return false;
      auto j = parse_json(trim(std::string_view(buf_).substr(0, end)));
      std::optional<ToolCall> c = j ? call_of(*j) : std::nullopt;
      if (!c) return give_back(kHermesOpen, end + kHermesClose.size());
      buf_.erase(0, end + kHermesClose.size());
      call(out, std::move(*c));
      state_ = State::text;
      return true;
    }
    case Syntax::llama3: {
      bool bad = false;
      const size_t end = json_extent(buf_, 0, bad);
      const std::string_view opener = bare_ ? "" : kPythonTag;
      if (bad) return answer_start_ = false, give_back(opener, end);
      if (end == std::string::npos) return false;
      auto j = parse_json(std::string_view(buf_).substr(0, end));
      std::optional<ToolCall> c = j ? call_of(*j) : std::nullopt;
      if (!c) return answer_start_ = false, give_back(opener, end);
      buf_.erase(0, end);
      call(out, std::move(*c));
      answer_start_ = true;  // another call may follow (";" or blanks between)
      state_ = State::text;
      return true;
    }
    case Syntax::mistral: {
      size_t i = 0;
      while (i < buf_.size() && blank(buf_[i])) ++i;
      if (i == buf_.size()) return false;
      if (buf_[i] == '[') {  // [TOOL_CALLS][{...}, ...]
        bool bad = false;
        const size_t end = json_extent(buf_, i, bad);
        if (bad) return give_back(kMistralCalls, end);
        if (end == std::string::npos) return false;
        auto j = parse_json(std::string_view(buf_).substr(i, end - i));
        std::vector<ToolCall> calls;
        if (j && j->is_array())
          for (const json& e : *j)
            if (auto c = call_of(e)) calls.push_back(std::move(*c));
        if (!j || !j->is_array() || calls.size() != j->size() || calls.empty()) return give_back(kMistralCalls, end);
        buf_.erase(0, end);
        for (ToolCall& c : calls) call(out, std::move(c));
        state_ = State::text;
        return true;
      }
      // [TOOL_CALLS]name[CALL_ID]id[ARGS]{...} (the call id is optional)
      const size_t args = buf_.find(kMistralArgs);
      if (args == std::string::npos) {
        if (buf_.size() > kMaxMistralName + kMistralArgs.size()) return give_back(kMistralCalls, buf_.size());
        return false;
      }
      std::string_view name = std::string_view(buf_).substr(0, args);
      if (size_t id = name.find(kMistralCallId); id != std::string_view::npos) name = name.substr(0, id);
      name = trim(name);
      bool bad = false;
      const size_t end = json_extent(buf_, args + kMistralArgs.size(), bad);
      if (bad || name.empty() || name.size() > kMaxMistralName) return give_back(kMistralCalls, bad ? end : args);
      if (end == std::string::npos) return false;
      auto j = parse_json(std::string_view(buf_).substr(args + kMistralArgs.size(), end - args - kMistralArgs.size()));
      if (!j || !j->is_object()) return give_back(kMistralCalls, end);
      ToolCall c{std::string(name), j->dump()};
      buf_.erase(0, end);
      call(out, std::move(c));
      state_ = State::text;
      return true;
    }
    case Syntax::deepseek: {
      for (;;) {
        size_t i = 0;
        while (i < buf_.size() && blank(buf_[i])) ++i;
        const std::string_view rest = std::string_view(buf_).substr(i);
        if (rest.starts_with(kDsCallsEnd)) {
          buf_.erase(0, i + kDsCallsEnd.size());
          state_ = State::text;
          return true;
        }
        if (!rest.starts_with(kDsCallBegin)) {
          const bool maybe = kDsCallsEnd.starts_with(rest) || kDsCallBegin.starts_with(rest);
          if (maybe && !at_end) return false;
          state_ = State::text;  // the calls ended without their closing marker: the rest is text
          return true;
        }
        const size_t end = buf_.find(kDsCallEnd, i);
        if (end == std::string::npos) return false;
        const size_t body_at = i + kDsCallBegin.size();
        std::string_view body = std::string_view(buf_).substr(body_at, end - body_at);
        std::optional<ToolCall> c;
        if (size_t sep = body.find(kDsSep); sep != std::string_view::npos) {
          std::string_view before = trim(body.substr(0, sep)), after = body.substr(sep + kDsSep.size());
          std::string_view name, args;
          if (size_t fence = after.find("```"); fence != std::string_view::npos) {  // V3: type, then name and a fenced block
            name = trim(after.substr(0, fence));
            args = after.substr(fence + 3);
            if (args.starts_with("json")) args.remove_prefix(4);
            if (size_t close = args.rfind("```"); close != std::string_view::npos) args = args.substr(0, close);
          } else {  // V3.1: the name before the separator
            name = before;
            args = after;
          }
          auto j = parse_json(trim(args));
          if (!name.empty() && j && j->is_object()) c = ToolCall{std::string(name), j->dump()};
        }
        if (!c) return give_back("", end + kDsCallEnd.size());
        buf_.erase(0, end + kDsCallEnd.size());
        call(out, std::move(*c));
      }
    }
  }
  return false;
}

std::vector<Event> parse(Syntax s, std::string_view text) {
  Parser p(s);
  std::vector<Event> out = p.push(text);
  for (Event& e : p.finish()) {
    if (e.kind == Event::Kind::content && !out.empty() && out.back().kind == Event::Kind::content) out.back().text += e.text;
    else out.push_back(std::move(e));
  }
  return out;
}

}  // namespace ds4::tools

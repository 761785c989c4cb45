#pragma once
/// Tool calls in a model's own syntax, recognised in its answer as it
/// streams. Each family writes calls its own way:
///
///   hermes    <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Qwen 2.5/3, Hermes, ChatML fallback)
///   llama3    {"name": "f", "parameters": {...}} as the whole answer, or after <|python_tag|>
///   mistral   [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]  or  [TOOL_CALLS]f[ARGS]{...}
///   deepseek  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>
///             (V3.1: <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>)
///
/// The parser is fed the answer's text in pieces of any size (byte by byte
/// works) and gives back, in order, content (the text around calls, sent as
/// soon as it cannot be the start of a call) and each call once its text is
/// complete. Text that looked like a call but is not one (malformed JSON, no
/// name) is given back as content. Pure; no allocation beyond the held text.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/chat_template.h"

namespace ds4::tools {

enum class Syntax { hermes, llama3, mistral, deepseek };
const char* syntax_name(Syntax s);

/// The syntax a model's template teaches it: by the markers in the template
/// text; a template without any (or none at all) by its chat family (ChatML
/// and Llama 2 get hermes, which the fallback prompt describes).
Syntax detect_syntax(std::string_view chat_template, ChatFamily family);

/// The control-token texts a syntax is made of: the proxy passes these
/// tokens' text to the parser (it drops other control tokens' text).
std::vector<std::string_view> markers(Syntax s);

struct ToolCall {
  std::string name;
  std::string arguments;  // JSON text of an object ("{}" when the model gave none)
  bool operator==(const ToolCall&) const = default;
};

struct Event {
  enum class Kind { content, call } kind = Kind::content;
  std::string text;  // content
  ToolCall call;     // call
  bool operator==(const Event&) const = default;
};

class Parser {
 public:
  explicit Parser(Syntax s) : syntax_(s) {}
  /// Adds answer text; returns what became certain.
  std::vector<Event> push(std::string_view text);
  /// The end of the answer: what was held back, as content (an unfinished call too).
  std::vector<Event> finish();
  /// Calls recognised so far.
  int64_t calls() const { return calls_; }

 private:
  enum class State { text, call };
  void scan(std::vector<Event>& out, bool at_end);
  bool scan_text(std::vector<Event>& out, bool at_end);
  bool scan_call(std::vector<Event>& out, bool at_end);
  void content(std::vector<Event>& out, std::string_view s);
  void call(std::vector<Event>& out, ToolCall c);

  Syntax syntax_;
  State state_ = State::text;
  std::string buf_;          // text not yet given back
  std::string opener_;       // the marker that opened the call in progress
  bool answer_start_ = true; // nothing but blanks given back yet (llama3's bare JSON call)
  bool bare_ = false;        // llama3: the call is a bare JSON object, not after <|python_tag|>
  int64_t calls_ = 0;
};

/// The whole text at once (tests, non-streamed answers).
std::vector<Event> parse(Syntax s, std::string_view text);

/// The end of the JSON value starting at `s[from]` (after blanks), or npos
/// when it is not complete yet; `bad` is set when it can never be valid
/// (a stray closing bracket, a value that is not an object or array), and
/// the index just past the character that made it so is returned: the text
/// up to there is given back as content and the scan goes on after it, the
/// same however the answer was cut into pieces.
size_t json_extent(std::string_view s, size_t from, bool& bad);

}  // namespace ds4::tools

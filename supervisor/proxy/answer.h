#pragma once
/// An answer's text read as the client sees it: the thought apart
/// (text/reasoning.h), tool calls in the model's syntax (text/tool_calls.h),
/// and the content around them. Fed the text after stop strings are applied
/// (TextStream), in pieces of any size. A plan that reads nothing out of its
/// answer (completions) passes every piece through as content. Pure.

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "supervisor/proxy/api_request.h"
#include "text/reasoning.h"
#include "text/tool_calls.h"

namespace ds4::proxy {

struct AnswerEvent {
  enum class Kind { reasoning, content, call } kind = Kind::content;
  std::string text;       // reasoning, content
  tools::ToolCall call;   // call
  bool operator==(const AnswerEvent&) const = default;
};

class AnswerParser {
 public:
  explicit AnswerParser(const Plan& plan);
  std::vector<AnswerEvent> push(std::string_view text);
  std::vector<AnswerEvent> finish();
  /// Inside the thought now (a thinking budget counts these tokens).
  bool in_thought() const { return read_ && think_.in_thought(); }
  int64_t calls() const { return tools_ ? tools_->calls() : 0; }

 private:
  void split(reasoning::Splitter::Out o, std::vector<AnswerEvent>& out, bool at_end);
  bool read_;
  reasoning::Splitter think_;
  std::optional<tools::Parser> tools_;
};

}  // namespace ds4::proxy

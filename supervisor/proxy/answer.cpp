#include "supervisor/proxy/answer.h"

namespace ds4::proxy {

AnswerParser::AnswerParser(const Plan& plan) : read_(plan.read_answer), think_(plan.thought_open) {
  if (plan.read_answer && plan.tool_calls) tools_.emplace(plan.tool_syntax);
}

namespace {

void add(std::vector<AnswerEvent>& out, AnswerEvent::Kind kind, std::string text) {
  if (text.empty()) return;
  if (!out.empty() && out.back().kind == kind) out.back().text += text;
  else out.push_back({kind, std::move(text), {}});
}

}  // namespace

void AnswerParser::split(reasoning::Splitter::Out o, std::vector<AnswerEvent>& out, bool at_end) {
  add(out, AnswerEvent::Kind::reasoning, std::move(o.reasoning));
  if (!tools_) return add(out, AnswerEvent::Kind::content, std::move(o.content));
  std::vector<tools::Event> events = tools_->push(o.content);
  if (at_end)
    for (tools::Event& e : tools_->finish()) events.push_back(std::move(e));
  for (tools::Event& e : events) {
    if (e.kind == tools::Event::Kind::content) add(out, AnswerEvent::Kind::content, std::move(e.text));
    else out.push_back({AnswerEvent::Kind::call, {}, std::move(e.call)});
  }
}

std::vector<AnswerEvent> AnswerParser::push(std::string_view text) {
  std::vector<AnswerEvent> out;
  if (!read_) {
    add(out, AnswerEvent::Kind::content, std::string(text));
    return out;
  }
  split(think_.push(text), out, false);
  return out;
}

std::vector<AnswerEvent> AnswerParser::finish() {
  std::vector<AnswerEvent> out;
  if (read_) split(think_.finish(), out, true);
  return out;
}

}  // namespace ds4::proxy

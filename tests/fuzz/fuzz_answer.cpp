// libFuzzer entry for what the proxy reads out of a model's answer: the tool
// call parser of each syntax (text/tool_calls.h) and the thought splitter
// (text/reasoning.h). The first byte picks the syntax (bits 0-1), whether the
// prompt opened a thought (bit 2) and the piece size (bits 3-7, 1 to 32
// bytes); the rest is the answer. Fed in pieces and whole, both must give the
// same events (adjacent content merged); every call's arguments must be a
// JSON object; nothing but the input's own bytes comes out. Nothing may
// throw.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/reasoning.h"
#include "text/tool_calls.h"

namespace {

using namespace ds4;

void require(bool ok) {
  if (!ok) std::abort();
}

std::vector<tools::Event> merged(const std::vector<tools::Event>& in) {
  std::vector<tools::Event> out;
  for (const tools::Event& e : in) {
    if (e.kind == tools::Event::Kind::content) {
      if (e.text.empty()) continue;
      if (!out.empty() && out.back().kind == tools::Event::Kind::content) {
        out.back().text += e.text;
        continue;
      }
    }
    out.push_back(e);
  }
  return out;
}

void tool_calls(tools::Syntax syntax, std::string_view answer, size_t piece) {
  tools::Parser p(syntax);
  std::vector<tools::Event> events;
  for (size_t at = 0; at < answer.size(); at += piece) {
    auto got = p.push(answer.substr(at, piece));
    events.insert(events.end(), got.begin(), got.end());
  }
  auto tail = p.finish();
  events.insert(events.end(), tail.begin(), tail.end());
  const auto pieces = merged(events), whole = merged(tools::parse(syntax, answer));
  require(pieces == whole);
  size_t content = 0;
  for (const tools::Event& e : whole) {
    if (e.kind == tools::Event::Kind::content) {
      content += e.text.size();
      continue;
    }
    require(!e.call.name.empty());
    const nlohmann::json args = nlohmann::json::parse(e.call.arguments, nullptr, false);
    require(!args.is_discarded() && args.is_object());
  }
  require(content <= answer.size());
}

void thoughts(bool in_thought, std::string_view answer, size_t piece) {
  reasoning::Splitter a(in_thought), b(in_thought);
  std::string thought, content;
  for (size_t at = 0; at < answer.size(); at += piece) {
    const auto o = a.push(answer.substr(at, piece));
    thought += o.reasoning;
    content += o.content;
  }
  const auto end = a.finish();
  thought += end.reasoning;
  content += end.content;
  auto w = b.push(answer);
  const auto wend = b.finish();
  require(thought == w.reasoning + wend.reasoning);
  require(content == w.content + wend.content);
  require(thought.size() + content.size() <= answer.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const std::string_view answer(reinterpret_cast<const char*>(data + 1), size - 1);
  const size_t piece = 1 + (mode >> 3);
  static constexpr tools::Syntax kSyntaxes[] = {tools::Syntax::hermes, tools::Syntax::llama3, tools::Syntax::mistral,
                                                tools::Syntax::deepseek};
  tool_calls(kSyntaxes[mode & 3], answer, piece);
  thoughts((mode & 4) != 0, answer, piece);
  return 0;
}

// libFuzzer entry for the Jinja interpreter (text/jinja.h): any input, read
// as a template source and, after a NUL byte, a JSON context (a fixed
// conversation with tools when absent or not a JSON object), must parse and
// render within small limits or throw ds4::Error: never crash, hang, leak or
// overflow the stack. The seeds are the real chat templates of the npm
// packages, written by scripts/fuzz.sh at fuzz time.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "shared/error.h"
#include "text/jinja.h"

namespace {

const char kContext[] = R"({
  "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
     "tool_calls": [{"id": "call00001", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
    {"role": "assistant", "content": "<think>\nok\n</think>\n\nSunny."},
    {"role": "user", "content": "Thanks \u00e9 \ud83d\ude00"}
  ],
  "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
  "add_generation_prompt": true, "enable_thinking": false,
  "bos_token": "<s>", "eos_token": "</s>"
})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  const std::string_view source = in.substr(0, nul);
  static const nlohmann::ordered_json fixed = nlohmann::ordered_json::parse(kContext);
  nlohmann::ordered_json ctx = fixed;
  if (nul != std::string_view::npos) {
    auto j = nlohmann::ordered_json::parse(in.substr(nul + 1), nullptr, false);
    if (j.is_object()) ctx = std::move(j);
  }
  ds4::jinja::Limits limits;
  limits.max_steps = 20'000;
  limits.max_output = 64 << 10;
  limits.max_depth = 16;
  try {
    const auto t = ds4::jinja::Template::parse(source);
    (void)t.render(ctx, limits);
  } catch (const ds4::Error&) {
  }
  return 0;
}

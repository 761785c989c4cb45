// libFuzzer entry for grammars (text/grammar.h): the first byte picks what
// the rest is. Even: GBNF text, then after a NUL byte the text fed to its
// matcher, byte by byte and whole, with the state key and end checks. Odd: a
// JSON Schema, compiled (schema_to_gbnf); what compiles must parse as a
// grammar. Anything may throw ds4::Error (a limit, a syntax error), nothing
// else; the two ways of feeding the same text must agree.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "shared/error.h"
#include "text/grammar.h"

namespace {

using namespace ds4::grammar;

void require(bool ok) {
  if (!ok) std::abort();
}

// Small limits keep every input fast.
Limits small() {
  Limits l;
  l.max_bytes = 1 << 16;
  l.max_rules = 2000;
  l.max_elements = 1 << 16;
  l.max_repeat = 64;
  l.max_stacks = 256;
  l.max_depth = 128;
  return l;
}

void grammar_input(std::string_view data) {
  const size_t nul = data.find('\0');
  const std::string_view text = data.substr(0, nul);
  const std::string_view input = nul == std::string_view::npos ? std::string_view() : data.substr(nul + 1);
  std::shared_ptr<const Grammar> g;
  try {
    g = Grammar::parse(text, small());
  } catch (const ds4::Error&) {
    return;
  }
  try {
    Matcher whole(g), bytes(g);
    const bool ok = whole.accept(input);
    bool ok_bytes = true;
    for (char c : input)
      if (!(ok_bytes = bytes.accept_byte(uint8_t(c)))) break;
    require(ok == ok_bytes);
    if (ok) {
      require(whole.key() == bytes.key());
      require(whole.can_end() == bytes.can_end());
      require(!whole.must_end() || whole.can_end());
    }
  } catch (const ds4::Error&) {
  }
}

void schema_input(std::string_view data) {
  nlohmann::json schema;
  try {
    schema = nlohmann::json::parse(data);
  } catch (const nlohmann::json::exception&) {
    return;
  }
  std::string text;
  try {
    SchemaLimits l;
    l.max_depth = 16;
    l.max_rules = 2000;
    text = schema_to_gbnf(schema, l);
  } catch (const ds4::Error&) {
    return;
  }
  // What the compiler wrote parses (text() checked it) and a matcher starts.
  try {
    Matcher m(Grammar::parse(text));
    m.can_accept("{}");
  } catch (const ds4::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) grammar_input(rest);
  else schema_input(rest);
  return 0;
}

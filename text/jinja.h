#pragma once
/// The chat-template interpreter: the subset of Jinja2 that real
/// `tokenizer.chat_template`s use, rendered as Hugging Face's
/// transformers (and @huggingface/jinja, the reference the tests compare
/// with) render them. Values are JSON values (nlohmann::json) plus the
/// interpreter's own callables (macros, namespace(), loop).
///
/// A template is parsed once (per model) and rendered per request. Every
/// render is bounded: steps, output bytes, call depth; a template that
/// loops, recurses or raises ends with ds4::Error, never a crash or a hang.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace ds4::jinja {

struct Limits {
  size_t max_steps = 5'000'000;      // statements and expression nodes evaluated
  size_t max_output = 16u << 20;     // bytes of rendered text
  size_t max_depth = 200;            // nested calls (macros, filters, includes)
};

class Template {
 public:
  /// Parses `source`. Throws ds4::Error "template:LINE:COL: what was expected".
  static Template parse(std::string_view source);
  /// Renders with `context` (an object: messages, tools, add_generation_prompt,
  /// bos_token, eos_token, ... as the caller gives). Throws ds4::Error for
  /// raise_exception() (its message), a limit reached, or a runtime type error.
  std::string render(const nlohmann::json& context, const Limits& limits = {}) const;
  /// The same with the context's key order kept: dicts render (tojson,
  /// items(), loops) in the order the request gave, as Python's do.
  std::string render(const nlohmann::ordered_json& context, const Limits& limits = {}) const;

  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  ~Template();

 private:
  struct Program;
  explicit Template(std::unique_ptr<Program> p);
  std::unique_ptr<Program> program_;
};

}  // namespace ds4::jinja

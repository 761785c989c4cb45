// Template: parse once, render per request (text/jinja.h). The parts are in
// jinja_lexer.cpp, jinja_parser.cpp, jinja_eval.cpp and jinja_builtins.cpp.
#include "text/jinja.h"

#include "shared/error.h"
#include "text/jinja_eval.h"

namespace ds4::jinja {

struct Template::Program {
  jinja::Program program;
};

Template::Template(std::unique_ptr<Program> p) : program_(std::move(p)) {}
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::~Template() = default;

Template Template::parse(std::string_view source) {
  auto p = std::make_unique<Program>();
  p->program = parse_tokens(lex(source));
  return Template(std::move(p));
}

std::string Template::render(const nlohmann::json& context, const Limits& limits) const {
  return render(nlohmann::ordered_json(context), limits);
}

std::string Template::render(const nlohmann::ordered_json& context, const Limits& limits) const {
  if (!context.is_object() && !context.is_null()) throw Error("template context must be a JSON object");
  Value ctx = from_json(context.is_null() ? nlohmann::ordered_json::object() : context);
  Interp in(limits, std::move(ctx));
  try {
    return in.run(program_->program);
  } catch (const Raised& r) {
    throw Error(r.message);
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.rfind("template:", 0) == 0) throw;
    throw Error(where(in.pos) + what);
  }
}

}  // namespace ds4::jinja

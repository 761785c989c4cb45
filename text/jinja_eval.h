#pragma once
/// The interpreter (internal to text/jinja*.cpp): runs a Program over a
/// context, within Limits. Statements and expressions are in jinja_eval.cpp;
/// filters, tests, methods and globals in jinja_builtins.cpp.

#include <string>
#include <unordered_map>
#include <vector>

#include "text/jinja.h"
#include "text/jinja_ast.h"

namespace ds4::jinja {

/// raise_exception(msg) from the template: its message is the error's.
struct Raised {
  std::string message;
};

class Interp {
 public:
  Interp(const Limits& limits, Value context);
  ~Interp();
  Interp(const Interp&) = delete;
  Interp& operator=(const Interp&) = delete;

  /// Renders the program; throws ds4::Error (with "template:L:C: " for
  /// errors at a place) or Raised.
  std::string run(const Program& p);

  // ---- used by the builtins ----
  void step(size_t n = 1);
  /// Charges a new string or list of `size` bytes/items and checks it
  /// against max_output.
  void charge(size_t size);
  /// Remembers a container that was changed in place (namespace attribute,
  /// list.append): cycles through such containers are broken after the run.
  void mutated(const Value& v);
  Value call(const Value& fn, Args& args);
  Value filter(const std::string& name, Value operand, Args& args);
  bool test(const std::string& name, const Value& operand, Args& args);
  /// obj.name: a dict's key, a namespace's attribute, or a bound method.
  Value attr(const Value& obj, const std::string& name);
  /// obj[key]: list and string indexes (negative from the end), dict keys.
  Value item(const Value& obj, const Value& key);
  /// The names defined at the top (globals and the context).
  Value lookup(const std::string& name) const;
  const Limits& limits() const { return limits_; }

 private:
  enum class Flow { normal, brk, cont };
  struct Frame {
    std::unordered_map<std::string, Value> vars;
  };
  struct Nest;

  Flow exec(const Body& body, std::string& out);
  Flow exec(const Stmt& s, std::string& out);
  void exec_for(const Stmt& s, std::string& out);
  void exec_set(const Stmt& s);
  void emit(std::string& out, std::string_view text);
  void assign(const Expr& target, const Value& v);
  Value eval(const Expr& e);
  Value eval_binop(const Expr& e);
  Value eval_slice(const Expr& e);
  Args eval_args(const CallArgs& a);
  Value make_macro(const Stmt& s, bool is_caller);
  void define(const std::string& name, Value v);

  Limits limits_;
  size_t steps_ = 0;
  size_t nest_ = 0;        // interpreter recursion (statements, expressions)
  size_t call_depth_ = 0;  // macro calls
  std::vector<Frame> frames_;
  std::vector<Value> mutated_;
  friend Value call_macro(Interp&, const Stmt&, Args&, bool);
  friend struct MacroCall;

 public:
  Pos pos;  // where the interpreter is, for errors
};

/// Globals every template sees: namespace, range, raise_exception,
/// strftime_now, dict, joiner-free subset (see jinja_builtins.cpp).
void add_globals(std::unordered_map<std::string, Value>& vars);

}  // namespace ds4::jinja

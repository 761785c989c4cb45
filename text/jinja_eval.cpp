// The interpreter's statements and expressions. Values follow Python's
// Jinja (truth, ==, slicing, scoping: a for loop and a macro call open a
// scope, `set` inside them does not leak, namespace() does), with the
// leniencies of @huggingface/jinja that chat templates lean on (string +
// anything concatenates, undefined renders empty).
#include "text/jinja_eval.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "shared/error.h"

namespace ds4::jinja {

struct Interp::Nest {
  explicit Nest(Interp& in) : in_(in) {
    const size_t max = std::max<size_t>(64, in_.limits_.max_depth * 8);
    if (++in_.nest_ > max) {
      --in_.nest_;
      throw Error("the template nests deeper than " + std::to_string(max) + " levels at run time (limit max_depth)");
    }
  }
  ~Nest() { --in_.nest_; }
  Interp& in_;
};

Interp::Interp(const Limits& limits, Value context) : limits_(limits) {
  frames_.emplace_back();
  add_globals(frames_.back().vars);
  if (context.is_attr_container())
    for (auto& [k, v] : context.o->items) frames_.back().vars[k] = v;
  frames_.emplace_back();  // the template's own top-level names
}

Interp::~Interp() {
  // Break the cycles a template may have made (ns.x = ns, l.append(l)).
  for (Value& v : mutated_) {
    if (v.a) v.a->items.clear();
    if (v.o) v.o->items.clear();
  }
}

std::string Interp::run(const Program& p) {
  std::string out;
  exec(p.body, out);
  return out;
}

void Interp::step(size_t n) {
  steps_ += n;
  if (steps_ > limits_.max_steps)
    throw Error("the template ran past " + std::to_string(limits_.max_steps) + " steps (limit max_steps)");
}

void Interp::charge(size_t size) {
  if (size > limits_.max_output)
    throw Error("the template built a value of " + std::to_string(size) + " bytes or items, past " +
                std::to_string(limits_.max_output) + " (limit max_output)");
  step(size / 16);
}

void Interp::mutated(const Value& v) {
  if (mutated_.size() < limits_.max_steps) mutated_.push_back(v);
}

void Interp::emit(std::string& out, std::string_view text) {
  if (out.size() + text.size() > limits_.max_output)
    throw Error("the rendering is longer than " + std::to_string(limits_.max_output) + " bytes (limit max_output)");
  out += text;
  step(text.size() / 64);
}

Value Interp::lookup(const std::string& name) const {
  for (size_t k = frames_.size(); k-- > 0;) {
    auto it = frames_[k].vars.find(name);
    if (it != frames_[k].vars.end()) return it->second;
  }
  return {};
}

void Interp::define(const std::string& name, Value v) { frames_.back().vars[name] = std::move(v); }

Interp::Flow Interp::exec(const Body& body, std::string& out) {
  Nest n(*this);
  for (const auto& s : body) {
    const Flow f = exec(*s, out);
    if (f != Flow::normal) return f;
  }
  return Flow::normal;
}

Interp::Flow Interp::exec(const Stmt& s, std::string& out) {
  step();
  pos = s.pos;
  switch (s.k) {
    case Stmt::K::text: emit(out, s.text); break;
    case Stmt::K::output: {
      const Value v = eval(*s.expr);
      pos = s.pos;
      if (!v.is_undefined() && !v.is_none()) emit(out, v.is_string() ? v.s : to_str(v));
      break;
    }
    case Stmt::K::if_: {
      for (const auto& [cond, body] : s.branches)
        if (eval(*cond).truthy()) return exec(body, out);
      return exec(s.else_body, out);
    }
    case Stmt::K::for_: exec_for(s, out); break;
    case Stmt::K::set: case Stmt::K::set_block: exec_set(s); break;
    case Stmt::K::macro: define(s.text, make_macro(s, false)); break;
    case Stmt::K::call_block: {
      frames_.emplace_back();
      define("caller", make_macro(s, true));
      Value r;
      try {
        r = eval(*s.expr);
      } catch (...) {
        frames_.pop_back();
        throw;
      }
      frames_.pop_back();
      if (!r.is_undefined() && !r.is_none()) emit(out, to_str(r));
      break;
    }
    case Stmt::K::filter_block: {
      std::string inner;
      exec(s.body, inner);
      Value v = Value::string(std::move(inner));
      for (const ExprP& f : s.filters) {
        Args args = eval_args(f->args);
        v = filter(f->name, std::move(v), args);
      }
      emit(out, to_str(v));
      break;
    }
    case Stmt::K::break_: return Flow::brk;
    case Stmt::K::continue_: return Flow::cont;
    case Stmt::K::do_: eval(*s.expr); break;
    case Stmt::K::block: return exec(s.body, out);
  }
  return Flow::normal;
}

void Interp::assign(const Expr& target, const Value& v) {
  if (target.k == Expr::K::name) {
    define(target.name, v);
    return;
  }
  if (target.k == Expr::K::tuple) {
    if (!v.is_array()) throw Error(std::string("cannot unpack a ") + v.type_name() + " into " + std::to_string(target.items.size()) + " names");
    if (v.a->items.size() != target.items.size())
      throw Error("cannot unpack " + std::to_string(v.a->items.size()) + " values into " + std::to_string(target.items.size()) + " names");
    const auto items = v.a->items;  // v may be one of the targets' old values
    for (size_t k = 0; k < items.size(); ++k) assign(*target.items[k], items[k]);
    return;
  }
  if (target.k == Expr::K::attr) {
    const Value obj = eval(*target.a);
    if (obj.t != Value::T::ns)
      throw Error("cannot set attribute '" + target.name + "' of a " + obj.type_name() + " (only of a namespace())");
    obj.o->set(target.name, v);
    mutated(obj);
    return;
  }
  throw Error("cannot assign to this expression");
}

void Interp::exec_set(const Stmt& s) {
  Value v;
  if (s.k == Stmt::K::set) {
    v = eval(*s.expr);
  } else {
    std::string inner;
    exec(s.body, inner);
    v = Value::string(std::move(inner));
    for (const ExprP& f : s.filters) {
      Args args = eval_args(f->args);
      v = filter(f->name, std::move(v), args);
    }
  }
  pos = s.pos;
  assign(*s.target, v);
}

void Interp::exec_for(const Stmt& s, std::string& out) {
  Value seq = eval(*s.expr);
  pos = s.pos;
  std::vector<Value> items;
  if (seq.is_array()) {
    items = seq.a->items;
  } else if (seq.is_mapping()) {
    for (const auto& kv : seq.o->items) items.push_back(Value::string(kv.first));
  } else if (seq.is_string()) {
    for (std::string_view c : utf8_chars(seq.s)) items.push_back(Value::string(std::string(c)));
  } else if (!seq.is_undefined()) {
    throw Error(std::string("cannot loop over a ") + seq.type_name());
  }
  frames_.emplace_back();
  struct Pop {
    ~Pop() { f.pop_back(); }
    std::vector<Frame>& f;
  } pop{frames_};
  if (s.cond) {  // for x in xs if cond: the loop sees only the items that pass
    std::vector<Value> kept;
    for (Value& x : items) {
      step();
      assign(*s.target, x);
      if (eval(*s.cond).truthy()) kept.push_back(std::move(x));
    }
    items = std::move(kept);
  }
  const int64_t n = int64_t(items.size());
  for (int64_t k = 0; k < n; ++k) {
    step();
    auto loop = Value::object({
        {"index", Value::integer(k + 1)},
        {"index0", Value::integer(k)},
        {"revindex", Value::integer(n - k)},
        {"revindex0", Value::integer(n - k - 1)},
        {"first", Value::boolean(k == 0)},
        {"last", Value::boolean(k == n - 1)},
        {"length", Value::integer(n)},
        {"previtem", k > 0 ? items[size_t(k - 1)] : Value()},
        {"nextitem", k + 1 < n ? items[size_t(k + 1)] : Value()},
    });
    loop.o->set("cycle", Value::func([k](Interp&, Args& a) -> Value {
      if (a.pos.empty()) throw Error("loop.cycle() needs at least one value");
      return a.pos[size_t(k) % a.pos.size()];
    }));
    define("loop", loop);
    assign(*s.target, items[size_t(k)]);
    const Flow f = exec(s.body, out);
    if (f == Flow::brk) break;
  }
  if (n == 0) exec(s.else_body, out);
}

// A macro (or a call block's caller) as a function: arguments by position
// or name, defaults, and the extra ones as varargs and kwargs.
Value Interp::make_macro(const Stmt& s, bool is_caller) {
  const Stmt* def = &s;
  (void)is_caller;
  return Value::func([def](Interp& in, Args& args) -> Value {
    if (++in.call_depth_ > in.limits_.max_depth) {
      --in.call_depth_;
      throw Error("macro calls nest deeper than " + std::to_string(in.limits_.max_depth) + " (limit max_depth)");
    }
    in.frames_.emplace_back();
    struct Pop {
      ~Pop() {
        in.frames_.pop_back();
        --in.call_depth_;
      }
      Interp& in;
    } pop{in};
    std::vector<std::pair<std::string, Value>> kw = args.kw;
    for (size_t k = 0; k < def->params.size(); ++k) {
      const Param& p = def->params[k];
      Value v;
      bool have = false;
      if (k < args.pos.size()) {
        v = args.pos[k];
        have = true;
      } else {
        for (auto it = kw.begin(); it != kw.end(); ++it) {
          if (it->first == p.name) {
            v = it->second;
            have = true;
            kw.erase(it);
            break;
          }
        }
      }
      if (!have && p.def) v = in.eval(*p.def);
      in.define(p.name, v);
    }
    std::vector<Value> rest;
    if (args.pos.size() > def->params.size()) rest.assign(args.pos.begin() + long(def->params.size()), args.pos.end());
    in.define("varargs", Value::array(std::move(rest)));
    in.define("kwargs", Value::object(std::move(kw)));
    std::string out;
    in.exec(def->body, out);
    return Value::string(std::move(out));
  });
}

Args Interp::eval_args(const CallArgs& a) {
  Args out;
  for (const ExprP& e : a.pos) out.pos.push_back(eval(*e));
  for (const auto& [k, e] : a.kw) out.kw.emplace_back(k, eval(*e));
  return out;
}

Value Interp::call(const Value& fn, Args& args) {
  if (fn.t != Value::T::func) throw Error(std::string("cannot call a ") + fn.type_name());
  return (*fn.f)(*this, args);
}

Value Interp::eval(const Expr& e) {
  Nest n(*this);
  step();
  pos = e.pos;
  switch (e.k) {
    case Expr::K::literal: return e.value;
    case Expr::K::name: return lookup(e.name);
    case Expr::K::list: case Expr::K::tuple: {
      std::vector<Value> items;
      items.reserve(e.items.size());
      for (const ExprP& x : e.items) items.push_back(eval(*x));
      return Value::array(std::move(items));
    }
    case Expr::K::dict: {
      std::vector<std::pair<std::string, Value>> items;
      for (size_t k = 0; k + 1 < e.items.size(); k += 2) {
        const Value key = eval(*e.items[k]);
        if (!key.is_string()) {
          pos = e.items[k]->pos;
          throw Error(std::string("a dict key must be a string, not a ") + key.type_name());
        }
        items.emplace_back(key.s, eval(*e.items[k + 1]));
      }
      return Value::object(std::move(items));
    }
    case Expr::K::attr: {
      const Value obj = eval(*e.a);
      pos = e.pos;
      return attr(obj, e.name);
    }
    case Expr::K::index: {
      const Value obj = eval(*e.a);
      const Value key = eval(*e.b);
      pos = e.pos;
      return item(obj, key);
    }
    case Expr::K::slice: return eval_slice(e);
    case Expr::K::call: {
      const Value fn = eval(*e.a);
      Args args = eval_args(e.args);
      pos = e.pos;
      if (fn.t != Value::T::func) {
        const std::string what = e.a->k == Expr::K::name ? "'" + e.a->name + "'"
                                 : e.a->k == Expr::K::attr ? "'" + e.a->name + "'"
                                                           : "this value";
        throw Error("cannot call " + what + ": it is " + (fn.is_undefined() ? "undefined" : std::string("a ") + fn.type_name()));
      }
      return call(fn, args);
    }
    case Expr::K::filter: {
      Value operand = eval(*e.a);
      Args args = eval_args(e.args);
      pos = e.pos;
      return filter(e.name, std::move(operand), args);
    }
    case Expr::K::test: {
      const Value operand = eval(*e.a);
      Args args = eval_args(e.args);
      pos = e.pos;
      return Value::boolean(test(e.name, operand, args) != e.negate);
    }
    case Expr::K::not_: return Value::boolean(!eval(*e.a).truthy());
    case Expr::K::neg: case Expr::K::pos_: {
      const Value v = eval(*e.a);
      pos = e.pos;
      const bool neg = e.k == Expr::K::neg;
      if (v.t == Value::T::integer) {
        if (neg && v.i == INT64_MIN) throw Error("integer overflow");
        return Value::integer(neg ? -v.i : v.i);
      }
      if (v.t == Value::T::boolean) return Value::integer(neg ? -int64_t(v.b) : int64_t(v.b));
      if (v.t == Value::T::floating) return Value::floating(neg ? -v.d : v.d);
      throw Error(std::string("bad operand for unary ") + (neg ? "-" : "+") + ": " + v.type_name());
    }
    case Expr::K::and_: {
      Value l = eval(*e.a);
      return l.truthy() ? eval(*e.b) : l;
    }
    case Expr::K::or_: {
      Value l = eval(*e.a);
      return l.truthy() ? l : eval(*e.b);
    }
    case Expr::K::cond: {
      if (eval(*e.a).truthy()) return eval(*e.b);
      return e.c ? eval(*e.c) : Value();
    }
    case Expr::K::binop: return eval_binop(e);
  }
  return {};
}

namespace {

// Python's slice indices for a sequence of n.
std::vector<size_t> slice_indices(int64_t n, const Value& start, const Value& stop, const Value& step_v) {
  auto as_int = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (v.t == Value::T::integer) return v.i;
    if (v.t == Value::T::boolean) return int64_t(v.b);
    throw Error(std::string("slice ") + what + " must be an integer, not a " + v.type_name());
  };
  const int64_t step = as_int(step_v, "step").value_or(1);
  if (step == 0) throw Error("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> x, int64_t def) {
    if (!x) return def;
    int64_t v = *x;
    if (v < 0) v = std::max<int64_t>(v + n, step < 0 ? -1 : 0);
    else v = std::min(v, step < 0 ? n - 1 : n);
    return v;
  };
  const int64_t b = clamp(as_int(start, "start"), step < 0 ? n - 1 : 0);
  const int64_t e = clamp(as_int(stop, "stop"), step < 0 ? -1 : n);
  std::vector<size_t> out;
  if (step > 0)
    for (int64_t k = b; k < e; k += step) out.push_back(size_t(k));
  else
    for (int64_t k = b; k > e; k += step) out.push_back(size_t(k));
  return out;
}

}  // namespace

Value Interp::eval_slice(const Expr& e) {
  const Value obj = eval(*e.items[0]);
  const Value start = e.a ? eval(*e.a) : Value();
  const Value stop = e.b ? eval(*e.b) : Value();
  const Value stp = e.c ? eval(*e.c) : Value();
  pos = e.pos;
  if (obj.is_array()) {
    const auto idx = slice_indices(int64_t(obj.a->items.size()), start, stop, stp);
    step(idx.size() / 16);
    std::vector<Value> out;
    out.reserve(idx.size());
    for (size_t k : idx) out.push_back(obj.a->items[k]);
    return Value::array(std::move(out));
  }
  if (obj.is_string()) {
    const auto chars = utf8_chars(obj.s);
    const auto idx = slice_indices(int64_t(chars.size()), start, stop, stp);
    std::string out;
    for (size_t k : idx) out += chars[k];
    charge(out.size());
    return Value::string(std::move(out));
  }
  if (obj.is_undefined()) return {};
  throw Error(std::string("cannot slice a ") + obj.type_name());
}

namespace {

bool numeric(const Value& v) { return v.is_number() || v.t == Value::T::boolean; }
double as_double(const Value& v) { return v.t == Value::T::integer ? double(v.i) : v.t == Value::T::boolean ? double(v.b) : v.d; }
int64_t as_int(const Value& v) { return v.t == Value::T::boolean ? int64_t(v.b) : v.i; }
bool both_int(const Value& a, const Value& b) { return a.t != Value::T::floating && b.t != Value::T::floating; }

[[noreturn]] void bad_operands(const std::string& op, const Value& a, const Value& b) {
  throw Error("cannot apply '" + op + "' to " + (a.is_undefined() ? "undefined" : std::string("a ") + a.type_name()) +
              " and " + (b.is_undefined() ? "undefined" : std::string("a ") + b.type_name()));
}

}  // namespace

Value Interp::eval_binop(const Expr& e) {
  const Value l = eval(*e.a);
  const Value r = eval(*e.b);
  pos = e.pos;
  const std::string& op = e.name;
  if (op == "==") return Value::boolean(equals(l, r));
  if (op == "!=") return Value::boolean(!equals(l, r));
  if (op == "~") {
    std::string s = to_str(l) + to_str(r);
    charge(s.size());
    return Value::string(std::move(s));
  }
  if (op == "in" || op == "not in") {
    bool found = false;
    if (r.is_string()) {
      if (!l.is_string()) bad_operands(op, l, r);
      found = r.s.find(l.s) != std::string::npos;
    } else if (r.is_array()) {
      for (const Value& x : r.a->items) {
        step();
        if (equals(l, x)) {
          found = true;
          break;
        }
      }
    } else if (r.is_attr_container()) {
      found = l.is_string() && r.o->find(l.s);
    } else if (!r.is_undefined()) {
      bad_operands(op, l, r);
    }
    return Value::boolean(found != (op == "not in"));
  }
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    if (!((numeric(l) && numeric(r)) || (l.is_string() && r.is_string()) || (l.is_array() && r.is_array())))
      bad_operands(op, l, r);
    const int c = compare(l, r);
    return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
  }
  if (numeric(l) && numeric(r)) {
    if (both_int(l, r)) {
      const int64_t a = as_int(l), b = as_int(r);
      int64_t x = 0;
      if (op == "+" && !__builtin_add_overflow(a, b, &x)) return Value::integer(x);
      if (op == "-" && !__builtin_sub_overflow(a, b, &x)) return Value::integer(x);
      if (op == "*" && !__builtin_mul_overflow(a, b, &x)) return Value::integer(x);
      if (op == "//" || op == "%") {
        if (b == 0) throw Error("integer division or modulo by zero");
        if (a == INT64_MIN && b == -1) throw Error("integer overflow");
        int64_t q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {
          --q;
          m += b;
        }
        return Value::integer(op == "//" ? q : m);
      }
      if (op == "**" && b >= 0) {
        int64_t res = 1, base = a;
        for (int64_t k = b; k > 0; k >>= 1) {
          if ((k & 1) && __builtin_mul_overflow(res, base, &res)) throw Error("integer overflow in '**'");
          if (k > 1 && __builtin_mul_overflow(base, base, &base)) throw Error("integer overflow in '**'");
        }
        return Value::integer(res);
      }
      if (op == "+" || op == "-" || op == "*") throw Error("integer overflow in '" + op + "'");
    }
    const double a = as_double(l), b = as_double(r);
    if (op == "+") return Value::floating(a + b);
    if (op == "-") return Value::floating(a - b);
    if (op == "*") return Value::floating(a * b);
    if (op == "/") {
      if (b == 0) throw Error("division by zero");
      return Value::floating(a / b);
    }
    if (op == "//" || op == "%") {
      if (b == 0) throw Error("float division or modulo by zero");
      const double q = std::floor(a / b);
      return Value::floating(op == "//" ? q : a - q * b);
    }
    if (op == "**") {
      if (a == 0 && b < 0) throw Error("0.0 cannot be raised to a negative power");
      return Value::floating(std::pow(a, b));
    }
  }
  if (op == "+") {
    if (l.is_array() && r.is_array()) {
      std::vector<Value> items = l.a->items;
      items.insert(items.end(), r.a->items.begin(), r.a->items.end());
      charge(items.size());
      return Value::array(std::move(items));
    }
    // As the reference does: a string and any other value (not none or
    // undefined) concatenate as text.
    if ((l.is_string() || r.is_string()) && !l.is_undefined() && !r.is_undefined() && !l.is_none() && !r.is_none()) {
      std::string s = (l.is_string() ? l.s : to_str(l)) + (r.is_string() ? r.s : to_str(r));
      charge(s.size());
      return Value::string(std::move(s));
    }
  }
  if (op == "*" && (l.is_string() || l.is_array()) && (r.t == Value::T::integer || r.t == Value::T::boolean)) {
    const int64_t times = std::max<int64_t>(0, as_int(r));
    const size_t unit = l.is_string() ? l.s.size() : l.a->items.size();
    if (unit && uint64_t(times) > limits_.max_output / unit) charge(limits_.max_output + 1);
    charge(unit * size_t(times));
    if (l.is_string()) {
      std::string s;
      for (int64_t k = 0; k < times; ++k) s += l.s;
      return Value::string(std::move(s));
    }
    std::vector<Value> items;
    for (int64_t k = 0; k < times; ++k) items.insert(items.end(), l.a->items.begin(), l.a->items.end());
    return Value::array(std::move(items));
  }
  bad_operands(op, l, r);
}

}  // namespace ds4::jinja

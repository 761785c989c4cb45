// The parser: tokens to statements and expressions, with Jinja's operator
// precedence (or, and, not, comparisons, + -, ~, * / // %, **, unary, then
// filters, tests and postfix). Nesting is bounded (kMaxParseDepth) so a
// hostile template cannot overflow the stack here or in the interpreter.
#include <algorithm>

#include "shared/error.h"
#include "text/jinja_ast.h"

namespace ds4::jinja {

namespace {

constexpr int kMaxParseDepth = 400;

// Depth of an expression tree: chains built by loops (a + b + c ..., a.b.c ...)
// do not recurse in the parser but would in the interpreter.
int expr_depth(const Expr* e) {
  if (!e) return 0;
  return e->depth;
}

std::string describe(const Token& t) {
  switch (t.k) {
    case Token::K::text: return "text";
    case Token::K::var_begin: return "'{{'";
    case Token::K::var_end: return "'}}'";
    case Token::K::block_begin: return "'{%'";
    case Token::K::block_end: return "'%}'";
    case Token::K::name: return "'" + t.s + "'";
    case Token::K::string: return "a string";
    case Token::K::integer: case Token::K::floating: return "a number";
    case Token::K::op: return "'" + t.s + "'";
    case Token::K::eof: return "end of template";
  }
  return "?";
}

class Parser {
 public:
  explicit Parser(std::vector<Token> t) : t_(std::move(t)) {}

  Program run() {
    Program p;
    std::string stop;
    p.body = body({}, &stop);
    return p;
  }

 private:
  struct Guard {
    explicit Guard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxParseDepth)
        throw Error(where(p_.cur().pos) + "the template nests deeper than " + std::to_string(kMaxParseDepth) + " levels");
    }
    ~Guard() { --p_.depth_; }
    Parser& p_;
  };

  const Token& cur() const { return t_[k_]; }
  const Token& next() const { return t_[std::min(k_ + 1, t_.size() - 1)]; }
  void skip() { if (k_ + 1 < t_.size()) ++k_; }
  bool is_op(std::string_view s) const { return cur().k == Token::K::op && cur().s == s; }
  bool is_name(std::string_view s) const { return cur().k == Token::K::name && cur().s == s; }
  [[noreturn]] void expected(const std::string& what) const {
    throw Error(where(cur().pos) + "expected " + what + ", got " + describe(cur()));
  }
  void expect_op(std::string_view s) {
    if (!is_op(s)) expected("'" + std::string(s) + "'");
    skip();
  }
  void expect_name(std::string_view s) {
    if (!is_name(s)) expected("'" + std::string(s) + "'");
    skip();
  }
  std::string take_name() {
    if (cur().k != Token::K::name) expected("a name");
    std::string s = cur().s;
    skip();
    return s;
  }
  void expect_block_end() {
    if (cur().k != Token::K::block_end) expected("'%}'");
    skip();
  }
  ExprP node(Expr::K k, Pos p) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->pos = p;
    return e;
  }

  // Statements until one of `stops` opens a block; its name goes to *stop
  // (the block_begin and name are consumed). At the top level stops is empty.
  Body body(std::initializer_list<std::string_view> stops, std::string* stop) {
    Guard g(*this);
    Body out;
    while (true) {
      const Token& t = cur();
      if (t.k == Token::K::eof) {
        if (stops.size() == 0) return out;
        std::string list;
        for (auto s : stops) list += (list.empty() ? "'" : " or '") + std::string(s) + "'";
        expected("{% " + list + " %}");
      }
      if (t.k == Token::K::text) {
        auto s = std::make_unique<Stmt>();
        s->k = Stmt::K::text;
        s->pos = t.pos;
        s->text = t.s;
        out.push_back(std::move(s));
        skip();
      } else if (t.k == Token::K::var_begin) {
        skip();
        auto s = std::make_unique<Stmt>();
        s->k = Stmt::K::output;
        s->pos = t.pos;
        s->expr = expression();
        if (cur().k != Token::K::var_end) expected("'}}'");
        skip();
        out.push_back(std::move(s));
      } else if (t.k == Token::K::block_begin) {
        const Pos p = t.pos;
        skip();
        if (cur().k != Token::K::name) expected("a statement name");
        for (auto s : stops) {
          if (cur().s == s) {
            *stop = cur().s;
            skip();
            return out;
          }
        }
        out.push_back(statement(p));
      } else {
        expected("text or a tag");
      }
    }
  }

  std::unique_ptr<Stmt> statement(Pos p) {
    auto s = std::make_unique<Stmt>();
    s->pos = p;
    const std::string kw = cur().s;
    const Pos kw_pos = cur().pos;
    skip();
    std::string stop;
    if (kw == "if") {
      s->k = Stmt::K::if_;
      ExprP cond = expression();
      expect_block_end();
      Body b = body({"elif", "else", "endif"}, &stop);
      s->branches.emplace_back(std::move(cond), std::move(b));
      while (stop == "elif") {
        ExprP c = expression();
        expect_block_end();
        Body bb = body({"elif", "else", "endif"}, &stop);
        s->branches.emplace_back(std::move(c), std::move(bb));
      }
      if (stop == "else") {
        expect_block_end();
        s->else_body = body({"endif"}, &stop);
      }
      expect_block_end();
    } else if (kw == "for") {
      s->k = Stmt::K::for_;
      s->target = targets();
      expect_name("in");
      s->expr = or_expr();
      if (is_name("if")) {
        skip();
        s->cond = expression();
      }
      if (is_name("recursive")) throw Error(where(cur().pos) + "recursive loops are not supported");
      expect_block_end();
      s->body = body({"else", "endfor"}, &stop);
      if (stop == "else") {
        expect_block_end();
        s->else_body = body({"endfor"}, &stop);
      }
      expect_block_end();
    } else if (kw == "set") {
      ExprP target = targets();
      if (target->k == Expr::K::name && is_op(".")) {
        skip();
        ExprP attr = node(Expr::K::attr, target->pos);
        attr->name = take_name();
        attr->a = std::move(target);
        target = std::move(attr);
      }
      s->target = std::move(target);
      if (is_op("=")) {
        skip();
        s->k = Stmt::K::set;
        s->expr = expression();
        if (is_op(",")) {  // set a, b = 1, 2
          ExprP tup = node(Expr::K::tuple, s->expr->pos);
          tup->items.push_back(std::move(s->expr));
          while (is_op(",")) {
            skip();
            tup->items.push_back(expression());
          }
          s->expr = std::move(tup);
        }
        expect_block_end();
      } else {
        s->k = Stmt::K::set_block;
        while (is_op("|")) {
          skip();
          s->filters.push_back(filter_node(nullptr));
        }
        expect_block_end();
        s->body = body({"endset"}, &stop);
        expect_block_end();
      }
    } else if (kw == "macro") {
      s->k = Stmt::K::macro;
      s->text = take_name();
      s->params = params();
      expect_block_end();
      s->body = body({"endmacro"}, &stop);
      if (cur().k == Token::K::name) skip();  // {% endmacro name %}
      expect_block_end();
    } else if (kw == "call") {
      s->k = Stmt::K::call_block;
      if (is_op("(")) s->params = params();
      s->expr = expression();
      if (s->expr->k != Expr::K::call) throw Error(where(s->expr->pos) + "expected a macro call after 'call'");
      expect_block_end();
      s->body = body({"endcall"}, &stop);
      expect_block_end();
    } else if (kw == "filter") {
      s->k = Stmt::K::filter_block;
      s->filters.push_back(filter_node(nullptr));
      while (is_op("|")) {
        skip();
        s->filters.push_back(filter_node(nullptr));
      }
      expect_block_end();
      s->body = body({"endfilter"}, &stop);
      expect_block_end();
    } else if (kw == "generation") {
      // transformers' {% generation %} marks the assistant's text; it renders as its body.
      s->k = Stmt::K::block;
      expect_block_end();
      s->body = body({"endgeneration"}, &stop);
      expect_block_end();
    } else if (kw == "break" || kw == "continue") {
      s->k = kw == "break" ? Stmt::K::break_ : Stmt::K::continue_;
      expect_block_end();
    } else if (kw == "do") {
      s->k = Stmt::K::do_;
      s->expr = expression();
      expect_block_end();
    } else {
      static const char* const kKnownUnsupported[] = {"include", "import", "from", "extends", "block", "with", "autoescape"};
      for (const char* u : kKnownUnsupported)
        if (kw == u) throw Error(where(kw_pos) + "'" + kw + "' is not supported in chat templates");
      throw Error(where(kw_pos) + "expected a statement (if, for, set, macro, call, filter, break, continue, do), got '" + kw + "'");
    }
    return s;
  }

  // name | name, name | (name, name)
  ExprP targets() {
    Guard g(*this);
    const Pos p = cur().pos;
    auto one = [&]() -> ExprP {
      if (is_op("(")) {
        skip();
        ExprP t = targets();
        expect_op(")");
        return t;
      }
      ExprP n = node(Expr::K::name, cur().pos);
      n->name = take_name();
      return n;
    };
    ExprP first = one();
    if (!is_op(",")) return first;
    ExprP tup = node(Expr::K::tuple, p);
    tup->items.push_back(std::move(first));
    while (is_op(",")) {
      skip();
      tup->items.push_back(one());
    }
    return tup;
  }

  std::vector<Param> params() {
    std::vector<Param> out;
    expect_op("(");
    while (!is_op(")")) {
      Param prm;
      prm.name = take_name();
      if (is_op("=")) {
        skip();
        prm.def = expression();
      }
      out.push_back(std::move(prm));
      if (!is_op(",")) break;
      skip();
    }
    expect_op(")");
    return out;
  }

  // ---- expressions ----

  ExprP expression() {
    Guard g(*this);
    ExprP e = or_expr();
    if (is_name("if")) {
      const Pos p = cur().pos;
      skip();
      ExprP c = node(Expr::K::cond, p);
      c->a = or_expr();  // condition
      c->b = std::move(e);
      if (is_name("else")) {
        skip();
        c->c = expression();
      }
      return deep(std::move(c));
    }
    return e;
  }

  ExprP binary(Expr::K k, const char* name, ExprP l, ExprP r, Pos p) {
    ExprP e = node(k, p);
    e->name = name;
    e->a = std::move(l);
    e->b = std::move(r);
    return deep(std::move(e));
  }

  // Records e's depth (its children's are known); too deep is an error.
  ExprP deep(ExprP e) {
    int d = std::max({expr_depth(e->a.get()), expr_depth(e->b.get()), expr_depth(e->c.get())});
    for (const ExprP& x : e->items) d = std::max(d, expr_depth(x.get()));
    for (const ExprP& x : e->args.pos) d = std::max(d, expr_depth(x.get()));
    for (const auto& kv : e->args.kw) d = std::max(d, expr_depth(kv.second.get()));
    e->depth = d + 1;
    if (e->depth > kMaxParseDepth)
      throw Error(where(e->pos) + "the expression nests deeper than " + std::to_string(kMaxParseDepth) + " levels");
    return e;
  }

  ExprP or_expr() {
    Guard g(*this);
    ExprP l = and_expr();
    while (is_name("or")) {
      const Pos p = cur().pos;
      skip();
      l = binary(Expr::K::or_, "or", std::move(l), and_expr(), p);
    }
    return l;
  }

  ExprP and_expr() {
    Guard g(*this);
    ExprP l = not_expr();
    while (is_name("and")) {
      const Pos p = cur().pos;
      skip();
      l = binary(Expr::K::and_, "and", std::move(l), not_expr(), p);
    }
    return l;
  }

  ExprP not_expr() {
    Guard g(*this);
    if (is_name("not")) {
      ExprP e = node(Expr::K::not_, cur().pos);
      skip();
      e->a = not_expr();
      return deep(std::move(e));
    }
    return compare();
  }

  ExprP compare() {
    Guard g(*this);
    ExprP l = math1();
    while (true) {
      const Pos p = cur().pos;
      static const char* const kOps[] = {"==", "!=", "<", ">", "<=", ">="};
      const char* op = nullptr;
      if (cur().k == Token::K::op)
        for (const char* o : kOps)
          if (cur().s == o) op = o;
      if (op) {
        skip();
      } else if (is_name("in")) {
        op = "in";
        skip();
      } else if (is_name("not") && next().k == Token::K::name && next().s == "in") {
        op = "not in";
        skip();
        skip();
      } else {
        return l;
      }
      l = binary(Expr::K::binop, op, std::move(l), math1(), p);
    }
  }

  ExprP math1() {
    Guard g(*this);
    ExprP l = concat();
    while (is_op("+") || is_op("-")) {
      const Pos p = cur().pos;
      const char* op = cur().s == "+" ? "+" : "-";
      skip();
      l = binary(Expr::K::binop, op, std::move(l), concat(), p);
    }
    return l;
  }

  ExprP concat() {
    Guard g(*this);
    ExprP l = math2();
    while (is_op("~")) {
      const Pos p = cur().pos;
      skip();
      l = binary(Expr::K::binop, "~", std::move(l), math2(), p);
    }
    return l;
  }

  ExprP math2() {
    Guard g(*this);
    ExprP l = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Pos p = cur().pos;
      const std::string op = cur().s;
      skip();
      l = binary(Expr::K::binop, op == "*" ? "*" : op == "/" ? "/" : op == "//" ? "//" : "%", std::move(l), power(), p);
    }
    return l;
  }

  ExprP power() {
    Guard g(*this);
    ExprP l = unary(true);
    while (is_op("**")) {
      const Pos p = cur().pos;
      skip();
      l = binary(Expr::K::binop, "**", std::move(l), unary(true), p);
    }
    return l;
  }

  ExprP unary(bool with_filter) {
    Guard g(*this);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      e = node(is_op("-") ? Expr::K::neg : Expr::K::pos_, cur().pos);
      skip();
      e->a = unary(false);
      e = deep(std::move(e));
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    if (with_filter) e = filters_and_tests(std::move(e));
    return e;
  }

  ExprP primary() {
    Guard g(*this);
    const Token& t = cur();
    const Pos p = t.pos;
    if (t.k == Token::K::name) {
      ExprP e = node(Expr::K::literal, p);
      if (t.s == "true" || t.s == "True") e->value = Value::boolean(true);
      else if (t.s == "false" || t.s == "False") e->value = Value::boolean(false);
      else if (t.s == "none" || t.s == "None") e->value = Value::none();
      else {
        e->k = Expr::K::name;
        e->name = t.s;
      }
      skip();
      return e;
    }
    if (t.k == Token::K::string) {
      std::string s;
      while (cur().k == Token::K::string) {  // adjacent literals join, as in Python
        s += cur().s;
        skip();
      }
      ExprP e = node(Expr::K::literal, p);
      e->value = Value::string(std::move(s));
      return e;
    }
    if (t.k == Token::K::integer || t.k == Token::K::floating) {
      ExprP e = node(Expr::K::literal, p);
      e->value = t.k == Token::K::integer ? Value::integer(t.i) : Value::floating(t.d);
      skip();
      return e;
    }
    if (is_op("(")) {
      skip();
      if (is_op(")")) {
        skip();
        return node(Expr::K::tuple, p);
      }
      ExprP e = expression();
      if (is_op(",")) {
        ExprP tup = node(Expr::K::tuple, p);
        tup->items.push_back(std::move(e));
        while (is_op(",")) {
          skip();
          if (is_op(")")) break;
          tup->items.push_back(expression());
        }
        e = deep(std::move(tup));
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      skip();
      ExprP e = node(Expr::K::list, p);
      while (!is_op("]")) {
        e->items.push_back(expression());
        if (!is_op(",")) break;
        skip();
      }
      expect_op("]");
      return deep(std::move(e));
    }
    if (is_op("{")) {
      skip();
      ExprP e = node(Expr::K::dict, p);
      while (!is_op("}")) {
        e->items.push_back(expression());
        expect_op(":");
        e->items.push_back(expression());
        if (!is_op(",")) break;
        skip();
      }
      expect_op("}");
      return deep(std::move(e));
    }
    expected("an expression");
  }

  ExprP postfix(ExprP e) {
    while (true) {
      const Pos p = cur().pos;
      if (is_op(".")) {
        skip();
        if (cur().k == Token::K::integer) {  // x.0 is x[0]
          ExprP idx = node(Expr::K::index, p);
          idx->a = std::move(e);
          idx->b = node(Expr::K::literal, cur().pos);
          idx->b->value = Value::integer(cur().i);
          skip();
          e = deep(std::move(idx));
          continue;
        }
        ExprP at = node(Expr::K::attr, p);
        at->name = take_name();
        at->a = std::move(e);
        e = deep(std::move(at));
      } else if (is_op("[")) {
        skip();
        e = deep(subscript(std::move(e), p));
      } else if (is_op("(")) {
        ExprP call = node(Expr::K::call, p);
        call->args = call_args();
        call->a = std::move(e);
        e = deep(std::move(call));
      } else {
        return e;
      }
    }
  }

  ExprP subscript(ExprP obj, Pos p) {
    Guard g(*this);
    ExprP parts[3];
    int n = 0;
    bool is_slice = false;
    while (true) {
      if (!is_op(":") && !is_op("]")) parts[n] = expression();
      if (is_op(":")) {
        is_slice = true;
        if (++n > 2) expected("']'");
        skip();
        continue;
      }
      break;
    }
    expect_op("]");
    if (!is_slice) {
      if (!parts[0]) throw Error(where(p) + "expected an index, got ']'");
      ExprP idx = node(Expr::K::index, p);
      idx->a = std::move(obj);
      idx->b = std::move(parts[0]);
      return idx;
    }
    ExprP sl = node(Expr::K::slice, p);
    sl->items.push_back(std::move(obj));
    sl->a = std::move(parts[0]);
    sl->b = std::move(parts[1]);
    sl->c = std::move(parts[2]);
    return sl;
  }

  CallArgs call_args() {
    Guard g(*this);
    CallArgs out;
    expect_op("(");
    while (!is_op(")")) {
      if (cur().k == Token::K::name && next().k == Token::K::op && next().s == "=") {
        std::string name = cur().s;
        skip();
        skip();
        out.kw.emplace_back(std::move(name), expression());
      } else {
        if (!out.kw.empty()) throw Error(where(cur().pos) + "a positional argument follows keyword arguments");
        out.pos.push_back(expression());
      }
      if (!is_op(",")) break;
      skip();
    }
    expect_op(")");
    return out;
  }

  // |name or |name(args), applied to `operand` (null for block filters).
  ExprP filter_node(ExprP operand) {
    ExprP f = node(Expr::K::filter, cur().pos);
    f->name = take_name();
    while (is_op(".")) {  // dotted filter names are kept whole
      skip();
      f->name += "." + take_name();
    }
    if (is_op("(")) f->args = call_args();
    f->a = std::move(operand);
    return f;
  }

  ExprP filters_and_tests(ExprP e) {
    while (true) {
      if (is_op("|")) {
        skip();
        e = deep(filter_node(std::move(e)));
        e = postfix(std::move(e));
      } else if (is_name("is")) {
        ExprP t = node(Expr::K::test, cur().pos);
        skip();
        if (is_name("not")) {
          t->negate = true;
          skip();
        }
        t->name = take_name();
        if (is_op("(")) {
          t->args = call_args();
        } else if (cur().k == Token::K::string || cur().k == Token::K::integer || cur().k == Token::K::floating ||
                   is_op("[") || is_op("{") ||
                   (cur().k == Token::K::name && cur().s != "and" && cur().s != "or" && cur().s != "else" &&
                    cur().s != "if" && cur().s != "not" && cur().s != "in" && cur().s != "is")) {
          // `is divisibleby 3`, `is sameas false`: one argument without parentheses.
          t->args.pos.push_back(postfix(primary()));
        }
        t->a = std::move(e);
        e = deep(std::move(t));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t k_ = 0;
  int depth_ = 0;
};

}  // namespace

Program parse_tokens(std::vector<Token> tokens) { return Parser(std::move(tokens)).run(); }

}  // namespace ds4::jinja

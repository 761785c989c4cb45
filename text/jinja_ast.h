#pragma once
/// The parsed form of a template (internal to text/jinja*.cpp): tokens from
/// the lexer, expression and statement nodes from the parser. Every node
/// keeps its line and column for runtime errors.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja_value.h"

namespace ds4::jinja {

struct Pos {
  int line = 1, col = 1;
};
/// "template:LINE:COL: " for messages.
std::string where(Pos p);

struct Token {
  enum class K { text, var_begin, var_end, block_begin, block_end, name, string, integer, floating, op, eof };
  K k = K::eof;
  std::string s;  // text, name, string value, operator
  int64_t i = 0;
  double d = 0;
  Pos pos;
};

/// Splits `source` into tokens, applying whitespace control (`{%-`, `-%}`),
/// trim_blocks, lstrip_blocks and the dropped trailing newline, as
/// transformers configures Jinja. Throws ds4::Error "template:L:C: ...".
std::vector<Token> lex(std::string_view source);

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct CallArgs {
  std::vector<ExprP> pos;
  std::vector<std::pair<std::string, ExprP>> kw;
};

struct Expr {
  enum class K {
    literal, name, list, tuple, dict, attr, index, slice, call, filter, test,
    neg, pos_, not_, binop, and_, or_, cond
  };
  K k;
  Pos pos;
  Value value;             // literal
  std::string name;        // name, attr, filter, test, binop operator
  std::vector<ExprP> items;  // list, tuple, dict (key, value, key, value ...)
  ExprP a, b, c;           // operands: object/left/cond..., slice start/stop/step
  CallArgs args;           // call, filter, test
  bool negate = false;     // test: `is not`
  int depth = 1;           // of the tree below, bounded by the parser
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Param {
  std::string name;
  ExprP def;  // may be null
};

struct Stmt {
  enum class K { text, output, if_, for_, set, set_block, macro, call_block, filter_block, break_, continue_, do_, block };
  K k;
  Pos pos;
  std::string text;                // text; macro name
  ExprP expr;                      // output, set value, for iterable, do, call_block call
  ExprP target;                    // set/for target: name, tuple of names, attr (ns.x)
  ExprP cond;                      // for ... if cond
  std::vector<std::pair<ExprP, Body>> branches;  // if / elif
  Body body, else_body;
  std::vector<Param> params;       // macro, call_block caller
  std::vector<ExprP> filters;      // filter_block, set_block: filter nodes with a = null operand
};

struct Program {
  Body body;
};

/// Parses the tokens. Throws ds4::Error "template:L:C: expected ..., got ...".
Program parse_tokens(std::vector<Token> tokens);

}  // namespace ds4::jinja

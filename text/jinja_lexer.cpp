// The lexer: template text, {{ expressions }}, {% statements %} and
// {# comments #}, with Jinja's whitespace control as transformers sets it up
// (trim_blocks, lstrip_blocks, no trailing newline).
#include <cstring>

#include "shared/error.h"
#include "text/jinja_ast.h"
#include "text/utf8.h"

namespace ds4::jinja {

std::string where(Pos p) { return "template:" + std::to_string(p.line) + ":" + std::to_string(p.col) + ": "; }

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }


class Lexer {
 public:
  explicit Lexer(std::string_view src) : src_(src) {
    if (!src_.empty() && src_.back() == '\n') src_.remove_suffix(1);
  }

  std::vector<Token> run() {
    while (k_ < src_.size()) text_then_tag();
    push(Token::K::eof, "", here());
    return std::move(out_);
  }

 private:
  Pos here() const { return {line_, col_}; }
  bool at(std::string_view s) const { return src_.substr(k_, s.size()) == s; }
  char peek(size_t ahead = 0) const { return k_ + ahead < src_.size() ? src_[k_ + ahead] : '\0'; }
  void advance(size_t n) {
    for (size_t m = 0; m < n && k_ < src_.size(); ++m, ++k_) {
      if (src_[k_] == '\n') {
        ++line_;
        col_ = 1;
      } else if ((static_cast<unsigned char>(src_[k_]) & 0xC0) != 0x80) {
        ++col_;
      }
    }
  }
  [[noreturn]] void fail(Pos p, const std::string& what) const { throw Error(where(p) + what); }
  void push(Token::K k, std::string s, Pos p) {
    Token t;
    t.k = k;
    t.s = std::move(s);
    t.pos = p;
    out_.push_back(std::move(t));
  }

  // Text up to the next tag, then the tag.
  void text_then_tag() {
    const Pos text_pos = here();
    size_t m = k_;
    while (true) {
      m = src_.find('{', m);
      if (m == std::string_view::npos || m + 1 >= src_.size()) {
        m = src_.size();
        break;
      }
      const char c = src_[m + 1];
      if (c == '{' || c == '%' || c == '#') break;
      ++m;
    }
    std::string text(src_.substr(k_, m - k_));
    if (strip_next_) {
      size_t s = 0;
      while (s < text.size() && is_space(text[s])) ++s;
      text.erase(0, s);
      strip_next_ = false;
    }
    advance(m - k_);
    if (k_ < src_.size()) {
      const char kind = src_[k_ + 1];
      const char mod = peek(2);
      if (mod == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (kind != '{' && mod != '+') {
        // lstrip_blocks: spaces and tabs between a line's start and a block tag go.
        size_t s = text.size();
        while (s > 0 && (text[s - 1] == ' ' || text[s - 1] == '\t')) --s;
        const bool line_start = s > 0 ? text[s - 1] == '\n' : text_pos.col == 1;
        if (line_start) text.resize(s);
      }
    }
    if (!text.empty()) push(Token::K::text, std::move(text), text_pos);
    if (k_ >= src_.size()) return;
    const Pos tag_pos = here();
    const char kind = src_[k_ + 1];
    advance(2);
    if (peek() == '-' || peek() == '+') advance(1);
    if (kind == '#') return comment(tag_pos);
    if (kind == '%' && raw_block(tag_pos)) return;
    push(kind == '{' ? Token::K::var_begin : Token::K::block_begin, "", tag_pos);
    inside_tag(kind == '{', tag_pos);
  }

  void comment(Pos tag_pos) {
    const size_t end = src_.find("#}", k_);
    if (end == std::string_view::npos) fail(tag_pos, "unterminated comment: expected '#}'");
    const bool strip = end > k_ && src_[end - 1] == '-';
    advance(end + 2 - k_);
    after_block(strip);
  }

  // After %} or #}: `-` strips the next text's leading whitespace, else
  // trim_blocks drops one newline.
  void after_block(bool strip) {
    if (strip) {
      strip_next_ = true;
    } else if (peek() == '\n') {
      advance(1);
    } else if (peek() == '\r' && peek(1) == '\n') {
      advance(2);
    }
  }

  // {% raw %} ... {% endraw %}: the text between is kept as it is.
  bool raw_block(Pos tag_pos) {
    size_t m = k_;
    while (m < src_.size() && is_space(src_[m])) ++m;
    if (src_.substr(m, 3) != "raw" || (m + 3 < src_.size() && is_name_char(src_[m + 3]))) return false;
    m += 3;
    while (m < src_.size() && is_space(src_[m])) ++m;
    bool strip = false;
    if (m < src_.size() && src_[m] == '-') {
      strip = true;
      ++m;
    }
    if (src_.substr(m, 2) != "%}") fail(here(), "expected '%}' after 'raw'");
    advance(m + 2 - k_);
    after_block(strip);
    // Find {%-? endraw -?%}.
    size_t s = k_;
    while (true) {
      s = src_.find("{%", s);
      if (s == std::string_view::npos) fail(tag_pos, "unterminated raw block: expected '{% endraw %}'");
      size_t e = s + 2;
      const bool lstrip = e < src_.size() && src_[e] == '-';
      if (e < src_.size() && (src_[e] == '-' || src_[e] == '+')) ++e;
      while (e < src_.size() && is_space(src_[e])) ++e;
      if (src_.substr(e, 6) != "endraw") {
        s += 2;
        continue;
      }
      e += 6;
      while (e < src_.size() && is_space(src_[e])) ++e;
      bool rstrip = false;
      if (e < src_.size() && src_[e] == '-') {
        rstrip = true;
        ++e;
      }
      if (src_.substr(e, 2) != "%}") fail(here(), "expected '%}' after 'endraw'");
      std::string text(src_.substr(k_, s - k_));
      if (strip_next_) {
        size_t p = 0;
        while (p < text.size() && is_space(text[p])) ++p;
        text.erase(0, p);
        strip_next_ = false;
      }
      if (lstrip) while (!text.empty() && is_space(text.back())) text.pop_back();
      const Pos text_pos = here();
      if (!text.empty()) push(Token::K::text, std::move(text), text_pos);
      advance(e + 2 - k_);
      after_block(rstrip);
      return true;
    }
  }

  void inside_tag(bool var, Pos tag_pos) {
    int braces = 0;
    while (true) {
      while (k_ < src_.size() && is_space(src_[k_])) advance(1);
      if (k_ >= src_.size()) fail(tag_pos, var ? "unterminated '{{': expected '}}'" : "unterminated '{%': expected '%}'");
      const Pos p = here();
      if (var && braces == 0 && (at("}}") || at("-}}"))) {
        const bool strip = peek() == '-';
        advance(strip ? 3 : 2);
        if (strip) strip_next_ = true;
        push(Token::K::var_end, "", p);
        return;
      }
      if (!var && (at("%}") || at("-%}"))) {
        const bool strip = peek() == '-';
        advance(strip ? 3 : 2);
        push(Token::K::block_end, "", p);
        after_block(strip);
        return;
      }
      const char c = peek();
      if (c == '\'' || c == '"') {
        string_literal(p);
      } else if (is_digit(c)) {
        number(p);
      } else if (is_name_start(c)) {
        size_t e = k_;
        while (e < src_.size() && is_name_char(src_[e])) ++e;
        std::string name(src_.substr(k_, e - k_));
        advance(e - k_);
        push(Token::K::name, std::move(name), p);
      } else {
        static const char* const kOps2[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* o : kOps2)
          if (at(o)) op = o;
        if (op.empty()) {
          if (!std::strchr("+-*/%~<>()[]{}.,:|=", c))
            fail(p, std::string("unexpected character '") + c + "'");
          op = std::string(1, c);
          if (c == '{') ++braces;
          if (c == '}' && braces > 0) --braces;
        }
        advance(op.size());
        push(Token::K::op, std::move(op), p);
      }
    }
  }

  void number(Pos p) {
    size_t e = k_;
    std::string digits;
    while (e < src_.size() && (is_digit(src_[e]) || src_[e] == '_')) {
      if (src_[e] != '_') digits += src_[e];
      ++e;
    }
    bool is_float = false;
    if (e + 1 < src_.size() && src_[e] == '.' && is_digit(src_[e + 1])) {
      is_float = true;
      digits += src_[e++];
      while (e < src_.size() && (is_digit(src_[e]) || src_[e] == '_')) {
        if (src_[e] != '_') digits += src_[e];
        ++e;
      }
    }
    if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t x = e + 1;
      if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
      if (x < src_.size() && is_digit(src_[x])) {
        is_float = true;
        digits += src_.substr(e, x - e);
        e = x;
        while (e < src_.size() && is_digit(src_[e])) digits += src_[e++];
      }
    }
    advance(e - k_);
    Token t;
    t.pos = p;
    if (is_float) {
      t.k = Token::K::floating;
      t.d = std::strtod(digits.c_str(), nullptr);
    } else {
      t.k = Token::K::integer;
      errno = 0;
      char* end = nullptr;
      const long long v = std::strtoll(digits.c_str(), &end, 10);
      if (errno == ERANGE) fail(p, "integer " + digits + " is out of range");
      t.i = v;
    }
    out_.push_back(std::move(t));
  }

  void string_literal(Pos p) {
    const char q = peek();
    advance(1);
    std::string s;
    while (true) {
      if (k_ >= src_.size()) fail(p, std::string("unterminated string: expected ") + q);
      const char c = src_[k_];
      if (c == q) {
        advance(1);
        break;
      }
      if (c != '\\') {
        s += c;
        advance(1);
        continue;
      }
      const char e = peek(1);
      advance(2);
      switch (e) {
        case 'n': s += '\n'; break;
        case 't': s += '\t'; break;
        case 'r': s += '\r'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'v': s += '\v'; break;
        case 'a': s += '\a'; break;
        case '0': s += '\0'; break;
        case '\\': s += '\\'; break;
        case '\'': s += '\''; break;
        case '"': s += '"'; break;
        case '\n': break;
        case 'x': case 'u': case 'U': {
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (size_t m = 0; m < n; ++m) {
            const char h = peek();
            const int v = is_digit(h) ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
            if (v < 0) fail(here(), std::string("expected a hexadecimal digit in '\\") + e + "' escape");
            cp = cp * 16 + uint32_t(v);
            advance(1);
          }
          append_utf8(s, cp);
          break;
        }
        case '\0': fail(p, std::string("unterminated string: expected ") + q);
        default:
          s += '\\';
          s += e;
      }
    }
    push(Token::K::string, std::move(s), p);
  }

  std::string_view src_;
  size_t k_ = 0;
  int line_ = 1, col_ = 1;
  bool strip_next_ = false;
  std::vector<Token> out_;
};

}  // namespace

std::vector<Token> lex(std::string_view source) { return Lexer(source).run(); }

}  // namespace ds4::jinja

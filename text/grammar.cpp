// The GBNF parser: text → Grammar (rules as one flat array of elements).
// Repetitions become rules of their own, as llama.cpp does: x* is
// R ::= x R | (empty), x{2,4} is x x R2 with R2 ::= x R1 | (empty), and so on.
#include <algorithm>
#include <functional>
#include <map>
#include <unordered_map>

#include "shared/error.h"
#include "text/grammar.h"

namespace ds4::grammar {

namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

class Parser {
 public:
  Parser(std::string_view text, const Limits& limits) : src_(text), limits_(limits) {}

  std::shared_ptr<const Grammar> run();

 private:
  using Seq = std::vector<Element>;  // one rule's body: alternatives separated by alt, ended by end

  [[noreturn]] void fail_at(size_t pos, const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos && i < src_.size(); ++i) {
      if (src_[i] == '\n') ++line, col = 1;
      else ++col;
    }
    throw Error("grammar:" + std::to_string(line) + ":" + std::to_string(col) + ": " + what);
  }
  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }

  bool at_end() const { return pos_ >= src_.size(); }
  char peek(size_t ahead = 0) const { return pos_ + ahead < src_.size() ? src_[pos_ + ahead] : '\0'; }

  // Spaces, tabs, newlines and comments.
  void skip_space() {
    while (!at_end()) {
      const char c = peek();
      if (c == ' ' || c == '\t' || c == '\r' || c == '\n') ++pos_;
      else if (c == '#')
        while (!at_end() && peek() != '\n') ++pos_;
      else break;
    }
  }

  std::string parse_name() {
    const size_t start = pos_;
    while (!at_end() && is_name_char(peek())) ++pos_;
    if (pos_ == start) fail("expected a rule name");
    return std::string(src_.substr(start, pos_ - start));
  }

  // Whether a rule definition `name ::=` starts here (it ends the rule before).
  bool at_definition() const {
    size_t p = pos_;
    while (p < src_.size() && is_name_char(src_[p])) ++p;
    if (p == pos_) return false;
    while (p < src_.size() && (src_[p] == ' ' || src_[p] == '\t')) ++p;
    return src_.substr(p, 3) == "::=";
  }

  uint32_t rule_id(const std::string& name, size_t used_at) {
    auto [it, added] = ids_.try_emplace(name, uint32_t(rules_.size()));
    if (added) {
      if (rules_.size() >= limits_.max_rules)
        fail_at(used_at, "more than " + std::to_string(limits_.max_rules) + " rules");
      rules_.emplace_back();
      names_.push_back(name);
      defined_at_.push_back(std::string::npos);
      used_at_.push_back(used_at);
    }
    return it->second;
  }

  // A rule of the parser's own (a group or a repetition), named after `base`.
  uint32_t reserve_rule(const std::string& base) {
    std::string name;
    do name = base + "_" + std::to_string(++generated_);
    while (ids_.count(name));
    const uint32_t id = rule_id(name, pos_);
    defined_at_[id] = pos_;
    return id;
  }
  uint32_t new_rule(const std::string& base, Seq body) {
    const uint32_t id = reserve_rule(base);
    count_elements(body.size());
    rules_[id] = std::move(body);
    return id;
  }

  void count_elements(size_t n) {
    n_elements_ += n;
    if (n_elements_ > limits_.max_elements)
      fail("more than " + std::to_string(limits_.max_elements) + " grammar elements");
  }

  uint32_t decode_utf8() {
    const auto b0 = uint8_t(src_[pos_]);
    if (b0 < 0x80) return ++pos_, b0;
    int len = b0 >= 0xF0 && b0 <= 0xF4 ? 4 : b0 >= 0xE0 ? 3 : b0 >= 0xC2 && b0 < 0xE0 ? 2 : 0;
    if (len == 0 || pos_ + size_t(len) > src_.size()) fail("invalid UTF-8");
    uint32_t cp = b0 & (0x7F >> len);
    for (int i = 1; i < len; ++i) {
      const auto b = uint8_t(src_[pos_ + size_t(i)]);
      if ((b & 0xC0) != 0x80) fail("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3F);
    }
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) fail("invalid UTF-8");
    pos_ += size_t(len);
    return cp;
  }

  uint32_t parse_hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const char c = peek();
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) fail("expected " + std::to_string(digits) + " hex digits");
      v = v * 16 + uint32_t(d);
      ++pos_;
    }
    if (v > kMaxCodePoint) fail("code point out of range");
    return v;
  }

  // One character of a literal or class, escapes decoded.
  uint32_t parse_char() {
    if (at_end()) fail("unexpected end of grammar");
    if (peek() != '\\') {
      if (peek() == '\n') fail("newline inside a literal or class");
      return decode_utf8();
    }
    ++pos_;
    const char c = peek();
    ++pos_;
    switch (c) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case '0': return 0;
      case '\\': case '"': case '[': case ']': case '-': case '/': case '\'': case '^': return uint32_t(uint8_t(c));
      case 'x': return parse_hex(2);
      case 'u': return parse_hex(4);
      case 'U': return parse_hex(8);
      default:
        --pos_;
        fail(std::string("unknown escape '\\") + (c ? std::string(1, c) : "") + "'");
    }
  }

  uint32_t class_id(Grammar::Class cls) {
    auto [it, added] = class_ids_.try_emplace(cls, uint32_t(classes_.size()));
    if (added) classes_.push_back(std::move(cls));
    return it->second;
  }

  static Grammar::Class normalize(std::vector<std::pair<uint32_t, uint32_t>> r, bool negated) {
    std::sort(r.begin(), r.end());
    Grammar::Class merged;
    for (auto [lo, hi] : r) {
      if (!merged.empty() && lo <= merged.back().second + 1) merged.back().second = std::max(merged.back().second, hi);
      else merged.push_back({lo, hi});
    }
    if (!negated) return merged;
    Grammar::Class out;
    uint32_t next = 0;
    for (auto [lo, hi] : merged) {
      if (lo > next) out.push_back({next, lo - 1});
      next = hi + 1;
    }
    if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
    return out;
  }

  void parse_literal(Seq& out) {
    ++pos_;  // "
    while (true) {
      if (at_end()) fail("unterminated literal");
      if (peek() == '"') break;
      const uint32_t cp = parse_char();
      out.push_back({Element::chars, class_id({{cp, cp}})});
    }
    ++pos_;
  }

  void parse_class(Seq& out) {
    const size_t start = pos_;
    ++pos_;  // [
    const bool negated = peek() == '^';
    if (negated) ++pos_;
    std::vector<std::pair<uint32_t, uint32_t>> ranges;
    while (true) {
      if (at_end()) fail_at(start, "unterminated character class");
      if (peek() == ']') break;
      const uint32_t lo = parse_char();
      uint32_t hi = lo;
      if (peek() == '-' && peek(1) != ']') {
        ++pos_;
        hi = parse_char();
        if (hi < lo) fail("range end below its start");
      }
      ranges.push_back({lo, hi});
    }
    ++pos_;
    Grammar::Class cls = normalize(std::move(ranges), negated);
    if (cls.empty()) fail_at(start, "the character class matches nothing");
    out.push_back({Element::chars, class_id(std::move(cls))});
  }

  size_t parse_count() {
    const size_t start = pos_;
    size_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      v = v * 10 + size_t(peek() - '0');
      if (v > limits_.max_repeat) fail_at(start, "repetition count above " + std::to_string(limits_.max_repeat));
      ++pos_;
    }
    if (pos_ == start) fail("expected a number");
    return v;
  }

  // Replaces out[last..] (one item) by its repetition {min, max} (max < 0: unbounded).
  void repeat(Seq& out, size_t last, size_t min, long max, const std::string& rule) {
    const Seq item(out.begin() + long(last), out.end());
    out.resize(last);
    const size_t copies = min + (max < 0 ? 1 : size_t(max) - min);
    if (copies > limits_.max_repeat) fail("repetition count above " + std::to_string(limits_.max_repeat));
    count_elements(item.size() * (copies + 1));
    for (size_t i = 0; i < min; ++i) out.insert(out.end(), item.begin(), item.end());
    if (max < 0) {
      // R ::= item R | (empty)
      const uint32_t id = reserve_rule(rule + "_star");
      Seq body = item;
      body.push_back({Element::rule_ref, id});
      body.push_back({Element::alt, 0});
      body.push_back({Element::end, 0});
      rules_[id] = std::move(body);
      out.push_back({Element::rule_ref, id});
      return;
    }
    // R1 ::= item | (empty);  Rk ::= item R(k-1) | (empty)
    long prev = -1;
    for (size_t k = min; k < size_t(max); ++k) {
      Seq body = item;
      if (prev >= 0) body.push_back({Element::rule_ref, uint32_t(prev)});
      body.push_back({Element::alt, 0});
      body.push_back({Element::end, 0});
      prev = long(new_rule(rule + "_opt", std::move(body)));
    }
    if (prev >= 0) out.push_back({Element::rule_ref, uint32_t(prev)});
  }

  // sequence ( "|" sequence )* up to `)` (nested) or the next definition / end.
  Seq parse_alternatives(const std::string& rule, bool nested) {
    Seq out;
    while (true) {
      parse_sequence(out, rule, nested);
      if (peek() != '|') break;
      ++pos_;
      out.push_back({Element::alt, 0});
    }
    out.push_back({Element::end, 0});
    return out;
  }

  void parse_sequence(Seq& out, const std::string& rule, bool nested) {
    size_t last = std::string::npos;  // start of the last item, for a postfix
    while (true) {
      skip_space();
      if (at_end()) break;
      const char c = peek();
      const size_t here = out.size();
      if (c == '|') break;
      if (c == ')') {
        if (!nested) fail("unmatched ')'");
        break;
      }
      if (c == '"') {
        parse_literal(out);
        if (out.size() == here) {
          last = std::string::npos;  // "" matches the empty text; nothing to repeat
          continue;
        }
      } else if (c == '[') {
        parse_class(out);
      } else if (c == '.') {
        ++pos_;
        out.push_back({Element::chars, class_id({{0, kMaxCodePoint}})});
      } else if (c == '(') {
        const size_t open = pos_++;
        Seq body = parse_alternatives(rule, true);
        if (peek() != ')') fail_at(open, "unclosed '('");
        ++pos_;
        out.push_back({Element::rule_ref, new_rule(rule, std::move(body))});
      } else if (is_name_char(c)) {
        if (at_definition()) {
          if (nested) fail("a rule definition inside '('");
          break;
        }
        const size_t at = pos_;
        out.push_back({Element::rule_ref, rule_id(parse_name(), at)});
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (last == std::string::npos) fail(std::string("'") + c + "' without an item before it");
        ++pos_;
        if (c == '*') repeat(out, last, 0, -1, rule);
        else if (c == '+') repeat(out, last, 1, -1, rule);
        else if (c == '?') repeat(out, last, 0, 1, rule);
        else {
          skip_space();
          const size_t min = parse_count();
          long max = long(min);
          skip_space();
          if (peek() == ',') {
            ++pos_;
            skip_space();
            max = peek() == '}' ? -1 : long(parse_count());
            skip_space();
          }
          if (peek() != '}') fail("expected '}'");
          ++pos_;
          if (max >= 0 && size_t(max) < min) fail("repetition {m,n} with n < m");
          repeat(out, last, min, max, rule);
        }
        last = std::string::npos;  // x** is an error, as in llama.cpp
        continue;
      } else {
        fail(std::string("unexpected '") + c + "'");
      }
      last = here;
    }
  }

  void check_left_recursion();

  std::string_view src_;
  Limits limits_;
  size_t pos_ = 0;
  std::unordered_map<std::string, uint32_t> ids_;
  std::vector<Seq> rules_;
  std::vector<std::string> names_;
  std::vector<size_t> defined_at_, used_at_;
  std::map<Grammar::Class, uint32_t> class_ids_;
  std::vector<Grammar::Class> classes_;
  size_t generated_ = 0;
  size_t n_elements_ = 0;
};

std::shared_ptr<const Grammar> Parser::run() {
  if (src_.size() > limits_.max_bytes)
    throw Error("grammar: the text is " + std::to_string(src_.size()) + " bytes, more than " +
                std::to_string(limits_.max_bytes));
  skip_space();
  while (!at_end()) {
    const size_t at = pos_;
    const std::string name = parse_name();
    skip_space();
    if (src_.substr(pos_, 3) != "::=") fail("expected '::=' after the rule name '" + name + "'");
    pos_ += 3;
    const uint32_t id = rule_id(name, at);
    if (defined_at_[id] != std::string::npos) fail_at(at, "rule '" + name + "' is defined twice");
    defined_at_[id] = at;
    Seq body = parse_alternatives(name, false);
    count_elements(body.size());
    rules_[id] = std::move(body);
    skip_space();
  }
  for (size_t i = 0; i < rules_.size(); ++i)
    if (defined_at_[i] == std::string::npos) fail_at(used_at_[i], "undefined rule '" + names_[i] + "'");
  auto root = ids_.find("root");
  if (root == ids_.end()) fail_at(src_.size(), "no 'root' rule");
  check_left_recursion();

  auto g = std::make_shared<Grammar>();
  g->limits = limits_;
  g->root = root->second;
  g->rule_names = names_;
  g->classes = std::move(classes_);
  g->alts.resize(rules_.size());
  for (size_t r = 0; r < rules_.size(); ++r) {
    const auto start = uint32_t(g->elements.size());
    g->rule_start.push_back(start);
    g->alts[r].push_back(start);
    for (const Element& e : rules_[r]) {
      g->elements.push_back(e);
      if (e.type == Element::alt) g->alts[r].push_back(uint32_t(g->elements.size()));
    }
  }
  return g;
}

// A rule that can reach itself without consuming a character would make the
// matcher expand forever: refuse it, naming the rule.
void Parser::check_left_recursion() {
  const size_t n = rules_.size();
  std::vector<bool> nullable(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      bool alt_ok = true;  // the current alternative matches the empty text so far
      for (const Element& e : rules_[r]) {
        if (e.type == Element::alt || e.type == Element::end) {
          if (alt_ok) {
            nullable[r] = changed = true;
            break;
          }
          alt_ok = true;
        } else if (e.type == Element::chars || (e.type == Element::rule_ref && !nullable[e.value])) {
          alt_ok = false;
        }
      }
    }
  }
  // Edges r → s where s can come first in r.
  std::vector<std::vector<uint32_t>> first(n);
  for (size_t r = 0; r < n; ++r) {
    bool open = true;
    for (const Element& e : rules_[r]) {
      if (e.type == Element::alt || e.type == Element::end) open = true;
      else if (!open) continue;
      else if (e.type == Element::chars) open = false;
      else {
        first[r].push_back(e.value);
        open = nullable[e.value];
      }
    }
  }
  std::vector<uint8_t> state(n, 0);  // 0 new, 1 on the path, 2 done
  // Iterative DFS (a long chain of rules must not overflow the C++ stack).
  for (size_t s = 0; s < n; ++s) {
    if (state[s]) continue;
    std::vector<std::pair<uint32_t, size_t>> path{{uint32_t(s), 0}};
    state[s] = 1;
    while (!path.empty()) {
      auto& [r, i] = path.back();
      if (i == first[r].size()) {
        state[r] = 2;
        path.pop_back();
        continue;
      }
      const uint32_t t = first[r][i++];
      if (state[t] == 1) fail_at(defined_at_[t], "rule '" + names_[t] + "' is left-recursive");
      if (state[t] == 0) {
        state[t] = 1;
        path.push_back({t, 0});
      }
    }
  }
}

}  // namespace

std::shared_ptr<const Grammar> Grammar::parse(std::string_view text, const Limits& limits) {
  return Parser(text, limits).run();
}

bool Grammar::class_has(uint32_t cls, uint32_t cp) const {
  const Class& c = classes[cls];
  auto it = std::upper_bound(c.begin(), c.end(), std::pair<uint32_t, uint32_t>{cp, UINT32_MAX});
  return it != c.begin() && std::prev(it)->second >= cp;
}

bool Grammar::class_meets(uint32_t cls, uint32_t lo, uint32_t hi) const {
  for (auto [a, b] : classes[cls])
    if (a <= hi && b >= lo) return true;
  return false;
}

std::string literal(std::string_view text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7F) {
          static const char* hex = "0123456789ABCDEF";
          out += "\\x";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += char(c);
        }
    }
  }
  return out + "\"";
}

}  // namespace ds4::grammar

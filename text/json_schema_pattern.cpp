// A JSON Schema `pattern` as GBNF over the JSON text of the string: a simple
// subset of ECMAScript regular expressions (literals, ., classes with ranges
// and negation, \d \w \s and their negations, groups, (?:...), |, * + ? {m,n},
// ^ and $ at the ends). The rest (lookaround, backreferences, \b) is refused,
// naming the place. A character that JSON must escape is generated escaped
// ("\"" as \", a newline as \n); control characters other than \t \n \r are
// left out of classes (the grammar then generates fewer strings, never an
// invalid one).
#include <algorithm>
#include <string>
#include <vector>

#include "shared/error.h"
#include "text/grammar.h"

namespace ds4::grammar {

namespace {

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

std::string hex_escape(uint32_t cp) {
  static const char* hex = "0123456789ABCDEF";
  std::string out = cp <= 0xFF ? "\\x" : cp <= 0xFFFF ? "\\u" : "\\U";
  const int digits = cp <= 0xFF ? 2 : cp <= 0xFFFF ? 4 : 8;
  for (int i = digits - 1; i >= 0; --i) out += hex[(cp >> (4 * i)) & 15];
  return out;
}

Ranges normalize(Ranges r, bool negated) {
  std::sort(r.begin(), r.end());
  Ranges merged;
  for (auto [lo, hi] : r) {
    if (!merged.empty() && lo <= merged.back().second + 1) merged.back().second = std::max(merged.back().second, hi);
    else merged.push_back({lo, hi});
  }
  if (!negated) return merged;
  Ranges out;
  uint32_t next = 0;
  for (auto [lo, hi] : merged) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= 0x10FFFF) out.push_back({next, 0x10FFFF});
  return out;
}

bool has(const Ranges& r, uint32_t cp) {
  for (auto [lo, hi] : r)
    if (lo <= cp && cp <= hi) return true;
  return false;
}

// The GBNF for one character of the string drawn from `r`, as JSON writes it.
std::string chars_gbnf(const Ranges& r) {
  // Plain part: without '"', '\\' and the control characters.
  Ranges plain;
  for (auto [lo, hi] : r) {
    lo = std::max(lo, 0x20u);
    for (uint32_t cut : {uint32_t('"'), uint32_t('\\')}) {
      if (lo <= cut && cut <= hi) {
        if (lo < cut) plain.push_back({lo, cut - 1});
        lo = cut + 1;
      }
    }
    if (lo <= hi) plain.push_back({lo, hi});
  }
  std::vector<std::string> alts;
  if (!plain.empty()) {
    std::string c = "[";
    for (auto [lo, hi] : plain) c += lo == hi ? hex_escape(lo) : hex_escape(lo) + "-" + hex_escape(hi);
    alts.push_back(c + "]");
  }
  if (has(r, '"')) alts.push_back(R"("\\\"")");
  if (has(r, '\\')) alts.push_back(R"("\\\\")");
  if (has(r, '\n')) alts.push_back(R"("\\n")");
  if (has(r, '\r')) alts.push_back(R"("\\r")");
  if (has(r, '\t')) alts.push_back(R"("\\t")");
  if (alts.empty()) return "";
  if (alts.size() == 1) return alts[0];
  std::string out = "(";
  for (size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + alts[i];
  return out + ")";
}

class PatternParser {
 public:
  PatternParser(const std::string& p, const std::string& path) : p_(p), path_(path) {}

  std::string run() {
    bool start = false, end = false;
    size_t b = 0, e = p_.size();
    if (e > 0 && p_[0] == '^') start = true, b = 1;
    if (e > b && p_[e - 1] == '$' && (e < 2 || p_[e - 2] != '\\')) end = true, --e;
    p_ = p_.substr(b, e - b);
    std::string body = alternatives();
    if (i_ != p_.size()) fail("unexpected ')'");
    const std::string any = "(" + chars_gbnf(normalize({{0, 0x10FFFF}}, false)) + ")*";
    return (start ? "" : any + " ") + "(" + body + ")" + (end ? "" : " " + any);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(path_ + ": " + what + " at offset " + std::to_string(i_) + " (only simple patterns are supported)");
  }
  bool more() const { return i_ < p_.size(); }

  std::string alternatives() {
    std::string out = sequence();
    while (more() && p_[i_] == '|') {
      ++i_;
      out += " | " + sequence();
    }
    return out;
  }

  std::string sequence() {
    std::string out;
    while (more() && p_[i_] != '|' && p_[i_] != ')') {
      std::string a = atom();
      a = quantified(a);
      out += (out.empty() ? "" : " ") + a;
    }
    return out.empty() ? "\"\"" : out;
  }

  std::string quantified(const std::string& a) {
    if (!more()) return a;
    const char c = p_[i_];
    std::string q;
    if (c == '*' || c == '+' || c == '?') {
      q = std::string(1, c);
      ++i_;
    } else if (c == '{') {
      const size_t close = p_.find('}', i_);
      if (close == std::string::npos) fail("unclosed '{'");
      q = p_.substr(i_, close - i_ + 1);
      for (char d : q.substr(1, q.size() - 2))
        if (!(std::isdigit(uint8_t(d)) || d == ',')) fail("bad repetition");
      i_ = close + 1;
    } else {
      return a;
    }
    if (more() && p_[i_] == '?') ++i_;  // lazy: the same strings
    if (more() && (p_[i_] == '*' || p_[i_] == '+' || p_[i_] == '{')) fail("a repetition of a repetition");
    return "(" + a + ")" + q;
  }

  uint32_t code_point() {
    const auto b0 = uint8_t(p_[i_]);
    const int len = b0 < 0x80 ? 1 : b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
    if (i_ + size_t(len) > p_.size()) fail("invalid UTF-8");
    uint32_t cp = len == 1 ? b0 : b0 & (0x7F >> len);
    for (int k = 1; k < len; ++k) cp = (cp << 6) | (uint8_t(p_[i_ + size_t(k)]) & 0x3F);
    i_ += size_t(len);
    return cp;
  }

  // An escape after '\': a class (\d …) into `out`, or one character.
  bool escape(Ranges& out) {
    if (!more()) fail("a pattern ending in '\\'");
    const char c = p_[i_++];
    switch (c) {
      case 'd': out.push_back({'0', '9'}); return true;
      case 'w': for (auto r : Ranges{{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}) out.push_back(r); return true;
      case 's': for (auto r : Ranges{{'\t', '\r'}, {' ', ' '}}) out.push_back(r); return true;
      case 'D': for (auto r : normalize({{'0', '9'}}, true)) out.push_back(r); return true;
      case 'W': for (auto r : normalize({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}, true)) out.push_back(r); return true;
      case 'S': for (auto r : normalize({{'\t', '\r'}, {' ', ' '}}, true)) out.push_back(r); return true;
      case 'n': out.push_back({'\n', '\n'}); return true;
      case 'r': out.push_back({'\r', '\r'}); return true;
      case 't': out.push_back({'\t', '\t'}); return true;
      default:
        if (std::isalnum(uint8_t(c))) { --i_; fail(std::string("the escape '\\") + c + "' is not supported"); }
        out.push_back({uint8_t(c), uint8_t(c)});
        return true;
    }
  }

  std::string atom() {
    const char c = p_[i_];
    if (c == '(') {
      ++i_;
      if (more() && p_[i_] == '?') {
        if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') i_ += 2;
        else fail("lookaround and named groups are not supported");
      }
      std::string inner = alternatives();
      if (!more() || p_[i_] != ')') fail("unclosed '('");
      ++i_;
      return "(" + inner + ")";
    }
    if (c == '*' || c == '+' || c == '?' || c == '{') fail(std::string("'") + c + "' with nothing to repeat");
    if (c == '^' || c == '$') fail("an anchor inside the pattern");
    Ranges r;
    if (c == '.') {
      ++i_;
      r = normalize({{'\n', '\n'}, {'\r', '\r'}}, true);
    } else if (c == '[') {
      r = klass();
    } else if (c == '\\') {
      ++i_;
      escape(r);
      r = normalize(r, false);
    } else {
      const uint32_t cp = code_point();
      r = {{cp, cp}};
    }
    std::string g = chars_gbnf(r);
    if (g.empty()) fail("a character class with no character a JSON string can hold");
    return g;
  }

  Ranges klass() {
    ++i_;  // [
    bool negated = false;
    if (more() && p_[i_] == '^') negated = true, ++i_;
    Ranges r;
    while (true) {
      if (!more()) fail("unclosed '['");
      if (p_[i_] == ']') break;
      Ranges one;
      if (p_[i_] == '\\') {
        ++i_;
        escape(one);
      } else {
        const uint32_t cp = code_point();
        one = {{cp, cp}};
      }
      if (one.size() == 1 && one[0].first == one[0].second && more() && p_[i_] == '-' && i_ + 1 < p_.size() &&
          p_[i_ + 1] != ']') {
        ++i_;
        Ranges hi;
        if (p_[i_] == '\\') {
          ++i_;
          escape(hi);
        } else {
          const uint32_t cp = code_point();
          hi = {{cp, cp}};
        }
        if (hi.size() != 1 || hi[0].first != hi[0].second || hi[0].first < one[0].first) fail("a bad range");
        one[0].second = hi[0].first;
      }
      r.insert(r.end(), one.begin(), one.end());
    }
    ++i_;
    return normalize(r, negated);
  }

  std::string p_;
  std::string path_;
  size_t i_ = 0;
};

}  // namespace

std::string pattern_to_gbnf(const std::string& pattern, const std::string& path) {
  return PatternParser(pattern, path).run();
}

}  // namespace ds4::grammar

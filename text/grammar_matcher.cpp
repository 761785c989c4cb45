// The matcher: a pushdown recognizer over code points, as llama.cpp's. Its
// state is the set of every stack the parse may be in; a stack's top is the
// next character class to match, the positions below it are where each
// enclosing rule continues.
#include <algorithm>

#include "shared/error.h"
#include "text/grammar.h"

namespace ds4::grammar {

namespace {

bool ends_alt(const Element& e) { return e.type == Element::end || e.type == Element::alt; }

void dedup(std::vector<Matcher::Stack>& v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
}

}  // namespace

Matcher::Matcher(std::shared_ptr<const Grammar> g) : g_(std::move(g)) {
  size_t n = 0;
  for (uint32_t a : g_->alts[g_->root]) {
    Stack s;
    if (!ends_alt(g_->elements[a])) s.push_back(a);
    expand(s, stacks_, n, 0);
  }
  stacks_.resize(n);
  dedup(stacks_);
}

// Writes `s` to out[n++] (reusing that slot's buffer) once its top is a
// character class (or it is empty), replacing a rule reference on top by
// each of the rule's alternatives. Leaves `s` as it was.
void Matcher::expand(Stack& s, std::vector<Stack>& out, size_t& n, size_t depth) const {
  const Limits& lim = g_->limits;
  if (s.size() > lim.max_depth || depth > lim.max_depth)
    throw Error("grammar: the parse nests deeper than " + std::to_string(lim.max_depth) + " rules");
  if (s.empty() || g_->elements[s.back()].type == Element::chars) {
    if (n >= lim.max_stacks)
      throw Error("grammar: more than " + std::to_string(lim.max_stacks) + " parse stacks at once (an ambiguous grammar)");
    if (n < out.size()) out[n].assign(s.begin(), s.end());
    else out.push_back(s);
    ++n;
    return;
  }
  const uint32_t pos = s.back();
  const uint32_t rule = g_->elements[pos].value;
  s.pop_back();
  const bool cont = !ends_alt(g_->elements[pos + 1]);
  if (cont) s.push_back(pos + 1);
  const size_t base = s.size();
  for (uint32_t a : g_->alts[rule]) {
    s.resize(base);
    if (!ends_alt(g_->elements[a])) s.push_back(a);
    expand(s, out, n, depth + 1);  // leaves s as it was
  }
  // Back to what the caller passed.
  s.resize(base);
  if (cont) s.pop_back();
  s.push_back(pos);
}

void Matcher::advance_code_point(uint32_t cp) {
  std::vector<Stack>& next = scratch_.out;
  Stack& t = scratch_.tmp;
  size_t n = 0;
  for (const Stack& s : stacks_) {
    if (s.empty()) continue;
    const uint32_t pos = s.back();
    if (!g_->class_has(g_->elements[pos].value, cp)) continue;
    t.assign(s.begin(), s.end() - 1);
    if (!ends_alt(g_->elements[pos + 1])) t.push_back(pos + 1);
    expand(t, next, n, 0);
  }
  next.resize(n);
  dedup(next);
  std::swap(stacks_, next);  // the old stacks' buffers serve the next character
}

bool Matcher::accept_byte(uint8_t b) {
  if (stacks_.empty()) return false;
  static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (partial_len_ == 0) {
    if (b < 0x80) {
      advance_code_point(b);
      return !stacks_.empty();
    }
    const int len = b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3 : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
    if (len == 0) {  // not a UTF-8 lead byte
      stacks_.clear();
      return false;
    }
    partial_len_ = uint8_t(len);
    partial_n_ = 1;
    partial_cp_ = b & (0x7F >> len);
  } else {
    if ((b & 0xC0) != 0x80) {
      stacks_.clear();
      return false;
    }
    partial_cp_ = (partial_cp_ << 6) | (b & 0x3F);
    if (++partial_n_ == partial_len_) {
      const uint32_t cp = partial_cp_;
      const int len = partial_len_;
      partial_len_ = partial_n_ = 0;
      partial_cp_ = 0;
      if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
        stacks_.clear();
        return false;
      }
      advance_code_point(cp);
      return !stacks_.empty();
    }
  }
  // Inside a character: keep the stacks whose class meets some code point
  // that starts with these bytes.
  const int rest = 6 * (partial_len_ - partial_n_);
  uint32_t lo = partial_cp_ << rest, hi = lo | ((1u << rest) - 1);
  lo = std::max(lo, kMin[partial_len_]);
  hi = std::min(hi, 0x10FFFFu);
  std::erase_if(stacks_, [&](const Stack& s) {
    return s.empty() || lo > hi || !g_->class_meets(g_->elements[s.back()].value, lo, hi);
  });
  return !stacks_.empty();
}

bool Matcher::accept(std::string_view bytes) {
  for (char c : bytes)
    if (!accept_byte(uint8_t(c))) return false;
  return !stacks_.empty();
}

bool Matcher::can_accept(std::string_view bytes) const {
  Matcher m = *this;
  return m.accept(bytes);
}

bool Matcher::can_end() const {
  if (partial_len_ != 0) return false;
  return std::any_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.empty(); });
}

bool Matcher::must_end() const { return can_end() && stacks_.size() == 1; }

std::string Matcher::key() const {
  std::string k;
  k.reserve(8 + stacks_.size() * 16);
  auto put = [&](uint32_t v) { k.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(partial_cp_);
  put(uint32_t(partial_n_) << 8 | partial_len_);
  for (const Stack& s : stacks_) {
    put(uint32_t(s.size()));
    for (uint32_t p : s) put(p);
  }
  return k;
}

}  // namespace ds4::grammar

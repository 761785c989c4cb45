#include "text/bpe_pretokenizer.h"

#include "text/unicode.h"

namespace ds4 {

namespace {

using namespace unicode;

constexpr uint8_t kWordClass = kWhitespace | kLetter | kNumber;

/// One fragment [begin, end) of the text being cut further; emit(end) closes
/// the piece from the last cut to `end`.
struct Cutter {
  std::span<const uint32_t> cpts;
  size_t begin, end;
  std::vector<uint32_t>& out;
  size_t prev;

  Cutter(std::span<const uint32_t> c, size_t b, size_t e, std::vector<uint32_t>& o)
      : cpts(c), begin(b), end(e), out(o), prev(b) {}

  bool in(size_t i) const { return i < end; }
  uint32_t cp(size_t i) const { return i < end ? cpts[i] : 0xFFFFFFFFu; }
  uint8_t fl(size_t i) const { return i < end ? flags(cpts[i]) : 0; }
  bool is(size_t i, uint8_t f) const { return (fl(i) & f) != 0; }
  bool is_rn(size_t i) const { return cp(i) == '\r' || cp(i) == '\n'; }

  void emit(size_t to) {
    if (to > prev) out.push_back(uint32_t(to - prev));
    prev = to;
  }

  /// 's 't 'm 'd 're 've 'll at pos (ASCII letters in either case when
  /// `any_case`): the length matched, 0 when none.
  size_t contraction(size_t pos, bool any_case) const {
    if (cp(pos) != '\'' || !in(pos + 1)) return 0;
    auto low = [&](size_t i) {
      const uint32_t c = cp(i);
      return any_case && c >= 'A' && c <= 'Z' ? c + 32 : c;
    };
    const uint32_t a = low(pos + 1);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (!in(pos + 2)) return 0;
    const uint32_t b = low(pos + 2);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
  }

  /// Whitespace at pos: its run length and the end of its last \r or \n (0 if none).
  std::pair<size_t, size_t> whitespace(size_t pos) const {
    size_t n = 0, last_rn = 0;
    while (is(pos + n, kWhitespace)) {
      if (is_rn(pos + n)) last_rn = pos + n + 1;
      ++n;
    }
    return {n, last_rn};
  }
};

// \s+(?!\S) then \s+: a run of n spaces before a non-space keeps its last one
// for the next word (" word"); at the fragment's end it is taken whole.
size_t whitespace_end(const Cutter& c, size_t pos, size_t n) {
  if (n > 1 && c.in(pos + n)) return pos + n - 1;
  return pos + n;
}

// llama.cpp's unicode_regex_split_custom_gpt2, in effect.
void split_gpt2(Cutter& c) {
  for (size_t pos = c.begin; pos < c.end;) {
    if (const size_t n = c.contraction(pos, false)) {
      c.emit(pos += n);
      continue;
    }
    const size_t p2 = c.cp(pos) == ' ' ? pos + 1 : pos;  // " ?"
    if (c.in(p2) && c.is(p2, kLetter | kNumber)) {  // \p{L}+ or \p{N}+
      const uint8_t cls = c.is(p2, kLetter) ? kLetter : kNumber;
      for (pos = p2; c.is(pos, cls);) ++pos;
      c.emit(pos);
      continue;
    }
    if (c.in(p2) && !c.is(p2, kWordClass)) {  // [^\s\p{L}\p{N}]+
      for (pos = p2; c.in(pos) && !c.is(pos, kWordClass);) ++pos;
      c.emit(pos);
      continue;
    }
    const size_t n = c.whitespace(pos).first;
    if (n > 0) {
      c.emit(pos = whitespace_end(c, pos, n));
      continue;
    }
    c.emit(++pos);  // no match: the character alone
  }
}

// llama.cpp's unicode_regex_split_custom_llama3 (max_digits 3) and the Qwen 2
// expression, which differs only in taking digits one at a time.
void split_llama3(Cutter& c, size_t max_digits) {
  for (size_t pos = c.begin; pos < c.end;) {
    const uint32_t cp = c.cp(pos);
    if (const size_t n = c.contraction(pos, true)) {
      c.emit(pos += n);
      continue;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (!(cp == '\r' || cp == '\n' || c.is(pos, kNumber)) &&
        (c.is(pos, kLetter) || c.is(pos + 1, kLetter))) {
      for (++pos; c.is(pos, kLetter);) ++pos;
      c.emit(pos);
      continue;
    }
    // \p{N}{1,max}
    if (c.is(pos, kNumber)) {
      for (size_t start = pos; c.is(pos, kNumber);) {
        if (++pos - start >= max_digits) {
          c.emit(pos);
          start = pos;
        }
      }
      c.emit(pos);
      continue;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    const size_t p2 = cp == ' ' ? pos + 1 : pos;
    if (c.in(p2) && !c.is(p2, kWordClass)) {
      for (pos = p2; c.in(pos) && !c.is(pos, kWordClass);) ++pos;
      while (c.is_rn(pos)) ++pos;
      c.emit(pos);
      continue;
    }
    const auto [n, last_rn] = c.whitespace(pos);
    if (last_rn > 0) {  // \s*[\r\n]+
      c.emit(pos = last_rn);
      continue;
    }
    if (n > 0) {
      c.emit(pos = whitespace_end(c, pos, n));
      continue;
    }
    c.emit(++pos);
  }
}

// \p{P} and \p{S} as llama.cpp's class tables have them: for ASCII its lists,
// which leave out '~'.
bool punct_or_symbol(const Cutter& c, size_t i) {
  const uint32_t cp = c.cp(i);
  if (cp < 0x80) return cp > 0x20 && cp < 0x7F && cp != '~' && !(cp >= '0' && cp <= '9') &&
                        !((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z');
  return c.is(i, kPunctuation | kSymbol);
}

bool ascii_letter(uint32_t cp) { return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z'; }

// DeepSeek V3's word expression, as std::regex reads it over llama.cpp's classes:
//   [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+ | [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
//   | ?[\p{P}\p{S}]+[\r\n]* | \s*[\r\n]+ | \s+(?!\S) | \s+
// Characters that no branch takes stay together between matches.
void split_deepseek3(Cutter& c) {
  size_t pos = c.begin;
  auto match = [&](size_t from, size_t to) {
    c.emit(from);  // the unmatched text before, if any
    c.emit(to);
    pos = to;
  };
  while (pos < c.end) {
    const uint32_t cp = c.cp(pos);
    const bool ascii_punct = cp < 0x80 && cp > 0x20 && cp < 0x7F && !ascii_letter(cp) &&
                             !(cp >= '0' && cp <= '9');
    if (ascii_punct && ascii_letter(c.cp(pos + 1))) {
      size_t e = pos + 1;
      while (ascii_letter(c.cp(e))) ++e;
      match(pos, e);
      continue;
    }
    const bool lead = !(cp == '\r' || cp == '\n' || c.is(pos, kLetter) || punct_or_symbol(c, pos));
    if ((lead && c.is(pos + 1, kLetter | kMark)) || c.is(pos, kLetter | kMark)) {
      size_t e = pos + 1;
      while (c.is(e, kLetter | kMark)) ++e;
      match(pos, e);
      continue;
    }
    const size_t p2 = cp == ' ' ? pos + 1 : pos;
    if (punct_or_symbol(c, p2)) {
      size_t e = p2;
      while (punct_or_symbol(c, e)) ++e;
      while (c.is_rn(e)) ++e;
      match(pos, e);
      continue;
    }
    const auto [n, last_rn] = c.whitespace(pos);
    if (last_rn > 0) {
      match(pos, last_rn);
      continue;
    }
    if (n > 0) {
      match(pos, whitespace_end(c, pos, n));
      continue;
    }
    ++pos;  // unmatched: joins the text before the next match
  }
  c.emit(c.end);
}

/// Runs of characters for which `in_class` holds, cut every `max_run` (0: no
/// limit); the text between runs stays as it is.
template <typename Pred>
void split_runs(Cutter& c, Pred in_class, size_t max_run) {
  for (size_t pos = c.begin; pos < c.end;) {
    if (!in_class(c.cp(pos))) {
      ++pos;
      continue;
    }
    c.emit(pos);
    for (size_t start = pos; pos < c.end && in_class(c.cp(pos));) {
      if (++pos - start == max_run) {
        c.emit(pos);
        start = pos;
      }
    }
    c.emit(pos);
  }
  c.emit(c.end);
}

bool is_number(uint32_t cp) { return (flags(cp) & kNumber) != 0; }
bool is_ascii_digit(uint32_t cp) { return cp >= '0' && cp <= '9'; }
bool is_cjk_deepseek(uint32_t cp) {
  return (cp >= 0x4E00 && cp <= 0x9FA5) || (cp >= 0x3040 && cp <= 0x309F) ||
         (cp >= 0x30A0 && cp <= 0x30FF);
}
// [\p{P}\$\+<=>\^~\|]+ of the default pre-tokenizer.
bool is_default_punct(uint32_t cp) {
  if (cp < 0x80) {
    static constexpr std::string_view kExtra = "$+<=>^~|";
    return kExtra.find(char(cp)) != std::string_view::npos || (flags(cp) & kPunctuation);
  }
  return (flags(cp) & kPunctuation) != 0;
}

/// Applies one pass to every fragment of `lengths`, which it replaces.
template <typename Pass>
void apply(std::span<const uint32_t> cpts, std::vector<uint32_t>& lengths, Pass pass) {
  std::vector<uint32_t> next;
  next.reserve(lengths.size() * 2);
  size_t start = 0;
  for (const uint32_t len : lengths) {
    Cutter c(cpts, start, start + len, next);
    pass(c);
    start += len;
  }
  lengths.swap(next);
}

}  // namespace

std::optional<PreTokenizerInfo> pre_tokenizer_named(std::string_view name) {
  struct Name {
    std::string_view name;
    PreTokenizerInfo info;
  };
  static constexpr Name kNames[] = {
      {"default", {PreTokenizer::kDefault, false, false}},
      {"llama-bpe", {PreTokenizer::kLlama3, true, true}},
      {"llama3", {PreTokenizer::kLlama3, true, true}},
      {"llama-v3", {PreTokenizer::kLlama3, true, true}},
      {"falcon3", {PreTokenizer::kLlama3, true, true}},
      {"pixtral", {PreTokenizer::kLlama3, true, true}},
      {"dbrx", {PreTokenizer::kLlama3, false, false}},
      {"smaug-bpe", {PreTokenizer::kLlama3, false, false}},
      {"qwen2", {PreTokenizer::kQwen2, false, false}},
      {"deepseek-r1-qwen", {PreTokenizer::kQwen2, false, false}},
      {"megrez", {PreTokenizer::kQwen2, false, false}},
      {"deepseek-v3", {PreTokenizer::kDeepSeek3, false, false}},
      {"hunyuan-dense", {PreTokenizer::kDeepSeek3, false, false}},
      {"gpt-2", {PreTokenizer::kGpt2, false, false}},
      {"phi-2", {PreTokenizer::kGpt2, false, false}},
      {"exaone4", {PreTokenizer::kGpt2, false, false}},
      {"mpt", {PreTokenizer::kGpt2, false, false}},
      {"olmo", {PreTokenizer::kGpt2, false, false}},
  };
  for (const Name& n : kNames) {
    if (n.name == name) return n.info;
  }
  return std::nullopt;
}

void pre_tokenize(PreTokenizer kind, std::span<const uint32_t> cpts, std::vector<uint32_t>& lengths) {
  std::vector<uint32_t> frags;
  if (!cpts.empty()) frags.push_back(uint32_t(cpts.size()));
  switch (kind) {
    case PreTokenizer::kGpt2:
      apply(cpts, frags, split_gpt2);
      break;
    case PreTokenizer::kLlama3:
      apply(cpts, frags, [](Cutter& c) { split_llama3(c, 3); });
      break;
    case PreTokenizer::kQwen2:
      apply(cpts, frags, [](Cutter& c) { split_llama3(c, 1); });
      break;
    case PreTokenizer::kDeepSeek3:
      apply(cpts, frags, [](Cutter& c) { split_runs(c, is_number, 3); });
      apply(cpts, frags, [](Cutter& c) { split_runs(c, is_cjk_deepseek, 0); });
      apply(cpts, frags, split_deepseek3);
      break;
    case PreTokenizer::kDefault:
      apply(cpts, frags, [](Cutter& c) { split_runs(c, is_default_punct, 0); });
      apply(cpts, frags, split_gpt2);
      apply(cpts, frags, [](Cutter& c) { split_runs(c, is_number, 0); });
      apply(cpts, frags, [](Cutter& c) { split_runs(c, is_ascii_digit, 3); });
      break;
  }
  lengths.insert(lengths.end(), frags.begin(), frags.end());
}

}  // namespace ds4

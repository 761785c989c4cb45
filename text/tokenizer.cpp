#include "text/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <queue>

#include "shared/error.h"

namespace ds4 {

namespace {

// GGUF token types (llama.cpp's llama_token_type).
enum TokenType : int32_t {
  kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6,
};

constexpr std::string_view kSpaceMark = "\xe2\x96\x81";  // U+2581, SentencePiece's space

// Length of the UTF-8 sequence a lead byte announces. Continuation bytes and
// invalid leads count as one byte, as llama.cpp's unicode_len_utf8 does.
size_t utf8_len(uint8_t lead) {
  static constexpr size_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[lead >> 4];
}

std::string escape_spaces(std::string_view text) {
  std::string out;
  out.reserve(text.size() + text.size() / 2);
  for (char c : text) {
    if (c == ' ') {
      out += kSpaceMark;
    } else {
      out += c;
    }
  }
  return out;
}

std::string unescape_spaces(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text.substr(i, kSpaceMark.size()) == kSpaceMark) {
      out += ' ';
      i += kSpaceMark.size();
    } else {
      out += text[i++];
    }
  }
  return out;
}

// "<0xNN>" → NN, or -1.
int parse_byte_token(std::string_view text) {
  if (text.size() != 6 || text.substr(0, 3) != "<0x" || text[5] != '>') return -1;
  int v = 0;
  for (char c : text.substr(3, 2)) {
    v <<= 4;
    if (c >= '0' && c <= '9') v |= c - '0';
    else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
    else return -1;
  }
  return v;
}

// One piece of the text during merging: a byte range, linked to its neighbours.
struct Symbol {
  uint32_t off = 0;
  uint32_t len = 0;  // 0 once merged into its left neighbour
  int32_t prev = -1;
  int32_t next = -1;
};

struct Bigram {
  int32_t left = 0;
  int32_t right = 0;
  float score = 0;
  uint32_t len = 0;  // bytes of the merged text when proposed
};

// Highest score first; equal scores: leftmost first (llm_tokenizer_spm's order).
struct BigramOrder {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

}  // namespace

Tokenizer Tokenizer::from_gguf(const gguf::File& meta) {
  const auto model = meta.get_string("tokenizer.ggml.model");
  if (!model) {
    throw Error(meta.source() + ": missing key 'tokenizer.ggml.model' (no vocabulary)");
  }
  if (*model != "llama") {
    throw Error(meta.source() + ": key 'tokenizer.ggml.model' is '" + *model +
                "'; only 'llama' (SentencePiece) vocabularies are supported");
  }
  auto tokens = meta.get_string_array("tokenizer.ggml.tokens");
  if (!tokens || tokens->empty()) {
    throw Error(meta.source() + ": missing or empty key 'tokenizer.ggml.tokens'");
  }
  const size_t n = tokens->size();
  if (n > size_t(INT32_MAX)) {
    throw Error(meta.source() + ": key 'tokenizer.ggml.tokens' has too many entries");
  }

  Tokenizer t;
  t.tokens_ = std::move(*tokens);
  if (auto scores = meta.get_float_array("tokenizer.ggml.scores")) {
    if (scores->size() != n) {
      throw Error(meta.source() + ": key 'tokenizer.ggml.scores' has " +
                  std::to_string(scores->size()) + " entries, expected " + std::to_string(n) +
                  " (one per token)");
    }
    t.scores_ = std::move(*scores);
  } else {
    t.scores_.assign(n, 0.0f);
  }
  if (auto types = meta.get_int_array("tokenizer.ggml.token_type")) {
    if (types->size() != n) {
      throw Error(meta.source() + ": key 'tokenizer.ggml.token_type' has " +
                  std::to_string(types->size()) + " entries, expected " + std::to_string(n) +
                  " (one per token)");
    }
    t.types_.assign(types->begin(), types->end());
  } else {
    t.types_.assign(n, kNormal);
  }

  // Special ids: an absent or out-of-range value keeps the SPM default, as llama.cpp does.
  auto special = [&](std::string_view key, int32_t fallback) {
    const auto v = meta.get_int(key);
    return v && *v >= 0 && *v < int64_t(n) ? int32_t(*v) : fallback;
  };
  auto in_range = [&](int32_t id) { return id >= 0 && id < int32_t(n) ? id : -1; };
  t.bos_ = in_range(special("tokenizer.ggml.bos_token_id", 1));
  t.eos_ = in_range(special("tokenizer.ggml.eos_token_id", 2));
  t.unk_ = in_range(special("tokenizer.ggml.unknown_token_id", 0));
  t.eot_ = special("tokenizer.ggml.eot_token_id", -1);
  t.add_bos_ = meta.get_bool("tokenizer.ggml.add_bos_token").value_or(true);
  t.add_space_prefix_ = meta.get_bool("tokenizer.ggml.add_space_prefix").value_or(true);
  if (t.add_bos_ && t.bos_ < 0) {
    throw Error(meta.source() + ": key 'tokenizer.ggml.bos_token_id' is needed (add_bos_token "
                "is true) but the default id 1 is outside the vocabulary");
  }

  t.build_tables();
  return t;
}

namespace {

// A hash for short texts, eight bytes at a time.
uint64_t text_hash(std::string_view s) {
  uint64_t h = (s.size() + 1) * 0x9E3779B97F4A7C15ull;
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  if (i < s.size()) {
    uint64_t w = 0;  // byte by byte: a memcpy of variable length is a call
    for (size_t k = i; k < s.size(); ++k) w |= uint64_t(uint8_t(s[k])) << (8 * (k - i));
    h = (h ^ w) * 0x94D049BB133111EBull;
    h ^= h >> 29;
  }
  return h;
}

}  // namespace

int32_t Tokenizer::find(std::string_view text) const {
  const uint64_t h = text_hash(text);
  const size_t mask = index_.size() - 1;
  for (size_t i = size_t(h) & mask;; i = (i + 1) & mask) {
    const Slot& s = index_[i];
    if (s.id < 0) return -1;
    if (s.hash == uint32_t(h >> 32) && tokens_[size_t(s.id)] == text) return s.id;
  }
}

void Tokenizer::build_tables() {
  const int32_t n = int32_t(tokens_.size());
  size_t size = 16;
  while (size < 2 * size_t(n)) size *= 2;  // at most half full
  index_.assign(size, Slot{});
  pieces_.resize(size_t(n));
  std::fill(std::begin(byte_tokens_), std::end(byte_tokens_), -1);
  user_defined_.clear();
  eog_.clear();

  max_token_bytes_ = 4;
  for (int32_t id = 0; id < n; ++id) {
    const std::string& text = tokens_[size_t(id)];
    max_token_bytes_ = std::max(max_token_bytes_, text.size());
    // A repeated text maps to its last id, as in llama.cpp.
    const uint64_t h = text_hash(text);
    for (size_t i = size_t(h) & (size - 1);; i = (i + 1) & (size - 1)) {
      Slot& slot = index_[i];
      if (slot.id >= 0 && (slot.hash != uint32_t(h >> 32) || tokens_[size_t(slot.id)] != text)) continue;
      slot = {uint32_t(h >> 32), id};
      break;
    }
    switch (types_[size_t(id)]) {
      case kNormal:
        pieces_[size_t(id)] = unescape_spaces(text);
        break;
      case kByte: {
        const int b = parse_byte_token(text);
        if (b >= 0) pieces_[size_t(id)] = std::string(1, char(b));
        break;
      }
      case kUnknown:
        pieces_[size_t(id)] = text;
        break;
      case kUserDefined:
        pieces_[size_t(id)] = text;
        if (!text.empty()) user_defined_.push_back(id);
        break;
      default:  // control, unused and types llama.cpp does not know: nothing
        break;
    }
  }

  // Byte fallback: <0xNN>, else the one-byte text itself, else unknown.
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    const std::string name = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
    int32_t id = find(name);
    if (id < 0) id = find(std::string(1, char(b)));
    byte_tokens_[b] = id >= 0 ? id : unk_;
  }

  // Longer user-defined tokens are matched first (tokenizer_st_partition's order).
  std::stable_sort(user_defined_.begin(), user_defined_.end(), [&](int32_t a, int32_t b) {
    return tokens_[size_t(a)].size() > tokens_[size_t(b)].size();
  });

  // End of generation: eos, eot, and control tokens whose text ends a turn in
  // the common chat formats (llama.cpp's special_eog_ids).
  static constexpr std::string_view kEogTexts[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
  };
  for (int32_t id : {eos_, eot_}) {
    if (id >= 0) eog_.push_back(id);
  }
  for (std::string_view text : kEogTexts) {
    const int32_t id = find(text);
    if (id >= 0 && types_[size_t(id)] == kControl) eog_.push_back(id);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 2 + 8);  // pieces average well over two bytes: no regrowth on the way
  if (add_bos && add_bos_) out.push_back(bos_);

  // User-defined tokens are matched in the raw text even without special
  // parsing; the text between them is tokenized with the SPM algorithm, and a
  // fragment that follows a token (or starts the text) gets the space prefix.
  std::vector<std::pair<std::string_view, int32_t>> fragments = {{text, -1}};
  for (int32_t id : user_defined_) {
    const std::string& word = tokens_[size_t(id)];
    std::vector<std::pair<std::string_view, int32_t>> split;
    for (const auto& [frag, tok] : fragments) {
      if (tok >= 0) {
        split.emplace_back(frag, tok);
        continue;
      }
      size_t start = 0;
      for (size_t pos; (pos = frag.find(word, start)) != std::string_view::npos;
           start = pos + word.size()) {
        if (pos > start) split.emplace_back(frag.substr(start, pos - start), -1);
        split.emplace_back(std::string_view(), id);
      }
      if (start < frag.size()) split.emplace_back(frag.substr(start), -1);
    }
    fragments = std::move(split);
  }

  bool prev_special = true;
  for (const auto& [frag, tok] : fragments) {
    if (tok >= 0) {
      out.push_back(tok);
      prev_special = true;
      continue;
    }
    if (frag.empty()) continue;
    std::string raw;
    if (add_space_prefix_ && prev_special) raw = " ";
    raw += frag;
    encode_spm(escape_spaces(raw), out);
    prev_special = false;
  }
  return out;
}

// llm_tokenizer_spm: start from UTF-8 characters, repeatedly merge the adjacent
// pair whose concatenation is the best-scoring token, then emit each piece as
// its token or, when the piece is no token, as byte tokens.
void Tokenizer::encode_spm(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<Symbol> symbols;
  symbols.reserve(text.size());
  for (size_t off = 0; off < text.size();) {
    const size_t len = std::min(utf8_len(uint8_t(text[off])), text.size() - off);
    Symbol s;
    s.off = uint32_t(off);
    s.len = uint32_t(len);
    s.prev = int32_t(symbols.size()) - 1;
    off += len;
    s.next = off == text.size() ? -1 : int32_t(symbols.size()) + 1;
    symbols.push_back(s);
  }

  std::vector<Bigram> pending;
  pending.reserve(2 * symbols.size());  // proposals: one per neighbour pair, two per merge
  std::priority_queue<Bigram, std::vector<Bigram>, BigramOrder> queue(BigramOrder{}, std::move(pending));
  auto propose = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const uint32_t len = symbols[size_t(left)].len + symbols[size_t(right)].len;
    const int32_t id = find(text.substr(symbols[size_t(left)].off, len));
    if (id < 0) return;
    queue.push(Bigram{left, right, scores_[size_t(id)], len});
  };
  for (int32_t i = 1; i < int32_t(symbols.size()); ++i) propose(i - 1, i);

  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& left = symbols[size_t(b.left)];
    Symbol& right = symbols[size_t(b.right)];
    // Stale: one side was merged away or grew since this pair was proposed.
    if (left.len == 0 || right.len == 0 || left.len + right.len != b.len) continue;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[size_t(right.next)].prev = b.left;
    propose(left.prev, b.left);
    propose(b.left, left.next);
  }

  // A merged piece is always a token; only single characters can be missing.
  for (int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[size_t(i)].next) {
    const std::string_view piece = text.substr(symbols[size_t(i)].off, symbols[size_t(i)].len);
    if (const int32_t id = find(piece); id >= 0) {
      out.push_back(id);
      continue;
    }
    for (char c : piece) out.push_back(byte_tokens_[uint8_t(c)]);
  }
}

std::string Tokenizer::piece(int32_t token) const {
  if (!valid(token)) {
    throw Error("token " + std::to_string(token) + " is outside the vocabulary (" +
                std::to_string(n_vocab()) + " tokens)");
  }
  return pieces_[size_t(token)];
}

std::string Tokenizer::decode(std::span<const int32_t> tokens) const {
  std::string out;
  for (int32_t t : tokens) out += piece(t);
  return out;
}

int32_t Tokenizer::n_vocab() const { return int32_t(tokens_.size()); }
int32_t Tokenizer::bos() const { return bos_; }
int32_t Tokenizer::eos() const { return eos_; }
bool Tokenizer::add_bos() const { return add_bos_; }

bool Tokenizer::is_eog(int32_t token) const {
  return std::find(eog_.begin(), eog_.end(), token) != eog_.end();
}

}  // namespace ds4

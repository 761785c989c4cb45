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
  const bool bpe = *model == "gpt2";
  if (!bpe && *model != "llama") {
    throw Error(meta.source() + ": key 'tokenizer.ggml.model' is '" + *model +
                "'; supported are 'llama' (SentencePiece) and 'gpt2' (byte-level BPE)");
  }
  PreTokenizerInfo pre{PreTokenizer::kDefault, false, false};
  if (bpe) {
    const auto name = meta.get_string("tokenizer.ggml.pre");
    if (name) {  // absent: llama.cpp's 'default'
      const auto info = pre_tokenizer_named(*name);
      if (!info) {
        throw Error(meta.source() + ": key 'tokenizer.ggml.pre' is '" + *name +
                    "', a pre-tokenizer ds4 does not know (known: llama-bpe, qwen2, deepseek-v3, "
                    "gpt-2, default and their aliases)");
      }
      pre = *info;
    }
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

  // Special ids: an absent or out-of-range value keeps the default, as llama.cpp
  // does (SPM: bos 1, eos 2, unk 0; BPE: bos and eos 11, no unk).
  auto special = [&](std::string_view key, int32_t fallback) {
    const auto v = meta.get_int(key);
    return v && *v >= 0 && *v < int64_t(n) ? int32_t(*v) : fallback;
  };
  auto in_range = [&](int32_t id) { return id >= 0 && id < int32_t(n) ? id : -1; };
  t.bos_ = in_range(special("tokenizer.ggml.bos_token_id", bpe ? 11 : 1));
  t.eos_ = in_range(special("tokenizer.ggml.eos_token_id", bpe ? 11 : 2));
  t.unk_ = in_range(special("tokenizer.ggml.unknown_token_id", bpe ? -1 : 0));
  t.eot_ = special("tokenizer.ggml.eot_token_id", -1);
  t.eom_ = special("tokenizer.ggml.eom_token_id", -1);
  t.add_bos_ = meta.get_bool("tokenizer.ggml.add_bos_token").value_or(bpe ? pre.add_bos : true);
  t.add_eos_ = meta.get_bool("tokenizer.ggml.add_eos_token").value_or(false);
  t.add_space_prefix_ = meta.get_bool("tokenizer.ggml.add_space_prefix").value_or(!bpe);
  if (t.add_bos_ && t.bos_ < 0) {
    throw Error(meta.source() + ": key 'tokenizer.ggml.bos_token_id' is needed (add_bos_token "
                "is true) but it is absent and the default id is outside the vocabulary");
  }
  if (t.add_eos_ && t.eos_ < 0) {
    throw Error(meta.source() + ": key 'tokenizer.ggml.eos_token_id' is needed (add_eos_token "
                "is true) but it is absent and the default id is outside the vocabulary");
  }

  t.build_index();
  t.mark_eog();
  t.build_tables(bpe);
  if (bpe) t.load_bpe(meta, pre);
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

void Tokenizer::build_index() {
  const int32_t n = int32_t(tokens_.size());
  size_t size = 16;
  while (size < 2 * size_t(n)) size *= 2;  // at most half full
  index_.assign(size, Slot{});
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
  }
}

void Tokenizer::mark_eog() {
  // llama.cpp's special_eog_ids: eos, eot, eom, the FIM pad/repo/separator
  // tokens and the tokens whose text ends a turn in the common chat formats.
  // It makes each of these (and the other FIM tokens) a control token, so that
  // its text in user content stays text.
  auto first_of = [&](std::initializer_list<std::string_view> texts) {
    for (std::string_view text : texts) {
      if (const int32_t id = find(text); id >= 0) return id;
    }
    return int32_t(-1);
  };
  auto make_control = [&](int32_t id) {
    if (id >= 0) types_[size_t(id)] = kControl;
  };
  if (eot_ < 0) {
    eot_ = first_of({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<EOT>", "_<EOT>",
                     "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",  // DeepSeek
                     "<end_of_utterance>"});
  }
  make_control(eot_);
  if (eom_ < 0) eom_ = find("<|eom_id|>");
  make_control(eom_);
  const int32_t fim_pad = first_of({"<|fim_pad|>", "<fim-pad>", "<fim_pad>"});
  const int32_t fim_rep = first_of({"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"});
  const int32_t fim_sep = first_of({"<|file_sep|>", "<fim-sep>", "<file_sep>"});
  for (const int32_t id : {fim_pad, fim_rep, fim_sep,
                           first_of({"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>"}),
                           first_of({"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>"}),
                           first_of({"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>"})}) {
    make_control(id);
  }

  eog_.clear();
  for (const int32_t id : {eos_, eot_, eom_, fim_pad, fim_rep, fim_sep}) {
    if (id >= 0) eog_.push_back(id);
  }
  static constexpr std::string_view kEogTexts[] = {
      "<|eot_id|>",    "<|im_end|>", "<|end|>", "<|return|>",      "<|call|>",
      "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
      "<|end_of_text|>", "<end_of_utterance>",
  };
  for (std::string_view text : kEogTexts) {
    const int32_t id = find(text);
    if (id < 0) continue;
    make_control(id);
    eog_.push_back(id);
  }
  std::sort(eog_.begin(), eog_.end());
  eog_.erase(std::unique(eog_.begin(), eog_.end()), eog_.end());
}

void Tokenizer::build_tables(bool bpe) {
  const int32_t n = int32_t(tokens_.size());
  pieces_.assign(size_t(n), std::string());
  std::fill(std::begin(byte_tokens_), std::end(byte_tokens_), -1);
  specials_.clear();

  for (int32_t id = 0; id < n; ++id) {
    const std::string& text = tokens_[size_t(id)];
    const int32_t type = types_[size_t(id)];
    if ((type == kControl || type == kUserDefined || type == kUnknown) && !text.empty()) {
      specials_.push_back(id);
    }
    if (bpe) {
      // llama.cpp's token_to_piece for BPE: normal tokens are spelled in byte
      // characters, user-defined ones are their text, anything else nothing.
      if (type == kNormal) pieces_[size_t(id)] = bpe::decode_token_text(text);
      else if (type == kUserDefined) pieces_[size_t(id)] = text;
      continue;
    }
    switch (type) {
      case kNormal:
        pieces_[size_t(id)] = unescape_spaces(text);
        break;
      case kByte: {
        const int b = parse_byte_token(text);
        if (b >= 0) pieces_[size_t(id)] = std::string(1, char(b));
        break;
      }
      case kUnknown:
      case kUserDefined:
        pieces_[size_t(id)] = text;
        break;
      default:  // control, unused and types llama.cpp does not know: nothing
        break;
    }
  }

  if (!bpe) {
    // Byte fallback: <0xNN>, else the one-byte text itself, else unknown.
    static constexpr char kHex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      const std::string name = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
      int32_t id = find(name);
      if (id < 0) id = find(std::string(1, char(b)));
      byte_tokens_[b] = id >= 0 ? id : unk_;
    }
  }

  // Longer special tokens are matched first (tokenizer_st_partition's order).
  std::stable_sort(specials_.begin(), specials_.end(), [&](int32_t a, int32_t b) {
    return tokens_[size_t(a)].size() > tokens_[size_t(b)].size();
  });
  special_by_byte_.assign(3 * 256, {});
  for (uint32_t k = 0; k < specials_.size(); ++k) {
    const int32_t id = specials_[k];
    const uint8_t first = uint8_t(tokens_[size_t(id)][0]);
    const bool control = types_[size_t(id)] != kUserDefined;
    if (!control) special_by_byte_[first].push_back(k);  // 0: matched in plain text too
    special_by_byte_[256 + first].push_back(k);             // 1: with parse_special
    if (control) special_by_byte_[512 + first].push_back(k);  // 2: what escape_special marks
  }
}

void Tokenizer::partition(std::string_view text, bool parse_special,
                          std::vector<Fragment>& out) const {
  out.clear();
  // Every place a special token's text starts, found in one pass by first byte.
  struct Hit {
    uint32_t order;  // index into specials_: longest text first
    uint32_t pos;
  };
  std::vector<Hit> hits;
  const std::vector<uint32_t>* buckets = special_by_byte_.data() + (parse_special ? 256 : 0);
  if (!specials_.empty()) {
    for (size_t i = 0; i < text.size(); ++i) {
      for (const uint32_t k : buckets[uint8_t(text[i])]) {
        if (text.substr(i).starts_with(tokens_[size_t(specials_[k])])) hits.push_back({k, uint32_t(i)});
      }
    }
  }
  if (hits.empty()) {
    if (!text.empty()) out.push_back({text, -1});
    return;
  }
  // llama.cpp takes the special tokens one by one, longest first, and each
  // one's occurrences left to right in the text that is still text.
  std::stable_sort(hits.begin(), hits.end(), [](const Hit& a, const Hit& b) { return a.order < b.order; });
  std::vector<uint8_t> taken(text.size(), 0);
  std::vector<std::pair<uint32_t, int32_t>> found;  // position, token
  uint32_t order = UINT32_MAX;
  size_t last_end = 0;
  for (const Hit& h : hits) {
    if (h.order != order) {
      order = h.order;
      last_end = 0;
    }
    const int32_t id = specials_[h.order];
    const size_t len = tokens_[size_t(id)].size();
    if (h.pos < last_end) continue;
    if (std::find(taken.begin() + h.pos, taken.begin() + h.pos + len, 1) != taken.begin() + h.pos + len) continue;
    std::fill(taken.begin() + h.pos, taken.begin() + h.pos + len, 1);
    last_end = h.pos + len;
    found.emplace_back(h.pos, id);
  }
  std::sort(found.begin(), found.end());
  size_t start = 0;
  for (const auto& [pos, id] : found) {
    if (pos > start) out.push_back({text.substr(start, pos - start), -1});
    out.push_back({std::string_view(), id});
    start = pos + tokens_[size_t(id)].size();
  }
  if (start < text.size()) out.push_back({text.substr(start), -1});
}

namespace {

// The text without escape marks; `buf` holds it when there were any.
std::string_view without_marks(std::string_view text, std::string& buf) {
  constexpr std::string_view mark = Tokenizer::kEscapeMark;
  size_t pos = text.find(mark);
  if (pos == std::string_view::npos) return text;
  buf.clear();
  size_t start = 0;
  for (; pos != std::string_view::npos; pos = text.find(mark, start)) {
    buf.append(text.substr(start, pos - start));
    start = pos + mark.size();
  }
  buf.append(text.substr(start));
  return buf;
}

}  // namespace

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 2 + 8);  // pieces average well over two bytes: no regrowth on the way
  if (add_bos && add_bos_) out.push_back(bos_);

  std::vector<Fragment> fragments;
  partition(text, parse_special, fragments);

  // SPM: a fragment that follows a special token (or starts the text) gets the
  // space prefix.
  bool prev_special = true;
  std::string buf;
  for (const auto& [frag, tok] : fragments) {
    if (tok >= 0) {
      out.push_back(tok);
      prev_special = true;
      continue;
    }
    const std::string_view plain = without_marks(frag, buf);
    if (plain.empty()) continue;
    if (bpe_) {
      encode_bpe(plain, out);
      continue;
    }
    std::string raw;
    if (add_space_prefix_ && prev_special) raw = " ";
    raw += plain;
    encode_spm(escape_spaces(raw), out);
    prev_special = false;
  }
  if (add_bos && add_eos_ && eos_ >= 0) out.push_back(eos_);
  return out;
}

std::string Tokenizer::escape_special(std::string_view content) const {
  std::string out;
  out.reserve(content.size() + 16);
  const std::vector<uint32_t>* buckets = special_by_byte_.empty() ? nullptr : special_by_byte_.data() + 512;
  for (size_t i = 0; i < content.size();) {
    bool starts = false;
    if (buckets) {
      for (const uint32_t k : buckets[uint8_t(content[i])]) {
        if (content.substr(i).starts_with(tokens_[size_t(specials_[k])])) {
          starts = true;
          break;
        }
      }
    }
    const size_t n = starts ? std::min(utf8_len(uint8_t(content[i])), content.size() - i) : 1;
    out.append(content.substr(i, n));
    if (starts) out += kEscapeMark;
    i += n;
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
  return std::binary_search(eog_.begin(), eog_.end(), token);
}

bool Tokenizer::is_control(int32_t token) const {
  return valid(token) && types_[size_t(token)] == kControl;
}

}  // namespace ds4

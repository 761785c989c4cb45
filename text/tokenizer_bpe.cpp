// Byte-level BPE: the merges of tokenizer.ggml.merges and the encoding of one
// fragment of plain text (llama.cpp's llm_tokenizer_bpe_session).
#include <algorithm>
#include <queue>

#include "shared/error.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "text/utf8.h"

namespace ds4 {

struct Tokenizer::Bpe {
  PreTokenizerInfo pre;
  bpe::MergeTable merges;
  int32_t byte_token[256];  // the token of each byte's character, -1 when none
};

void Tokenizer::load_bpe(const gguf::File& meta, const PreTokenizerInfo& pre) {
  auto b = std::make_shared<Bpe>();
  b->pre = pre;
  const auto merges = meta.get_string_array("tokenizer.ggml.merges");
  if (!merges) {
    throw Error(meta.source() + ": missing key 'tokenizer.ggml.merges' (a 'gpt2' vocabulary "
                "needs its merges, an array of \"left right\" strings)");
  }
  b->merges.reserve(merges->size());
  std::string joined;
  for (size_t i = 0; i < merges->size(); ++i) {
    const std::string& m = (*merges)[i];
    auto where = [&] {
      return meta.source() + ": key 'tokenizer.ggml.merges' entry " + std::to_string(i) + " ('" + m + "')";
    };
    const size_t space = m.find(' ', 1);
    if (space == std::string::npos) throw Error(where() + " is not two tokens separated by a space");
    const std::string_view left(m.data(), space), right(m.data() + space + 1, m.size() - space - 1);
    const int32_t l = find(left), r = find(right);
    if (l < 0) throw Error(where() + " names '" + std::string(left) + "', which is not in the vocabulary");
    if (r < 0) throw Error(where() + " names '" + std::string(right) + "', which is not in the vocabulary");
    joined.assign(left);
    joined += right;
    const int32_t result = find(joined);
    if (result < 0) throw Error(where() + " makes '" + joined + "', which is not in the vocabulary");
    b->merges.add(l, r, int32_t(i), result);
  }
  for (int c = 0; c < 256; ++c) b->byte_token[c] = find(bpe::byte_char(uint8_t(c)));
  bpe_ = std::move(b);
}

namespace {

struct Symbol {
  int32_t id;     // its token, -1 when its byte's character is no token
  int32_t prev;
  int32_t next;
  uint32_t byte;  // the first byte of the word it covers (for the -1 case)
};

struct Pair {
  int32_t rank;
  int32_t left, right;  // symbol indices
  int32_t left_id, right_id;
};

// Lowest rank first; equal ranks: leftmost first (llm_bigram_bpe's order).
struct PairOrder {
  bool operator()(const Pair& a, const Pair& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

}  // namespace

void Tokenizer::encode_bpe(std::string_view text, std::vector<int32_t>& out) const {
  const Bpe& b = *bpe_;
  std::vector<uint32_t> cpts;
  unicode::decode_utf8(text, cpts);
  // The text as llama.cpp sees it (invalid bytes became U+FFFD), with the
  // byte offset of each code point.
  std::string norm;
  norm.reserve(text.size());
  std::vector<uint32_t> offset(cpts.size() + 1);
  for (size_t i = 0; i < cpts.size(); ++i) {
    offset[i] = uint32_t(norm.size());
    append_utf8(norm, cpts[i]);
  }
  offset[cpts.size()] = uint32_t(norm.size());

  std::vector<uint32_t> words;
  pre_tokenize(b.pre.kind, cpts, words);

  std::vector<Symbol> symbols;
  std::vector<Pair> storage;
  std::string spelled;
  size_t at = 0;  // code point index of the word
  for (const uint32_t len : words) {
    const std::string_view word(norm.data() + offset[at], offset[at + len] - offset[at]);
    at += len;
    if (b.pre.ignore_merges) {  // the whole word when it is a token
      spelled.clear();
      for (char c : word) spelled += bpe::byte_char(uint8_t(c));
      if (const int32_t id = find(spelled); id >= 0) {
        out.push_back(id);
        continue;
      }
    }
    symbols.clear();
    for (size_t i = 0; i < word.size(); ++i) {
      const int32_t n = int32_t(word.size());
      symbols.push_back({b.byte_token[uint8_t(word[i])], int32_t(i) - 1, int32_t(i) + 1 < n ? int32_t(i) + 1 : -1,
                         uint32_t(uint8_t(word[i]))});
    }
    storage.clear();
    std::priority_queue<Pair, std::vector<Pair>, PairOrder> queue(PairOrder{}, std::move(storage));
    auto propose = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0) return;
      const int32_t li = symbols[size_t(l)].id, ri = symbols[size_t(r)].id;
      if (li < 0 || ri < 0) return;
      const bpe::MergeTable::Merge m = b.merges.find(li, ri);
      if (m.rank >= 0) queue.push({m.rank, l, r, li, ri});
    };
    for (int32_t i = 1; i < int32_t(symbols.size()); ++i) propose(i - 1, i);
    while (!queue.empty()) {
      const Pair p = queue.top();
      queue.pop();
      Symbol& left = symbols[size_t(p.left)];
      Symbol& right = symbols[size_t(p.right)];
      // Stale: a side was merged away or grew since the pair was proposed.
      if (left.id != p.left_id || right.id != p.right_id || left.next != p.right) continue;
      left.id = b.merges.find(p.left_id, p.right_id).result;
      left.next = right.next;
      if (right.next >= 0) symbols[size_t(right.next)].prev = p.left;
      right.id = -2;  // gone
      right.next = -1;
      propose(left.prev, p.left);
      propose(p.left, left.next);
    }
    for (int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[size_t(i)].next) {
      const Symbol& s = symbols[size_t(i)];
      if (s.id >= 0) {
        out.push_back(s.id);
        continue;
      }
      // A byte whose character is no token: llama.cpp tries each byte of the
      // character's UTF-8 as a token of its own.
      for (char c : bpe::byte_char(uint8_t(s.byte))) {
        if (const int32_t id = find(std::string_view(&c, 1)); id >= 0) out.push_back(id);
      }
    }
  }
}

}  // namespace ds4

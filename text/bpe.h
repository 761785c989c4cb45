#pragma once
/// Pieces of byte-level BPE (GPT-2's scheme): the byte-to-unicode mapping in
/// which vocabularies spell their tokens, and the merge table.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ds4::bpe {

/// The UTF-8 text of the character that stands for byte `b` in token texts:
/// printable Latin-1 bytes stand for themselves, the other 68 for U+0100 on
/// ('Ġ' is the space, 'Ċ' the newline).
std::string_view byte_char(uint8_t b);
/// The byte that code point `cpt` stands for, -1 when it stands for none.
int char_byte(uint32_t cpt);
/// A token's text back to the bytes it stands for; a character that stands
/// for no byte is kept as its UTF-8.
std::string decode_token_text(std::string_view text);

/// Merge ranks by the pair of token ids: (left, right) → rank and the token
/// of their concatenation. Open addressing on one 64-bit key per pair: a
/// lookup per neighbour pair is the inner loop of encoding.
class MergeTable {
 public:
  struct Merge {
    int32_t rank = -1;  // -1: no such merge
    int32_t result = -1;
  };
  /// Sizes the table for `n` merges (call before add()).
  void reserve(size_t n);
  /// Adds a merge; a pair already present keeps its first (best) rank.
  void add(int32_t left, int32_t right, int32_t rank, int32_t result);
  Merge find(int32_t left, int32_t right) const {
    if (slots_.empty()) return {};
    const uint64_t key = pack(left, right);
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.merge.rank < 0) return {};
      if (s.key == key) return s.merge;
    }
  }
  size_t size() const { return count_; }

 private:
  static uint64_t pack(int32_t l, int32_t r) { return uint64_t(uint32_t(l)) << 32 | uint32_t(r); }
  static size_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return size_t(k);
  }
  struct Slot {
    uint64_t key = 0;
    Merge merge;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t count_ = 0;
};

}  // namespace ds4::bpe

#include "text/bpe.h"

#include <algorithm>
#include <array>

#include "text/unicode.h"
#include "text/utf8.h"

namespace ds4::bpe {

namespace {

struct ByteMap {
  std::array<std::string, 256> text;  // byte → UTF-8 of its character
  std::array<int16_t, 324> byte;      // code point (< 324) → byte, -1 when none
};

const ByteMap& byte_map() {
  static const ByteMap m = [] {
    ByteMap m;
    m.byte.fill(-1);
    auto printable = [](int b) {
      return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cpt = printable(b) ? uint32_t(b) : uint32_t(next++);
      append_utf8(m.text[size_t(b)], cpt);
      m.byte[cpt] = int16_t(b);
    }
    return m;
  }();
  return m;
}

}  // namespace

std::string_view byte_char(uint8_t b) { return byte_map().text[b]; }

int char_byte(uint32_t cpt) { return cpt < 324 ? byte_map().byte[cpt] : -1; }

std::string decode_token_text(std::string_view text) {
  std::vector<uint32_t> cpts;
  unicode::decode_utf8(text, cpts);
  std::string out;
  out.reserve(text.size());
  for (const uint32_t c : cpts) {
    const int b = char_byte(c);
    if (b >= 0) {
      out += char(b);
    } else {
      append_utf8(out, c);
    }
  }
  return out;
}

void MergeTable::reserve(size_t n) {
  size_t size = 16;
  while (size < 2 * n) size *= 2;  // at most half full
  slots_.assign(size, Slot{});
  mask_ = size - 1;
  count_ = 0;
}

void MergeTable::add(int32_t left, int32_t right, int32_t rank, int32_t result) {
  if (2 * (count_ + 1) > slots_.size()) {  // grow: rehash into twice the room
    std::vector<Slot> old = std::move(slots_);
    reserve(std::max<size_t>(8, count_ * 2 + 2));
    for (const Slot& s : old) {
      if (s.merge.rank >= 0) add(int32_t(s.key >> 32), int32_t(uint32_t(s.key)), s.merge.rank, s.merge.result);
    }
  }
  const uint64_t key = pack(left, right);
  for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.merge.rank < 0) {
      s.key = key;
      s.merge = {rank, result};
      ++count_;
      return;
    }
    if (s.key == key) return;  // the first rank wins
  }
}

}  // namespace ds4::bpe

#include "text/unicode.h"

#include <memory>

namespace ds4::unicode {

namespace {

constexpr uint32_t kCodePoints = 0x110000;

// One byte per code point (1.1 MB), expanded once from the ranges: the
// pre-tokenizers look up every character of every prompt.
const uint8_t* flag_table() {
  static const std::unique_ptr<uint8_t[]> table = [] {
    auto t = std::make_unique<uint8_t[]>(kCodePoints);
    for (size_t i = 0; i < kRangeCount; ++i) {
      const uint32_t end = i + 1 < kRangeCount ? kRanges[i + 1].first : kCodePoints;
      for (uint32_t c = kRanges[i].first; c < end; ++c) t[c] = kRanges[i].flags;
    }
    return t;
  }();
  return table.get();
}

}  // namespace

uint8_t flags(uint32_t cpt) {
  static const uint8_t* table = flag_table();
  return cpt < kCodePoints ? table[cpt] : 0;
}

void decode_utf8(std::string_view s, std::vector<uint32_t>& cpts) {
  cpts.clear();
  cpts.reserve(s.size());
  const size_t n = s.size();
  auto cont = [&](size_t i) { return i < n && (uint8_t(s[i]) & 0xC0) == 0x80; };
  for (size_t i = 0; i < n;) {
    const uint8_t b = uint8_t(s[i]);
    if (b < 0x80) {
      cpts.push_back(b);
      i += 1;
    } else if ((b & 0xE0) == 0xC0 && cont(i + 1)) {
      cpts.push_back(uint32_t(b & 0x1F) << 6 | (uint8_t(s[i + 1]) & 0x3F));
      i += 2;
    } else if ((b & 0xF0) == 0xE0 && cont(i + 1) && cont(i + 2)) {
      cpts.push_back(uint32_t(b & 0x0F) << 12 | uint32_t(uint8_t(s[i + 1]) & 0x3F) << 6 |
                     (uint8_t(s[i + 2]) & 0x3F));
      i += 3;
    } else if ((b & 0xF8) == 0xF0 && cont(i + 1) && cont(i + 2) && cont(i + 3)) {
      cpts.push_back(uint32_t(b & 0x07) << 18 | uint32_t(uint8_t(s[i + 1]) & 0x3F) << 12 |
                     uint32_t(uint8_t(s[i + 2]) & 0x3F) << 6 | (uint8_t(s[i + 3]) & 0x3F));
      i += 4;
    } else {
      cpts.push_back(0xFFFD);
      i += 1;
    }
  }
}

}  // namespace ds4::unicode

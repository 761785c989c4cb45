#pragma once
/// UTF-8 helpers for streaming text: a character split across tokens is held
/// back until it is complete.

#include <cstddef>
#include <string_view>

namespace ds4 {

/// Length of the longest prefix of `s` that does not end inside an incomplete
/// UTF-8 sequence. Invalid bytes count as complete (they are passed on as is).
inline size_t utf8_complete_prefix(std::string_view s) {
  const size_t n = s.size();
  // Look back at most 3 bytes for the start of the last sequence.
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    size_t need = 1;
    if ((c & 0xE0) == 0xC0) need = 2;
    else if ((c & 0xF0) == 0xE0) need = 3;
    else if ((c & 0xF8) == 0xF0) need = 4;
    return need > back ? n - back : n;
  }
  return n;
}

}  // namespace ds4

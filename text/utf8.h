#pragma once
/// UTF-8: the one encoder of code points, and the helper for streaming text
/// (a character split across tokens is held back until it is complete).
/// Decoding, as llama.cpp does it, is in text/unicode.h.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ds4 {

/// Appends code point `cp` as UTF-8 (one to four bytes); a surrogate
/// (U+D800..U+DFFF) or a value past U+10FFFF becomes U+FFFD.
///
/// Why U+FFFD and not the surrogate's three bytes (WTF-8, CESU-8): what this
/// writes ends in JSON bodies, HTTP streams and prompts, and a lone
/// surrogate's bytes are not UTF-8 (RFC 3629 §3). Strict decoders (Python's,
/// Rust's serde_json, nlohmann) refuse the whole body, lenient ones (Go's
/// encoding/json) put U+FFFD in themselves: U+FFFD here makes every client
/// see the same valid text. The decoder (text/unicode.h) still yields such
/// code points from such bytes, as llama.cpp's does, so a pre-tokenizer
/// classes them as llama.cpp does; their bytes are then U+FFFD's where
/// llama.cpp keeps the three (token ids differ only for such invalid input).
inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

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

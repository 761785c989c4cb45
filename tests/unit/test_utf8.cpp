// The one UTF-8 encoder (text/utf8.h) at every boundary of its byte lengths,
// surrogates and values past Unicode; and the decoder beside it.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "text/bpe.h"
#include "text/unicode.h"
#include "text/utf8.h"

using ds4::append_utf8;

namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  append_utf8(s, cp);
  return s;
}

const std::string kReplacement = "\xef\xbf\xbd";  // U+FFFD

}  // namespace

TEST_CASE("utf8: each byte length's first and last code point") {
  CHECK(utf8(0x0000) == std::string(1, '\0'));
  CHECK(utf8(0x007F) == "\x7f");
  CHECK(utf8(0x0080) == "\xc2\x80");
  CHECK(utf8(0x07FF) == "\xdf\xbf");
  CHECK(utf8(0x0800) == "\xe0\xa0\x80");
  CHECK(utf8(0xFFFF) == "\xef\xbf\xbf");
  CHECK(utf8(0x10000) == "\xf0\x90\x80\x80");
  CHECK(utf8(0x10FFFF) == "\xf4\x8f\xbf\xbf");
  CHECK(utf8(0x00E9) == "\xc3\xa9");
  CHECK(utf8(0x1F642) == "\xf0\x9f\x99\x82");
}

TEST_CASE("utf8: a surrogate or a value past U+10FFFF is written as U+FFFD, never as WTF-8") {
  for (const uint32_t cp : {0xD7FFu, 0xD800u, 0xDBFFu, 0xDC00u, 0xDFFFu, 0xE000u, 0x110000u, 0x1FFFFFu, 0xFFFFFFFFu}) {
    CAPTURE(cp);
    const bool valid = cp == 0xD7FF || cp == 0xE000;
    CHECK((utf8(cp) == kReplacement) == !valid);
  }
  CHECK(utf8(0xD7FF) == "\xed\x9f\xbf");
  CHECK(utf8(0xE000) == "\xee\x80\x80");
  // Appends: what was there stays.
  std::string s = "a";
  append_utf8(s, 0xD800);
  append_utf8(s, 'b');
  CHECK(s == "a" + kReplacement + "b");
}

TEST_CASE("utf8: decoding then encoding gives valid text back unchanged; surrogate bytes become U+FFFD") {
  std::string all;
  for (const uint32_t cp : {0x0u, 0x7Fu, 0x80u, 0x7FFu, 0x800u, 0xFFFFu, 0x10000u, 0x10FFFFu}) append_utf8(all, cp);
  std::vector<uint32_t> cpts;
  ds4::unicode::decode_utf8(all, cpts);
  CHECK(cpts == std::vector<uint32_t>{0x0, 0x7F, 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000, 0x10FFFF});
  std::string back;
  for (const uint32_t c : cpts) append_utf8(back, c);
  CHECK(back == all);
  // "\xed\xa0\x80" decodes to U+D800, as llama.cpp's decoder does; written
  // again it is U+FFFD (a byte-level BPE vocabulary's text goes this way).
  ds4::unicode::decode_utf8("\xed\xa0\x80", cpts);
  CHECK(cpts == std::vector<uint32_t>{0xD800});
  CHECK(ds4::bpe::decode_token_text("\xed\xa0\x80") == kReplacement);
}

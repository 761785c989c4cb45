#pragma once
/// The text a client sees, made from token pieces as they arrive: a UTF-8
/// character split across tokens is held back until complete, and so is any
/// tail that could still grow into a stop string. A stop string is matched
/// across token boundaries; the text ends just before it.

#include <string>
#include <string_view>
#include <vector>

namespace ds4::proxy {

class TextStream {
 public:
  explicit TextStream(std::vector<std::string> stops = {});

  struct Out {
    std::string text;     // ready to send
    bool stopped = false; // a stop string matched: nothing more may be sent
  };
  /// Adds one token's bytes.
  Out push(std::string_view piece);
  /// At the end of generation: what was held back (a partial stop string, an
  /// incomplete character, sent as is).
  std::string flush();

  /// The stop string that matched, or empty.
  const std::string& matched() const { return matched_; }
  /// Every byte sent so far (the answer text).
  const std::string& sent() const { return sent_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  std::string sent_;
  std::string matched_;
  bool stopped_ = false;
};

}  // namespace ds4::proxy

#pragma once
/// A thinking model's thought, apart from its answer. Qwen 3 and DeepSeek R1
/// (and V3.1 in thinking mode) write `<think>…</think>` before the answer;
/// DeepSeek's templates open the `<think>` in the prompt itself, so the
/// answer starts inside the thought. Fed the answer's text in pieces of any
/// size; the tags themselves are neither thought nor answer, and the blanks
/// between `</think>` and the answer are dropped. Pure.

#include <string>
#include <string_view>

namespace ds4::reasoning {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

/// Whether `prompt` ends inside a thought: its last `<think>` is not closed
/// (blanks after it allowed).
bool prompt_opens_thought(std::string_view prompt);

class Splitter {
 public:
  /// `in_thought`: the prompt opened the thought. Otherwise a `<think>` at the
  /// start of the answer (blanks before it allowed) opens one.
  explicit Splitter(bool in_thought);

  struct Out {
    std::string reasoning;  // thought text
    std::string content;    // answer text
  };
  Out push(std::string_view text);
  /// What was held back (a partial tag), as the side it was on.
  Out finish();

  bool in_thought() const { return state_ == State::thought; }
  /// Whether a thought was seen (opened by the prompt or the answer).
  bool thought() const { return thought_; }

 private:
  enum class State { start, thought, after, answer };
  void scan(Out& out, bool at_end);

  State state_;
  std::string buf_;
  bool thought_ = false;
};

}  // namespace ds4::reasoning

#include "text/reasoning.h"

#include <algorithm>

namespace ds4::reasoning {

namespace {

bool blank(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// The longest tail of `s` that is a proper prefix of `word`.
size_t partial_tail(std::string_view s, std::string_view word) {
  for (size_t k = std::min(word.size() - 1, s.size()); k > 0; --k)
    if (s.substr(s.size() - k) == word.substr(0, k)) return k;
  return 0;
}

}  // namespace

bool prompt_opens_thought(std::string_view prompt) {
  const size_t open = prompt.rfind(kOpen);
  if (open == std::string_view::npos) return false;
  for (char c : prompt.substr(open + kOpen.size()))
    if (!blank(c)) return false;
  return true;
}

Splitter::Splitter(bool in_thought) : state_(in_thought ? State::thought : State::start), thought_(in_thought) {}

Splitter::Out Splitter::push(std::string_view text) {
  buf_ += text;
  Out out;
  scan(out, false);
  return out;
}

Splitter::Out Splitter::finish() {
  Out out;
  scan(out, true);
  (state_ == State::thought ? out.reasoning : out.content) += buf_;
  buf_.clear();
  return out;
}

void Splitter::scan(Out& out, bool at_end) {
  for (;;) {
    switch (state_) {
      case State::start: {  // blanks, then <think> or the answer
        size_t i = 0;
        while (i < buf_.size() && blank(buf_[i])) ++i;
        const std::string_view rest = std::string_view(buf_).substr(i);
        if (rest.starts_with(kOpen)) {
          buf_.erase(0, i + kOpen.size());
          state_ = State::thought;
          thought_ = true;
          continue;
        }
        if (!at_end && kOpen.starts_with(rest)) return;  // still undecided
        state_ = State::answer;
        continue;
      }
      case State::thought: {
        const size_t close = buf_.find(kClose);
        if (close != std::string::npos) {
          out.reasoning += buf_.substr(0, close);
          buf_.erase(0, close + kClose.size());
          state_ = State::after;
          continue;
        }
        const size_t hold = at_end ? 0 : partial_tail(buf_, kClose);
        out.reasoning += buf_.substr(0, buf_.size() - hold);
        buf_.erase(0, buf_.size() - hold);
        return;
      }
      case State::after: {  // the blanks between the thought and the answer
        size_t i = 0;
        while (i < buf_.size() && blank(buf_[i])) ++i;
        buf_.erase(0, i);
        if (buf_.empty()) return;
        state_ = State::answer;
        continue;
      }
      case State::answer:
        out.content += buf_;
        buf_.clear();
        return;
    }
  }
}

}  // namespace ds4::reasoning

#include "supervisor/proxy/text_stream.h"

#include <algorithm>

#include "text/utf8.h"

namespace ds4::proxy {

TextStream::TextStream(std::vector<std::string> stops) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

TextStream::Out TextStream::push(std::string_view piece) {
  Out out;
  if (stopped_) {
    out.stopped = true;
    return out;
  }
  pending_ += piece;
  // The earliest complete stop string wins.
  size_t best = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t at = pending_.find(s);
    if (at < best) {
      best = at;
      matched_ = s;
    }
  }
  if (best != std::string::npos) {
    out.text = pending_.substr(0, best);
    out.stopped = stopped_ = true;
    pending_.clear();
    sent_ += out.text;
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k) {
      if (std::string_view(pending_).substr(pending_.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
    }
  }
  size_t n = pending_.size() - hold;
  n = utf8_complete_prefix(std::string_view(pending_).substr(0, n));
  out.text = pending_.substr(0, n);
  pending_.erase(0, n);
  sent_ += out.text;
  return out;
}

std::string TextStream::flush() {
  if (stopped_) return {};
  std::string rest = std::move(pending_);
  pending_.clear();
  sent_ += rest;
  return rest;
}

}  // namespace ds4::proxy

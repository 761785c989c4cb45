#include "supervisor/proxy/model_text.h"

#include <algorithm>

#include "text/reasoning.h"

namespace ds4::proxy {

ModelText ModelText::from_gguf(const gguf::File& meta, std::string name) {
  ModelText m(Tokenizer::from_gguf(meta));
  m.name_ = std::move(name);
  m.template_ = meta.get_string("tokenizer.chat_template").value_or("");
  m.family_ = detect_family(m.template_);
  m.syntax_ = tools::detect_syntax(m.template_, m.family_);
  std::vector<std::string_view> marks = tools::markers(m.syntax_);
  marks.push_back(reasoning::kOpen);
  marks.push_back(reasoning::kClose);
  const auto tokens = meta.get_string_array("tokenizer.ggml.tokens");
  const auto types = meta.get_int_array("tokenizer.ggml.token_type");
  if (tokens && types && types->size() == tokens->size()) {
    constexpr int64_t kControl = 3;
    for (size_t i = 0; i < tokens->size(); ++i) {
      const std::string& t = (*tokens)[i];
      if ((*types)[i] == kControl && t.size() > 1) {
        m.specials_[static_cast<unsigned char>(t[0])].emplace_back(t, int32_t(i));
        if (std::find(marks.begin(), marks.end(), std::string_view(t)) != marks.end()) m.markers_[int32_t(i)] = t;
      }
    }
    for (auto& [c, list] : m.specials_)
      std::stable_sort(list.begin(), list.end(), [](auto& a, auto& b) { return a.first.size() > b.first.size(); });
  }
  return m;
}

std::vector<int32_t> ModelText::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> out;
  bool split = false;  // a control token was found: the text is encoded in parts
  size_t start = 0;    // beginning of the plain text not yet encoded
  auto flush = [&](size_t end) {
    if (end > start) {
      const auto part = tok_.encode(text.substr(start, end - start), false);
      out.insert(out.end(), part.begin(), part.end());
    }
  };
  if (!specials_.empty()) {
    for (size_t i = 0; i < text.size();) {
      auto it = specials_.find(static_cast<unsigned char>(text[i]));
      const std::pair<std::string, int32_t>* hit = nullptr;
      if (it != specials_.end())
        for (const auto& s : it->second)
          if (text.substr(i, s.first.size()) == s.first) {
            hit = &s;
            break;
          }
      if (!hit) {
        ++i;
        continue;
      }
      if (!split && add_bos && tok_.add_bos()) out.push_back(tok_.bos());
      split = true;
      flush(i);
      out.push_back(hit->second);
      i += hit->first.size();
      start = i;
    }
  }
  if (!split) return tok_.encode(text, add_bos);  // the usual case: no parts to join
  flush(text.size());
  return out;
}

}  // namespace ds4::proxy

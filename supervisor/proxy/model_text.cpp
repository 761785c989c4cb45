#include "supervisor/proxy/model_text.h"

#include <algorithm>

#include "shared/error.h"
#include "text/reasoning.h"

namespace ds4::proxy {

ModelText ModelText::from_gguf(const gguf::File& meta, std::string name) {
  ModelText m(Tokenizer::from_gguf(meta));
  m.name_ = std::move(name);
  m.template_ = meta.get_string("tokenizer.chat_template").value_or("");
  m.family_ = detect_family(m.template_);
  if (!m.template_.empty()) {
    try {
      m.jinja_ = std::make_shared<const jinja::Template>(jinja::Template::parse(m.template_));
    } catch (const Error& e) {
      m.template_error_ = e.what();
    }
  }
  m.syntax_ = tools::detect_syntax(m.template_, m.family_);
  std::vector<std::string_view> marks = tools::markers(m.syntax_);
  marks.push_back(reasoning::kOpen);
  marks.push_back(reasoning::kClose);
  const auto tokens = meta.get_string_array("tokenizer.ggml.tokens");
  const auto types = meta.get_int_array("tokenizer.ggml.token_type");
  if (tokens) {
    const auto text_of = [&](const char* key) {
      const auto id = meta.get_int(key);
      return id && *id >= 0 && size_t(*id) < tokens->size() ? (*tokens)[size_t(*id)] : std::string();
    };
    m.bos_text_ = text_of("tokenizer.ggml.bos_token_id");
    m.eos_text_ = text_of("tokenizer.ggml.eos_token_id");
  }
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
  return tok_.encode(text, add_bos, /*parse_special=*/true);
}

}  // namespace ds4::proxy

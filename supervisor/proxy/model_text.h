#pragma once
/// What the proxy knows of the model's text side: its name, tokenizer, chat
/// family and special tokens. Built from GGUF metadata (the model segment's,
/// or a file's in standalone mode); immutable afterwards.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shared/gguf.h"
#include "text/chat_template.h"
#include "text/jinja.h"
#include "text/tool_calls.h"
#include "text/tokenizer.h"

namespace ds4::proxy {

class ModelText {
 public:
  /// Throws ds4::Error when the vocabulary cannot be used.
  static ModelText from_gguf(const gguf::File& meta, std::string name);

  const std::string& name() const { return name_; }
  const Tokenizer& tokenizer() const { return tok_; }
  ChatFamily family() const { return family_; }
  /// The GGUF's tokenizer.chat_template ("" when it has none).
  const std::string& chat_template() const { return template_; }
  /// That template, parsed: what chat prompts are rendered with. Null when the
  /// GGUF has none or it does not parse (template_error() says why): the
  /// family's format is written then.
  const jinja::Template* jinja_template() const { return jinja_.get(); }
  const std::string& template_error() const { return template_error_; }
  /// The texts of the BOS and EOS tokens, as templates write them ("" when none).
  const std::string& bos_text() const { return bos_text_; }
  const std::string& eos_text() const { return eos_text_; }
  /// The syntax the model writes tool calls in (tools::detect_syntax).
  tools::Syntax tool_syntax() const { return syntax_; }
  /// The text of a control token that answer parsing needs to see (the tool
  /// call markers of tool_syntax(), <think>, </think>); empty for any other.
  /// Tokenizer::piece() gives "" for control tokens.
  std::string_view marker_text(int32_t token) const {
    auto it = markers_.find(token);
    return it == markers_.end() ? std::string_view() : std::string_view(it->second);
  }

  /// Tokens for `text` with control tokens written in it (<|im_start|>, </s>)
  /// taken as those tokens, as llama.cpp's server does (a chat template's
  /// output; message contents went through Tokenizer::escape_special first,
  /// so a control token's text a client wrote stays text); BOS first when the
  /// model wants one and `add_bos`.
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;

 private:
  ModelText(Tokenizer tok) : tok_(std::move(tok)) {}
  std::string name_;
  Tokenizer tok_;
  ChatFamily family_ = ChatFamily::chatml;
  std::string template_;
  std::shared_ptr<const jinja::Template> jinja_;
  std::string template_error_;
  std::string bos_text_, eos_text_;
  tools::Syntax syntax_ = tools::Syntax::hermes;
  std::unordered_map<int32_t, std::string> markers_;
  // Control tokens by their first byte, longest text first.
  std::unordered_map<unsigned char, std::vector<std::pair<std::string, int32_t>>> specials_;
};

}  // namespace ds4::proxy

#pragma once
/// Chat prompts. A GGUF's tokenizer.chat_template (a Jinja program) runs in
/// ds4's interpreter (text/jinja.h) through apply_chat_template. The five
/// formats below are the fallback for a GGUF without a template: the family
/// is recognised by its markers and its format written here; an absent or
/// unknown template gets ChatML, as llama.cpp does, so that models without
/// chat tuning still answer.
///
///   chatml    <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
///   llama3    <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> ...
///   llama2    [INST] <<SYS>>\nsys\n<</SYS>>\n\nuser [/INST] answer </s><s>[INST] ...
///   mistral   [INST] sys\n\nuser[/INST] answer</s>[INST] ...
///   deepseek  sys<｜User｜>user<｜Assistant｜>answer<｜end▁of▁sentence｜> ...
/// BOS is not part of the text: the tokenizer adds it.

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/jinja.h"

namespace ds4 {

enum class ChatFamily { chatml, llama2, llama3, mistral, deepseek };
const char* family_name(ChatFamily f);

/// The family a template belongs to; chatml when empty or unrecognised.
ChatFamily detect_family(std::string_view chat_template);

struct ChatMessage {
  std::string role;  // system, user, assistant (developer and tool are mapped before)
  std::string content;
};

/// The prompt text, ending where the assistant's answer begins.
std::string render_chat(ChatFamily family, const std::vector<ChatMessage>& messages);

/// What transformers' apply_chat_template gives a template. The JSON fields
/// keep their keys' order (a tool's schema renders through tojson in the
/// order the request gave it); a plain nlohmann::json converts to them.
struct ChatTemplateInput {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // OpenAI chat messages
  nlohmann::ordered_json tools;  // null when none: the template sees none, as transformers passes None
  bool add_generation_prompt = true;
  std::string bos_token, eos_token;
  /// chat_template_kwargs, enable_thinking, ...: each becomes a top-level
  /// name of the template (they do not replace the five above).
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
};

/// Renders a GGUF chat template for a conversation as transformers'
/// apply_chat_template does (messages, tools, add_generation_prompt,
/// bos_token, eos_token and the kwargs as the template's names). Throws
/// ds4::Error: the template's raise_exception message, a limit reached, or a
/// runtime error with "template:LINE:COL: ".
std::string apply_chat_template(const jinja::Template& t, const ChatTemplateInput& in,
                                const jinja::Limits& limits = {});

}  // namespace ds4

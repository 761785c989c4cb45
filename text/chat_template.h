#pragma once
/// Chat prompts. The GGUF's tokenizer.chat_template (a Jinja program) is not
/// executed; it is recognised by the markers of the common families and the
/// family's format is written here. An absent or unknown template gets
/// ChatML, as llama.cpp does, so that models without chat tuning still answer.
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

}  // namespace ds4

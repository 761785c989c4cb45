#pragma once
/// A conversation as chat templates take it, made from each API's request:
/// the shape Hugging Face's transformers passes to `apply_chat_template`.
///
///   messages  [{role: system|user|assistant|tool, content: string,
///               tool_calls?: [{id, type: "function", function: {name, arguments: {object}}}],
///               tool_call_id?, name?}]
///   tools     [{type: "function", function: {name, description, parameters}}]
///   kwargs    chat_template_kwargs (enable_thinking among them)
///
/// OpenAI chat, Anthropic messages and the Responses API's input items are
/// all turned into this; the prompt is then written from it (render_prompt).
/// Errors are ds4::Error naming the field ("'messages[2].tool_calls[0].function.arguments' ...").

#include <optional>
#include <string>

#include "supervisor/proxy/json_util.h"

#include "supervisor/proxy/model_text.h"

namespace ds4::proxy {

struct ChatInput {
  json messages = json::array();
  json tools = json::array();
  json kwargs = json::object();
  /// The tools marked `strict: true`: their calls must fit their schema,
  /// under tool_choice auto too (kept apart so that the template sees the
  /// tools as before).
  std::vector<std::string> strict;
  bool operator==(const ChatInput&) const = default;
};

/// Which calls a request allows or asks for.
struct ToolChoice {
  enum class Mode { automatic, none, required, named } mode = Mode::automatic;
  std::string name;  // named
  bool parallel = true;
  bool operator==(const ToolChoice&) const = default;
};

/// OpenAI chat: messages (system/developer anywhere, tool_calls, role tool),
/// tools, tool_choice, parallel_tool_calls.
ChatInput openai_chat_input(const json& body, ToolChoice& choice);
/// Anthropic: system, messages with text/tool_use/tool_result/thinking blocks
/// (a system message anywhere too), tools, tool_choice.
ChatInput anthropic_input(const json& body, ToolChoice& choice);
/// Responses: instructions, input (a string or items: messages,
/// function_call, function_call_output, reasoning), tools, tool_choice.
/// `previous`: the stored conversation of previous_response_id, put first.
ChatInput responses_input(const json& body, const json* previous, ToolChoice& choice);

/// The prompt text for `in`, ending where the assistant's answer begins. The
/// model's own template is run when it has one (ModelText::chat_template());
/// otherwise the family's format is written, with the tools and the calls
/// in the history described in the model's call syntax.
std::string render_prompt(const ModelText& model, const ChatInput& in);

/// The thinking switch a request's controls ask for (reasoning_effort,
/// chat_template_kwargs.enable_thinking, Anthropic's and DeepSeek's
/// `thinking`, Responses' reasoning.effort); nullopt when it says nothing.
std::optional<bool> thinking_asked(const json& body, bool anthropic);

}  // namespace ds4::proxy

#pragma once
/// Anthropic message streams on an exec engine that resumes chat
/// (engine_resume.h): llama-server's /v1/messages stream carries no token
/// ids, so a cut could not be continued. The request goes to the engine as
/// an OpenAI chat stream instead (the same conversation, sampling and
/// thinking switch), whose ids the resume machinery reads, and the chat
/// stream that reaches the client is turned back into Anthropic's events.
/// Only what the translation carries exactly is translated: text messages,
/// a system prompt, max_tokens, temperature, top_p, top_k and the thinking
/// switch. Tools, images, stop sequences (the chat stream does not say which
/// one matched) or any other key leave the request as it was: forwarded to
/// the engine's own /v1/messages, replayed before its first byte only.

#include <optional>
#include <string>
#include <string_view>

#include "supervisor/proxy/engine_call.h"
#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

/// The streamed /v1/messages request as a /v1/chat/completions stream (with
/// stream_options.include_usage); nullopt when it is not one or has
/// anything the translation does not carry.
std::optional<EngineRequest> anthropic_as_chat(const EngineRequest& req);

/// A chat completions stream (SSE, split anywhere) in, Anthropic message
/// events out: message_start, a thinking block for reasoning_content, a text
/// block for content, message_delta (stop reason, usage) and message_stop at
/// [DONE]. An error event passes as Anthropic's `event: error`.
class AnthropicFromChat {
 public:
  /// `model`: the name the client asked for (message_start's model).
  explicit AnthropicFromChat(std::string model) : model_(std::move(model)) {}
  std::string feed(std::string_view sse);

 private:
  std::string event(std::string_view data);
  std::string start(const json& chunk);
  std::string block(const char* type);
  std::string close_block();
  std::string end();
  std::string model_, pending_;
  bool started_ = false, ended_ = false;
  std::string open_;      // the type of the open block
  int64_t index_ = -1;    // of the open (or last) block
  std::string stop_reason_ = "end_turn";
  int64_t input_tokens_ = 0, output_tokens_ = -1, cached_tokens_ = 0;
  int64_t chunks_ = 0;    // text and thought events: the output count when no usage came
};

}  // namespace ds4::proxy

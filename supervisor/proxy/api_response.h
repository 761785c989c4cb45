#pragma once
/// Answers in each API's shape, streamed (SSE) or whole. One Responder per
/// request turns the text as it comes (with the tokens behind it, for
/// log-probs) and the finish into bytes. Pure: tested without sockets.
///
/// Streams:
///   OpenAI     data: {chunk}\n\n ... data: [DONE]\n\n
///   Anthropic  event: message_start, then per content block (thinking, text,
///              tool_use) content_block_start (ping after the first),
///              content_block_delta* (thinking_delta, text_delta,
///              input_json_delta), content_block_stop; message_delta, message_stop
///   Responses  event: response.created, response.in_progress, per output item
///              (reasoning, message, function_call) response.output_item.added,
///              its deltas (response.reasoning_text.delta,
///              response.output_text.delta, response.function_call_arguments.delta)
///              and .done events, response.output_item.done; response.completed
///              (or response.incomplete at max_output_tokens)
/// While a request waits in the queue, a stream carries SSE comment lines
/// (": waiting, position N"), which SSE parsers skip.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shared/protocol.h"
#include "supervisor/proxy/api_error.h"
#include "supervisor/proxy/api_request.h"
#include "text/tokenizer.h"
#include "text/tool_calls.h"

namespace ds4::proxy {

struct TokenInfo {
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

enum class FinishReason { stop, length, stop_sequence, tool_calls };

struct Finish {
  FinishReason reason = FinishReason::stop;
  std::string stop_sequence;  // the one that matched
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  proto::Timings timings;
};

class Responder {
 public:
  virtual ~Responder() = default;
  /// Streams: the first bytes (role chunk, message_start). Whole answers: "".
  virtual std::string open() = 0;
  /// New answer text and the tokens it came from. Streams: the event(s) to
  /// send; whole answers keep it and return "".
  virtual std::string text(std::string_view delta, std::vector<TokenInfo> tokens) = 0;
  /// Thought text (reasoning_content, thinking blocks, reasoning items).
  virtual std::string reasoning(std::string_view delta) = 0;
  /// A complete tool call; `id` is the one the client answers with.
  virtual std::string tool_call(const std::string& id, const tools::ToolCall& call) = 0;
  /// Streams: the closing events; whole answers: the JSON body.
  virtual std::string finish(const Finish& f) = 0;
  /// An error after the stream began (queue timeout): the API's error event.
  virtual std::string stream_error(const ApiError& e) = 0;
};

/// `id` is the response id ("chatcmpl-…", "msg_…", "resp_…"), `created` Unix seconds.
std::unique_ptr<Responder> make_responder(const Plan& plan, const Tokenizer& tok, std::string id, int64_t created);
/// The Responses API's (responses_api.cpp); make_responder picks it for Endpoint::responses.
std::unique_ptr<Responder> make_responses_responder(const Plan& plan, std::string id, int64_t created);

/// An SSE error event in `api`'s shape around an error body (JSON; line
/// breaks in it become blanks): OpenAI `data: {…}`, Anthropic `event: error`.
std::string sse_error_event(Api api, std::string_view error_json);

/// ": waiting, position N\n\n".
std::string waiting_comment(int64_t position);

/// llama.cpp's timings object: prompt_n, prompt_ms, prompt_per_token_ms,
/// prompt_per_second, predicted_n, …, cache_n.
std::string timings_json(const proto::Timings& t);

}  // namespace ds4::proxy

#pragma once
/// Turns an API request body into what the proxy runs: prompt tokens,
/// sampling, limits, stop strings and how to answer. Pure: no I/O, so every
/// field's validation is tested directly. Errors are ApiErrors naming the
/// field and what was expected.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "shared/protocol.h"
#include "supervisor/proxy/api_error.h"
#include "supervisor/proxy/chat_input.h"
#include "supervisor/proxy/model_text.h"
#include "supervisor/proxy/response_store.h"

namespace ds4::proxy {

/// /v1/chat/completions, /v1/completions, /v1/messages, /v1/responses, /v1/messages/count_tokens
enum class Endpoint { chat, completion, messages, responses, count_tokens };

struct Plan {
  Endpoint endpoint = Endpoint::chat;
  bool stream = false;
  bool include_usage = false;         // OpenAI stream_options.include_usage
  bool logprobs = false;              // report log-probs of the chosen tokens
  int32_t top_logprobs = 0;           // alternatives per token
  std::vector<std::string> stop;      // stop strings (matched on text)
  std::string model;                  // as the client named it (echoed), else ours
  proto::GenerateRequest gen;         // prompt tokens, max_tokens, sampling

  // What is read out of the answer (chat, messages, responses).
  bool read_answer = false;           // thoughts (<think>…</think>) apart, and calls when tool_calls
  bool tool_calls = false;            // tools offered and tool_choice not none: calls are parsed
  tools::Syntax tool_syntax = tools::Syntax::hermes;
  bool thought_open = false;          // the prompt ends inside <think>: the answer starts in a thought
  int64_t thinking_budget = 0;        // Anthropic thinking.budget_tokens (0: no budget)
  ToolChoice tool_choice;
  // Responses: the conversation so far (previous response's and this input,
  // without the instructions), stored with the answer; and what the
  // response object echoes (instructions, tools, tool_choice, ...).
  json conversation;
  json echo;
  bool store = true;                  // Responses' store: false keeps it out of the store
  bool operator==(const Plan&) const = default;
};

/// What parse_request needs to know beyond the body.
struct PlanLimits {
  int64_t max_tokens_per_request = 32768;  // prompt + generated
  int64_t context = 0;                     // the largest worker context known; 0 = unknown
  uint64_t random_seed = 0;                // used when sampling without a seed
  const ResponseStore* responses = nullptr;  // for previous_response_id; none: such a request is refused
};

/// Parses `body` for `endpoint`. Returns the plan or the error to answer.
std::variant<Plan, ApiError> parse_request(Endpoint endpoint, std::string_view body, const ModelText& model,
                                           const PlanLimits& limits);

/// parse_request's first try, without a JSON tree: the plan for a valid body
/// of the common shape (an object of the fields clients usually send, with
/// scalar values, messages as role and content strings, stops as strings),
/// the same plan as the full parse; nullopt for anything else: another field,
/// a null, a duplicate, an invalid value or malformed JSON. The full parse
/// then reads it and words any error.
std::optional<Plan> parse_common_request(Endpoint endpoint, std::string_view body, const ModelText& model,
                                         const PlanLimits& limits);

}  // namespace ds4::proxy

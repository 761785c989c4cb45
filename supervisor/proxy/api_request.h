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
#include "supervisor/proxy/model_text.h"

namespace ds4::proxy {

enum class Endpoint { chat, completion, messages };  // /v1/chat/completions, /v1/completions, /v1/messages

struct Plan {
  Endpoint endpoint = Endpoint::chat;
  bool stream = false;
  bool include_usage = false;         // OpenAI stream_options.include_usage
  bool logprobs = false;              // report log-probs of the chosen tokens
  int32_t top_logprobs = 0;           // alternatives per token
  std::vector<std::string> stop;      // stop strings (matched on text)
  std::string model;                  // as the client named it (echoed), else ours
  proto::GenerateRequest gen;         // prompt tokens, max_tokens, sampling
  bool operator==(const Plan&) const = default;
};

/// What parse_request needs to know beyond the body.
struct PlanLimits {
  int64_t max_tokens_per_request = 32768;  // prompt + generated
  int64_t context = 0;                     // the largest worker context known; 0 = unknown
  uint64_t random_seed = 0;                // used when sampling without a seed
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

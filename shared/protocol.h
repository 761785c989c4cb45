#pragma once
/// The worker's token-level protocol, spoken over a Unix stream socket as
/// newline-delimited JSON. Each answer ends with its done, error or info line.
///
///   client → worker   {"op":"generate","id":7,"prompt":[1,403,...],"generated":[432,...],
///                      "max_tokens":64,"temperature":0,"top_k":40,"top_p":0.95,
///                      "min_p":0.05,"seed":7,"logprobs":0,"ignore_eos":false
///                      [,"frequency_penalty":0.5,"presence_penalty":0.5,"logit_bias":[[13,-100],...],
///                       "grammar":"root ::= ...","grammar_triggers":[{"text":"<tool_call>"},...]]}
///   worker → client   {"ev":"token","i":0,"id":7,"lp":-0.01,"t":432,"top":[[432,-0.01],...]}   (one per token)
///                     {"ev":"done","id":7,"reason":"stop|length|context|cancelled","timings":{...}}
///                  or {"ev":"error","id":7,"message":"..."}
///
///   client → worker   {"op":"cancel","id":7}   the request's done line (cancelled) follows;
///                                              nothing if it has ended already
///   client → worker   {"op":"info"}            →  {"ev":"info", model, ctx, slots, busy, ...}
///
/// Requests with an "id" (a positive integer, unique among the connection's
/// running requests) share their connection: the next line is read at once,
/// every event of the request carries its id, and the events of one step
/// leave in one write. The proxy sends all its requests to a worker this way,
/// on one connection. A generate request without "id" has the connection to
/// itself: its events carry no id, and the next line is read once it ended.
/// A line that cannot be parsed (or reuses a running id) is answered with an
/// error line without id, and the connection closes. Closing the connection
/// cancels every request running on it.
///
/// Resuming: a request whose worker died is sent again, to any worker, with
/// "generated" holding every token received so far; "i" of the next token is
/// generated.size(). Sampling draws depend only on (seed, i), so the answer
/// continues exactly as it would have.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ds4::proto {

/// Hard limits on what one request may carry.
inline constexpr size_t kMaxLineBytes = 32u << 20;
inline constexpr size_t kMaxTokens = 1u << 22;
inline constexpr size_t kMaxLogitBias = 1024;  // entries of a request's logit_bias
inline constexpr size_t kMaxGrammarBytes = 1u << 20;  // a request's grammar text
inline constexpr size_t kMaxGrammarTriggers = 16;     // a lazy grammar's triggers
inline constexpr size_t kMaxTriggerBytes = 256;       // the text of one

struct Sampling {
  float temperature = 0.8f;
  int32_t top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  uint64_t seed = 0;
  float frequency_penalty = 0;  // OpenAI's, over the generated tokens; sent only when not 0
  float presence_penalty = 0;
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token, bias); sent only when not empty
  bool operator==(const Sampling&) const = default;
};

/// Where a lazy grammar starts: the first place in the answer where `text`
/// appears (`at_start`: only as the answer's first text after blanks). The
/// grammar then applies from that text on; before it, the answer is free.
struct GrammarTrigger {
  std::string text;
  bool at_start = false;
  bool operator==(const GrammarTrigger&) const = default;
};

struct GenerateRequest {
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;
  int32_t max_tokens = 128;
  Sampling sampling;
  int32_t logprobs = 0;
  bool ignore_eos = false;
  /// A grammar (text/grammar.h) every generated token must keep the answer
  /// inside; empty: none. Its state is a function of `generated`, so a
  /// resumed request stays exact. Sent only when not empty.
  std::string grammar;
  /// Not empty: the grammar is lazy, waiting for one of these (a tool call
  /// the model may or may not make). Sent only when not empty.
  std::vector<GrammarTrigger> grammar_triggers;
  bool operator==(const GenerateRequest&) const = default;
};

struct Request {
  enum class Op { generate, cancel, info } op = Op::info;
  int64_t id = 0;  // generate, cancel: the request's id on its connection (0 = none)
  GenerateRequest generate;
};

/// Parses one request line. Throws ds4::Error saying which field is wrong and
/// what was expected (types, ranges, sizes); never anything else.
Request parse_request(std::string_view line);
/// `id` 0: a request without id.
std::string to_line(const GenerateRequest& r, int64_t id = 0);
std::string cancel_line(int64_t id);

struct TokenEvent {
  int64_t index = 0;
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

struct Timings {
  int64_t prompt_n = 0, cache_n = 0, predicted_n = 0;
  double prompt_ms = 0, predicted_ms = 0;
};

/// `id`: the request's id, 0 when it has none.
std::string token_line(const TokenEvent& e, int64_t id = 0);
std::string done_line(std::string_view reason, const Timings& t, int64_t id = 0);
std::string error_line(std::string_view message, int64_t id = 0);

/// One event a worker sent, parsed (for clients: the proxy, tests, tools).
struct Event {
  enum class Kind { token, done, error, info } kind = Kind::error;
  int64_t id = 0;       // the request's id, 0 when it has none
  TokenEvent token;
  std::string reason;   // done
  Timings timings;      // done
  std::string message;  // error
  nlohmann::json info;  // info
};
Event parse_event(std::string_view line);

}  // namespace ds4::proto

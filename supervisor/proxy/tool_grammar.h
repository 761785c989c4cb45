#pragma once
/// Grammars the proxy sends with a request (text/grammar.h; the worker masks
/// every token that leaves them): a forced tool call in the model's own call
/// syntax, its arguments valid JSON of the tool's `parameters`, and the JSON
/// answer formats. Errors are ds4::Error naming the field (a 400).

#include <string>

#include "supervisor/proxy/json_util.h"

#include "shared/protocol.h"
#include "supervisor/proxy/chat_input.h"
#include "text/tool_calls.h"

namespace ds4::proxy {

/// The grammar of exactly one call of one of `tools` (OpenAI function shape),
/// or of the tool `choice` names, written in `syntax`; "" when the choice
/// forces no call (auto, none).
std::string forced_call_grammar(tools::Syntax syntax, const json& tools, const ToolChoice& choice);

/// Under tool_choice auto with strict tools: a lazy grammar (the worker
/// applies it from the first trigger on) of the calls the model may make in
/// `syntax`, one call or (`choice.parallel`, where the syntax repeats calls)
/// several. A strict tool's arguments fit its schema; another tool's are any
/// JSON object. Empty when no tool is strict or the choice is not auto.
struct LazyGrammar {
  std::string grammar;
  std::vector<proto::GrammarTrigger> triggers;
};
LazyGrammar strict_calls_grammar(tools::Syntax syntax, const json& tools, const ToolChoice& choice,
                                 const std::vector<std::string>& strict);

/// The grammar of an answer that is one JSON value of `schema` (json_schema)
/// or any JSON object (json_object: `schema` null). `field` names where the
/// schema came from, for errors.
std::string json_answer_grammar(const json* schema, const std::string& field);

}  // namespace ds4::proxy

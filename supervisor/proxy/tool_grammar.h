#pragma once
/// Grammars the proxy sends with a request (text/grammar.h; the worker masks
/// every token that leaves them): a forced tool call in the model's own call
/// syntax, its arguments valid JSON of the tool's `parameters`, and the JSON
/// answer formats. Errors are ds4::Error naming the field (a 400).

#include <string>

#include "supervisor/proxy/json_util.h"

#include "supervisor/proxy/chat_input.h"
#include "text/tool_calls.h"

namespace ds4::proxy {

/// The grammar of exactly one call of one of `tools` (OpenAI function shape),
/// or of the tool `choice` names, written in `syntax`; "" when the choice
/// forces no call (auto, none).
std::string forced_call_grammar(tools::Syntax syntax, const json& tools, const ToolChoice& choice);

/// The grammar of an answer that is one JSON value of `schema` (json_schema)
/// or any JSON object (json_object: `schema` null). `field` names where the
/// schema came from, for errors.
std::string json_answer_grammar(const json* schema, const std::string& field);

}  // namespace ds4::proxy

// The request an exec engine gets (router.h forward_request): its own file,
// so that the request fuzzer links it without the rest of the proxy.
#include <nlohmann/json.hpp>

#include "shared/error.h"
#include "supervisor/proxy/chat_input.h"
#include "supervisor/proxy/json_util.h"
#include "supervisor/proxy/router.h"

namespace ds4::proxy {

namespace http = boost::beast::http;

namespace {

/// Nesting of `text` deeper than `limit` (brackets outside strings), checked
/// before parsing: the JSON tree is freed recursively.
bool nests_deeper(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

/// The reasoning controls of every API, as the one switch engines take. An
/// engine reads its own subset (llama-server: chat_template_kwargs,
/// reasoning_effort "none" and Anthropic's thinking "enabled"; vLLM:
/// chat_template_kwargs), so that a thinking model answers the same
/// whichever way the client asked: reasoning_effort, reasoning.effort and
/// thinking become chat_template_kwargs.enable_thinking, unless the client
/// set that itself. False when the body needed no change.
bool translate_reasoning(json& body, std::string_view path) {
  const bool anthropic = path == "/v1/messages";
  if (!anthropic && path != "/v1/chat/completions" && path != "/v1/responses") return false;
  const std::optional<bool> think = thinking_asked(body, anthropic);
  if (!think) return false;
  json& kwargs = body["chat_template_kwargs"];
  if (kwargs.is_null()) kwargs = json::object();
  if (!kwargs.is_object()) throw Error("'chat_template_kwargs' must be an object");
  if (kwargs.contains("enable_thinking")) return false;
  kwargs["enable_thinking"] = *think;
  return true;
}

}  // namespace

std::variant<EngineRequest, ApiError> forward_request(const HttpRequest& req) {
  constexpr int kMaxDepth = 64;
  if (nests_deeper(req.body(), kMaxDepth))
    return bad_request("the request body nests deeper than " + std::to_string(kMaxDepth) + " levels");
  auto parsed = parse_body(req.body());
  if (auto* why = std::get_if<std::string>(&parsed)) return bad_request("the request body is not valid JSON: " + *why);
  json& body = std::get<json>(parsed);
  if (!body.is_object()) return bad_request("the body must be a JSON object");
  EngineRequest f;
  if (auto s = body.find("stream"); s != body.end() && !s->is_null()) {
    if (!s->is_boolean()) return bad_request("stream: expected true or false");
    f.stream = s->get<bool>();
  }
  f.method = std::string(req.method_string());
  f.target = std::string(req.target());
  auto ct = req.find(http::field::content_type);
  f.content_type = ct == req.end() ? "application/json" : std::string(ct->value());
  f.body = req.body();
  const std::string_view target(f.target);
  try {
    if (translate_reasoning(body, target.substr(0, target.find('?')))) f.body = dump(body);
  } catch (const Error& e) {
    return bad_request(e.what());
  }
  return f;
}

}  // namespace ds4::proxy

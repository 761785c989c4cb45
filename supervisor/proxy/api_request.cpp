#include "supervisor/proxy/api_request.h"

#include "shared/error.h"
#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

namespace {

constexpr size_t kMaxStops = 16;
constexpr size_t kMaxStopBytes = 1024;
constexpr int kMaxDepth = 64;  // nesting in request JSON (the parser recurses)

// Text of an OpenAI or Anthropic content field: a string, or an array of
// parts of which the text ones are joined.
std::string content_text(const json& c, const std::string& where) {
  if (c.is_null()) return {};
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) throw Error("'" + where + ".content' must be a string or an array of parts");
  std::string out;
  for (const json& part : c) {
    if (part.is_string()) {
      out += part.get<std::string>();
      continue;
    }
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      throw Error("'" + where + ".content' parts must be objects with a 'type'");
    const std::string type = part["type"];
    if (type != "text") throw Error("'" + where + ".content' has a part of type '" + type + "'; only text is supported");
    auto t = opt_string(part, "text");
    if (!t) throw Error("'" + where + ".content' text part needs 'text'");
    out += *t;
  }
  return out;
}

std::vector<ChatMessage> chat_messages(const json& body, const char* key, bool anthropic) {
  auto it = body.find(key);
  if (it == body.end() || !it->is_array()) throw Error(std::string("'") + key + "' must be an array of messages");
  if (it->empty()) throw Error(std::string("'") + key + "' must not be empty");
  std::vector<ChatMessage> out;
  if (anthropic && body.contains("system") && !body["system"].is_null())
    out.push_back({"system", content_text(body["system"], "system")});
  size_t i = 0;
  for (const json& m : *it) {
    const std::string where = std::string(key) + "[" + std::to_string(i++) + "]";
    if (!m.is_object()) throw Error("'" + where + "' must be an object");
    auto role = opt_string(m, "role");
    if (!role) throw Error("'" + where + ".role' is required");
    std::string r = *role;
    if (r == "developer") r = "system";
    if (r == "tool" || r == "function") r = "user";
    const bool known = anthropic ? (r == "user" || r == "assistant") : (r == "system" || r == "user" || r == "assistant");
    if (!known) throw Error("'" + where + ".role' is '" + *role + "', not a role this endpoint accepts");
    out.push_back({r, m.contains("content") ? content_text(m["content"], where) : std::string()});
  }
  return out;
}

std::vector<std::string> stop_strings(const json& body, const char* key) {
  auto it = body.find(key);
  std::vector<std::string> out;
  if (it == body.end() || it->is_null()) return out;
  if (it->is_string()) {
    out.push_back(it->get<std::string>());
  } else if (it->is_array()) {
    for (const json& s : *it) {
      if (!s.is_string()) throw Error(std::string("'") + key + "' must be a string or an array of strings");
      out.push_back(s.get<std::string>());
    }
  } else {
    throw Error(std::string("'") + key + "' must be a string or an array of strings");
  }
  if (out.size() > kMaxStops) throw Error(std::string("'") + key + "' has more than " + std::to_string(kMaxStops) + " strings");
  for (const auto& s : out)
    if (s.size() > kMaxStopBytes)
      throw Error(std::string("'") + key + "' holds a string longer than " + std::to_string(kMaxStopBytes) + " bytes");
  return out;
}

// Completions' prompt: a string, one string in an array, or token ids.
std::vector<int32_t> completion_prompt(const json& body, const ModelText& model) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) throw Error("'prompt' is required");
  if (it->is_string()) return model.encode(it->get<std::string>(), true);
  if (it->is_array() && it->size() == 1 && (*it)[0].is_string()) return model.encode((*it)[0].get<std::string>(), true);
  if (it->is_array() && !it->empty() && (*it)[0].is_number()) {
    std::vector<int32_t> toks;
    for (const json& t : *it) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= model.tokenizer().n_vocab())
        throw Error("'prompt' holds " + t.dump() + ", not a token id of this model");
      toks.push_back(t.get<int32_t>());
    }
    return toks;
  }
  throw Error("'prompt' must be a string (one prompt per request) or an array of token ids");
}

int depth_of(const json& j, int depth) {
  if (depth > kMaxDepth) return depth;
  int d = depth;
  if (j.is_array() || j.is_object())
    for (const json& v : j) d = std::max(d, depth_of(v, depth + 1));
  return d;
}

Plan parse(Endpoint endpoint, const json& body, const ModelText& model, const PlanLimits& limits) {
  Plan p;
  p.endpoint = endpoint;
  const bool anthropic = endpoint == Endpoint::messages;
  p.model = opt_string(body, "model").value_or(model.name());
  p.stream = opt_bool(body, "stream").value_or(false);
  if (auto so = body.find("stream_options"); so != body.end() && !so->is_null()) {
    if (!so->is_object()) throw Error("'stream_options' must be an object");
    p.include_usage = opt_bool(*so, "include_usage").value_or(false);
  }
  if (auto n = opt_int(body, "n", 1, 1 << 20); n && *n != 1) throw Error("'n' must be 1: one choice per request");

  // Prompt.
  if (endpoint == Endpoint::completion) {
    p.gen.prompt = completion_prompt(body, model);
  } else {
    p.gen.prompt = model.encode(render_chat(model.family(), chat_messages(body, "messages", anthropic)), true);
  }
  if (p.gen.prompt.empty()) throw Error("the prompt has no tokens");
  const int64_t n_prompt = int64_t(p.gen.prompt.size());
  if (limits.context > 0 && n_prompt >= limits.context)
    throw Error("the prompt has " + std::to_string(n_prompt) + " tokens but the context is " +
                std::to_string(limits.context) + " tokens: shorten the prompt");
  if (n_prompt >= limits.max_tokens_per_request)
    throw Error("the prompt has " + std::to_string(n_prompt) + " tokens, more than the limit of " +
                std::to_string(limits.max_tokens_per_request) + " tokens per request");

  // Length. Anthropic requires max_tokens; OpenAI defaults to what fits.
  std::optional<int64_t> max_tokens = opt_int(body, "max_tokens", anthropic ? 1 : 0, INT64_MAX);
  if (!anthropic)
    if (auto m = opt_int(body, "max_completion_tokens", 0, INT64_MAX)) max_tokens = m;
  if (anthropic && !max_tokens) throw Error("'max_tokens' is required");
  int64_t room = limits.max_tokens_per_request - n_prompt;
  if (limits.context > 0) room = std::min(room, limits.context - n_prompt);
  p.gen.max_tokens = int32_t(std::min<int64_t>(max_tokens.value_or(room), room));

  // Sampling: llama.cpp's defaults where the client says nothing.
  proto::Sampling& s = p.gen.sampling;
  s.temperature = float(opt_number(body, "temperature", 0, anthropic ? 1 : 2).value_or(s.temperature));
  s.top_p = float(opt_number(body, "top_p", 0, 1).value_or(s.top_p));
  s.top_k = int32_t(opt_int(body, "top_k", 0, 1 << 30).value_or(s.top_k));
  s.min_p = float(opt_number(body, "min_p", 0, 1).value_or(s.min_p));
  if (auto seed = opt_int(body, "seed", INT64_MIN, INT64_MAX)) s.seed = uint64_t(*seed);
  else s.seed = limits.random_seed;

  p.stop = stop_strings(body, anthropic ? "stop_sequences" : "stop");

  // Log-probs: chat has logprobs (bool) + top_logprobs; completions an int.
  if (endpoint == Endpoint::chat) {
    p.logprobs = opt_bool(body, "logprobs").value_or(false);
    p.top_logprobs = int32_t(opt_int(body, "top_logprobs", 0, 20).value_or(0));
    if (p.top_logprobs > 0 && !p.logprobs) throw Error("'top_logprobs' needs 'logprobs': true");
  } else if (endpoint == Endpoint::completion) {
    if (auto lp = opt_int(body, "logprobs", 0, 20)) {
      p.logprobs = true;
      p.top_logprobs = int32_t(*lp);
    }
    if (opt_bool(body, "echo").value_or(false)) throw Error("'echo' is not supported");
  }
  p.gen.logprobs = p.top_logprobs;
  return p;
}

}  // namespace

std::variant<Plan, ApiError> parse_request(Endpoint endpoint, std::string_view text, const ModelText& model,
                                           const PlanLimits& limits) {
  json body = json::parse(text, nullptr, false);
  if (body.is_discarded()) return bad_request("the request body is not valid JSON");
  if (!body.is_object()) return bad_request("the request body must be a JSON object");
  if (depth_of(body, 0) > kMaxDepth)
    return bad_request("the request body nests deeper than " + std::to_string(kMaxDepth) + " levels");
  try {
    return parse(endpoint, body, model, limits);
  } catch (const Error& e) {
    return bad_request(e.what());
  } catch (const json::exception& e) {
    return bad_request(std::string("bad request: ") + e.what());
  }
}

}  // namespace ds4::proxy

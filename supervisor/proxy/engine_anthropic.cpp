#include "supervisor/proxy/engine_anthropic.h"

#include <algorithm>

namespace ds4::proxy {

namespace {

std::string sse(const char* name, const json& j) { return std::string("event: ") + name + "\ndata: " + dump(j) + "\n\n"; }

// Members read without trusting their types (json::value throws on a mismatch).
std::string str(const json& j, const char* key, std::string fallback = {}) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : fallback;
}
int64_t num(const json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : fallback;
}

/// A text content (a string, or an array of text blocks) as one string;
/// nullopt for anything else (images, tool use and results, documents).
std::optional<std::string> text_of(const json& content) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) return std::nullopt;
  std::string out;
  for (const json& b : content) {
    if (!b.is_object() || str(b, "type") != "text") return std::nullopt;
    auto t = b.find("text");
    if (t == b.end() || !t->is_string()) return std::nullopt;
    for (auto it = b.begin(); it != b.end(); ++it)
      if (it.key() != "type" && it.key() != "text" && it.key() != "cache_control") return std::nullopt;
    out += t->get<std::string>();
  }
  return out;
}

}  // namespace

std::optional<EngineRequest> anthropic_as_chat(const EngineRequest& req) {
  const std::string_view target(req.target);
  if (target.substr(0, target.find('?')) != "/v1/messages" || !req.stream) return std::nullopt;
  auto parsed = parse_body(req.body);
  auto* b = std::get_if<json>(&parsed);
  if (!b || !b->is_object()) return std::nullopt;
  json out = json::object();
  json messages = json::array();
  for (auto it = b->begin(); it != b->end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (k == "model" || k == "max_tokens" || k == "temperature" || k == "top_p" || k == "top_k" ||
        k == "chat_template_kwargs" || k == "ignore_eos" || k == "seed") {
      out[k] = v;
    } else if (k == "stream" || k == "metadata" || k == "thinking") {
      // stream: set below; metadata: not for the model; thinking: already
      // chat_template_kwargs.enable_thinking (forward_request).
    } else if (k == "stop_sequences") {
      if (!v.is_null() && !(v.is_array() && v.empty())) return std::nullopt;
    } else if (k == "system") {
      if (v.is_null()) continue;
      auto text = text_of(v);
      if (!text) return std::nullopt;
      messages.push_back({{"role", "system"}, {"content", *text}});
    } else if (k != "messages") {
      return std::nullopt;
    }
  }
  auto m = b->find("messages");
  if (m == b->end() || !m->is_array() || m->empty()) return std::nullopt;
  for (const json& msg : *m) {
    if (!msg.is_object() || msg.size() != 2 || !msg.contains("role") || !msg.contains("content")) return std::nullopt;
    const json& role = msg["role"];
    if (!role.is_string() || (role != "user" && role != "assistant")) return std::nullopt;
    auto text = text_of(msg["content"]);
    if (!text) return std::nullopt;
    messages.push_back({{"role", role}, {"content", *text}});
  }
  out["messages"] = std::move(messages);
  out["stream"] = true;
  out["stream_options"] = {{"include_usage", true}};
  EngineRequest r = req;
  r.target = "/v1/chat/completions";
  r.content_type = "application/json";
  r.body = dump(out);
  return r;
}

std::string AnthropicFromChat::feed(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  for (size_t end; (end = pending_.find("\n\n")) != std::string::npos;) {
    const std::string ev = pending_.substr(0, end);
    pending_.erase(0, end + 2);
    if (ev.empty()) continue;
    if (ev[0] == ':') {  // a comment (the queue's "waiting"): as it is
      out += ev + "\n\n";
      continue;
    }
    std::string data;
    size_t at = 0;
    while (at < ev.size()) {
      size_t nl = ev.find('\n', at);
      if (nl == std::string::npos) nl = ev.size();
      const std::string_view line(ev.data() + at, nl - at);
      if (line.substr(0, 5) == "data:") {
        std::string_view d = line.substr(5);
        if (!d.empty() && d[0] == ' ') d.remove_prefix(1);
        if (!data.empty()) data += '\n';
        data += d;
      }
      at = nl + 1;
    }
    out += event(data);
  }
  return out;
}

std::string AnthropicFromChat::start(const json& chunk) {
  if (started_) return {};
  started_ = true;
  std::string id = str(chunk, "id", "msg");
  if (id.rfind("chatcmpl-", 0) == 0) id = id.substr(9);
  json msg = {{"id", "msg_" + id},
              {"type", "message"},
              {"role", "assistant"},
              {"model", model_},
              {"content", json::array()},
              {"stop_reason", nullptr},
              {"stop_sequence", nullptr},
              {"usage", {{"input_tokens", 0}, {"output_tokens", 0}}}};
  return sse("message_start", {{"type", "message_start"}, {"message", msg}});
}

std::string AnthropicFromChat::close_block() {
  if (open_.empty()) return {};
  open_.clear();
  return sse("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
}

std::string AnthropicFromChat::block(const char* type) {
  if (open_ == type) return {};
  std::string out = close_block();
  open_ = type;
  const json b = open_ == "thinking" ? json{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                                     : json{{"type", "text"}, {"text", ""}};
  out += sse("content_block_start", {{"type", "content_block_start"}, {"index", ++index_}, {"content_block", b}});
  if (index_ == 0) out += sse("ping", {{"type", "ping"}});
  return out;
}

std::string AnthropicFromChat::end() {
  if (ended_) return {};
  ended_ = true;
  std::string out = start(json::object());
  if (index_ < 0) out += block("text");  // an answer with no text still has its block
  out += close_block();
  const int64_t output = output_tokens_ >= 0 ? output_tokens_ : chunks_;
  const int64_t cached = std::clamp<int64_t>(cached_tokens_, 0, input_tokens_);
  out += sse("message_delta", {{"type", "message_delta"},
                               {"delta", {{"stop_reason", stop_reason_}, {"stop_sequence", nullptr}}},
                               {"usage",
                                {{"input_tokens", input_tokens_ - cached},
                                 {"cache_creation_input_tokens", 0},
                                 {"cache_read_input_tokens", cached},
                                 {"output_tokens", output}}}});
  return out + sse("message_stop", {{"type", "message_stop"}});
}

std::string AnthropicFromChat::event(std::string_view data) {
  if (data == "[DONE]") return end();
  auto parsed = parse_body(data);
  auto* j = std::get_if<json>(&parsed);
  if (!j || !j->is_object()) return {};
  if (j->contains("error")) {
    const json& e = (*j)["error"];
    const std::string message = e.is_object() ? str(e, "message", "the engine failed") : dump(e);
    return "event: error\ndata: " + dump({{"type", "error"}, {"error", {{"type", "api_error"}, {"message", message}}}}) +
           "\n\n";
  }
  std::string out = start(*j);
  if (auto u = j->find("usage"); u != j->end() && u->is_object()) {
    input_tokens_ = num(*u, "prompt_tokens", input_tokens_);
    output_tokens_ = num(*u, "completion_tokens", output_tokens_);
    if (auto d = u->find("prompt_tokens_details"); d != u->end() && d->is_object())
      cached_tokens_ = num(*d, "cached_tokens", cached_tokens_);
  }
  auto choices = j->find("choices");
  if (choices == j->end() || !choices->is_array() || choices->empty() || !(*choices)[0].is_object()) return out;
  const json& c = (*choices)[0];
  if (auto d = c.find("delta"); d != c.end() && d->is_object()) {
    if (auto r = d->find("reasoning_content"); r != d->end() && r->is_string() && !r->get<std::string>().empty()) {
      ++chunks_;
      out += block("thinking");
      out += sse("content_block_delta", {{"type", "content_block_delta"},
                                         {"index", index_},
                                         {"delta", {{"type", "thinking_delta"}, {"thinking", *r}}}});
    }
    if (auto t = d->find("content"); t != d->end() && t->is_string() && !t->get<std::string>().empty()) {
      ++chunks_;
      out += block("text");
      out += sse("content_block_delta",
                 {{"type", "content_block_delta"}, {"index", index_}, {"delta", {{"type", "text_delta"}, {"text", *t}}}});
    }
  }
  if (auto f = c.find("finish_reason"); f != c.end() && f->is_string())
    stop_reason_ = *f == "length" ? "max_tokens" : "end_turn";
  return out;
}

}  // namespace ds4::proxy

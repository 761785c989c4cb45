#include "supervisor/proxy/api_response.h"

#include <algorithm>

#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

namespace {

// llama.cpp's timings object (keys sorted, as nlohmann writes objects).
void put_timings(JsonWriter& w, const proto::Timings& t) {
  auto per_token = [](double ms, int64_t n) { return n > 0 ? ms / double(n) : 0.0; };
  auto per_second = [](double ms, int64_t n) { return ms > 0 ? 1e3 * double(n) / ms : 0.0; };
  w.begin_object()
      .key("cache_n").value(t.cache_n)
      .key("predicted_ms").value(t.predicted_ms)
      .key("predicted_n").value(t.predicted_n)
      .key("predicted_per_second").value(per_second(t.predicted_ms, t.predicted_n))
      .key("predicted_per_token_ms").value(per_token(t.predicted_ms, t.predicted_n))
      .key("prompt_ms").value(t.prompt_ms)
      .key("prompt_n").value(t.prompt_n)
      .key("prompt_per_second").value(per_second(t.prompt_ms, t.prompt_n))
      .key("prompt_per_token_ms").value(per_token(t.prompt_ms, t.prompt_n))
      .end_object();
}

std::string sse_event(const char* name, const json& j) { return std::string("event: ") + name + "\ndata: " + dump(j) + "\n\n"; }

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

// OpenAI's usage block.
// prompt_tokens_details.cached_tokens: the prompt's tokens a slot's cache
// already held (the prefix cache), as OpenAI reports its prompt caching.
void put_usage(JsonWriter& w, const Finish& f) {
  w.begin_object()
      .key("completion_tokens").value(f.completion_tokens)
      .key("prompt_tokens").value(f.prompt_tokens)
      .key("total_tokens").value(f.prompt_tokens + f.completion_tokens)
      .key("prompt_tokens_details").begin_object().key("cached_tokens").value(f.timings.cache_n).end_object()
      .end_object();
}

const char* openai_reason(FinishReason r) {
  return r == FinishReason::length ? "length" : r == FinishReason::tool_calls ? "tool_calls" : "stop";
}

/// /v1/chat/completions and /v1/completions. Written with JsonWriter (one
/// of these runs per token and per request), log-probs through nlohmann.
class OpenAIResponder : public Responder {
 public:
  OpenAIResponder(const Plan& p, const Tokenizer& tok, std::string id, int64_t created)
      : plan_(p), tok_(tok), id_(std::move(id)), created_(created), chat_(p.endpoint == Endpoint::chat) {}

  std::string open() override {
    if (!plan_.stream || !chat_) return {};
    return sse(chunk("", true, "null", nullptr, nullptr));
  }

  std::string text(std::string_view delta, std::vector<TokenInfo> tokens) override {
    if (!plan_.stream) {
      text_ += delta;
      if (plan_.logprobs) for (auto& t : tokens) tokens_.push_back(std::move(t));
      return {};
    }
    if (delta.empty() && (!plan_.logprobs || tokens.empty())) return {};
    const std::string lp = plan_.logprobs ? dump(logprobs(tokens)) : "null";
    return sse(chunk(delta, false, lp, nullptr, nullptr));
  }

  std::string reasoning(std::string_view delta) override {
    if (delta.empty() || !chat_) return {};
    if (!plan_.stream) {
      reasoning_ += delta;
      return {};
    }
    return sse(delta_chunk({{"reasoning_content", delta}}));
  }

  std::string tool_call(const std::string& id, const tools::ToolCall& c) override {
    if (!chat_) return {};
    const int64_t index = int64_t(calls_.size());
    calls_.push_back({{"id", id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    if (!plan_.stream) return {};
    // As the SDKs assemble them: id, type and name first, then the arguments.
    return sse(delta_chunk({{"tool_calls", json::array({{{"index", index},
                                                         {"id", id},
                                                         {"type", "function"},
                                                         {"function", {{"name", c.name}, {"arguments", ""}}}}})}})) +
           sse(delta_chunk({{"tool_calls", json::array({{{"index", index}, {"function", {{"arguments", c.arguments}}}}})}}));
  }

  std::string finish(const Finish& f) override {
    if (plan_.stream) {
      std::string out = sse(chunk("", false, "null", openai_reason(f.reason), &f.timings));
      if (plan_.include_usage) {
        JsonWriter w;
        w.begin_object().key("choices").begin_array().end_array();
        envelope(w, chat_ ? "chat.completion.chunk" : "text_completion");
        w.key("timings");
        put_timings(w, f.timings);
        w.key("usage");
        put_usage(w, f);
        out += sse(std::move(w.end_object().str()));
      }
      return out + "data: [DONE]\n\n";
    }
    JsonWriter w;
    w.begin_object().key("choices").begin_array().begin_object();
    w.key("finish_reason").value(openai_reason(f.reason)).key("index").value(int64_t(0));
    w.key("logprobs").raw(plan_.logprobs ? dump(logprobs(tokens_)) : "null");
    if (chat_) {
      w.key("message").begin_object().key("content");
      if (text_.empty() && !calls_.empty()) w.null();
      else w.value(text_);
      if (!reasoning_.empty()) w.key("reasoning_content").value(reasoning_);
      w.key("role").value("assistant");
      if (!calls_.empty()) w.key("tool_calls").raw(dump(calls_));
      w.end_object();
    } else {
      w.key("text").value(text_);
    }
    w.end_object().end_array();
    envelope(w, chat_ ? "chat.completion" : "text_completion");
    w.key("timings");
    put_timings(w, f.timings);
    w.key("usage");
    put_usage(w, f);
    return std::move(w.end_object().str());
  }

  std::string stream_error(const ApiError& e) override { return "data: " + error_body(Api::openai, e) + "\n\n"; }

 private:
  static std::string sse(std::string json) { return "data: " + json + "\n\n"; }

  // The keys after "choices": created, id, model, object, system_fingerprint.
  void envelope(JsonWriter& w, const char* object) const {
    w.key("created").value(created_).key("id").value(id_).key("model").value(plan_.model);
    w.key("object").value(object).key("system_fingerprint").value("ds4");
  }
  // One stream chunk: the delta (chat: content, and the role when `role`) or
  // text, the log-probs as JSON text, the finish reason, timings at the end.
  std::string chunk(std::string_view text, bool role, std::string_view lp, const char* reason,
                    const proto::Timings* timings) const {
    JsonWriter w;
    w.begin_object().key("choices").begin_array().begin_object();
    if (chat_) {
      w.key("delta").begin_object();
      if (reason == nullptr) w.key("content").value(text);
      if (role) w.key("role").value("assistant");
      w.end_object();
    }
    w.key("finish_reason");
    if (reason) w.value(reason);
    else w.null();
    w.key("index").value(int64_t(0)).key("logprobs").raw(lp);
    if (!chat_) w.key("text").value(text);
    w.end_object().end_array();
    envelope(w, chat_ ? "chat.completion.chunk" : "text_completion");
    if (timings) {
      w.key("timings");
      put_timings(w, *timings);
    }
    return std::move(w.end_object().str());
  }
  // A chat chunk whose delta is `delta`.
  std::string delta_chunk(const json& delta) const {
    JsonWriter w;
    w.begin_object().key("choices").begin_array().begin_object();
    w.key("delta").raw(dump(delta)).key("finish_reason").null().key("index").value(int64_t(0)).key("logprobs").null();
    w.end_object().end_array();
    envelope(w, "chat.completion.chunk");
    return std::move(w.end_object().str());
  }
  // Chat: {"content":[{token, logprob, bytes, top_logprobs}]}; completions:
  // {tokens, token_logprobs, top_logprobs:[{text: lp}], text_offset}.
  json logprobs(const std::vector<TokenInfo>& tokens) {
    if (chat_) {
      json content = json::array();
      for (const TokenInfo& t : tokens) {
        const std::string piece = tok_.piece(t.token);
        json top = json::array();
        for (auto& [id, lp] : t.top) {
          const std::string p = tok_.piece(id);
          top.push_back({{"token", p}, {"logprob", lp}, {"bytes", bytes_of(p)}});
        }
        content.push_back({{"token", piece}, {"logprob", t.logprob}, {"bytes", bytes_of(piece)}, {"top_logprobs", top}});
      }
      return {{"content", content}};
    }
    json toks = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
    for (const TokenInfo& t : tokens) {
      const std::string piece = tok_.piece(t.token);
      toks.push_back(piece);
      lps.push_back(t.logprob);
      json top = json::object();
      for (auto& [id, lp] : t.top) top[tok_.piece(id)] = lp;
      tops.push_back(top);
      offs.push_back(offset_);
      offset_ += int64_t(piece.size());
    }
    return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
  }

  const Plan& plan_;
  const Tokenizer& tok_;
  std::string id_;
  int64_t created_;
  bool chat_;
  std::string text_;
  std::string reasoning_;
  json calls_ = json::array();
  std::vector<TokenInfo> tokens_;
  int64_t offset_ = 0;
};

/// /v1/messages. Streams open each content block when its first text comes
/// (a thinking block, then text, then tool_use blocks as the answer has them).
class AnthropicResponder : public Responder {
 public:
  AnthropicResponder(const Plan& p, std::string id) : plan_(p), id_(std::move(id)) {}

  std::string open() override {
    if (!plan_.stream) return {};
    json msg = message(json::array());
    msg["usage"] = {{"input_tokens", int64_t(plan_.gen.prompt.size())}, {"output_tokens", 0}};
    return sse_event("message_start", {{"type", "message_start"}, {"message", msg}});
  }

  std::string text(std::string_view delta, std::vector<TokenInfo>) override {
    if (delta.empty()) return {};
    if (!plan_.stream) {
      add_block("text", delta);
      return {};
    }
    std::string out = begin("text", {{"type", "text"}, {"text", ""}});  // first: it sets the block's index
    return out + delta_event({{"type", "text_delta"}, {"text", delta}});
  }

  std::string reasoning(std::string_view delta) override {
    if (delta.empty()) return {};
    if (!plan_.stream) {
      add_block("thinking", delta);
      return {};
    }
    std::string out = begin("thinking", {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}});
    return out + delta_event({{"type", "thinking_delta"}, {"thinking", delta}});
  }

  std::string tool_call(const std::string& id, const tools::ToolCall& c) override {
    json input = json::parse(c.arguments, nullptr, false);
    if (!input.is_object()) input = json::object();
    if (!plan_.stream) {
      blocks_.push_back({{"type", "tool_use"}, {"id", id}, {"name", c.name}, {"input", std::move(input)}});
      return {};
    }
    std::string out = begin("tool_use", {{"type", "tool_use"}, {"id", id}, {"name", c.name}, {"input", json::object()}});
    out += delta_event({{"type", "input_json_delta"}, {"partial_json", c.arguments}});
    return out + end_block();
  }

  std::string finish(const Finish& f) override {
    const char* reason = f.reason == FinishReason::length          ? "max_tokens"
                         : f.reason == FinishReason::stop_sequence ? "stop_sequence"
                         : f.reason == FinishReason::tool_calls    ? "tool_use"
                                                                   : "end_turn";
    json seq = f.reason == FinishReason::stop_sequence ? json(f.stop_sequence) : json(nullptr);
    if (plan_.stream) {
      std::string out = index_ < 0 ? begin("text", {{"type", "text"}, {"text", ""}}) : std::string();
      out += end_block();
      return out +
             sse_event("message_delta", {{"type", "message_delta"},
                                         {"delta", {{"stop_reason", reason}, {"stop_sequence", seq}}},
                                         {"usage", usage(f)}}) +
             sse_event("message_stop", {{"type", "message_stop"}});
    }
    if (blocks_.empty()) blocks_.push_back({{"type", "text"}, {"text", ""}});
    json msg = message(std::move(blocks_));
    msg["stop_reason"] = reason;
    msg["stop_sequence"] = seq;
    msg["usage"] = usage(f);
    return dump(msg);
  }

  std::string stream_error(const ApiError& e) override {
    return "event: error\ndata: " + error_body(Api::anthropic, e) + "\n\n";
  }

 private:
  // Anthropic counts a prompt in three parts: read from the cache (the
  // tokens the slot already held: an agent's earlier turns), written to it,
  // and the rest. The slot keeps every prompt, so nothing is billed as
  // written: input_tokens + cache_read_input_tokens is the whole prompt.
  // Streams give the final figures in message_delta (its usage is cumulative).
  static json usage(const Finish& f) {
    const int64_t cached = std::clamp<int64_t>(f.timings.cache_n, 0, f.prompt_tokens);
    return {{"input_tokens", f.prompt_tokens - cached},
            {"cache_creation_input_tokens", 0},
            {"cache_read_input_tokens", cached},
            {"output_tokens", f.completion_tokens}};
  }
  json message(json content) const {
    return {{"id", id_}, {"type", "message"}, {"role", "assistant"}, {"model", plan_.model}, {"content", std::move(content)},
            {"stop_reason", nullptr}, {"stop_sequence", nullptr}};
  }
  // Whole answers: text joined into the last block of its type.
  void add_block(const char* type, std::string_view delta) {
    const char* key = std::string_view(type) == "text" ? "text" : "thinking";
    if (blocks_.empty() || blocks_.back()["type"] != type) {
      blocks_.push_back({{"type", type}, {key, ""}});
      if (std::string_view(type) == "thinking") blocks_.back()["signature"] = "";
    }
    blocks_.back()[key] = blocks_.back()[key].get<std::string>() + std::string(delta);
  }
  // Streams: the block of `type` open (the one before closed), ping after the first.
  std::string begin(const char* type, const json& block) {
    if (open_ == type) return {};
    std::string out = end_block();
    open_ = type;
    out += sse_event("content_block_start", {{"type", "content_block_start"}, {"index", ++index_}, {"content_block", block}});
    if (!pinged_) out += sse_event("ping", {{"type", "ping"}});
    pinged_ = true;
    return out;
  }
  std::string delta_event(const json& delta) const {
    return sse_event("content_block_delta", {{"type", "content_block_delta"}, {"index", index_}, {"delta", delta}});
  }
  std::string end_block() {
    if (open_.empty()) return {};
    open_.clear();
    return sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
  }
  const Plan& plan_;
  std::string id_;
  json blocks_ = json::array();
  std::string open_;  // the type of the block open in a stream
  int64_t index_ = -1;
  bool pinged_ = false;
};

}  // namespace

std::unique_ptr<Responder> make_responder(const Plan& plan, const Tokenizer& tok, std::string id, int64_t created) {
  if (plan.endpoint == Endpoint::messages) return std::make_unique<AnthropicResponder>(plan, std::move(id));
  if (plan.endpoint == Endpoint::responses) return make_responses_responder(plan, std::move(id), created);
  return std::make_unique<OpenAIResponder>(plan, tok, std::move(id), created);
}

std::string sse_error_event(Api api, std::string_view error_json) {
  std::string out = api == Api::anthropic ? "event: error\ndata: " : "data: ";
  for (char c : error_json) out += (c == '\n' || c == '\r') ? ' ' : c;
  return out + "\n\n";
}

std::string waiting_comment(int64_t position) { return ": waiting, position " + std::to_string(position) + "\n\n"; }

std::string timings_json(const proto::Timings& t) {
  JsonWriter w;
  put_timings(w, t);
  return std::move(w.str());
}

}  // namespace ds4::proxy

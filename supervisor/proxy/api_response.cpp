#include "supervisor/proxy/api_response.h"

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
void put_usage(JsonWriter& w, const Finish& f) {
  w.begin_object()
      .key("completion_tokens").value(f.completion_tokens)
      .key("prompt_tokens").value(f.prompt_tokens)
      .key("total_tokens").value(f.prompt_tokens + f.completion_tokens)
      .end_object();
}

const char* openai_reason(FinishReason r) { return r == FinishReason::length ? "length" : "stop"; }

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
    if (chat_) w.key("message").begin_object().key("content").value(text_).key("role").value("assistant").end_object();
    else w.key("text").value(text_);
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
  std::vector<TokenInfo> tokens_;
  int64_t offset_ = 0;
};

/// /v1/messages.
class AnthropicResponder : public Responder {
 public:
  AnthropicResponder(const Plan& p, std::string id) : plan_(p), id_(std::move(id)) {}

  std::string open() override {
    if (!plan_.stream) return {};
    json msg = message(json::array());
    msg["usage"] = {{"input_tokens", int64_t(plan_.gen.prompt.size())}, {"output_tokens", 0}};
    return sse_event("message_start", {{"type", "message_start"}, {"message", msg}}) +
           sse_event("content_block_start",
                     {{"type", "content_block_start"}, {"index", 0}, {"content_block", {{"type", "text"}, {"text", ""}}}}) +
           sse_event("ping", {{"type", "ping"}});
  }

  std::string text(std::string_view delta, std::vector<TokenInfo>) override {
    if (!plan_.stream) {
      text_ += delta;
      return {};
    }
    if (delta.empty()) return {};
    return sse_event("content_block_delta", {{"type", "content_block_delta"},
                                             {"index", 0},
                                             {"delta", {{"type", "text_delta"}, {"text", delta}}}});
  }

  std::string finish(const Finish& f) override {
    const char* reason = f.reason == FinishReason::length ? "max_tokens"
                         : f.reason == FinishReason::stop_sequence ? "stop_sequence" : "end_turn";
    json seq = f.reason == FinishReason::stop_sequence ? json(f.stop_sequence) : json(nullptr);
    if (plan_.stream) {
      return sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", 0}}) +
             sse_event("message_delta", {{"type", "message_delta"},
                                         {"delta", {{"stop_reason", reason}, {"stop_sequence", seq}}},
                                         {"usage", {{"output_tokens", f.completion_tokens}}}}) +
             sse_event("message_stop", {{"type", "message_stop"}});
    }
    json msg = message(json::array({{{"type", "text"}, {"text", text_}}}));
    msg["stop_reason"] = reason;
    msg["stop_sequence"] = seq;
    msg["usage"] = {{"input_tokens", f.prompt_tokens}, {"output_tokens", f.completion_tokens}};
    return dump(msg);
  }

  std::string stream_error(const ApiError& e) override {
    return "event: error\ndata: " + error_body(Api::anthropic, e) + "\n\n";
  }

 private:
  json message(json content) const {
    return {{"id", id_}, {"type", "message"}, {"role", "assistant"}, {"model", plan_.model}, {"content", std::move(content)},
            {"stop_reason", nullptr}, {"stop_sequence", nullptr}};
  }
  const Plan& plan_;
  std::string id_;
  std::string text_;
};

}  // namespace

std::unique_ptr<Responder> make_responder(const Plan& plan, const Tokenizer& tok, std::string id, int64_t created) {
  if (plan.endpoint == Endpoint::messages) return std::make_unique<AnthropicResponder>(plan, std::move(id));
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

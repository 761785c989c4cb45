#include "supervisor/proxy/api_response.h"

#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

namespace {

json timings(const proto::Timings& t) {
  auto per_token = [](double ms, int64_t n) { return n > 0 ? ms / double(n) : 0.0; };
  auto per_second = [](double ms, int64_t n) { return ms > 0 ? 1e3 * double(n) / ms : 0.0; };
  return {{"prompt_n", t.prompt_n},
          {"prompt_ms", t.prompt_ms},
          {"prompt_per_token_ms", per_token(t.prompt_ms, t.prompt_n)},
          {"prompt_per_second", per_second(t.prompt_ms, t.prompt_n)},
          {"predicted_n", t.predicted_n},
          {"predicted_ms", t.predicted_ms},
          {"predicted_per_token_ms", per_token(t.predicted_ms, t.predicted_n)},
          {"predicted_per_second", per_second(t.predicted_ms, t.predicted_n)},
          {"cache_n", t.cache_n}};
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }
std::string sse_event(const char* name, const json& j) { return std::string("event: ") + name + "\ndata: " + dump(j) + "\n\n"; }

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

// OpenAI's usage block.
json usage(const Finish& f) {
  return {{"prompt_tokens", f.prompt_tokens},
          {"completion_tokens", f.completion_tokens},
          {"total_tokens", f.prompt_tokens + f.completion_tokens}};
}

const char* openai_reason(FinishReason r) { return r == FinishReason::length ? "length" : "stop"; }

/// /v1/chat/completions and /v1/completions.
class OpenAIResponder : public Responder {
 public:
  OpenAIResponder(const Plan& p, const Tokenizer& tok, std::string id, int64_t created)
      : plan_(p), tok_(tok), id_(std::move(id)), created_(created), chat_(p.endpoint == Endpoint::chat) {}

  std::string open() override {
    if (!plan_.stream || !chat_) return {};
    return sse(chunk(json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr));
  }

  std::string text(std::string_view delta, std::vector<TokenInfo> tokens) override {
    if (!plan_.stream) {
      text_ += delta;
      if (plan_.logprobs) for (auto& t : tokens) tokens_.push_back(std::move(t));
      return {};
    }
    if (delta.empty() && (!plan_.logprobs || tokens.empty())) return {};
    json lp = plan_.logprobs ? logprobs(tokens) : json(nullptr);
    if (chat_) return sse(chunk(json{{"content", delta}}, lp, nullptr));
    return sse(chunk(std::string(delta), lp, nullptr));
  }

  std::string finish(const Finish& f) override {
    if (plan_.stream) {
      json last = chat_ ? chunk(json::object(), nullptr, openai_reason(f.reason)) : chunk("", nullptr, openai_reason(f.reason));
      last["timings"] = timings(f.timings);
      std::string out = sse(last);
      if (plan_.include_usage) {
        json u = base();
        u["choices"] = json::array();
        u["usage"] = usage(f);
        u["timings"] = timings(f.timings);
        out += sse(u);
      }
      return out + "data: [DONE]\n\n";
    }
    json body = base();
    body["object"] = chat_ ? "chat.completion" : "text_completion";
    json choice = {{"index", 0}, {"finish_reason", openai_reason(f.reason)}};
    choice["logprobs"] = plan_.logprobs ? logprobs(tokens_) : json(nullptr);
    if (chat_) choice["message"] = {{"role", "assistant"}, {"content", text_}};
    else choice["text"] = text_;
    body["choices"] = json::array({choice});
    body["usage"] = usage(f);
    body["timings"] = timings(f.timings);
    return dump(body);
  }

  std::string stream_error(const ApiError& e) override { return "data: " + error_body(Api::openai, e) + "\n\n"; }

 private:
  json base() const {
    return {{"id", id_}, {"object", chat_ ? "chat.completion.chunk" : "text_completion"}, {"created", created_},
            {"model", plan_.model}, {"system_fingerprint", "ds4"}};
  }
  json chunk(json delta_or_text, json lp, const char* reason) const {
    json c = base();
    json choice = {{"index", 0}, {"logprobs", std::move(lp)}};
    choice["finish_reason"] = reason ? json(reason) : json(nullptr);
    if (chat_) choice["delta"] = std::move(delta_or_text);
    else choice["text"] = std::move(delta_or_text);
    c["choices"] = json::array({choice});
    return c;
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

std::string waiting_comment(int64_t position) { return ": waiting, position " + std::to_string(position) + "\n\n"; }

std::string timings_json(const proto::Timings& t) { return dump(timings(t)); }

}  // namespace ds4::proxy

#include "supervisor/proxy/engine_resume.h"

#include <algorithm>

namespace ds4::proxy {

namespace {

std::string_view path_of(const EngineRequest& r) {
  const std::string_view t(r.target);
  return t.substr(0, t.find('?'));
}

std::optional<json> body_of(const EngineRequest& r) {
  auto parsed = parse_body(r.body);
  if (auto* j = std::get_if<json>(&parsed); j && j->is_object()) return std::move(*j);
  return std::nullopt;
}

bool set(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && !it->is_null() && !(it->is_boolean() && !it->get<bool>());
}

EngineRequest post(std::string target, const json& body, bool stream = false) {
  EngineRequest r;
  r.target = std::move(target);
  r.content_type = "application/json";
  r.body = dump(body);
  r.stream = stream;
  return r;
}

std::optional<std::vector<int32_t>> int_array(const json& a) {
  if (!a.is_array()) return std::nullopt;
  std::vector<int32_t> out;
  out.reserve(a.size());
  for (const json& v : a) {
    if (!v.is_number_integer()) return std::nullopt;
    out.push_back(v.get<int32_t>());
  }
  return out;
}

// The keys of a chat request that a continuation must not carry: the
// messages (its prompt is ids now) and what would restart with it.
constexpr const char* kChatOnly[] = {"messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                                     "chat_template_kwargs", "reasoning_format", "reasoning_effort", "reasoning",
                                     "thinking", "logprobs", "top_logprobs", "max_completion_tokens", "n",
                                     "stream_options"};

}  // namespace

std::string EngineCaps::describe() const {
  if (resumes_chat()) return "completions and chat";
  if (resumes_completions()) return "completions (no /apply-template)";
  std::string why;
  if (!tokenize) why = "no /tokenize";
  else if (!token_ids) why = "no token ids in its stream";
  return "none (" + why + ")";
}

EngineRequest probe_tokenize_request() { return post("/tokenize", {{"content", "a"}, {"add_special", true}}); }

EngineRequest probe_template_request() {
  return post("/apply-template", {{"messages", json::array({{{"role", "user"}, {"content", "a"}}})}});
}

EngineRequest probe_ids_request(const std::vector<int32_t>& prompt) {
  return post("/v1/completions",
              {{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}, {"n_probs", 1}, {"post_sampling_probs", true},
               {"stream", true}},
              true);
}

std::optional<std::vector<int32_t>> read_tokens(std::string_view body) {
  auto parsed = parse_body(body);
  auto* j = std::get_if<json>(&parsed);
  if (!j || !j->is_object() || !j->contains("tokens")) return std::nullopt;
  auto ids = int_array((*j)["tokens"]);
  if (!ids || ids->empty()) return std::nullopt;
  return ids;
}

std::optional<std::string> read_prompt(std::string_view body) {
  auto parsed = parse_body(body);
  auto* j = std::get_if<json>(&parsed);
  if (!j || !j->is_object()) return std::nullopt;
  auto it = j->find("prompt");
  if (it == j->end() || !it->is_string()) return std::nullopt;
  return it->get<std::string>();
}

bool stream_has_ids(std::string_view sse) { return first_token_id(sse).has_value(); }

ResumeKind resume_kind(const EngineRequest& req, const EngineCaps& caps) {
  if (!req.stream || req.method != "POST") return ResumeKind::none;
  const std::string_view path = path_of(req);
  const bool chat = path == "/v1/chat/completions" || path == "/chat/completions";
  const bool completions = path == "/v1/completions" || path == "/completions";
  if (chat ? !caps.resumes_chat() : !(completions && caps.resumes_completions())) return ResumeKind::none;
  const std::optional<json> b = body_of(req);
  if (!b) return ResumeKind::none;
  if (auto n = b->find("n"); n != b->end() && !(n->is_number_integer() && n->get<int64_t>() == 1)) return ResumeKind::none;
  for (const char* k : {"grammar", "json_schema", "response_format", "tools", "functions", "echo"})
    if (set(*b, k)) return ResumeKind::none;
  if (completions) {
    auto p = b->find("prompt");
    if (p == b->end()) return ResumeKind::none;
    if (p->is_string() || int_array(*p)) return ResumeKind::completions;
    if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || int_array((*p)[0]))) return ResumeKind::completions;
    return ResumeKind::none;
  }
  return ResumeKind::chat;
}

EngineRequest with_token_ids(const EngineRequest& req, ResumeKind kind, Added& added) {
  added = {};
  if (kind == ResumeKind::none) return req;
  std::optional<json> b = body_of(req);
  if (!b) return req;
  const bool asked = kind == ResumeKind::chat ? set(*b, "logprobs") : (set(*b, "logprobs") || set(*b, "n_probs"));
  if (!asked) {  // else its own log-probs carry the ids
    added.ids = true;
    (*b)["n_probs"] = 1;
    (*b)["post_sampling_probs"] = true;  // the sampler's candidates: no sort of the vocabulary
  }
  if (!set(*b, "timings_per_token")) {
    added.timings = true;
    (*b)["timings_per_token"] = true;
  }
  EngineRequest out = req;
  out.body = dump(*b);
  return out;
}

bool wants_usage_chunk(const EngineRequest& req) {
  const std::optional<json> b = body_of(req);
  if (!b) return false;
  auto so = b->find("stream_options");
  return so != b->end() && so->is_object() && set(*so, "include_usage");
}

std::string tokenize_body(const std::string& text) {
  return dump({{"content", text}, {"add_special", true}, {"parse_special", true}});
}

std::optional<std::vector<int32_t>> prompt_ids(const EngineRequest& req, std::string& text) {
  std::optional<json> b = body_of(req);
  if (!b) return std::nullopt;
  json p = (*b)["prompt"];
  if (p.is_array() && p.size() == 1 && !p[0].is_number()) p = p[0];
  if (p.is_string()) {
    text = p.get<std::string>();
    return std::nullopt;
  }
  return int_array(p);
}

EngineRequest apply_template_request(const EngineRequest& req) {
  EngineRequest r = req;
  r.target = "/apply-template";
  r.stream = false;
  return r;
}

std::optional<EngineRequest> continuation_request(const EngineRequest& req, ResumeKind kind,
                                                  const std::vector<int32_t>& prompt,
                                                  const std::vector<int32_t>& generated, int top) {
  std::optional<json> b = body_of(req);
  if (!b) return std::nullopt;
  std::vector<int32_t> ids = prompt;
  ids.insert(ids.end(), generated.begin(), generated.end());
  json& body = *b;
  // What is left of the answer's limit (llama-server reads n_predict too).
  int64_t limit = -1;
  for (const char* k : {"max_completion_tokens", "max_tokens", "n_predict"})
    if (auto it = body.find(k); it != body.end() && it->is_number_integer() && it->get<int64_t>() >= 0) {
      limit = it->get<int64_t>();
      break;
    }
  if (limit >= 0 && int64_t(generated.size()) >= limit) return std::nullopt;
  bool asked = false;
  if (kind == ResumeKind::chat) {
    asked = set(body, "logprobs");
    for (const char* k : kChatOnly) body.erase(k);
  } else {
    asked = set(body, "logprobs") || set(body, "n_probs");
  }
  body.erase("n_predict");
  body["prompt"] = ids;
  body["stream"] = true;
  if (limit >= 0) body["max_tokens"] = limit - int64_t(generated.size());
  if (!asked) {
    body["n_probs"] = 1;
    body["post_sampling_probs"] = true;
  } else if (kind == ResumeKind::chat) {
    body["n_probs"] = std::max(top, 1);  // the client's top_logprobs, as its first answer had them
  }
  if (!set(body, "timings_per_token")) body["timings_per_token"] = true;  // the count of each event's tokens
  return post("/v1/completions", body, true);
}

EngineRequest hole_request(const EngineRequest& req, ResumeKind kind, const std::vector<int32_t>& prompt,
                           const std::vector<int32_t>& generated, size_t at) {
  const std::vector<int32_t> before(generated.begin(), generated.begin() + std::min(at, generated.size()));
  std::optional<EngineRequest> r = continuation_request(req, kind, prompt, before, -1);
  std::optional<json> b = r ? body_of(*r) : std::nullopt;
  if (!b) b = json{{"prompt", prompt}};
  json& body = *b;
  body["max_tokens"] = 1;
  body["temperature"] = 0;
  body["n_probs"] = 1;
  body["post_sampling_probs"] = true;
  body["stream"] = true;
  return post("/v1/completions", body, true);
}

std::optional<int32_t> first_token_id(std::string_view sse) {
  ResumableStream s(ResumeKind::completions, Added{true, true});
  s.feed(sse);
  s.feed("\n\n");
  for (int32_t id : s.generated())
    if (id != ResumableStream::kHole) return id;
  return std::nullopt;
}

// ---- the stream ----

std::optional<size_t> ResumableStream::first_hole() const {
  auto it = std::find(generated_.begin(), generated_.end(), kHole);
  if (it == generated_.end()) return std::nullopt;
  return size_t(it - generated_.begin());
}

// An event's timings.predicted_n is the count of tokens generated so far
// (since the continuation began): more than the ids seen means the stream
// left out the ids of tokens before this event's own (llama-server's chat
// stream drops the event of a token that adds no text). They become holes.
void ResumableStream::count_tokens(const json& event, size_t before) {
  auto t = event.find("timings");
  if (t == event.end() || !t->is_object()) return;
  auto n = t->find("predicted_n");
  if (n == t->end() || !n->is_number_integer()) return;
  const int64_t total = n->get<int64_t>() + base_;
  const int64_t have = int64_t(generated_.size());
  if (total <= have || total - have > (int64_t(1) << 20)) return;
  generated_.insert(generated_.begin() + int64_t(before), size_t(total - have), kHole);
}

// The per-token timings the filter asked for, out of an event the client
// would not have had them in (the last event keeps them: llama-server
// always sends them there).
bool ResumableStream::strip_event_timings(json& event) const {
  if (!strip_timings_ || !event.contains("timings") || event.contains("usage")) return false;
  if (auto ch = event.find("choices"); ch != event.end() && ch->is_array())
    for (const json& c : *ch)
      if (c.is_object() && c.contains("finish_reason") && !c["finish_reason"].is_null()) return false;
  event.erase("timings");
  return true;
}

std::string ResumableStream::feed(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  size_t start = 0;
  for (size_t end; (end = pending_.find("\n\n", start)) != std::string::npos; start = end + 2)
    out += event(std::string_view(pending_).substr(start, end - start));
  pending_.erase(0, start);
  return out;
}

void ResumableStream::begin_continuation() {
  continuing_ = true;
  pending_.clear();  // a half event of the engine that died: it never went out
  base_ = int64_t(generated_.size());
}

void ResumableStream::take_ids(const json& choice) {
  auto lp = choice.find("logprobs");
  const bool text = (choice.contains("text") && choice["text"].is_string() && !choice["text"].get_ref<const std::string&>().empty()) ||
                    (choice.contains("delta") && choice["delta"].is_object() && choice["delta"].contains("content") &&
                     choice["delta"]["content"].is_string() && !choice["delta"]["content"].get_ref<const std::string&>().empty());
  size_t n = 0;
  if (lp != choice.end() && lp->is_object() && lp->contains("content") && (*lp)["content"].is_array()) {
    for (const json& e : (*lp)["content"]) {
      auto id = e.find("id");
      if (id == e.end() || !id->is_number_integer()) {
        resumable_ = false;
        return;
      }
      generated_.push_back(id->get<int32_t>());
      ++n;
      if (top_ < 0)
        for (const char* k : {"top_logprobs", "top_probs"})
          if (e.contains(k) && e[k].is_array()) top_ = int(e[k].size());
    }
  }
  if (text && n == 0) resumable_ = false;  // text whose tokens we do not know
}

std::string ResumableStream::event(std::string_view ev) {
  auto raw = [&] { return std::string(ev) + "\n\n"; };
  if (!ev.starts_with("data: ")) {
    if (!ev.empty() && !ev.starts_with(":")) resumable_ = false;  // an error event: the answer is over
    return raw();
  }
  const std::string_view data = ev.substr(6);
  if (data == "[DONE]") {
    ended_ = true;
    return raw();
  }
  auto parsed = parse_body(data);
  auto* j = std::get_if<json>(&parsed);
  if (!j || !j->is_object()) {
    resumable_ = false;
    return raw();
  }
  if (continuing_) return continued(*j);
  if (id_.is_null()) {
    id_ = j->value("id", json());
    created_ = j->value("created", json());
    model_ = j->value("model", json());
    fingerprint_ = j->value("system_fingerprint", json());
  }
  auto ch = j->find("choices");
  if (ch == j->end() || !ch->is_array() || ch->empty())
    return strip_event_timings(*j) ? "data: " + dump(*j) + "\n\n" : raw();
  json& c = (*ch)[0];
  const size_t before = generated_.size();
  take_ids(c);
  count_tokens(*j, before);
  const bool timings_out = strip_event_timings(*j);
  if (kind_ == ResumeKind::chat && c.contains("delta") && c["delta"].is_object()) {
    const json& d = c["delta"];
    for (const char* k : {"reasoning_content", "tool_calls", "function_call"})
      if (d.contains(k) && !d[k].is_null() && !(d[k].is_string() && d[k].get_ref<const std::string&>().empty()))
        resumable_ = false;
  }
  if (c.contains("finish_reason") && !c["finish_reason"].is_null()) finished_ = true;
  if (!timings_out && (!strip_ || !c.contains("logprobs"))) return raw();
  if (strip_ && c.contains("logprobs")) {
    if (kind_ == ResumeKind::chat) c.erase("logprobs");
    else c["logprobs"] = nullptr;
  }
  return "data: " + dump(*j) + "\n\n";
}

std::string ResumableStream::continued(json& j) {
  auto adjust_usage = [&](json& u) {
    if (!u.is_object()) return;
    if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer())
      u["prompt_tokens"] = u["prompt_tokens"].get<int64_t>() - base_;
    if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer())
      u["completion_tokens"] = u["completion_tokens"].get<int64_t>() + base_;
    u.erase("prompt_tokens_details");  // the cache figures are the continuation's
  };
  json* choice = nullptr;
  if (auto ch = j.find("choices"); ch != j.end() && ch->is_array() && !ch->empty()) choice = &(*ch)[0];
  const size_t before = generated_.size();
  if (choice) take_ids(*choice);
  count_tokens(j, before);
  strip_event_timings(j);
  const bool finish = choice && choice->contains("finish_reason") && !(*choice)["finish_reason"].is_null();
  if (finish) finished_ = true;
  if (kind_ == ResumeKind::completions) {
    if (!id_.is_null()) j["id"] = id_;
    if (!created_.is_null()) j["created"] = created_;
    if (choice && strip_) (*choice)["logprobs"] = nullptr;
    if (j.contains("usage")) adjust_usage(j["usage"]);
    return "data: " + dump(j) + "\n\n";
  }
  // Chat: the completions chunk in the chat chunk's shape, as llama-server writes it.
  auto chunk = [&](json choices) {
    json c;
    c["choices"] = std::move(choices);
    c["created"] = created_;
    c["id"] = id_;
    c["model"] = model_;
    if (!fingerprint_.is_null()) c["system_fingerprint"] = fingerprint_;
    c["object"] = "chat.completion.chunk";
    return c;
  };
  std::string out;
  if (choice) {
    const std::string text = choice->value("text", std::string());
    const json lp = choice->value("logprobs", json());
    if (!text.empty() || (!strip_ && !lp.is_null())) {
      json c = {{"finish_reason", nullptr}, {"index", 0}, {"delta", {{"content", text}}}};
      if (!strip_ && !lp.is_null()) c["logprobs"] = lp;
      out += "data: " + dump(chunk(json::array({c}))) + "\n\n";
    }
  }
  if (finish) {
    json c = chunk(json::array({{{"finish_reason", (*choice)["finish_reason"]}, {"index", 0}, {"delta", json::object()}}}));
    if (!usage_chunk_ && j.contains("timings")) c["timings"] = j["timings"];
    out += "data: " + dump(c) + "\n\n";
    if (usage_chunk_ && j.contains("usage")) {
      json u = chunk(json::array());
      u["usage"] = j["usage"];
      adjust_usage(u["usage"]);
      if (j.contains("timings")) u["timings"] = j["timings"];
      out += "data: " + dump(u) + "\n\n";
    }
  }
  return out;
}

std::string ResumableStream::close() {
  pending_.clear();  // a half event of the engine that died: it never went out
  ended_ = true;
  return "data: [DONE]\n\n";
}

std::string ResumableStream::end_length(int64_t prompt_tokens) {
  const int64_t n = int64_t(generated_.size());
  const json usage = {{"completion_tokens", n}, {"prompt_tokens", prompt_tokens}, {"total_tokens", prompt_tokens + n}};
  std::string out;
  if (kind_ == ResumeKind::completions) {
    json c = {{"choices", json::array({{{"text", ""}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", "length"}}})},
              {"created", created_}, {"model", model_}, {"object", "text_completion"}, {"usage", usage}, {"id", id_}};
    out += "data: " + dump(c) + "\n\n";
  } else {
    json c = {{"choices", json::array({{{"finish_reason", "length"}, {"index", 0}, {"delta", json::object()}}})},
              {"created", created_}, {"id", id_}, {"model", model_}, {"object", "chat.completion.chunk"}};
    out += "data: " + dump(c) + "\n\n";
    if (usage_chunk_) {
      json u = {{"choices", json::array()}, {"created", created_}, {"id", id_}, {"model", model_},
                {"object", "chat.completion.chunk"}, {"usage", usage}};
      out += "data: " + dump(u) + "\n\n";
    }
  }
  finished_ = ended_ = true;
  return out + "data: [DONE]\n\n";
}

}  // namespace ds4::proxy

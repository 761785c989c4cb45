#include "supervisor/proxy/api_request.h"

#include <algorithm>
#include <charconv>

#include "shared/error.h"
#include "supervisor/proxy/json_util.h"
#include "supervisor/proxy/tool_grammar.h"
#include "text/reasoning.h"
#include "text/utf8.h"

namespace ds4::proxy {

namespace {

constexpr size_t kMaxStops = 16;
constexpr size_t kMaxStopBytes = 1024;
constexpr int kMaxDepth = 64;  // nesting in request JSON (the parser recurses)
constexpr int64_t kMaxN = 1 << 20;
constexpr int64_t kMaxTopK = 1 << 30;
double max_temperature(bool anthropic) { return anthropic ? 1 : 2; }

// The role a message of the common shape has in ChatInput; nullopt when it
// needs the full parse (tool, function) or the endpoint has no such role.
std::optional<std::string> chat_role(std::string_view role) {
  if (role == "developer") role = "system";
  if (role == "user" || role == "assistant" || role == "system") return std::string(role);
  return std::nullopt;
}

// OpenAI's logit_bias: {"token id": bias}, biases in [-100, 100], ids in the
// vocabulary. Sorted by token.
std::vector<std::pair<int32_t, float>> logit_bias(const json& body, int32_t n_vocab) {
  std::vector<std::pair<int32_t, float>> out;
  auto it = body.find("logit_bias");
  if (it == body.end() || it->is_null()) return out;
  if (!it->is_object()) throw Error("'logit_bias' must be an object of token ids to biases");
  if (it->size() > proto::kMaxLogitBias)
    throw Error("'logit_bias' has " + std::to_string(it->size()) + " entries, more than " +
                std::to_string(proto::kMaxLogitBias));
  for (const auto& [key, bias] : it->items()) {
    int64_t token = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), token);
    if (ec != std::errc() || end != key.data() + key.size() || key.empty() || token < 0 || token >= n_vocab)
      throw Error("'logit_bias' key '" + key + "' is not a token id of this model (0 to " +
                  std::to_string(n_vocab - 1) + ")");
    if (!bias.is_number() || !(bias.get<double>() >= -100 && bias.get<double>() <= 100))
      throw Error("'logit_bias' value for token " + key + " must be a number from -100 to 100");
    out.emplace_back(int32_t(token), bias.get<float>());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Fields whose meaning this server cannot honour get a 400 naming them,
// rather than an answer that quietly ignores them. Their "off" values pass.
void refuse_unsupported(const json& body, Endpoint endpoint) {
  const bool anthropic = endpoint == Endpoint::messages || endpoint == Endpoint::count_tokens;
  auto given = [&](const char* key) -> const json* {
    auto it = body.find(key);
    return it == body.end() || it->is_null() ? nullptr : &*it;
  };
  auto empty_list = [](const json* v) { return v->is_array() && v->empty(); };
  auto one_of = [](const json* v, std::initializer_list<const char*> words) {
    for (const char* w : words)
      if (*v == w) return true;
    return false;
  };
  if (anthropic) return;
  if (endpoint == Endpoint::responses) {
    if (const json* t = given("text"); t && t->is_object())
      if (const json* f = t->contains("format") ? &(*t)["format"] : nullptr; f && !f->is_null() &&
          !(f->is_object() && f->contains("type") && ((*f)["type"] == "text" || (*f)["type"] == "json_object" || (*f)["type"] == "json_schema")))
        throw Error("'text.format': the type must be text, json_object or json_schema");
    if (const json* b = given("background"); b && *b != false) throw Error("'background': background responses are not supported");
    return;
  }
  if (const json* f = given("functions"); f && !empty_list(f))
    throw Error("'functions': function calls are not supported by this server (the model answers in text)");
  if (const json* f = given("function_call"); f && !one_of(f, {"none", "auto"}))
    throw Error("'function_call': function calls are not supported by this server");
  if (const json* r = given("response_format"); r && !(r->is_object() && r->contains("type") &&
                                                       ((*r)["type"] == "text" || (*r)["type"] == "json_object" || (*r)["type"] == "json_schema")))
    throw Error("'response_format': the type must be text, json_object or json_schema");
  if (const json* r = given("repeat_penalty"); r && *r != 1 && *r != 1.0)
    throw Error("'repeat_penalty' is not supported: use 'frequency_penalty' or 'presence_penalty'");
  if (endpoint == Endpoint::completion) {
    if (const json* b = given("best_of"); b && *b != 1) throw Error("'best_of' must be 1: one completion per request");
    if (const json* s = given("suffix"); s && *s != "") throw Error("'suffix' (insertion) is not supported");
  }
}

void check_stops(const std::vector<std::string>& stops, const char* key) {
  if (stops.size() > kMaxStops) throw Error(std::string("'") + key + "' has more than " + std::to_string(kMaxStops) + " strings");
  for (const auto& s : stops)
    if (s.size() > kMaxStopBytes)
      throw Error(std::string("'") + key + "' holds a string longer than " + std::to_string(kMaxStopBytes) + " bytes");
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
  check_stops(out, key);
  return out;
}

// The limit a prompt must stay under, and what to say when it does not.
void check_prompt_length(int64_t n_prompt, const PlanLimits& limits, const char* or_more) {
  if (limits.context > 0 && n_prompt >= limits.context)
    throw Error("the prompt has " + std::to_string(n_prompt) + " tokens" + or_more + " but the context is " +
                std::to_string(limits.context) + " tokens: shorten the prompt");
  if (n_prompt >= limits.max_tokens_per_request)
    throw Error("the prompt has " + std::to_string(n_prompt) + " tokens" + or_more + ", more than the limit of " +
                std::to_string(limits.max_tokens_per_request) + " tokens per request");
}

// The prompt's tokens. A text too long for the limits by its length alone
// (no token stands for more than max_token_bytes() of it) is refused without
// encoding it: a 16 MB body would take seconds of a thread.
std::vector<int32_t> encode_prompt(const ModelText& model, std::string_view text, const PlanLimits& limits,
                                   bool add_bos = true) {
  check_prompt_length(int64_t(text.size() / model.tokenizer().max_token_bytes()), limits, " or more");
  return model.encode(text, add_bos);
}

// Completions' prompt: a string, one string in an array, or token ids.
std::vector<int32_t> completion_prompt(const json& body, const ModelText& model, const PlanLimits& limits) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) throw Error("'prompt' is required");
  if (it->is_string()) return encode_prompt(model, it->get_ref<const std::string&>(), limits);
  if (it->is_array() && it->size() == 1 && (*it)[0].is_string())
    return encode_prompt(model, (*it)[0].get_ref<const std::string&>(), limits);
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

void check_prompt(const std::vector<int32_t>& prompt, const PlanLimits& limits) {
  if (prompt.empty()) throw Error("the prompt has no tokens");
  check_prompt_length(int64_t(prompt.size()), limits, "");
}

// Tokens to generate: as asked, at most what fits after the prompt.
int32_t answer_length(std::optional<int64_t> max_tokens, int64_t n_prompt, const PlanLimits& limits) {
  int64_t room = limits.max_tokens_per_request - n_prompt;
  if (limits.context > 0) room = std::min(room, limits.context - n_prompt);
  return int32_t(std::min<int64_t>(max_tokens.value_or(room), room));
}

int depth_of(const json& j, int depth) {
  if (depth > kMaxDepth) return depth;
  int d = depth;
  if (j.is_array() || j.is_object())
    for (const json& v : j) d = std::max(d, depth_of(v, depth + 1));
  return d;
}

// A chat's prompt and what is read out of its answer. The thinking controls
// reach the template as enable_thinking (unless chat_template_kwargs says).
// response_format (chat) or text.format (Responses): json_object, json_schema.
std::string answer_format_grammar(const json& body, Endpoint endpoint) {
  const bool responses = endpoint == Endpoint::responses;
  const json* f = nullptr;
  if (responses) {
    if (auto t = body.find("text"); t != body.end() && t->is_object())
      if (auto g = t->find("format"); g != t->end() && g->is_object()) f = &*g;
  } else if (auto r = body.find("response_format"); r != body.end() && r->is_object()) {
    f = &*r;
  }
  if (!f || !f->contains("type")) return "";
  const std::string field = responses ? "text.format" : "response_format";
  if ((*f)["type"] == "json_object") return json_answer_grammar(nullptr, field);
  if ((*f)["type"] != "json_schema") return "";
  // Chat nests the schema in json_schema; Responses has it in the format itself.
  const json* holder = responses ? f : (f->contains("json_schema") ? &(*f)["json_schema"] : nullptr);
  if (!holder || !holder->is_object() || !holder->contains("schema"))
    throw Error("'" + field + (responses ? "" : ".json_schema") + ".schema' is required for json_schema");
  return json_answer_grammar(&(*holder)["schema"], field + (responses ? ".schema" : ".json_schema.schema"));
}

void chat_plan(Plan& p, Endpoint endpoint, const json* body, ChatInput in, const ModelText& model, const PlanLimits& limits) {
  if (body) {
    if (std::optional<bool> think = thinking_asked(*body, endpoint != Endpoint::chat && endpoint != Endpoint::responses);
        think && !in.kwargs.contains("enable_thinking"))
      in.kwargs["enable_thinking"] = *think;
    if (auto t = body->find("thinking"); t != body->end() && t->is_object() && (*t)["type"] == "enabled")
      if (auto b = opt_int(*t, "budget_tokens", 1, INT64_MAX)) p.thinking_budget = *b;
  }
  if (p.tool_choice.mode == ToolChoice::Mode::none) in.tools = json::array();  // not offered: no call to parse
  const std::string text = render_prompt(model, in);
  // A template that writes bos_token itself (Llama 3's) gets no second one.
  const bool template_bos = !model.bos_text().empty() && std::string_view(text).starts_with(model.bos_text());
  p.gen.prompt = encode_prompt(model, text, limits, !template_bos);
  p.read_answer = true;
  p.tool_calls = !in.tools.empty();
  // A forced call, and the JSON answer formats, are kept to their grammar by
  // the worker's sampler: the call parses and its arguments fit the schema.
  if (p.tool_calls) p.gen.grammar = forced_call_grammar(model.tool_syntax(), in.tools, p.tool_choice);
  if (body && p.gen.grammar.empty()) p.gen.grammar = answer_format_grammar(*body, endpoint);
  // Strict tools under auto: the calls the model chooses to make fit their
  // schemas (a lazy grammar, from the call's marker on).
  if (p.tool_calls && p.gen.grammar.empty()) {
    LazyGrammar lazy = strict_calls_grammar(model.tool_syntax(), in.tools, p.tool_choice, in.strict);
    p.gen.grammar = std::move(lazy.grammar);
    p.gen.grammar_triggers = std::move(lazy.triggers);
  }
  p.tool_syntax = model.tool_syntax();
  p.thought_open = reasoning::prompt_opens_thought(text);
}
void chat_plan(Plan& p, Endpoint endpoint, const json& body, ChatInput in, const ModelText& model, const PlanLimits& limits) {
  chat_plan(p, endpoint, &body, std::move(in), model, limits);
}

Plan parse(Endpoint endpoint, const json& body, const ModelText& model, const PlanLimits& limits) {
  Plan p;
  p.endpoint = endpoint;
  const bool anthropic = endpoint == Endpoint::messages || endpoint == Endpoint::count_tokens;
  p.model = opt_string(body, "model").value_or(model.name());
  p.stream = opt_bool(body, "stream").value_or(false);
  if (auto so = body.find("stream_options"); so != body.end() && !so->is_null()) {
    if (!so->is_object()) throw Error("'stream_options' must be an object");
    p.include_usage = opt_bool(*so, "include_usage").value_or(false);
  }
  if (auto n = opt_int(body, "n", 1, kMaxN); n && *n != 1) throw Error("'n' must be 1: one choice per request");

  // Prompt.
  if (endpoint == Endpoint::completion) {
    p.gen.prompt = completion_prompt(body, model, limits);
  } else {
    ChatInput in;
    if (endpoint == Endpoint::chat) {
      in = openai_chat_input(body, p.tool_choice);
    } else if (endpoint == Endpoint::responses) {
      std::optional<json> previous;
      if (auto id = opt_string(body, "previous_response_id")) {
        if (limits.responses) previous = limits.responses->get(*id);
        if (!previous) throw Error("'previous_response_id': no stored response '" + *id + "' (the store keeps the most recent ones, proxy.responses.store)");
        p.echo["previous_response_id"] = *id;
      }
      in = responses_input(body, previous ? &*previous : nullptr, p.tool_choice);
      p.conversation = in.messages;
      if (opt_string(body, "instructions")) {
        p.conversation.erase(p.conversation.begin());
        p.echo["instructions"] = body["instructions"];
      }
      p.store = opt_bool(body, "store").value_or(true);
      if (auto u = opt_string(body, "user")) p.echo["user"] = *u;
      if (auto m = body.find("metadata"); m != body.end() && m->is_object()) p.echo["metadata"] = *m;
    } else {
      in = anthropic_input(body, p.tool_choice);
    }
    chat_plan(p, endpoint, body, std::move(in), model, limits);
  }
  check_prompt(p.gen.prompt, limits);

  // Length. Anthropic requires max_tokens; OpenAI defaults to what fits; a
  // length past the context is cut to it (as the hosted APIs do).
  std::optional<int64_t> max_tokens = opt_int(body, "max_tokens", anthropic ? 1 : 0, INT64_MAX);
  if (!anthropic)
    if (auto m = opt_int(body, "max_completion_tokens", 0, INT64_MAX)) max_tokens = m;
  if (endpoint == Endpoint::responses) max_tokens = opt_int(body, "max_output_tokens", 1, INT64_MAX);
  if (endpoint == Endpoint::messages && !max_tokens) throw Error("'max_tokens' is required");
  p.gen.max_tokens = answer_length(max_tokens, int64_t(p.gen.prompt.size()), limits);

  // Sampling: llama.cpp's defaults where the client says nothing.
  proto::Sampling& s = p.gen.sampling;
  s.temperature = float(opt_number(body, "temperature", 0, max_temperature(anthropic)).value_or(s.temperature));
  s.top_p = float(opt_number(body, "top_p", 0, 1).value_or(s.top_p));
  s.top_k = int32_t(opt_int(body, "top_k", 0, kMaxTopK).value_or(s.top_k));
  s.min_p = float(opt_number(body, "min_p", 0, 1).value_or(s.min_p));
  if (auto seed = opt_int(body, "seed", INT64_MIN, INT64_MAX)) s.seed = uint64_t(*seed);
  else s.seed = limits.random_seed;
  if (!anthropic) {  // OpenAI's logit adjustments, over the answer's tokens
    s.frequency_penalty = float(opt_number(body, "frequency_penalty", -2, 2).value_or(0));
    s.presence_penalty = float(opt_number(body, "presence_penalty", -2, 2).value_or(0));
    s.logit_bias = logit_bias(body, model.tokenizer().n_vocab());
  }
  refuse_unsupported(body, endpoint);

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

// ---- the common request shape, read without a JSON tree ----

// Reads JSON's tokens as strictly as the full parser (RFC 8259): what it
// refuses fails here too, and parse_request's full path then says why.
class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}

  bool next(char c) {
    skip_space();
    if (i_ == s_.size() || s_[i_] != c) return false;
    ++i_;
    return true;
  }
  bool at(char c) {
    skip_space();
    return i_ < s_.size() && s_[i_] == c;
  }
  bool at_end() {
    skip_space();
    return i_ == s_.size();
  }

  bool string(std::string& out) {
    if (!next('"')) return false;
    out.clear();
    for (;;) {
      size_t j = i_;
      while (j < s_.size() && plain(s_[j])) ++j;
      out.append(s_, i_, j - i_);
      i_ = j;
      if (i_ == s_.size()) return false;
      const unsigned char c = static_cast<unsigned char>(s_[i_]);
      if (c == '"') {
        ++i_;
        return true;
      }
      if (c < 0x20) return false;
      if (c >= 0x80) {
        const size_t n = utf8_length(s_.substr(i_));
        if (n == 0) return false;
        out.append(s_, i_, n);
        i_ += n;
        continue;
      }
      if (!escape(out)) return false;
    }
  }

  bool boolean(bool& b) {
    skip_space();
    for (bool v : {true, false}) {
      const std::string_view word = v ? "true" : "false";
      if (s_.substr(i_, word.size()) == word) {
        i_ += word.size();
        b = v;
        return true;
      }
    }
    return false;
  }

  // A number; `integer` is set when it has neither fraction nor exponent
  // and fits an int64.
  bool number(double& d, std::optional<int64_t>& integer) {
    skip_space();
    const size_t start = i_;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    if (i_ < s_.size() && s_[i_] == '0') ++i_;
    else if (!digits()) return false;
    bool whole = true;
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      whole = false;
      if (!digits()) return false;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      whole = false;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (!digits()) return false;
    }
    const char* first = s_.data() + start;
    const char* last = s_.data() + i_;
    integer.reset();
    if (whole) {
      int64_t v = 0;
      if (std::from_chars(first, last, v).ec != std::errc()) return false;
      integer = v;
      d = double(v);
      return true;
    }
    return std::from_chars(first, last, d).ec == std::errc();
  }

 private:
  static bool plain(char c) {
    const unsigned char u = static_cast<unsigned char>(c);
    return u >= 0x20 && u < 0x80 && c != '"' && c != '\\';
  }
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool digits() {
    const size_t start = i_;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    return i_ > start;
  }
  bool hex4(uint32_t& v) {
    if (s_.size() - i_ < 4) return false;
    const char* first = s_.data() + i_;
    if (std::from_chars(first, first + 4, v, 16).ptr != first + 4) return false;
    i_ += 4;
    return true;
  }
  // After a backslash: one escape; a \u escape as UTF-8 (a surrogate only as
  // the first half of a pair).
  bool escape(std::string& out) {
    if (++i_ == s_.size()) return false;
    const char c = s_[i_++];
    switch (c) {
      case '"': case '\\': case '/': out += c; return true;
      case 'b': out += '\b'; return true;
      case 'f': out += '\f'; return true;
      case 'n': out += '\n'; return true;
      case 'r': out += '\r'; return true;
      case 't': out += '\t'; return true;
      case 'u': break;
      default: return false;
    }
    uint32_t cp = 0, low = 0;
    if (!hex4(cp) || (cp >= 0xDC00 && cp <= 0xDFFF)) return false;
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      if (s_.substr(i_, 2) != "\\u") return false;
      i_ += 2;
      if (!hex4(low) || low < 0xDC00 || low > 0xDFFF) return false;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    append_utf8(out, cp);
    return true;
  }

  std::string_view s_;
  size_t i_ = 0;
};

// The fields of a common request, each read at most once.
struct CommonFields {
  std::optional<std::string> model, prompt, system;
  std::optional<bool> stream;
  std::optional<int64_t> n, max_tokens, max_completion_tokens, top_k, seed;
  std::optional<double> temperature, top_p, min_p;
  std::optional<std::vector<ChatMessage>> messages;
  std::optional<std::vector<std::string>> stop;
};

// [{"role": "...", "content": "..."}, ...], not empty.
bool read_messages(Reader& r, std::vector<ChatMessage>& out) {
  if (!r.next('[') || r.at(']')) return false;
  std::string key;
  do {
    if (!r.next('{')) return false;
    std::optional<std::string> role, content;
    do {
      if (!r.string(key) || !r.next(':')) return false;
      std::optional<std::string>* f = key == "role" ? &role : key == "content" ? &content : nullptr;
      if (!f || *f || !r.string(f->emplace())) return false;
    } while (r.next(','));
    if (!r.next('}') || !role || !content) return false;
    out.push_back({std::move(*role), std::move(*content)});
  } while (r.next(','));
  return r.next(']');
}

// A string or an array of strings.
bool read_stops(Reader& r, std::vector<std::string>& out) {
  if (r.at('"')) return r.string(out.emplace_back());
  if (!r.next('[')) return false;
  if (r.next(']')) return true;
  do {
    if (!r.string(out.emplace_back())) return false;
  } while (r.next(','));
  return r.next(']');
}

bool read_field(Reader& r, Endpoint endpoint, const std::string& key, CommonFields& f) {
  const bool anthropic = endpoint == Endpoint::messages;
  auto text = [&](std::optional<std::string>& v) { return !v && r.string(v.emplace()); };
  auto integer = [&](std::optional<int64_t>& v) {
    double d;
    return !v && r.number(d, v) && v;
  };
  auto number = [&](std::optional<double>& v) {
    std::optional<int64_t> ignored;
    return !v && r.number(v.emplace(), ignored);
  };
  if (key == "model") return text(f.model);
  if (key == "stream") return !f.stream && r.boolean(f.stream.emplace());
  if (key == "n") return integer(f.n);
  if (key == "max_tokens") return integer(f.max_tokens);
  if (key == "max_completion_tokens" && !anthropic) return integer(f.max_completion_tokens);
  if (key == "temperature") return number(f.temperature);
  if (key == "top_p") return number(f.top_p);
  if (key == "top_k") return integer(f.top_k);
  if (key == "min_p") return number(f.min_p);
  if (key == "seed") return integer(f.seed);
  if (key == (anthropic ? "stop_sequences" : "stop")) return !f.stop && read_stops(r, f.stop.emplace());
  if (key == "prompt" && endpoint == Endpoint::completion) return text(f.prompt);
  if (key == "messages" && endpoint != Endpoint::completion) return !f.messages && read_messages(r, f.messages.emplace());
  if (key == "system" && anthropic) return text(f.system);
  return false;
}

bool within(const std::optional<double>& v, double lo, double hi) { return !v || (*v >= lo && *v <= hi); }
bool within(const std::optional<int64_t>& v, int64_t lo, int64_t hi) { return !v || (*v >= lo && *v <= hi); }

// The plan parse() makes of the same request, when every field is valid.
std::optional<Plan> common_plan(Endpoint endpoint, CommonFields& f, const ModelText& model, const PlanLimits& limits) {
  const bool anthropic = endpoint == Endpoint::messages;
  if ((endpoint == Endpoint::completion ? !f.prompt : !f.messages) || (f.n && *f.n != 1)) return std::nullopt;
  if (!within(f.max_tokens, anthropic ? 1 : 0, INT64_MAX) || !within(f.max_completion_tokens, 0, INT64_MAX) ||
      (anthropic && !f.max_tokens) || !within(f.temperature, 0, max_temperature(anthropic)) ||
      !within(f.top_p, 0, 1) || !within(f.top_k, 0, kMaxTopK) || !within(f.min_p, 0, 1))
    return std::nullopt;
  Plan p;
  p.endpoint = endpoint;
  p.model = f.model ? std::move(*f.model) : model.name();
  p.stream = f.stream.value_or(false);
  if (endpoint == Endpoint::completion) {
    p.gen.prompt = encode_prompt(model, *f.prompt, limits);
  } else {
    ChatInput in;
    if (f.system) in.messages.push_back({{"role", "system"}, {"content", std::move(*f.system)}});
    for (ChatMessage& m : *f.messages) {
      std::optional<std::string> role = chat_role(m.role);
      if (!role) return std::nullopt;
      in.messages.push_back({{"role", std::move(*role)}, {"content", std::move(m.content)}});
    }
    chat_plan(p, endpoint, nullptr, std::move(in), model, limits);
  }
  check_prompt(p.gen.prompt, limits);
  p.gen.max_tokens = answer_length(f.max_completion_tokens ? f.max_completion_tokens : f.max_tokens,
                                   int64_t(p.gen.prompt.size()), limits);
  proto::Sampling& s = p.gen.sampling;
  s.temperature = float(f.temperature.value_or(s.temperature));
  s.top_p = float(f.top_p.value_or(s.top_p));
  s.top_k = int32_t(f.top_k.value_or(s.top_k));
  s.min_p = float(f.min_p.value_or(s.min_p));
  s.seed = f.seed ? uint64_t(*f.seed) : limits.random_seed;
  if (f.stop) p.stop = std::move(*f.stop);
  check_stops(p.stop, anthropic ? "stop_sequences" : "stop");
  return p;
}

}  // namespace

std::optional<Plan> parse_common_request(Endpoint endpoint, std::string_view text, const ModelText& model,
                                         const PlanLimits& limits) {
  if (endpoint == Endpoint::responses || endpoint == Endpoint::count_tokens) return std::nullopt;
  Reader r(text);
  CommonFields f;
  std::string key;
  if (!r.next('{')) return std::nullopt;
  if (!r.next('}')) {
    do {
      if (!r.string(key) || !r.next(':') || !read_field(r, endpoint, key, f)) return std::nullopt;
    } while (r.next(','));
    if (!r.next('}')) return std::nullopt;
  }
  if (!r.at_end()) return std::nullopt;
  try {
    return common_plan(endpoint, f, model, limits);
  } catch (const Error&) {
    return std::nullopt;  // the full path words the error
  }
}

std::variant<Plan, ApiError> parse_request(Endpoint endpoint, std::string_view text, const ModelText& model,
                                           const PlanLimits& limits) {
  if (std::optional<Plan> p = parse_common_request(endpoint, text, model, limits)) return std::move(*p);
  auto parsed = parse_body(text);
  if (auto* why = std::get_if<std::string>(&parsed)) return bad_request("the request body is not valid JSON: " + *why);
  json& body = std::get<json>(parsed);
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

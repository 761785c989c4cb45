#include "shared/protocol.h"

#include <charconv>
#include <cmath>
#include <limits>

#include "shared/error.h"

namespace ds4::proto {

using nlohmann::json;

namespace {

template <typename T>
T number(const json& j, const char* key, T lo, T hi) {
  const json& v = j.at(key);
  if (!v.is_number()) throw Error(std::string("'") + key + "' must be a number, got " + std::string(v.type_name()));
  if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) throw Error(std::string("'") + key + "' must be an integer");
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > uint64_t(hi) || (lo > 0 && u < uint64_t(lo)))
        throw Error(std::string("'") + key + "' = " + v.dump() + " is out of range");
      return T(u);
    }
    const int64_t i = v.get<int64_t>();
    if (i < int64_t(lo) || (hi >= 0 && uint64_t(i) > uint64_t(hi)))
      throw Error(std::string("'") + key + "' = " + v.dump() + " is out of range [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "]");
    return T(i);
  } else {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d < double(lo) || d > double(hi))
      throw Error(std::string("'") + key + "' = " + v.dump() + " is out of range [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "]");
    return T(d);
  }
}

std::vector<int32_t> tokens(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_array()) throw Error(std::string("'") + key + "' must be an array of token ids");
  if (v.size() > kMaxTokens)
    throw Error(std::string("'") + key + "' has " + std::to_string(v.size()) + " tokens, more than the limit " +
                std::to_string(kMaxTokens));
  std::vector<int32_t> out;
  out.reserve(v.size());
  for (const json& t : v) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
      throw Error(std::string("'") + key + "' holds " + t.dump() + ", not a token id");
    out.push_back(t.get<int32_t>());
  }
  return out;
}

// [[token, bias], ...]: biases in [-100, 100], as OpenAI allows.
std::vector<std::pair<int32_t, float>> logit_bias(const json& v) {
  if (!v.is_array()) throw Error("'logit_bias' must be an array of [token, bias] pairs");
  if (v.size() > kMaxLogitBias)
    throw Error("'logit_bias' has " + std::to_string(v.size()) + " entries, more than " + std::to_string(kMaxLogitBias));
  std::vector<std::pair<int32_t, float>> out;
  out.reserve(v.size());
  for (const json& e : v) {
    if (!e.is_array() || e.size() != 2) throw Error("'logit_bias' holds " + e.dump() + ", not a [token, bias] pair");
    const json pair = {{"token", e[0]}, {"bias", e[1]}};
    out.emplace_back(number<int32_t>(pair, "token", 0, std::numeric_limits<int32_t>::max()),
                     number<float>(pair, "bias", -100.f, 100.f));
  }
  return out;
}

// [{"text": "...", "at_start": bool}, ...]: a lazy grammar's triggers.
std::vector<GrammarTrigger> grammar_triggers(const json& v) {
  if (!v.is_array()) throw Error("'grammar_triggers' must be an array of {text, at_start} objects");
  if (v.size() > kMaxGrammarTriggers)
    throw Error("'grammar_triggers' has " + std::to_string(v.size()) + " entries, more than " + std::to_string(kMaxGrammarTriggers));
  std::vector<GrammarTrigger> out;
  for (const json& e : v) {
    if (!e.is_object() || !e.contains("text") || !e["text"].is_string())
      throw Error("'grammar_triggers' holds " + e.dump(-1, ' ', false, json::error_handler_t::replace) + ", not a {text, at_start} object");
    GrammarTrigger t{e["text"].get<std::string>(), false};
    if (t.text.empty() || t.text.size() > kMaxTriggerBytes)
      throw Error("a 'grammar_triggers' text must have 1 to " + std::to_string(kMaxTriggerBytes) + " bytes");
    if (e.contains("at_start")) {
      if (!e["at_start"].is_boolean()) throw Error("'grammar_triggers[].at_start' must be true or false");
      t.at_start = e["at_start"].get<bool>();
    }
    out.push_back(std::move(t));
  }
  return out;
}

Request general_request(std::string_view line) {
  json j = json::parse(line, nullptr, false);
  if (j.is_discarded()) throw Error("request is not valid JSON");
  if (!j.is_object()) throw Error("request must be a JSON object");
  if (!j.contains("op") || !j["op"].is_string()) throw Error("request needs a string 'op'");
  Request r;
  const std::string op = j["op"];
  if (op == "info") {
    r.op = Request::Op::info;
    return r;
  }
  if (op != "generate" && op != "cancel") throw Error("unknown op '" + op + "' (expected generate, cancel or info)");
  if (j.contains("id")) r.id = number<int64_t>(j, "id", 1, std::numeric_limits<int64_t>::max());
  if (op == "cancel") {
    if (r.id == 0) throw Error("cancel needs the 'id' of a request");
    r.op = Request::Op::cancel;
    return r;
  }
  r.op = Request::Op::generate;
  GenerateRequest& g = r.generate;
  try {
    if (!j.contains("prompt")) throw Error("generate needs 'prompt'");
    g.prompt = tokens(j, "prompt");
    if (j.contains("generated")) g.generated = tokens(j, "generated");
    if (j.contains("max_tokens")) g.max_tokens = number<int32_t>(j, "max_tokens", 0, int32_t(kMaxTokens));
    if (j.contains("temperature")) g.sampling.temperature = number<float>(j, "temperature", 0.f, 100.f);
    if (j.contains("top_k")) g.sampling.top_k = number<int32_t>(j, "top_k", 0, 1 << 30);
    if (j.contains("top_p")) g.sampling.top_p = number<float>(j, "top_p", 0.f, 1.f);
    if (j.contains("min_p")) g.sampling.min_p = number<float>(j, "min_p", 0.f, 1.f);
    if (j.contains("seed")) g.sampling.seed = number<uint64_t>(j, "seed", 0, std::numeric_limits<uint64_t>::max());
    if (j.contains("logprobs")) g.logprobs = number<int32_t>(j, "logprobs", 0, 20);
    if (j.contains("frequency_penalty")) g.sampling.frequency_penalty = number<float>(j, "frequency_penalty", -2.f, 2.f);
    if (j.contains("presence_penalty")) g.sampling.presence_penalty = number<float>(j, "presence_penalty", -2.f, 2.f);
    if (j.contains("logit_bias")) g.sampling.logit_bias = logit_bias(j["logit_bias"]);
    if (j.contains("ignore_eos")) {
      if (!j["ignore_eos"].is_boolean()) throw Error("'ignore_eos' must be true or false");
      g.ignore_eos = j["ignore_eos"].get<bool>();
    }
    if (j.contains("grammar")) {
      if (!j["grammar"].is_string()) throw Error("'grammar' must be a string");
      g.grammar = j["grammar"].get<std::string>();
      if (g.grammar.size() > kMaxGrammarBytes)
        throw Error("'grammar' is " + std::to_string(g.grammar.size()) + " bytes, more than " + std::to_string(kMaxGrammarBytes));
    }
    if (j.contains("grammar_triggers")) g.grammar_triggers = grammar_triggers(j["grammar_triggers"]);
    if (!g.grammar_triggers.empty() && g.grammar.empty()) throw Error("'grammar_triggers' without a 'grammar'");
  } catch (const json::exception& e) {
    throw Error(std::string("bad request: ") + e.what());
  }
  return r;
}

}  // namespace

// ---- the lines of every request, token and end, written and read by hand ----
// The same JSON nlohmann writes (keys in its order), without building a tree:
// these run once per token and twice per request on both sides of the socket.
namespace {

void put(std::string& s, int64_t v) {
  char b[24];
  s.append(b, std::to_chars(b, b + sizeof b, v).ptr);
}

void put(std::string& s, uint64_t v) {
  char b[24];
  s.append(b, std::to_chars(b, b + sizeof b, v).ptr);
}

// Shortest text that reads back as the same value; null for NaN and
// infinities, as nlohmann writes them.
template <typename F>
void put_real(std::string& s, F v) {
  if (!std::isfinite(v)) {
    s += "null";
    return;
  }
  char b[40];
  s.append(b, std::to_chars(b, b + sizeof b, v).ptr);
}

void put(std::string& s, const std::vector<int32_t>& v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    put(s, int64_t(v[i]));
  }
  s += ']';
}

// Text a JSON string holds as it is: printable ASCII without quote or backslash.
bool plain(std::string_view w) {
  for (unsigned char c : w)
    if (c < 0x20 || c == '"' || c == '\\' || c >= 0x80) return false;
  return true;
}

// The id field as the writers put it: `before` "id":N `after`, none for id 0.
void put_id(std::string& s, int64_t id, std::string_view before, std::string_view after) {
  if (!id) return;
  s += before;
  s += R"("id":)";
  put(s, id);
  s += after;
}

/// Reads what put() wrote; any other text sets ok = false (the caller then
/// parses the line as general JSON).
struct Cursor {
  std::string_view s;
  size_t p = 0;
  bool ok = true;
  void lit(std::string_view t) {
    if (ok && s.substr(p, t.size()) == t) p += t.size();
    else ok = false;
  }
  /// Skips `t` when it comes next; says whether it did.
  bool maybe(std::string_view t) {
    if (!ok || s.substr(p, t.size()) != t) return false;
    p += t.size();
    return true;
  }
  /// A request id after `key` (an optional field).
  int64_t id(std::string_view key);
  template <typename T>
  T num() {
    T v{};
    // JSON numbers only: from_chars would also take "nan", "inf", "infinity".
    if (!ok || p == s.size() || !(s[p] == '-' || (s[p] >= '0' && s[p] <= '9'))) {
      ok = false;
      return v;
    }
    const auto r = std::from_chars(s.data() + p, s.data() + s.size(), v);
    if (r.ec != std::errc()) ok = false;
    else p = size_t(r.ptr - s.data());
    return v;
  }
  std::string_view word() {  // the rest of a plain string (see plain()), up to its closing quote
    const size_t q = ok ? s.find('"', p) : std::string_view::npos;
    if (q == std::string_view::npos || !plain(s.substr(p, q - p))) {
      ok = false;
      return {};
    }
    std::string_view w = s.substr(p, q - p);
    p = q;
    return w;
  }
  bool end() const { return ok && p == s.size(); }
};

// Token ids as put() writes them, within the limits general_request checks.
bool fast_tokens(Cursor& c, std::vector<int32_t>& out) {
  c.lit("[");
  if (c.ok && c.p < c.s.size() && c.s[c.p] == ']') {
    ++c.p;
    return c.ok;
  }
  while (c.ok) {
    const int32_t t = c.num<int32_t>();
    if (!c.ok || t < 0 || out.size() >= kMaxTokens) return c.ok = false;
    out.push_back(t);
    if (c.p < c.s.size() && c.s[c.p] == ',') ++c.p;
    else break;
  }
  c.lit("]");
  return c.ok;
}

template <typename T>
T fast_number(Cursor& c, T lo, T hi) {
  using Read = std::conditional_t<std::is_integral_v<T>, T, double>;  // reals as general_request reads them
  const Read v = c.num<Read>();
  if (!(v >= Read(lo) && v <= Read(hi))) c.ok = false;  // NaN too
  return T(v);
}

int64_t Cursor::id(std::string_view key) {
  return maybe(key) ? fast_number<int64_t>(*this, 1, std::numeric_limits<int64_t>::max()) : 0;
}

// The line to_line() writes, read without building a tree; false for any
// other text (the general parser then reads it, or says what is wrong).
bool fast_generate(std::string_view line, Request& r) {
  Cursor c{line};
  GenerateRequest& g = r.generate;
  c.lit(R"({"op":"generate",)");
  if ((r.id = c.id(R"("id":)"))) c.lit(",");
  c.lit(R"("prompt":)");
  fast_tokens(c, g.prompt);
  c.lit(R"(,"generated":)");
  fast_tokens(c, g.generated);
  c.lit(R"(,"max_tokens":)");
  g.max_tokens = fast_number<int32_t>(c, 0, int32_t(kMaxTokens));
  c.lit(R"(,"temperature":)");
  g.sampling.temperature = fast_number<float>(c, 0.f, 100.f);
  c.lit(R"(,"top_k":)");
  g.sampling.top_k = fast_number<int32_t>(c, 0, 1 << 30);
  c.lit(R"(,"top_p":)");
  g.sampling.top_p = fast_number<float>(c, 0.f, 1.f);
  c.lit(R"(,"min_p":)");
  g.sampling.min_p = fast_number<float>(c, 0.f, 1.f);
  c.lit(R"(,"seed":)");
  g.sampling.seed = c.num<uint64_t>();
  c.lit(R"(,"logprobs":)");
  g.logprobs = fast_number<int32_t>(c, 0, 20);
  c.lit(R"(,"ignore_eos":)");
  if (c.maybe("true")) g.ignore_eos = true;
  else c.lit("false");
  c.lit("}");
  if (c.ok && c.p + 1 == c.s.size() && c.s[c.p] == '\n') ++c.p;  // the line may keep its newline
  r.op = Request::Op::generate;
  return c.end();
}

bool fast_token(std::string_view line, Event& e) {
  Cursor c{line};
  c.lit(R"({"ev":"token","i":)");
  e.token.index = c.num<int64_t>();
  e.id = c.id(R"(,"id":)");
  c.lit(R"(,"lp":)");
  const double lp = c.num<double>();  // as the general path reads it: via double
  if (!(lp >= -std::numeric_limits<float>::max() && lp <= std::numeric_limits<float>::max())) c.ok = false;
  e.token.logprob = c.ok ? float(lp) : 0.f;
  c.lit(R"(,"t":)");
  e.token.token = c.num<int32_t>();
  c.lit("}");
  e.kind = Event::Kind::token;
  return c.end();
}

bool fast_done(std::string_view line, Event& e) {
  e = Event{};  // a token line tried first may have filled some fields
  Cursor c{line};
  c.lit(R"({"ev":"done",)");
  if ((e.id = c.id(R"("id":)"))) c.lit(",");
  c.lit(R"("reason":")");
  e.reason = c.word();
  c.lit(R"(","timings":{"cache_n":)");
  e.timings.cache_n = c.num<int64_t>();
  c.lit(R"(,"predicted_ms":)");
  e.timings.predicted_ms = c.num<double>();
  c.lit(R"(,"predicted_n":)");
  e.timings.predicted_n = c.num<int64_t>();
  c.lit(R"(,"prompt_ms":)");
  e.timings.prompt_ms = c.num<double>();
  c.lit(R"(,"prompt_n":)");
  e.timings.prompt_n = c.num<int64_t>();
  c.lit("}}");
  e.kind = Event::Kind::done;
  return c.end();
}

}  // namespace

Request parse_request(std::string_view line) {
  if (line.size() > kMaxLineBytes) throw Error("request line is longer than " + std::to_string(kMaxLineBytes) + " bytes");
  if (Request r; fast_generate(line, r)) return r;
  return general_request(line);
}

std::string to_line(const GenerateRequest& g, int64_t id) {
  std::string s;
  s.reserve(200 + 8 * (g.prompt.size() + g.generated.size()));
  s += R"({"op":"generate",)";
  put_id(s, id, "", ",");
  s += R"("prompt":)";
  put(s, g.prompt);
  s += R"(,"generated":)";
  put(s, g.generated);
  s += R"(,"max_tokens":)";
  put(s, int64_t(g.max_tokens));
  s += R"(,"temperature":)";
  put_real(s, g.sampling.temperature);
  s += R"(,"top_k":)";
  put(s, int64_t(g.sampling.top_k));
  s += R"(,"top_p":)";
  put_real(s, g.sampling.top_p);
  s += R"(,"min_p":)";
  put_real(s, g.sampling.min_p);
  s += R"(,"seed":)";
  put(s, g.sampling.seed);
  s += R"(,"logprobs":)";
  put(s, int64_t(g.logprobs));
  s += g.ignore_eos ? R"(,"ignore_eos":true)" : R"(,"ignore_eos":false)";
  // Rare options: only when set (the fast reader then leaves the line to the general one).
  if (g.sampling.frequency_penalty != 0) {
    s += R"(,"frequency_penalty":)";
    put_real(s, g.sampling.frequency_penalty);
  }
  if (g.sampling.presence_penalty != 0) {
    s += R"(,"presence_penalty":)";
    put_real(s, g.sampling.presence_penalty);
  }
  if (!g.sampling.logit_bias.empty()) {
    s += R"(,"logit_bias":[)";
    for (size_t i = 0; i < g.sampling.logit_bias.size(); ++i) {
      s += i ? ",[" : "[";
      put(s, int64_t(g.sampling.logit_bias[i].first));
      s += ',';
      put_real(s, g.sampling.logit_bias[i].second);
      s += ']';
    }
    s += ']';
  }
  if (!g.grammar.empty()) {
    s += R"(,"grammar":)";
    s += json(g.grammar).dump(-1, ' ', false, json::error_handler_t::replace);
  }
  if (!g.grammar_triggers.empty()) {
    json triggers = json::array();
    for (const GrammarTrigger& t : g.grammar_triggers) {
      json one = {{"text", t.text}};
      if (t.at_start) one["at_start"] = true;
      triggers.push_back(std::move(one));
    }
    s += R"(,"grammar_triggers":)";
    s += triggers.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  s += "}\n";
  return s;
}

std::string cancel_line(int64_t id) {
  std::string s = R"({"op":"cancel","id":)";
  put(s, id);
  s += "}\n";
  return s;
}

std::string token_line(const TokenEvent& e, int64_t id) {
  std::string s = R"({"ev":"token","i":)";
  put(s, e.index);
  put_id(s, id, ",", "");
  s += R"(,"lp":)";
  put_real(s, e.logprob);
  s += R"(,"t":)";
  put(s, int64_t(e.token));
  if (!e.top.empty()) {
    s += R"(,"top":[)";
    for (size_t i = 0; i < e.top.size(); ++i) {
      s += i ? ",[" : "[";
      put(s, int64_t(e.top[i].first));
      s += ',';
      put_real(s, e.top[i].second);
      s += ']';
    }
    s += ']';
  }
  s += "}\n";
  return s;
}

static json timings_json(const Timings& t) {
  return {{"prompt_n", t.prompt_n}, {"cache_n", t.cache_n}, {"predicted_n", t.predicted_n},
          {"prompt_ms", t.prompt_ms}, {"predicted_ms", t.predicted_ms}};
}

std::string done_line(std::string_view reason, const Timings& t, int64_t id) {
  if (!plain(reason)) {
    json j{{"ev", "done"}, {"reason", reason}, {"timings", timings_json(t)}};
    if (id) j["id"] = id;
    return j.dump() + "\n";
  }
  std::string s = R"({"ev":"done",)";
  put_id(s, id, "", ",");
  s += R"("reason":")";
  s += reason;
  s += R"(","timings":{"cache_n":)";
  put(s, t.cache_n);
  s += R"(,"predicted_ms":)";
  put_real(s, t.predicted_ms);
  s += R"(,"predicted_n":)";
  put(s, t.predicted_n);
  s += R"(,"prompt_ms":)";
  put_real(s, t.prompt_ms);
  s += R"(,"prompt_n":)";
  put(s, t.prompt_n);
  s += "}}\n";
  return s;
}

std::string error_line(std::string_view message, int64_t id) {
  json j{{"ev", "error"}, {"message", message}};
  if (id) j["id"] = id;
  return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

Event parse_event(std::string_view line) {
  if (Event e; fast_token(line, e) || fast_done(line, e)) return e;
  json j = json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("ev")) throw Error("worker sent a malformed event");
  Event e;
  try {
    const std::string ev = j["ev"];
    if (j.contains("id")) {
      const json& id = j["id"];
      if (!id.is_number_integer() || id.get<int64_t>() <= 0) throw Error("worker sent an event with a bad id " + id.dump());
      e.id = id.get<int64_t>();
    }
    // number(), not get(): a missing field, another type or a value out of
    // range is an error, never a conversion with undefined behaviour.
    constexpr int64_t kInt64 = std::numeric_limits<int64_t>::max();
    constexpr int32_t kInt32 = std::numeric_limits<int32_t>::max();
    constexpr float kFloat = std::numeric_limits<float>::max();
    constexpr double kDouble = std::numeric_limits<double>::max();
    if (ev == "token") {
      e.kind = Event::Kind::token;
      e.token.index = number<int64_t>(j, "i", 0, kInt64);
      e.token.token = number<int32_t>(j, "t", 0, kInt32);
      e.token.logprob = number<float>(j, "lp", -kFloat, kFloat);
      if (j.contains("top")) {
        if (!j["top"].is_array()) throw Error("worker sent a malformed event: 'top' must be an array");
        for (const json& p : j["top"]) {
          if (!p.is_array() || p.size() != 2) throw Error("worker sent a malformed event: 'top' holds " + p.dump());
          const json pair = {{"t", p[0]}, {"lp", p[1]}};
          e.token.top.emplace_back(number<int32_t>(pair, "t", 0, kInt32), number<float>(pair, "lp", -kFloat, kFloat));
        }
      }
    } else if (ev == "done") {
      e.kind = Event::Kind::done;
      e.reason = j.at("reason");
      const json& t = j.at("timings");
      if (!t.is_object()) throw Error("worker sent a malformed event: 'timings' must be an object");
      e.timings = {number<int64_t>(t, "prompt_n", 0, kInt64), number<int64_t>(t, "cache_n", 0, kInt64),
                   number<int64_t>(t, "predicted_n", 0, kInt64), number<double>(t, "prompt_ms", -kDouble, kDouble),
                   number<double>(t, "predicted_ms", -kDouble, kDouble)};
    } else if (ev == "error") {
      e.kind = Event::Kind::error;
      e.message = j.at("message");
    } else if (ev == "info") {
      e.kind = Event::Kind::info;
      e.info = std::move(j);
    } else {
      throw Error("worker sent an unknown event '" + ev + "'");
    }
  } catch (const json::exception& ex) {
    throw Error(std::string("worker sent a malformed event: ") + ex.what());
  }
  return e;
}

}  // namespace ds4::proto

#include "shared/protocol.h"

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
      if (u > uint64_t(hi)) throw Error(std::string("'") + key + "' = " + v.dump() + " is out of range");
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

}  // namespace

Request parse_request(std::string_view line) {
  if (line.size() > kMaxLineBytes) throw Error("request line is longer than " + std::to_string(kMaxLineBytes) + " bytes");
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
  if (op != "generate") throw Error("unknown op '" + op + "' (expected generate or info)");
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
    if (j.contains("ignore_eos")) {
      if (!j["ignore_eos"].is_boolean()) throw Error("'ignore_eos' must be true or false");
      g.ignore_eos = j["ignore_eos"].get<bool>();
    }
  } catch (const json::exception& e) {
    throw Error(std::string("bad request: ") + e.what());
  }
  return r;
}

std::string to_line(const GenerateRequest& g) {
  json j = {{"op", "generate"},
            {"prompt", g.prompt},
            {"generated", g.generated},
            {"max_tokens", g.max_tokens},
            {"temperature", g.sampling.temperature},
            {"top_k", g.sampling.top_k},
            {"top_p", g.sampling.top_p},
            {"min_p", g.sampling.min_p},
            {"seed", g.sampling.seed},
            {"logprobs", g.logprobs},
            {"ignore_eos", g.ignore_eos}};
  return j.dump() + "\n";
}

std::string token_line(const TokenEvent& e) {
  json j = {{"ev", "token"}, {"i", e.index}, {"t", e.token}, {"lp", e.logprob}};
  if (!e.top.empty()) {
    json top = json::array();
    for (auto& [t, lp] : e.top) top.push_back({t, lp});
    j["top"] = std::move(top);
  }
  return j.dump() + "\n";
}

static json timings_json(const Timings& t) {
  return {{"prompt_n", t.prompt_n}, {"cache_n", t.cache_n}, {"predicted_n", t.predicted_n},
          {"prompt_ms", t.prompt_ms}, {"predicted_ms", t.predicted_ms}};
}

std::string done_line(std::string_view reason, const Timings& t) {
  return json{{"ev", "done"}, {"reason", reason}, {"timings", timings_json(t)}}.dump() + "\n";
}

std::string error_line(std::string_view message) {
  return json{{"ev", "error"}, {"message", message}}.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

Event parse_event(std::string_view line) {
  json j = json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("ev")) throw Error("worker sent a malformed event");
  Event e;
  try {
    const std::string ev = j["ev"];
    if (ev == "token") {
      e.kind = Event::Kind::token;
      e.token.index = j["i"];
      e.token.token = j["t"];
      e.token.logprob = j["lp"];
      if (j.contains("top"))
        for (auto& p : j["top"]) e.token.top.emplace_back(p[0].get<int32_t>(), p[1].get<float>());
    } else if (ev == "done") {
      e.kind = Event::Kind::done;
      e.reason = j["reason"];
      const json& t = j["timings"];
      e.timings = {t["prompt_n"], t["cache_n"], t["predicted_n"], t["prompt_ms"], t["predicted_ms"]};
    } else if (ev == "error") {
      e.kind = Event::Kind::error;
      e.message = j["message"];
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

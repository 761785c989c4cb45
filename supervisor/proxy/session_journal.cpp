#include "supervisor/proxy/session_journal.h"

#include <cstring>
#include <limits>
#include <type_traits>

#include "supervisor/proxy/json_util.h"

namespace ds4::proxy {

namespace {

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <class T>
bool take(std::string_view& s, T& v) {
  if (s.size() < sizeof v) return false;
  std::memcpy(&v, s.data(), sizeof v);
  s.remove_prefix(sizeof v);
  return true;
}

}  // namespace

std::string encode_request(const JournalRequest& r) {
  return json{{"id", r.id}, {"created", r.created}, {"seed", r.seed}, {"max_tokens", r.max_tokens}, {"forward", r.forward}}
      .dump();
}

namespace {

// A whole number of `v` that fits T; false for anything else (a float, a
// string, a number out of T's range: nlohmann's get would be undefined then).
template <class T>
bool whole(const json& v, T& out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<T>::max())) return false;
    out = T(u);
    return true;
  }
  if (!v.is_number_integer()) return false;
  const int64_t i = v.get<int64_t>();
  if (std::is_unsigned_v<T> ? i < 0 : (i < int64_t(std::numeric_limits<T>::min()) || i > int64_t(std::numeric_limits<T>::max())))
    return false;
  out = T(i);
  return true;
}

}  // namespace

std::optional<JournalRequest> decode_request(std::string_view s) {
  json j = json::parse(s, nullptr, false);
  if (!j.is_object()) return std::nullopt;
  try {
    JournalRequest r;
    r.id = j.at("id").get<std::string>();
    r.forward = j.at("forward").get<bool>();
    if (!whole(j.at("created"), r.created) || !whole(j.at("seed"), r.seed) || !whole(j.at("max_tokens"), r.max_tokens))
      return std::nullopt;
    return r;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

std::string encode_token(const proto::TokenEvent& e) {
  std::string s;
  put(s, e.index);
  put(s, e.token);
  put(s, e.logprob);
  put(s, uint32_t(e.top.size()));
  for (const auto& [t, p] : e.top) {
    put(s, t);
    put(s, p);
  }
  return s;
}

std::optional<proto::TokenEvent> decode_token(std::string_view s) {
  proto::TokenEvent e;
  uint32_t n = 0;
  if (!take(s, e.index) || !take(s, e.token) || !take(s, e.logprob) || !take(s, n) || s.size() != size_t(n) * 8)
    return std::nullopt;
  e.top.resize(n);
  for (auto& [t, p] : e.top)
    if (!take(s, t) || !take(s, p)) return std::nullopt;
  return e;
}

std::string encode_result(const JobResult& r) {
  const proto::Timings& t = r.timings;
  return json{{"ok", r.ok},
              {"reason", r.reason},
              {"timings", {t.prompt_n, t.cache_n, t.predicted_n, t.prompt_ms, t.predicted_ms}},
              {"error", {int(r.error.kind), r.error.message, r.error.retry_after_s, r.error.param}}}
      .dump(-1, ' ', false, json::error_handler_t::replace);
}

std::optional<JobResult> decode_result(std::string_view s) {
  json j = json::parse(s, nullptr, false);
  if (!j.is_object()) return std::nullopt;
  try {
    JobResult r;
    r.ok = j.at("ok").get<bool>();
    r.reason = j.at("reason").get<std::string>();
    const json& t = j.at("timings");
    const json& e = j.at("error");
    int kind = 0, retry = 0;
    if (!whole(t.at(0), r.timings.prompt_n) || !whole(t.at(1), r.timings.cache_n) ||
        !whole(t.at(2), r.timings.predicted_n) || !t.at(3).is_number() || !t.at(4).is_number() ||
        !whole(e.at(0), kind) || kind < 0 || kind > int(ErrorKind::internal) || !whole(e.at(2), retry))
      return std::nullopt;
    r.timings.prompt_ms = t.at(3).get<double>();
    r.timings.predicted_ms = t.at(4).get<double>();
    r.error = ApiError(ErrorKind(kind), e.at(1).get<std::string>(), retry, e.at(3).get<std::string>());
    return r;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

std::string encode_engine_op(const EngineOp& op) {
  std::string s;
  put(s, uint8_t(op.kind));
  put(s, uint8_t(op.resume));
  put(s, uint8_t(op.as_chat));
  put(s, op.at);
  put(s, op.id);
  return s + op.bytes;
}

std::optional<EngineOp> decode_engine_op(std::string_view s) {
  EngineOp op;
  uint8_t kind = 0, resume = 0, as_chat = 0;
  if (!take(s, kind) || !take(s, resume) || !take(s, as_chat) || !take(s, op.at) || !take(s, op.id) ||
      kind > uint8_t(EngineOp::Kind::close) || resume > uint8_t(ResumeKind::chat) || as_chat > 1)
    return std::nullopt;
  op.kind = EngineOp::Kind(kind);
  op.resume = ResumeKind(resume);
  op.as_chat = as_chat != 0;
  op.bytes = std::string(s);
  return op;
}

}  // namespace ds4::proxy

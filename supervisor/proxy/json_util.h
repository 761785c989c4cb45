#pragma once
/// JSON helpers for the proxy: output never throws on invalid UTF-8 (a model
/// can produce any bytes; they become U+FFFD), and typed field readers whose
/// errors name the field and what was expected.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include <nlohmann/json.hpp>

namespace ds4::proxy {

using json = nlohmann::ordered_json;  // keys in the order the client (or the model) wrote them

/// Compact JSON; invalid UTF-8 in strings is replaced, never thrown.
inline std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

/// Compact JSON written straight into a string, for the answers on the hot
/// path: the text dump() gives for the same values, keys in the order
/// written (as the proxy's json, an ordered_json, keeps them). Invalid UTF-8 in
/// strings becomes U+FFFD, as with dump().
class JsonWriter {
 public:
  JsonWriter() { out_.reserve(512); }  // an answer's size: no growing on the way
  JsonWriter& begin_object() { return open('{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array() { return open('['); }
  JsonWriter& end_array() { return close(']'); }
  JsonWriter& key(std::string_view k);
  JsonWriter& value(std::string_view s);
  JsonWriter& value(const char* s) { return value(std::string_view(s)); }
  JsonWriter& value(int64_t v);
  JsonWriter& value(double v);
  JsonWriter& null() { return raw("null"); }
  /// JSON text written elsewhere, as one value.
  JsonWriter& raw(std::string_view json);
  std::string& str() { return out_; }

 private:
  JsonWriter& open(char c);
  JsonWriter& close(char c);
  void separate();
  std::string out_;
  bool after_value_ = false;
};

/// Length of the valid UTF-8 sequence at the start of `s` (not empty), 0 when
/// invalid: overlong forms, surrogates and code points above U+10FFFF are, as
/// for JSON parsers (RFC 3629).
size_t utf8_length(std::string_view s);

/// Appends `s` as a JSON string (quoted, escaped) to `out`.
void put_json_string(std::string& out, std::string_view s);

/// A request body as JSON, or why it cannot be read as JSON: nlohmann's
/// reason with its place ("parse error at line 1, column 9: ..."), for
/// malformed text and for what it refuses in well-formed text too (a number
/// past a double, a lone UTF-16 surrogate in an escape). At most ~200 bytes
/// of the reason: it may quote the client's text.
std::variant<json, std::string> parse_body(std::string_view text);

/// Readers for optional request fields: nullopt when absent or null; throw
/// ds4::Error("'name' must be ...") on a wrong type or range.
std::optional<bool> opt_bool(const json& obj, const char* name);
std::optional<double> opt_number(const json& obj, const char* name, double lo, double hi);
std::optional<int64_t> opt_int(const json& obj, const char* name, int64_t lo, int64_t hi);
std::optional<std::string> opt_string(const json& obj, const char* name);

}  // namespace ds4::proxy

#pragma once
/// JSON helpers for the proxy: output never throws on invalid UTF-8 (a model
/// can produce any bytes; they become U+FFFD), and typed field readers whose
/// errors name the field and what was expected.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace ds4::proxy {

using nlohmann::json;

/// Compact JSON; invalid UTF-8 in strings is replaced, never thrown.
inline std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

/// Readers for optional request fields: nullopt when absent or null; throw
/// ds4::Error("'name' must be ...") on a wrong type or range.
std::optional<bool> opt_bool(const json& obj, const char* name);
std::optional<double> opt_number(const json& obj, const char* name, double lo, double hi);
std::optional<int64_t> opt_int(const json& obj, const char* name, int64_t lo, int64_t hi);
std::optional<std::string> opt_string(const json& obj, const char* name);

}  // namespace ds4::proxy

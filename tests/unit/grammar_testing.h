#pragma once
// Test helpers for grammars: a random walk that writes sentences of a grammar
// (through the real Matcher), and a small JSON Schema validator written
// apart from the compiler, so that the two check each other.
#include <optional>
#include <random>
#include <regex>
#include <string>

#include <nlohmann/json.hpp>

#include "text/grammar.h"
#include "text/utf8.h"

namespace ds4::testing {

/// A random sentence of `g`: at each step one live stack's next class, one
/// code point of it (mostly ASCII), ended when the grammar allows it with
/// probability `p_end` (always when nothing can follow). nullopt when it did
/// not end within `max_chars`.
inline std::optional<std::string> random_sentence(std::shared_ptr<const grammar::Grammar> g, std::mt19937& rng,
                                                  double p_end = 0.3, size_t max_chars = 4000) {
  grammar::Matcher m(g);
  std::string out;
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t n = 0; n < max_chars; ++n) {
    if (m.must_end() || (m.can_end() && u(rng) < p_end)) return out;
    std::vector<const grammar::Matcher::Stack*> live;
    for (const auto& s : m.stacks())
      if (!s.empty()) live.push_back(&s);
    if (live.empty()) return std::nullopt;
    const auto& top = g->elements[live[rng() % live.size()]->back()];
    const auto& cls = g->classes[top.value];
    auto [lo, hi] = cls[rng() % cls.size()];
    uint32_t cp;
    do {
      if (lo < 0x80 && u(rng) < 0.9) cp = lo + uint32_t(rng() % (std::min(hi, 0x7Fu) - lo + 1));
      else cp = lo + uint32_t(rng() % (uint64_t(hi) - lo + 1));
    } while (cp >= 0xD800 && cp <= 0xDFFF);
    std::string c;
    append_utf8(c, cp);
    if (!m.accept(c)) return std::nullopt;  // cannot happen: the class allowed it
    out += c;
  }
  return std::nullopt;
}

inline size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

/// Whether `v` is valid against `schema` (the subset the compiler supports).
/// `root` resolves $ref. Writes why not to `why`.
inline bool validate(const nlohmann::json& v, const nlohmann::json& schema, const nlohmann::json& root,
                     std::string& why, int depth = 0) {
  using nlohmann::json;
  auto no = [&](const std::string& w) { why = w + " at " + v.dump().substr(0, 80); return false; };
  if (depth > 200) return no("too deep");
  if (schema.is_boolean()) return schema.get<bool>() || no("false schema");
  if (schema.contains("$ref")) {
    std::string ref = schema["$ref"];
    const json* at = &root;
    if (ref != "#") {
      json::json_pointer p(ref.substr(1));
      at = &root.at(p);
    }
    return validate(v, *at, root, why, depth + 1);
  }
  if (schema.contains("const") && v != schema["const"]) return no("not the const");
  if (schema.contains("enum")) {
    bool found = false;
    for (const json& e : schema["enum"]) found |= e == v;
    if (!found) return no("not in the enum");
  }
  if (schema.contains("anyOf")) {
    bool any = false;
    for (const json& s : schema["anyOf"]) { std::string w; any |= validate(v, s, root, w, depth + 1); }
    if (!any) return no("no anyOf matches");
  }
  if (schema.contains("oneOf")) {
    int n = 0;
    for (const json& s : schema["oneOf"]) { std::string w; n += validate(v, s, root, w, depth + 1); }
    if (n != 1) return no("oneOf matches " + std::to_string(n));
  }
  if (schema.contains("allOf"))
    for (const json& s : schema["allOf"])
      if (!validate(v, s, root, why, depth + 1)) return false;
  if (schema.contains("type")) {
    auto is = [&](const std::string& t) {
      if (t == "string") return v.is_string();
      if (t == "integer") return v.is_number_integer() || (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()));
      if (t == "number") return v.is_number();
      if (t == "boolean") return v.is_boolean();
      if (t == "null") return v.is_null();
      if (t == "object") return v.is_object();
      if (t == "array") return v.is_array();
      return false;
    };
    const json& t = schema["type"];
    bool ok = false;
    if (t.is_string()) ok = is(t);
    else for (const json& x : t) ok |= is(x);
    if (!ok) return no("wrong type");
  }
  if (v.is_string()) {
    const std::string s = v;
    if (schema.contains("minLength") && code_points(s) < schema["minLength"].get<size_t>()) return no("too short");
    if (schema.contains("maxLength") && code_points(s) > schema["maxLength"].get<size_t>()) return no("too long");
    if (schema.contains("pattern") && !std::regex_search(s, std::regex(schema["pattern"].get<std::string>())))
      return no("pattern");
    if (schema.contains("format")) {
      const std::string f = schema["format"];
      const char* re = f == "date" ? R"(^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$)"
                     : f == "uuid" ? R"(^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$)"
                     : f == "time" ? R"(^([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)$)"
                     : nullptr;
      if (re && !std::regex_search(s, std::regex(re))) return no("format " + f);
    }
  }
  if (v.is_number()) {
    const double x = v.get<double>();
    if (schema.contains("minimum") && x < schema["minimum"].get<double>()) return no("below minimum");
    if (schema.contains("maximum") && x > schema["maximum"].get<double>()) return no("above maximum");
    if (schema.contains("exclusiveMinimum") && x <= schema["exclusiveMinimum"].get<double>()) return no("exclusiveMinimum");
    if (schema.contains("exclusiveMaximum") && x >= schema["exclusiveMaximum"].get<double>()) return no("exclusiveMaximum");
  }
  if (v.is_object()) {
    const json props = schema.value("properties", json::object());
    for (const json& r : schema.value("required", json::array()))
      if (!v.contains(r.get<std::string>())) return no("missing " + r.get<std::string>());
    for (auto& [k, x] : v.items()) {
      if (props.contains(k)) {
        if (!validate(x, props[k], root, why, depth + 1)) return false;
      } else if (schema.contains("additionalProperties")) {
        if (!validate(x, schema["additionalProperties"], root, why, depth + 1)) return false;
      }
    }
  }
  if (v.is_array()) {
    if (schema.contains("minItems") && v.size() < schema["minItems"].get<size_t>()) return no("too few items");
    if (schema.contains("maxItems") && v.size() > schema["maxItems"].get<size_t>()) return no("too many items");
    size_t i = 0;
    if (schema.contains("prefixItems"))
      for (; i < v.size() && i < schema["prefixItems"].size(); ++i)
        if (!validate(v[i], schema["prefixItems"][i], root, why, depth + 1)) return false;
    if (schema.contains("items"))
      for (; i < v.size(); ++i)
        if (!validate(v[i], schema["items"], root, why, depth + 1)) return false;
  }
  return true;
}

}  // namespace ds4::testing

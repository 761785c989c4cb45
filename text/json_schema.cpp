// JSON Schema → GBNF, and the builder that composes grammars from schemas and
// the caller's rules. Every value rule matches the value alone; the structure
// around it (after "{", ",", ":" and after each value) allows `ws`, a little
// whitespace, so a model may write compact or lightly indented JSON but cannot
// wander off in spaces. Numbers have at most 16 digits; strings are as long as
// their maxLength allows (no bound without one).
//
// What a schema allows and the grammar does not generate (still valid
// answers): properties that are not listed when additionalProperties is
// absent (JSON Schema's default is to allow them; generating them only makes
// small models wander) unless the schema lists none, array items after prefixItems when items is absent.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <set>

#include "shared/error.h"
#include "text/grammar.h"

namespace ds4::grammar {

using json = nlohmann::ordered_json;  // properties in the order the schema gives them

namespace {

// The shared rules. Names carry a "json-" prefix so that they rarely meet a
// caller's own.
const std::pair<const char*, const char*> kPrimitives[] = {
    {"json-ws", R"(| " " | "\n" [ \t]{0,20})"},
    // \uXXXX but no surrogate (a lone one is not valid JSON; pairs are
    // left out, the character itself can be written instead).
    {"json-char", R"([^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" ([0-9a-cA-CeEfF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2})))"},
    {"json-string", R"("\"" json-char* "\"")"},
    {"json-int", R"("-"? ("0" | [1-9] [0-9]{0,15}))"},
    {"json-number", R"(json-int ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?)"},
    {"json-boolean", R"("true" | "false")"},
    {"json-null", R"("null")"},
    {"json-value", R"(json-object | json-array | json-string | json-number | json-boolean | json-null)"},
    {"json-object", R"("{" json-ws (json-member ("," json-ws json-member)*)? "}")"},
    {"json-member", R"(json-string json-ws ":" json-ws json-value json-ws)"},
    {"json-array", R"("[" json-ws (json-value json-ws ("," json-ws json-value json-ws)*)? "]")"},
    {"json-date", R"([0-9]{4} "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]))"},
    {"json-time", R"(([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{1,6})? ("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9]))"},
    {"json-hex", R"([0-9a-fA-F])"},
};

// Which primitives each one uses (added with it).
std::vector<std::string> primitive_deps(const std::string& name) {
  if (name == "json-string") return {"json-char"};
  if (name == "json-number") return {"json-int"};
  if (name == "json-value")
    return {"json-object", "json-array", "json-string", "json-number", "json-boolean", "json-null"};
  if (name == "json-object") return {"json-ws", "json-member"};
  if (name == "json-member") return {"json-string", "json-ws", "json-value"};
  if (name == "json-array") return {"json-ws", "json-value"};
  return {};
}

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(uint8_t(c)) || c == '-') ? c : '-';
  if (out.empty()) out = "r";
  return out;
}

// Keywords that constrain a value in a way the compiler does not express:
// refused, so that no answer breaks the schema.
const char* const kUnsupported[] = {
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "patternProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
    "uniqueItems", "contains", "minContains", "maxContains", "multipleOf",
    "minProperties", "maxProperties", "$dynamicRef", "$recursiveRef",
};

}  // namespace

/// Compiles one schema into rules (kept apart until the whole schema
/// compiled, so that a failure leaves the builder unchanged).
class SchemaCompiler {
 public:
  SchemaCompiler(GrammarBuilder& b, const json& root) : b_(b), root_(root) {}

  std::string compile(const std::string& name) {
    const std::string rule = fresh(sanitize(name));
    define(rule, body(root_, "schema", 0, rule));
    return rule;
  }

  void commit() {
    for (auto& [name, body] : added_) {
      b_.rules_[name] = body;
      b_.order_.push_back(name);
    }
  }

  // The rules this schema added (and the shared ones they use), with a root.
  std::string rules_text(const std::string& root) const {
    std::string t = root == "root" ? "" : "root ::= " + root + "\n";
    for (const auto& [name, body] : b_.rules_)
      if (name.rfind("json-", 0) == 0) t += name + " ::= " + body + "\n";
    for (const auto& [name, body] : added_) t += name + " ::= " + body + "\n";
    return t;
  }

 private:
  [[noreturn]] static void fail(const std::string& path, const std::string& what) {
    throw Error(path + ": " + what);
  }

  bool taken(const std::string& n) const {
    return b_.rules_.count(n) || std::any_of(added_.begin(), added_.end(), [&](auto& r) { return r.first == n; });
  }
  std::string fresh(const std::string& base) {
    std::string n = base;
    for (int i = 2; taken(n) || reserved_.count(n); ++i) n = base + "-" + std::to_string(i);
    reserved_.insert(n);
    return n;
  }
  void define(const std::string& name, std::string body) {
    if (b_.rules_.size() + added_.size() >= b_.limits_.max_rules)
      throw Error("schema: the grammar needs more than " + std::to_string(b_.limits_.max_rules) + " rules");
    added_.emplace_back(name, std::move(body));
  }
  // A shared primitive, added once (with the primitives it uses).
  std::string prim(const std::string& name) {
    if (std::find(prims_.begin(), prims_.end(), name) != prims_.end() || b_.rules_.count(name)) return name;
    prims_.push_back(name);
    for (const auto& [n, body] : kPrimitives)
      if (name == n) define(name, body);
    for (const std::string& d : primitive_deps(name)) prim(d);
    return name;
  }
  // A rule for `body_text` named after `base`; returns its name.
  std::string rule(const std::string& base, std::string body_text) {
    const std::string n = fresh(base);
    define(n, std::move(body_text));
    return n;
  }

  const json& resolve(const std::string& ref, const std::string& path) const;
  std::string ref_rule(const std::string& ref, const std::string& path, size_t depth);
  std::string body(const json& s, const std::string& path, size_t depth, const std::string& base);
  std::string typed(const json& s, const std::string& type, const std::string& path, size_t depth,
                    const std::string& base);
  std::string string_rule(const json& s, const std::string& path);
  std::string integer_rule(const json& s, const std::string& path);
  std::string object_rule(const json& s, const std::string& path, size_t depth, const std::string& base);
  std::string array_rule(const json& s, const std::string& path, size_t depth, const std::string& base);
  std::string pattern_rule(const std::string& pattern, const std::string& path);

  GrammarBuilder& b_;
  const json& root_;
  std::vector<std::pair<std::string, std::string>> added_;
  std::set<std::string> reserved_;
  std::vector<std::string> prims_;
  std::map<std::string, std::string> refs_;  // $ref → its rule
};

const json& SchemaCompiler::resolve(const std::string& ref, const std::string& path) const {
  if (ref == "#") return root_;
  if (ref.rfind("#/", 0) != 0) fail(path, "only local $ref (#/$defs/..., #/definitions/...) is supported, not '" + ref + "'");
  const json* at = &root_;
  size_t i = 2;
  while (i <= ref.size()) {
    size_t j = ref.find('/', i);
    if (j == std::string::npos) j = ref.size();
    std::string key = ref.substr(i, j - i);
    for (size_t k; (k = key.find("~1")) != std::string::npos;) key.replace(k, 2, "/");
    for (size_t k; (k = key.find("~0")) != std::string::npos;) key.replace(k, 2, "~");
    if (at->is_object() && at->contains(key)) at = &(*at)[key];
    else if (at->is_array() && !key.empty() && std::all_of(key.begin(), key.end(), ::isdigit) &&
             std::stoul(key) < at->size())
      at = &(*at)[std::stoul(key)];
    else fail(path, "$ref '" + ref + "' does not resolve");
    i = j + 1;
  }
  return *at;
}

std::string SchemaCompiler::ref_rule(const std::string& ref, const std::string& path, size_t depth) {
  if (auto it = refs_.find(ref); it != refs_.end()) {
    // Recursion: grammar recursion. One without structure between (A is
    // A, or anyOf A) is left recursion, which the parse in add_schema refuses.
    return it->second;
  }
  const json& target = resolve(ref, path);
  const std::string name = fresh(sanitize("ref-" + ref.substr(ref.rfind('/') + 1)));
  refs_[ref] = name;
  std::string b = body(target, path + "($ref " + ref + ")", depth + 1, name);
  define(name, std::move(b));
  return name;
}

std::string SchemaCompiler::body(const json& s, const std::string& path, size_t depth, const std::string& base) {
  if (depth > b_.limits_.max_depth) fail(path, "nested deeper than " + std::to_string(b_.limits_.max_depth));
  if (s.is_boolean()) {
    if (!s.get<bool>()) fail(path, "the schema false allows no value");
    return prim("json-value");
  }
  if (!s.is_object()) fail(path, "a schema must be an object or a boolean");
  for (const char* k : kUnsupported)
    if (s.contains(k)) fail(path + "." + k, "not supported");
  if (s.contains("$ref")) {
    if (!s["$ref"].is_string()) fail(path + ".$ref", "must be a string");
    return ref_rule(s["$ref"].get<std::string>(), path + ".$ref", depth);
  }
  if (s.contains("const")) return literal(s["const"].dump());
  if (s.contains("enum")) {
    const json& e = s["enum"];
    if (!e.is_array() || e.empty()) fail(path + ".enum", "must be a non-empty array");
    std::string out;
    for (const json& v : e) out += (out.empty() ? "" : " | ") + literal(v.dump());
    return out;
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    if (!s.contains(key)) continue;
    const json& alts = s[key];
    if (!alts.is_array() || alts.empty()) fail(path + "." + key, "must be a non-empty array");
    std::string out;
    for (size_t i = 0; i < alts.size(); ++i) {
      const std::string p = path + "." + key + "[" + std::to_string(i) + "]";
      out += (out.empty() ? "" : " | ") + rule(base + "-" + std::to_string(i), body(alts[i], p, depth + 1, base + "-" + std::to_string(i)));
    }
    return out;
  }
  if (s.contains("allOf")) {
    const json& all = s["allOf"];
    if (!all.is_array() || all.empty()) fail(path + ".allOf", "must be a non-empty array");
    // Simple allOf: objects whose properties and required lists merge.
    json merged = s;
    merged.erase("allOf");
    for (size_t i = 0; i < all.size(); ++i) {
      const std::string p = path + ".allOf[" + std::to_string(i) + "]";
      const json* part = &all[i];
      if (part->is_object() && part->contains("$ref") && (*part)["$ref"].is_string()) part = &resolve((*part)["$ref"], p);
      if (!part->is_object()) fail(p, "allOf supports object schemas only");
      for (auto& [k, v] : part->items()) {
        if (k == "properties" && v.is_object()) {
          for (auto& [pk, pv] : v.items()) {
            if (merged["properties"].contains(pk)) fail(p + ".properties." + pk, "allOf with the same property twice is not supported");
            merged["properties"][pk] = pv;
          }
        } else if (k == "required" && v.is_array()) {
          for (const json& r : v) merged["required"].push_back(r);
        } else if (k == "type" || k == "additionalProperties") {
          if (merged.contains(k) && merged[k] != v) fail(p + "." + k, "allOf with different " + k + " is not supported");
          merged[k] = v;
        } else if (k == "title" || k == "description" || k == "$comment") {
        } else {
          fail(p + "." + k, "not supported inside allOf");
        }
      }
    }
    return body(merged, path, depth + 1, base);
  }
  if (!s.contains("type")) {
    // No type: infer it from the keywords, or any value.
    if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required"))
      return typed(s, "object", path, depth, base);
    if (s.contains("items") || s.contains("prefixItems")) return typed(s, "array", path, depth, base);
    if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern") || s.contains("format"))
      return typed(s, "string", path, depth, base);
    return prim("json-value");
  }
  const json& t = s["type"];
  if (t.is_string()) return typed(s, t.get<std::string>(), path, depth, base);
  if (!t.is_array() || t.empty()) fail(path + ".type", "must be a string or a non-empty array of strings");
  std::string out;
  for (size_t i = 0; i < t.size(); ++i) {
    if (!t[i].is_string()) fail(path + ".type[" + std::to_string(i) + "]", "must be a string");
    const std::string n = base + "-" + t[i].get<std::string>();
    out += (out.empty() ? "" : " | ") + rule(sanitize(n), typed(s, t[i].get<std::string>(), path, depth, n));
  }
  return out;
}

std::string SchemaCompiler::typed(const json& s, const std::string& type, const std::string& path, size_t depth,
                                  const std::string& base) {
  if (type == "string") return string_rule(s, path);
  if (type == "integer") return integer_rule(s, path);
  if (type == "number") {
    for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
      if (s.contains(k) && !(std::string(k) == "minimum" && s[k].is_number() && s[k].get<double>() == 0))
        fail(path + "." + k, "bounds on a number are not supported (only minimum 0; use integer for ranges)");
    if (s.contains("minimum")) {
      prim("json-number");
      return R"(("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?)";
    }
    return prim("json-number");
  }
  if (type == "boolean") return prim("json-boolean");
  if (type == "null") return prim("json-null");
  if (type == "object") return object_rule(s, path, depth, base);
  if (type == "array") return array_rule(s, path, depth, base);
  fail(path + ".type", "unknown type '" + type + "'");
}

std::string SchemaCompiler::string_rule(const json& s, const std::string& path) {
  auto count = [&](const char* k, size_t dflt) -> size_t {
    if (!s.contains(k)) return dflt;
    if (!s[k].is_number_unsigned()) fail(path + "." + k, "must be a non-negative integer");
    const size_t v = s[k].get<size_t>();
    if (v > 1000) fail(path + "." + k, "above 1000 is not supported");
    return v;
  };
  const bool lengths = s.contains("minLength") || s.contains("maxLength");
  if (s.contains("pattern")) {
    if (!s["pattern"].is_string()) fail(path + ".pattern", "must be a string");
    if (lengths) fail(path + ".pattern", "a pattern together with minLength/maxLength is not supported");
    return pattern_rule(s["pattern"].get<std::string>(), path + ".pattern");
  }
  if (s.contains("format") && s["format"].is_string() && !lengths) {
    const std::string f = s["format"];
    if (f == "date") return "\"\\\"\" " + prim("json-date") + " \"\\\"\"";
    if (f == "time") return "\"\\\"\" " + prim("json-time") + " \"\\\"\"";
    if (f == "date-time") return "\"\\\"\" " + prim("json-date") + " \"T\" " + prim("json-time") + " \"\\\"\"";
    if (f == "uuid") {
      const std::string h = prim("json-hex");
      return "\"\\\"\" " + h + "{8} \"-\" " + h + "{4} \"-\" " + h + "{4} \"-\" " + h + "{4} \"-\" " + h + "{12} \"\\\"\"";
    }
    // Other formats are annotations only (JSON Schema 2020-12): any string.
  }
  if (!lengths) return prim("json-string");
  const size_t min = count("minLength", 0), max = count("maxLength", 1000);
  if (max < min) fail(path + ".maxLength", "below minLength");
  prim("json-char");
  return "\"\\\"\" json-char{" + std::to_string(min) + "," + std::to_string(max) + "} \"\\\"\"";
}

}  // namespace ds4::grammar

namespace ds4::grammar {

/// A JSON Schema `pattern` (ECMAScript regex, a simple subset) as the GBNF of
/// the string's characters between its quotes (json_schema_pattern.cpp).
std::string pattern_to_gbnf(const std::string& pattern, const std::string& path);

namespace {

constexpr int64_t kMaxInt = 9'999'999'999'999'999;  // 16 digits, what json-int allows

std::string digit(char c) { return std::string("\"") + c + "\""; }

std::string any_digits(size_t n) {
  if (n == 0) return "";
  return n == 1 ? "[0-9]" : "[0-9]{" + std::to_string(n) + "}";
}

// Numbers of the same length from l to h (decimal strings, l <= h).
std::string same_length(const std::string& l, const std::string& h) {
  if (l.empty()) return "";
  if (l == h) return literal(l);
  size_t i = 0;
  while (l[i] == h[i]) ++i;
  const std::string prefix = i ? literal(l.substr(0, i)) + " " : "";
  const std::string lr = l.substr(i + 1), hr = h.substr(i + 1);
  const size_t n = lr.size();
  const bool low_zeros = lr.find_first_not_of('0') == std::string::npos;
  const bool high_nines = hr.find_first_not_of('9') == std::string::npos;
  const char lo = low_zeros ? l[i] : char(l[i] + 1);
  const char hi = high_nines ? h[i] : char(h[i] - 1);
  std::vector<std::string> alts;
  if (!low_zeros) alts.push_back(digit(l[i]) + " (" + same_length(lr, std::string(n, '9')) + ")");
  if (lo <= hi) {
    std::string d = lo == hi ? digit(lo) : std::string("[") + lo + "-" + hi + "]";
    alts.push_back(d + (n ? " " + any_digits(n) : ""));
  }
  if (!high_nines) alts.push_back(digit(h[i]) + " (" + same_length(std::string(n, '0'), hr) + ")");
  std::string out;
  for (const std::string& a : alts) out += (out.empty() ? "" : " | ") + a;
  return prefix + "(" + out + ")";
}

std::string uint_range(int64_t a, int64_t b) {
  std::string out;
  int64_t p = 1;  // 10^(len-1)
  for (size_t len = 1; len <= 16; ++len, p *= 10) {
    const int64_t lo = std::max(a, len == 1 ? 0 : p), hi = std::min(b, p * 10 - 1);
    if (lo > hi) continue;
    out += (out.empty() ? "" : " | ") + same_length(std::to_string(lo), std::to_string(hi));
  }
  return "(" + out + ")";
}

}  // namespace

std::string SchemaCompiler::integer_rule(const json& s, const std::string& path) {
  int64_t lo = -kMaxInt, hi = kMaxInt;
  bool bounded = false;
  auto bound = [&](const char* k) -> std::optional<double> {
    if (!s.contains(k)) return std::nullopt;
    if (!s[k].is_number()) fail(path + "." + k, "must be a number");
    bounded = true;
    return s[k].get<double>();
  };
  auto clamp = [](double v) { return int64_t(std::max(-double(kMaxInt), std::min(double(kMaxInt), v))); };
  if (auto v = bound("minimum")) lo = std::max(lo, clamp(std::ceil(*v)));
  if (auto v = bound("exclusiveMinimum")) lo = std::max(lo, clamp(std::floor(*v) + 1));
  if (auto v = bound("maximum")) hi = std::min(hi, clamp(std::floor(*v)));
  if (auto v = bound("exclusiveMaximum")) hi = std::min(hi, clamp(std::ceil(*v) - 1));
  if (!bounded) return prim("json-int");
  if (lo > hi) fail(path, "no integer lies within minimum and maximum");
  if (hi < 0) return "\"-\" " + uint_range(-hi, -lo);
  if (lo >= 0) return uint_range(lo, hi);
  return "\"-\" " + uint_range(1, -lo) + " | " + uint_range(0, hi);
}

std::string SchemaCompiler::object_rule(const json& s, const std::string& path, size_t depth, const std::string& base) {
  const std::string ws = prim("json-ws");
  std::vector<std::pair<std::string, std::string>> props;  // (key, value rule)
  if (s.contains("properties")) {
    const json& p = s["properties"];
    if (!p.is_object()) fail(path + ".properties", "must be an object");
    for (auto& [k, v] : p.items()) {
      const std::string vbase = base + "-" + sanitize(k);
      const std::string value = rule(vbase, body(v, path + ".properties." + k, depth + 1, vbase));
      props.push_back({k, value});
    }
  }
  std::set<std::string> required;
  if (s.contains("required")) {
    const json& r = s["required"];
    if (!r.is_array()) fail(path + ".required", "must be an array");
    for (const json& k : r) {
      if (!k.is_string()) fail(path + ".required", "must be an array of strings");
      required.insert(k.get<std::string>());
    }
  }
  std::string extra;  // the rule for one more member, when allowed
  // An object schema that lists no property ({"type": "object"}, OpenAI's
  // json_object) takes any members: with none listed, "{}" would be all.
  const bool open = !s.contains("properties") && !s.contains("additionalProperties");
  if (s.contains("additionalProperties") || open) {
    const json a = open ? json(true) : s["additionalProperties"];
    if (!(a.is_boolean() && !a.get<bool>())) {
      const std::string v = rule(base + "-extra-value", body(a, path + ".additionalProperties", depth + 1, base + "-extra"));
      extra = rule(base + "-extra", prim("json-string") + " " + ws + " \":\" " + ws + " " + v + " " + ws);
    }
  }
  for (const std::string& r : required)
    if (std::none_of(props.begin(), props.end(), [&](auto& p) { return p.first == r; })) {
      if (extra.empty()) fail(path + ".required", "'" + r + "' is required but not among the properties");
      props.push_back({r, rule(base + "-" + sanitize(r), prim("json-value"))});
    }
  // member_i ::= "\"key\"" ws ":" ws value ws
  // tail_i: members i.. after one already written (each with a comma);
  // head_i: members i.. when none was written yet (the first has no comma).
  const size_t n = props.size();
  std::vector<std::string> member(n), tail(n + 1), head(n + 1);
  for (size_t i = 0; i < n; ++i)
    member[i] = rule(base + "-kv", literal(json(props[i].first).dump()) + " " + ws + " \":\" " + ws + " " + props[i].second + " " + ws);
  tail[n] = extra.empty() ? "" : rule(base + "-more", "(\",\" " + ws + " " + extra + ")*");
  head[n] = extra.empty() ? "" : "(" + extra + " " + tail[n] + ")?";
  for (size_t i = n; i-- > 0;) {
    const bool req = required.count(props[i].first) != 0;
    const std::string comma = "\",\" " + ws + " " + member[i];
    std::string t = req ? comma + " " + tail[i + 1] : "(" + comma + ")? " + tail[i + 1];
    tail[i] = rule(base + "-tail", t);
    std::string h = member[i] + " " + tail[i + 1];
    if (!req) h = "(" + h + ") | " + (head[i + 1].empty() ? "\"\"" : head[i + 1]);
    head[i] = rule(base + "-head", h);
  }
  return "\"{\" " + ws + " " + head[0] + " \"}\"";
}

std::string SchemaCompiler::array_rule(const json& s, const std::string& path, size_t depth, const std::string& base) {
  const std::string ws = prim("json-ws");
  auto count = [&](const char* k) -> std::optional<size_t> {
    if (!s.contains(k)) return std::nullopt;
    if (!s[k].is_number_unsigned()) fail(path + "." + k, "must be a non-negative integer");
    if (s[k].get<size_t>() > 1000) fail(path + "." + k, "above 1000 is not supported");
    return s[k].get<size_t>();
  };
  const size_t min = count("minItems").value_or(0);
  const std::optional<size_t> max = count("maxItems");
  if (max && *max < min) fail(path + ".maxItems", "below minItems");
  std::vector<std::string> prefix;
  if (s.contains("prefixItems")) {
    const json& p = s["prefixItems"];
    if (!p.is_array()) fail(path + ".prefixItems", "must be an array");
    for (size_t i = 0; i < p.size(); ++i) {
      const std::string b = base + "-" + std::to_string(i);
      prefix.push_back(rule(b, body(p[i], path + ".prefixItems[" + std::to_string(i) + "]", depth + 1, b)));
    }
    if (max && prefix.size() > *max) fail(path + ".maxItems", "below the number of prefixItems");
  }
  std::string item;  // the rule for the items after the prefix; empty: none
  if (s.contains("items")) {
    const json& it = s["items"];
    if (!(it.is_boolean() && !it.get<bool>()))
      item = rule(base + "-item", body(it, path + ".items", depth + 1, base + "-item"));
    else if (min > prefix.size()) fail(path + ".minItems", "above the number of prefixItems with items false");
  } else if (prefix.empty()) {
    item = prim("json-value");
  } else if (min > prefix.size()) {
    item = prim("json-value");
  }
  // The elements in order; each but the first preceded by a comma.
  std::vector<std::string> seq;
  for (const std::string& p : prefix) seq.push_back(p + " " + ws);
  const size_t done = prefix.size();
  std::string rest;  // items after the prefix
  if (!item.empty()) {
    const size_t need = min > done ? min - done : 0;
    const std::optional<size_t> room = max ? std::optional<size_t>(*max - done) : std::nullopt;
    if (!room || *room > 0) {
      const std::string one = item + " " + ws;
      if (done == 0) {
        // first item without a comma, then {need-1, room-1} more
        const size_t m = need ? need - 1 : 0;
        const std::string more = "(\",\" " + ws + " " + one + ")" +
                                 (room ? "{" + std::to_string(m) + "," + std::to_string(*room - 1) + "}"
                                       : "{" + std::to_string(m) + ",}");
        rest = one + " " + more;
        if (need == 0) rest = "(" + rest + ")?";
      } else {
        rest = "(\",\" " + ws + " " + one + ")" +
               (room ? "{" + std::to_string(need) + "," + std::to_string(*room) + "}" : "{" + std::to_string(need) + ",}");
      }
    }
  }
  std::string out = "\"[\" " + ws;
  for (size_t i = 0; i < seq.size(); ++i) out += (i ? " \",\" " + ws + " " : " ") + seq[i];
  if (!rest.empty()) out += " " + rule(base + "-items", rest);
  return out + " \"]\"";
}

std::string SchemaCompiler::pattern_rule(const std::string& pattern, const std::string& path) {
  prim("json-char");
  return "\"\\\"\" " + rule("pattern", pattern_to_gbnf(pattern, path)) + " \"\\\"\"";
}

GrammarBuilder::GrammarBuilder(SchemaLimits limits) : limits_(limits) {}

std::string GrammarBuilder::add_schema(const nlohmann::ordered_json& schema, const std::string& name) {
  size_t bytes = 0;
  try {
    bytes = schema.dump().size();
  } catch (const nlohmann::ordered_json::exception& e) {  // a string that is not UTF-8
    throw Error(std::string("schema: ") + e.what());
  }
  if (bytes > limits_.max_bytes)
    throw Error("schema: " + std::to_string(bytes) + " bytes, more than " + std::to_string(limits_.max_bytes));
  SchemaCompiler c(*this, schema);
  const std::string rule = c.compile(name);
  // Parse what it made: a schema recursive without end (left recursion) or
  // a limit passed is an error here, not in the worker.
  try {
    Grammar::parse(c.rules_text(rule));
  } catch (const Error& e) {
    // Left recursion comes only from $ref cycles: say so in the schema's terms.
    if (std::string_view(e.what()).find("left-recursive") != std::string_view::npos)
      throw Error("schema: a $ref cycle comes back to itself before any value, so no JSON value of it can end");
    throw Error(std::string("schema: ") + e.what());
  }
  c.commit();
  return rule;
}

void GrammarBuilder::add_rule(const std::string& name, const std::string& body) {
  if (name.empty() || !std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(uint8_t(c)) || c == '_' || c == '-';
      }))
    throw Error("grammar: '" + name + "' is not a rule name ([A-Za-z0-9_-]+)");
  auto it = rules_.find(name);
  if (it != rules_.end()) {
    if (it->second == body) return;
    throw Error("grammar: rule '" + name + "' is already defined");
  }
  rules_[name] = body;
  order_.push_back(name);
}

std::string GrammarBuilder::fresh_name(const std::string& base) const {
  std::string n = sanitize(base);
  for (int i = 2; rules_.count(n); ++i) n = sanitize(base) + "-" + std::to_string(i);
  return n;
}

std::string GrammarBuilder::text() const {
  auto root = rules_.find("root");
  if (root == rules_.end()) throw Error("grammar: no 'root' rule was added");
  std::string t = "root ::= " + root->second + "\n";
  for (const std::string& n : order_)
    if (n != "root") t += n + " ::= " + rules_.at(n) + "\n";
  Grammar::parse(t);
  return t;
}

std::string schema_to_gbnf(const nlohmann::ordered_json& schema, const SchemaLimits& limits) {
  GrammarBuilder b(limits);
  b.add_schema(schema, "root");
  return b.text();
}

}  // namespace ds4::grammar
